"""Random programs of KV-cache operations, checked against an independent model after every step.

A *program* is a random sequence of ``allocate / append / free / fork / swap_out / swap_in`` calls on a
small :class:`KVCacheManager`. The checker keeps its own record (the "shadow") of what every sequence
must hold: its length and, when data is checked, every token's K and V rows in every layer. After each
step it checks the invariants of a paged cache, computed here from the public queries only:

* every device block is either free (``ref_count == 0``) or in some block table, and ``ref_count``
  equals the number of tables that hold it; ``num_free_blocks`` counts exactly the free ones;
* a sequence of ``n`` tokens holds ``ceil(n / block_size)`` blocks;
* every token of every resident sequence reads back bit for bit what was written (copy-on-write and
  swaps lose nothing);
* a call that raises ``OutOfBlocks`` leaves everything as it was;
* once every sequence is freed, every block is free again (nothing leaked).

The programs run through :func:`grader.programs.run_programs`: fixed cases first (each test names its
own), then fresh programs from hypothesis (which shrinks a failing program to a short one) or, without
it, from Python's ``random``.
"""

from __future__ import annotations

import torch

from grader.checks import GradingError
from grader.programs import run_programs  # noqa: F401  (the graders import it from here)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fail(what: str, **details) -> None:
    lines = [f"KV cache invariant broken: {what}"] + [f"  {k + ':':9} {v}" for k, v in details.items()]
    raise GradingError("\n".join(lines))


def snapshot(m) -> tuple:
    """Everything observable about the manager's bookkeeping (no tensor data)."""
    seqs = {}
    for sid in m.seq_ids():
        swapped = m.is_swapped(sid)
        seqs[sid] = (swapped, m.num_tokens(sid), None if swapped else tuple(m.block_ids(sid)))
    return (m.num_free_blocks, m.num_free_cpu_blocks, tuple(b.ref_count for b in m.blocks),
            tuple(b.ref_count for b in m.cpu_blocks), seqs)


def check_bookkeeping(m, lengths: dict) -> None:
    """The block invariants, from public queries. ``lengths``: the shadow's tokens per sequence."""
    if sorted(map(str, m.seq_ids())) != sorted(map(str, lengths)):
        fail("the manager's sequences differ from the ones allocated and not freed",
             expected=sorted(lengths, key=str), got=sorted(m.seq_ids(), key=str))
    owners = [0] * m.num_blocks
    for sid, length in lengths.items():
        if m.num_tokens(sid) != length:
            fail(f"sequence {sid} holds the wrong number of tokens", expected=length, got=m.num_tokens(sid))
        if m.is_swapped(sid):
            continue
        ids = m.block_ids(sid)
        if len(ids) != cdiv(length, m.block_size):
            fail(f"sequence {sid} of {length} tokens must hold ceil({length}/{m.block_size}) blocks",
                 expected=cdiv(length, m.block_size), got=f"{len(ids)} blocks {ids}")
        if len(set(ids)) != len(ids):
            fail(f"sequence {sid}'s block table holds a block twice", got=ids)
        for block_id in ids:
            owners[block_id] += 1
    refs = [b.ref_count for b in m.blocks]
    if refs != owners:
        bad = next(i for i in range(m.num_blocks) if refs[i] != owners[i])
        fail("ref_count must equal the number of block tables holding the block",
             block=bad, expected=owners[bad], got=refs[bad])
    free = sum(r == 0 for r in refs)
    if m.num_free_blocks != free:
        fail("num_free_blocks must count the blocks nobody holds", expected=free, got=m.num_free_blocks)


