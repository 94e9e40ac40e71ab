"""Lesson 07's buffer gradient by rows (the reference's inverted map): the same sums as float64 autograd on
any map, whatever its tiles, and the route each kind of map gets (blocked atomics for stable columns, the
per-position atomic kernel for maps that rarely change a slot's row, by rows for the others)."""

from __future__ import annotations

import pytest
import torch

from solutions.kernels import telescoping as ref


def _map(kind: str, length: int, capacity: int) -> tuple[torch.Tensor, int]:
    index_map, starts, _ = ref.telescoping_index_map(length, capacity)
    n = starts.numel()
    gen = torch.Generator().manual_seed(0)
    if kind == "stable":
        index_map = ref.stable_slots(index_map, n)
    elif kind == "random":
        index_map = torch.randint(0, n + 2, (length, capacity), generator=gen)
    elif kind.startswith("runs of"):              # each slot keeps a random row for R positions
        run = int(kind.split()[-1])
        rows = torch.randint(0, n, (length // run + 1, capacity), generator=gen)
        index_map = rows.repeat_interleave(run, dim=0)[:length]
    return index_map, n


def _want(p, a, index_map, n):
    """The buffer gradient of indexed_pv (p = weights, a = dout) by float64 autograd through the gather."""
    v = torch.zeros(p.shape[0], n, p.shape[2], a.shape[4], dtype=torch.float64, requires_grad=True)
    out = ref.indexed_pv_reference(p.double(), v, index_map)
    return torch.autograd.grad(out, v, a.double())[0]


@pytest.mark.parametrize("tiles", [{}, dict(block_r=32, block_k=4), dict(block_r=16, block_k=1)],
                         ids=["default tiles", "32 rows, 4 entries", "16 rows, 1 entry"])
@pytest.mark.parametrize("kind", ["random", "oldest-first", "stable"])
def test_rows_kernel_sums_every_entry_once(kind, tiles):
    index_map, n = _map(kind, 37, 8)
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(2, 37, 2, 3, 8, generator=gen)
    a = torch.randn(2, 37, 2, 3, 16, generator=gen)
    p = p.transpose(3, 4).contiguous().transpose(3, 4)          # strided: e side by side
    m = ref._normalise_map(index_map, n)
    got = ref._scatter_rows(p, a, m, n, torch.float32, **tiles)
    torch.testing.assert_close(got.double(), _want(p, a, index_map, n), atol=5e-5, rtol=1e-5)


def test_rows_order_inverts_the_map():
    index_map, n = _map("random", 50, 12)
    m = ref._normalise_map(index_map, n)
    order, bounds = ref._rows_order(m, n, 16)
    flat = m.flatten().long()
    assert bounds[0] == 0 and bounds[-1] == int((flat < n).sum())     # every used entry once, unused last
    for block in range(bounds.numel() - 1):
        entries = order[bounds[block]:bounds[block + 1]].long()
        assert bool(((flat[entries] // 16) == block).all())
        assert bool((entries[1:] > entries[:-1]).all())              # stable: position order kept


@pytest.mark.parametrize("kind,route", [("stable", "blocks"), ("runs of 16", "blocks"), ("runs of 4", "rows"),
                                        ("oldest-first", "rows"), ("random", "rows")])
def test_route_follows_the_map(kind, route):
    """Maps whose slots keep their rows for a while go to the blocked atomic kernels, the others by rows
    (runs of 4: the blocked kernels could take them, but by rows is faster)."""
    index_map, n = _map(kind, 300, 32)
    m = ref._normalise_map(index_map, n)
    assert ref._rows_route(index_map, m, n, e=4) is (route == "rows")
    if route == "blocks":
        assert ref._blocks_plan(index_map, m, n, e=4)[0] > 0


def test_few_row_changes_keep_the_atomics():
    """A map that changes rows in few (position, slot) pairs adds to memory rarely: the per-position atomic
    kernel; more than ``most_changes`` of them: by rows. The share is measured once and kept on the map."""
    index_map, n = _map("random", 300, 32)
    m = ref._normalise_map(index_map, n)
    share = ref._row_change_share(m)
    assert 0.9 < share <= 1.0
    assert ref._rows_route(index_map, m, n, e=4, most_changes=0.5)
    assert index_map._yaie_rows[1] is True
    index_map, n = _map("random", 300, 32)
    assert not ref._rows_route(index_map, m, n, e=4, most_changes=1.0)


def _pv_case(length: int = 30, capacity: int = 8, seed: int = 2):
    index_map, n = _map("random", length, capacity)
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(1, length, 2, 3, capacity, generator=gen)
    v = torch.randn(1, n, 2, 16, generator=gen)
    dout = torch.randn(1, length, 2, 3, 16, generator=gen)
    return index_map, n, p, v, dout


def test_a_valid_map_is_read_once_per_version(monkeypatch):
    """The map's minimum (a device sync on a GPU) is read at the first call and after each in-place edit,
    not at every call; an edit that makes an entry negative is still a ValueError."""
    index_map, n, p, v, dout = _pv_case()
    reads = []
    real_min = torch.Tensor.min
    monkeypatch.setattr(torch.Tensor, "min", lambda t, *a, **k: reads.append(1) or real_min(t, *a, **k))
    ref.indexed_pv_backward(dout, p, v, index_map)
    ref.indexed_pv_backward(dout, p, v, index_map)
    ref.indexed_pv_forward(p, v, index_map)
    assert len(reads) == 1 and index_map._yaie_checked == index_map._version
    index_map[3, 1] = -1
    with pytest.raises(ValueError, match="negative"):
        ref.indexed_pv_backward(dout, p, v, index_map)
    with pytest.raises(ValueError, match="negative"):           # an invalid map is never marked
        ref.indexed_pv_forward(p, v, index_map)
    index_map[3, 1] = 0
    ref.indexed_pv_forward(p, v, index_map)
    assert len(reads) == 4


def test_a_map_of_inference_mode_is_checked_at_every_call():
    """Inference tensors have no version counter: nothing is kept that could hide an edit."""
    with torch.inference_mode():
        index_map, n, p, v, _ = _pv_case()
        ref.indexed_pv_forward(p, v, index_map)
        assert getattr(index_map, "_yaie_checked", None) is None
        index_map[0, 0] = -2
        with pytest.raises(ValueError, match="negative"):
            ref.indexed_pv_forward(p, v, index_map)


def test_the_sorted_order_is_kept_and_follows_edits():
    """The normalised map and its sorted order are made once per map and version: the second backward
    reuses them; after an in-place edit of the map the buffer gradient follows the new map."""
    index_map, n, p, v, dout = _pv_case()
    assert ref._rows_route(index_map, ref._normalise_map(index_map, n), n, e=3)
    _, dv = ref.indexed_pv_backward(dout, p, v, index_map)
    m = ref._normalise_map(index_map, n)
    order = m._yaie_order[1][0]
    _, dv_again = ref.indexed_pv_backward(dout, p, v, index_map)
    assert ref._normalise_map(index_map, n) is m and m._yaie_order[1][0] is order
    assert torch.equal(dv, dv_again)
    index_map[:, 0] = index_map[:, 1]                          # every position: slot 0 now holds slot 1's row
    _, dv_edited = ref.indexed_pv_backward(dout, p, v, index_map)
    assert ref._normalise_map(index_map, n) is not m
    torch.testing.assert_close(dv_edited.double(), _want(p, dout, index_map, n), atol=5e-5, rtol=1e-5)
    assert not torch.allclose(dv_edited, dv)