def gather_rows(m, sid: int, length: int) -> torch.Tensor:
    """Every token's K and V rows of a resident sequence: [length, num_layers, 2, num_kv_heads, head_dim]."""
    ids = torch.tensor(m.block_ids(sid), dtype=torch.long)
    t = torch.arange(length)
    blocks, offsets = ids[t // m.block_size], t % m.block_size
    per_layer = [torch.stack([m.k_cache[i].cpu()[blocks, offsets], m.v_cache[i].cpu()[blocks, offsets]], 1)
                 for i in range(m.num_layers)]
    return torch.stack(per_layer, 1) if length else torch.empty(0, m.num_layers, 2, m.num_kv_heads, m.head_dim, dtype=m.dtype)


def _first_values(row: torch.Tensor) -> str:
    return "[" + ", ".join(f"{float(x):.4g}" for x in row.flatten()[:4]) + ", ...]"


def check_data(m, rows: dict) -> None:
    for sid, expected in rows.items():
        if m.is_swapped(sid):
            continue
        got = gather_rows(m, sid, expected.shape[0])
        if got.dtype != expected.dtype or got.shape != expected.shape:
            fail(f"sequence {sid}'s cache rows have the wrong dtype or shape", expected=f"{expected.dtype} {tuple(expected.shape)}",
                 got=f"{got.dtype} {tuple(got.shape)}")
        if not torch.equal(got, expected):   # random finite values: equal means the same bits
            bad = (got != expected).flatten(1).any(1).nonzero()
            token = int(bad[0])
            layer, kv = [int(i) for i in (got[token] != expected[token]).nonzero()[0][:2]]
            fail(f"sequence {sid} does not read back what was written (token {token} of {expected.shape[0]}, "
                 f"layer {layer}, {'KV'[kv]})",
                 expected=_first_values(expected[token, layer, kv]), got=_first_values(got[token, layer, kv]),
                 hint="copy-on-write must copy the shared block before the new token is written; swaps must "
                      "copy every layer's K and V, and swap_in must read the host blocks swap_out wrote (a host "
                      "block id is not the device block id it comes back to)")


class ProgramRunner:
    """Runs one random program on a fresh manager and checks it after every step."""

    def __init__(self, lesson, pick, device: str, dtype: torch.dtype, ops: tuple[str, ...], with_data: bool,
                 max_steps: int = 25):
        self.L, self.pick, self.ops, self.with_data = lesson, pick, ops, with_data
        self.device, self.dtype, self.max_steps = device, dtype, max_steps
        block_size = [2, 4, 8, 1][pick(0, 3)]
        self.m = lesson.KVCacheManager(num_blocks=pick(1, 12), block_size=block_size, num_layers=2, num_kv_heads=2,
                                       head_dim=4, dtype=dtype, device=device,
                                       num_cpu_blocks=pick(0, 10) if "swap_out" in ops else 0)
        self.lengths: dict[int, int] = {}
        self.rows: dict[int, torch.Tensor] = {}
        self.next_id = 0
        self.trace: list[str] = getattr(pick, "trace", [])   # shared with the runner's report of a crash

    # ---------------------------------------------------------------- helpers

    def new_rows(self, n: int) -> torch.Tensor:
        m = self.m
        return torch.randn(n, m.num_layers, 2, m.num_kv_heads, m.head_dim,
                           generator=torch.Generator().manual_seed(self.pick(0, 2**16))).to(self.dtype)

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        for layer in range(self.m.num_layers):
            self.m.write_kv(layer, slots, rows[:, layer, 0].to(self.device), rows[:, layer, 1].to(self.device))

    def check_slots(self, sid: int, slots, start: int, n: int) -> None:
        m = self.m
        if not isinstance(slots, torch.Tensor) or tuple(slots.shape) != (n,) or slots.dtype.is_floating_point:
            fail("the slot mapping must be an integer tensor [num_new_tokens]", expected=f"[{n}] integers",
                 got=f"{type(slots).__name__} {getattr(slots, 'shape', '')} {getattr(slots, 'dtype', '')}")
        if slots.device.type != torch.device(self.device).type:
            fail("the slot mapping must be on the cache's device", expected=self.device, got=slots.device)
        ids = m.block_ids(sid)
        expected = [ids[t // m.block_size] * m.block_size + t % m.block_size for t in range(start, start + n)]
        if slots.tolist() != expected:
            fail(f"slot mapping of tokens {start}..{start + n - 1} of sequence {sid}",
                 expected=expected, got=slots.tolist(), hint="slot = table[t // block_size] * block_size + t % block_size")

    def expect_out_of_blocks(self, call, what: str) -> None:
        before = snapshot(self.m)
        try:
            call()
        except self.L.OutOfBlocks:
            pass
        else:
            fail(f"{what} must raise OutOfBlocks (not enough free blocks)", trace=" ; ".join(self.trace))
        if snapshot(self.m) != before:
            fail(f"{what} raised OutOfBlocks but changed the manager (it must change nothing)",
                 trace=" ; ".join(self.trace))

    def resident(self) -> list[int]:
        return [s for s in self.lengths if not self.m.is_swapped(s)]

    def choose(self, seqs: list[int]):
        return seqs[self.pick(0, len(seqs) - 1)] if seqs else None

    # ---------------------------------------------------------------- operations

    def op_allocate(self) -> None:
        m, n = self.m, self.pick(0, 3 * self.m.block_size + 1)
        sid, self.next_id = self.next_id, self.next_id + 1
        self.trace.append(f"allocate({sid}, {n})")
        if cdiv(n, m.block_size) > m.num_free_blocks:
            self.expect_out_of_blocks(lambda: m.allocate(sid, n), self.trace[-1])
            return
        slots = m.allocate(sid, n)
        self.lengths[sid] = n
        self.check_slots(sid, slots, 0, n)
        if self.with_data:
            self.rows[sid] = self.new_rows(n)
            self.write(slots, self.rows[sid])

    def op_append(self) -> None:
        m, sid = self.m, self.choose(self.resident())
        if sid is None:
            return
        n, length = self.pick(1, 2 * m.block_size), self.lengths[sid]
        self.trace.append(f"append_slots({sid}, {n})")
        table = m.block_ids(sid)
        shared_last = length % m.block_size != 0 and m.blocks[table[-1]].ref_count > 1
        needed = cdiv(length + n, m.block_size) - len(table) + int(shared_last)
        if needed > m.num_free_blocks:
            self.expect_out_of_blocks(lambda: m.append_slots(sid, n), self.trace[-1])
            return
        others = {s: m.block_ids(s) for s in self.resident() if s != sid}
        slots = m.append_slots(sid, n)
        self.lengths[sid] = length + n
        self.check_slots(sid, slots, length, n)
        for s, ids in others.items():
            if m.block_ids(s) != ids:
                fail(f"append_slots({sid}) changed the block table of sequence {s}", expected=ids, got=m.block_ids(s))
        if self.with_data:
            new = self.new_rows(n)
            self.write(slots, new)
            self.rows[sid] = torch.cat([self.rows[sid], new])

    def op_free(self) -> None:
        sid = self.choose(list(self.lengths))
        if sid is None:
            return
        self.trace.append(f"free({sid})")
        self.m.free(sid)
        del self.lengths[sid]
        self.rows.pop(sid, None)

    def op_fork(self) -> None:
        parent = self.choose(self.resident())
        if parent is None:
            return
        child, self.next_id = self.next_id, self.next_id + 1
        self.trace.append(f"fork({parent}, {child})")
        self.m.fork(parent, child)
        self.lengths[child] = self.lengths[parent]
        if self.with_data:
            self.rows[child] = self.rows[parent].clone()
        if self.m.block_ids(child) != self.m.block_ids(parent):
            fail("a forked child must share the parent's blocks", expected=self.m.block_ids(parent),
                 got=self.m.block_ids(child))

    def op_swap_out(self) -> None:
        m, sid = self.m, self.choose(self.resident())
        if sid is None:
            return
        self.trace.append(f"swap_out({sid})")
        if cdiv(self.lengths[sid], m.block_size) > m.num_free_cpu_blocks:
            self.expect_out_of_blocks(lambda: m.swap_out(sid), self.trace[-1])
            return
        m.swap_out(sid)
        if not m.is_swapped(sid):
            fail(f"after swap_out({sid}), is_swapped must be True")

    def op_swap_in(self) -> None:
        m, sid = self.m, self.choose([s for s in self.lengths if self.m.is_swapped(s)])
        if sid is None:
            return
        self.trace.append(f"swap_in({sid})")
        if cdiv(self.lengths[sid], m.block_size) > m.num_free_blocks:
            self.expect_out_of_blocks(lambda: m.swap_in(sid), self.trace[-1])
            return
        m.swap_in(sid)

    # ---------------------------------------------------------------- the program

    def run(self) -> None:
        m = self.m
        for _ in range(self.pick(1, self.max_steps)):
            try:
                getattr(self, f"op_{self.ops[self.pick(0, len(self.ops) - 1)]}")()
                check_bookkeeping(m, self.lengths)
                if self.with_data:
                    check_data(m, self.rows)
            except GradingError as err:
                raise GradingError(f"{err}\n  after:    {' ; '.join(self.trace)} (block_size {m.block_size}, "
                                   f"{m.num_blocks} blocks, {m.num_cpu_blocks} host blocks)") from None
        for sid in list(self.lengths):
            m.free(sid)
        del self.lengths
        if m.num_free_blocks != m.num_blocks or any(b.ref_count for b in m.blocks):
            fail("blocks leaked: after freeing every sequence every block must be free",
                 expected=f"{m.num_blocks} free", got=f"{m.num_free_blocks} free", trace=" ; ".join(self.trace))
        if m.num_free_cpu_blocks != m.num_cpu_blocks:
            fail("host blocks leaked: after freeing every sequence every host block must be free",
                 expected=m.num_cpu_blocks, got=m.num_free_cpu_blocks, trace=" ; ".join(self.trace))
