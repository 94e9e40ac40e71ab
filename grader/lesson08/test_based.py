"""Grader of lesson 08: Based linear attention (the Taylor feature map, chunked prefill, recurrent decode).

References are written here, independently of the solution, in float64:

* the weight of key ``j`` for query ``i`` is ``1 + s + s^2/2`` with ``s = q_i . k_j / 4``, for ``j <= i``;
  ``out_i`` is the weighted sum of the values over the sum of the weights;
* the state after ``n`` tokens is ``sum_j phi(k_j) v_j^T`` and ``sum_j phi(k_j)``, with ``phi`` built
  here block by block from its definition.

Lengths 1, 15, 16, 17 and 300 sit on, just before and just after chunk edges (chunks of 16 on the
CPU). On a CPU the kernel runs in the Triton interpreter: float32 and float16, two heads. bf16 (and
longer sequences, more heads) run on a GPU (the interpreter's bf16 ``tl.dot`` is broken).
"""

from __future__ import annotations

import math

import pytest
import torch

from grader.checks import GradingError, assert_close, describe, expect_value_error, randn, task
from grader.edges import tile
from yaie.switch import LessonProxy

L = LessonProxy(8)

FEATURES = 16
LENGTHS = [1, 15, 16, 17, 300]


def shape_dtype(device: str) -> torch.dtype:
    """The dtype of the checks about shapes, strides, chunks and edges.

    On a CPU float32, whose tolerances are tight. On a GPU bf16, the engine's dtype: there every distinct
    compiled configuration costs seconds of Triton compile, and an exact float32 ("ieee") configuration of
    the chunked kernel costs most (tens of seconds at a chunk of 64), so float32 is checked on the GPU by
    ``test_prefill_float32`` and the default route's float32 case, and the shape checks reuse the bf16
    configurations (chunk 64, 64 value columns a program) of ``test_prefill_bfloat16_gpu``.
    """
    return torch.bfloat16 if device == "cuda" else torch.float32


def output_tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of a prefill output against the float64 reference."""
    return (2e-5, 1e-4) if dtype == torch.float32 else (2e-2, 1.6e-2)


def state_tolerances(dtype: torch.dtype, seq: int) -> tuple[float, float]:
    """(atol, rtol) of the state: the sums grow with the length, and with them a bf16 operand's error."""
    return (1e-3 * max(seq / 64, 1) ** 0.5, 1e-4) if dtype == torch.float32 else (1e-2 * seq ** 0.5, 2e-2)


# ---------------------------------------------------------------- references

def ref_phi(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = [1, x / 2, x_a x_b / (4 sqrt 2) for a, b in 0..15 (a major)], in float64."""
    x = x.double()
    blocks = [torch.ones(*x.shape[:-1], 1, dtype=torch.float64, device=x.device), x / 2]
    blocks += [x[..., a:a + 1] * x / (4 * math.sqrt(2)) for a in range(FEATURES)]
    return torch.cat(blocks, -1)


def ref_based(q, k, v) -> torch.Tensor:
    """Causal Based attention from the weights, float64, [batch, heads, seq, d_v]."""
    q, k, v = q.double().cpu(), k.double().cpu(), v.double().cpu()
    s = q @ k.transpose(-1, -2) / math.sqrt(FEATURES)
    w = (1 + s + 0.5 * s * s) * torch.ones_like(s).tril()
    return (w @ v) / w.sum(-1, keepdim=True)


def ref_state(k, v):
    """(sum_j phi(k_j) v_j^T, sum_j phi(k_j)) in float64."""
    fk = ref_phi(k.cpu())
    return fk.transpose(-1, -2) @ v.double().cpu(), fk.sum(-2)


def make_qkv(batch, heads, seq, value_dim, dtype, device, seed, layout="bhsd"):
    if layout == "bshd":
        # The engine's token-major layout seen as [batch, heads, seq, dim] (non-contiguous).
        q, k = (randn(batch, seq, heads, FEATURES, dtype=dtype, device=device, seed=seed + i).transpose(1, 2)
                for i in range(2))
        v = randn(batch, seq, heads, value_dim, dtype=dtype, device=device, seed=seed + 2).transpose(1, 2)
        return q, k, v
    q = randn(batch, heads, seq, FEATURES, dtype=dtype, device=device, seed=seed)
    k = randn(batch, heads, seq, FEATURES, dtype=dtype, device=device, seed=seed + 1)
    v = randn(batch, heads, seq, value_dim, dtype=dtype, device=device, seed=seed + 2)
    return q, k, v


def check_tuple(result, name: str):
    if not (isinstance(result, tuple) and len(result) == 2):
        raise GradingError(f"{name} must return a tuple (out, state)\n  got:      {type(result).__name__}")
    return result


def check_state(state, k, v, case: str, atol: float, rtol: float, hint: str) -> None:
    if state is None or len(state) != 2:
        raise GradingError(f"the state is missing\n  case:     {case}\n  expected: BasedState(kv, k)\n"
                           f"  got:      {state!r}")
    exact_kv, exact_k = ref_state(k, v)
    assert_close(state[0], exact_kv, name="state.kv (sum of phi(k) v^T)", dtype=torch.float32, case=case,
                 atol=atol, rtol=rtol, hint=hint)
    assert_close(state[1], exact_k, name="state.k (sum of phi(k))", dtype=torch.float32, case=case,
                 atol=atol, rtol=rtol, hint=hint)


# ---------------------------------------------------------------- task 1: feature map, quadratic reference

@task(1, "taylor_feature_map, based_attention_reference")
def test_feature_map_products_are_the_taylor_series(device, seed):
    x = randn(3, 5, FEATURES, dtype=torch.float64, device=device, seed=seed)
    y = randn(7, FEATURES, dtype=torch.float64, device=device, seed=seed + 1, scale=2.0)
    fx, fy = L.taylor_feature_map(x), L.taylor_feature_map(y)
    s = (x @ y.T) / math.sqrt(FEATURES)
    assert_close(fx @ fy.T, 1 + s + s * s / 2, name="phi(x) . phi(y)", case=describe(x=x, y=y),
                 atol=1e-10, rtol=1e-10, hint="phi = [1, x / 16**0.25, vec(x x^T) / (sqrt(2) * sqrt(16))]")


@task(1, "taylor_feature_map, based_attention_reference")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_feature_map_layout(device, seed, dtype):
    x = randn(2, 3, FEATURES, dtype=dtype, device=device, seed=seed)
    got = L.taylor_feature_map(x)
    assert_close(got, ref_phi(x), name="taylor_feature_map(x)", dtype=dtype, case=describe(x=x),
                 hint="273 features in the order [1, the 16 x_a / 2, the 256 x_a x_b / (4 sqrt 2) with a major]: "
                      "the state layout of tasks 2 and 3 depends on it")


@task(1, "taylor_feature_map, based_attention_reference")
@pytest.mark.parametrize("seq", [1, 17, 40])
def test_reference_matches_float64(device, seed, seq):
    q, k, v = make_qkv(2, 2, seq, 8, torch.float64, device, seed)
    got = L.based_attention_reference(q, k, v)
    assert_close(got, ref_based(q, k, v), name="based_attention_reference", dtype=torch.float64,
                 case=describe(q=q, k=k, v=v), atol=1e-10, rtol=1e-10,
                 hint="w = 1 + s + s^2/2 with s = q.k / sqrt(16), zero above the diagonal; divide w @ v by w.sum(-1)")


# ---------------------------------------------------------------- task 2: chunked prefill

def _prefill_case(device, seed, dtype, seq, value_dim, chunk, heads=2, batch=1, layout="bhsd"):
    q, k, v = make_qkv(batch, heads, seq, value_dim, dtype, device, seed, layout)
    out, state = check_tuple(L.based_prefill(q, k, v, chunk_size=chunk), "based_prefill")
    case = f"{describe(q=q, k=k, v=v)}, chunk_size={chunk}"
    return q, k, v, out, state, case


@task(2, "based_prefill")
@pytest.mark.parametrize("seq", LENGTHS)
def test_prefill_float32(device, seed, seq):
    heads = 2 if device == "cpu" else 8
    q, k, v, out, state, case = _prefill_case(device, seed, torch.float32, seq, 64, 16, heads=heads)
    assert_close(out, ref_based(q, k, v), name="based_prefill output", dtype=torch.float32, case=case,
                 atol=2e-5, rtol=1e-4,
                 hint="inside a chunk the causal tile (row >= column); before it, phi(q) @ state; "
                      "a partial last chunk must not count its missing rows in the normaliser")
    check_state(state, k, v, case, atol=1e-3, rtol=1e-4,
                hint="after the last chunk: sums over every token of phi(k) v^T and phi(k), in the layout of phi")


@task(2, "based_prefill")
@pytest.mark.parametrize("seq,value_dim,chunk", [(17, 128, 16), (300, 64, 64), (45, 32, 32), (40, 16, None)])
def test_prefill_value_dims_and_chunks(device, seed, seq, value_dim, chunk):
    dtype = shape_dtype(device)
    q, k, v, out, state, case = _prefill_case(device, seed, dtype, seq, value_dim, chunk, layout="bshd")
    atol, rtol = output_tolerances(dtype)
    assert_close(out, ref_based(q, k, v), name="based_prefill output", dtype=dtype, case=case,
                 atol=atol, rtol=rtol,
                 hint="value columns beyond the first block, inputs with strides (q.stride(2) != 16), "
                      "chunk_size=None (your default)")
    atol, rtol = state_tolerances(dtype, seq) if dtype != torch.float32 else (1e-3, 1e-4)
    check_state(state, k, v, case, atol=atol, rtol=rtol, hint="every value column of the state")


@task(2, "based_prefill")
@pytest.mark.parametrize("seq,chunk", [(17, 16), (300, 16), (300, None)])
def test_prefill_float16(device, seed, seq, chunk):
    q, k, v, out, state, case = _prefill_case(device, seed, torch.float16, seq, 64, chunk)
    assert_close(out, ref_based(q, k, v), name="based_prefill output", dtype=torch.float16, case=case,
                 atol=1e-2, rtol=1e-2, hint="accumulate the tile and the state in float32; cast only the operands")
    check_state(state, k, v, case, atol=2e-2, rtol=1e-2, hint="keep the state in float32")


@task(2, "based_prefill")
@pytest.mark.gpu
@pytest.mark.parametrize("seq", LENGTHS + [2049])
@pytest.mark.parametrize("value_dim", [64, 128])
def test_prefill_bfloat16_gpu(device, seed, seq, value_dim):
    q, k, v, out, state, case = _prefill_case(device, seed, torch.bfloat16, seq, value_dim, 64, heads=4, batch=2)
    assert_close(out, ref_based(q, k, v), name="based_prefill output", dtype=torch.bfloat16, case=case,
                 atol=2e-2, rtol=1.6e-2, hint="accumulate in float32; the state is float32")
    scale = float(seq)      # the sums grow with the length; their bf16-operand error with them
    check_state(state, k, v, case, atol=1e-2 * scale ** 0.5, rtol=2e-2, hint="keep the state in float32")


@task(2, "based_prefill")
@pytest.mark.gpu
# 64 value columns: each value-block width is a compile of its own for both kernels of the route (an exact
# float32 one takes about twice as long at 128 as at 64); value_dim 128 is checked by the chunked kernel in
# test_prefill_value_dims_and_chunks and test_prefill_bfloat16_gpu.
@pytest.mark.parametrize("dtype,seq,value_dim", [(torch.float32, 2049, 64), (torch.float16, 2049, 64),
                                                 (torch.bfloat16, 1, 64), (torch.bfloat16, 300, 64),
                                                 (torch.bfloat16, 4097, 64)],
                         ids=["fp32-2049", "fp16-2049", "bf16-1", "bf16-300", "bf16-4097"])
def test_prefill_default_route_gpu(device, seed, dtype, seq, value_dim):
    """chunk_size=None: whatever route your default takes (short and long sequences may differ)."""
    heads, batch = (2, 1) if seq > 2048 else (4, 2)
    q, k, v, out, state, case = _prefill_case(device, seed, dtype, seq, value_dim, None, heads=heads, batch=batch)
    low = dtype != torch.float32
    atol, rtol = (2e-2, 1.6e-2) if low else (2e-5, 1e-4)
    assert_close(out, ref_based(q, k, v), name="based_prefill output", dtype=dtype, case=case, atol=atol, rtol=rtol,
                 hint="chunk_size=None (your default route); accumulate in float32")
    scale = float(seq) ** 0.5
    check_state(state, k, v, case, atol=(1e-2 if low else 1e-3) * scale, rtol=2e-2 if low else 1e-4,
                hint="the default route must return the state too")


@task(2, "based_prefill")
@pytest.mark.parametrize("chunk", [16, None], ids=["chunk16", "default"])
def test_prefill_batch_and_heads_apart(device, seed, chunk):
    """Two sequences of three heads (program ids of batch and head no longer coincide, as with one sequence),
    in the token-major layout (q.stride(1) is not the head stride of a [b, h, s, d] tensor)."""
    dtype = shape_dtype(device)
    value_dim = 64 if device == "cuda" else 32      # on a GPU: the compiled configuration of the bf16 checks
    q, k, v, out, state, case = _prefill_case(device, seed, dtype, 40, value_dim, chunk, heads=3, batch=2,
                                              layout="bshd")
    hint = ("each program reads and writes its own (sequence, head): offsets b * stride(0) + h * stride(1) for "
            "q, k, v and out, and the state of that (sequence, head)")
    atol, rtol = output_tolerances(dtype)
    assert_close(out, ref_based(q, k, v), name="based_prefill output", dtype=dtype, case=case,
                 atol=atol, rtol=rtol, hint=hint)
    atol, rtol = state_tolerances(dtype, 40) if dtype != torch.float32 else (1e-3, 1e-4)
    check_state(state, k, v, case, atol=atol, rtol=rtol, hint=hint)


EDGES = ["1 segment", "2 segments", "2 segments + 1", "2 chunks of 16", "2 chunks of 32", "4 chunks of 64"]


@task(2, "based_prefill")
@pytest.mark.parametrize("edge", EDGES)
def test_prefill_lengths_on_chunk_and_segment_edges(device, seed, edge):
    """Lengths of exactly whole chunks and segments (the module's DEFAULT_SEGMENT): no partial last piece, so
    a state kept for the piece after the last one would be stored past the end of its buffer."""
    segment = tile(8, 0, lambda m: m.DEFAULT_SEGMENT, 256)
    seq, chunk = {"1 segment": (segment, None), "2 segments": (2 * segment, None),
                  "2 segments + 1": (2 * segment + 1, None), "2 chunks of 16": (32, 16),
                  "2 chunks of 32": (64, 32), "4 chunks of 64": (256, 64)}[edge]
    dtype = shape_dtype(device)
    value_dim = 64 if device == "cuda" else 32      # on a GPU: the compiled configuration of the bf16 checks
    q, k, v, out, state, case = _prefill_case(device, seed, dtype, seq, value_dim, chunk)
    case += f" ({edge}; DEFAULT_SEGMENT = {segment})"
    hint = ("a length that fills its last chunk (or segment) exactly has no partial piece: no state is carried "
            "into, or stored for, a piece after the last one")
    atol, rtol = output_tolerances(dtype)
    assert_close(out, ref_based(q, k, v), name="based_prefill output", dtype=dtype, case=case,
                 atol=atol, rtol=rtol, hint=hint)
    atol, rtol = state_tolerances(dtype, seq)
    check_state(state, k, v, case, atol=atol, rtol=rtol, hint=hint)


@task(2, "based_prefill")
def test_prefill_refuses_other_chunk_sizes_and_may_skip_the_state(device, seed):
    """The docstring's promises: a chunk size outside 16, 32, 64, 128 is a ValueError; ``return_state=False``
    returns ``(out, None)`` with the same output."""
    value_dim = 64 if device == "cuda" else 16      # on a GPU: test_prefill_float32's compiled configuration
    q, k, v = make_qkv(1, 2, 20, value_dim, torch.float32, device, seed)
    for chunk in (8, 24, 256, "16", 16.0):
        expect_value_error(L.based_prefill, q, k, v, chunk_size=chunk, what=f"chunk_size={chunk!r}")
    out, state = check_tuple(L.based_prefill(q, k, v, chunk_size=16, return_state=False), "based_prefill")
    if state is not None:
        raise GradingError("based_prefill(..., return_state=False) must return (out, None)\n"
                           f"  got:      a state of type {type(state).__name__}\n"
                           "  hint:     skip computing (and returning) the final state when it is not asked for")
    assert_close(out, ref_based(q, k, v), name="based_prefill output with return_state=False", dtype=torch.float32,
                 case=describe(q=q, k=k, v=v), atol=1e-5, rtol=1e-4, hint="the output does not depend on return_state")


@task(2, "based_prefill")
def test_prefill_writes_every_row(device, seed):
    """A NaN in one input row may spoil only that row's own output and the rows after it."""
    value_dim = 64 if device == "cuda" else 32      # on a GPU: test_prefill_float32's compiled configuration
    q, k, v = make_qkv(1, 2, 40, value_dim, torch.float32, device, seed)
    q[:, :, 33] = float("nan")                  # query 33 only: only out[33] may be NaN
    out, _ = check_tuple(L.based_prefill(q, k, v, chunk_size=16), "based_prefill")
    bad = torch.isnan(out).any(-1).any(0).any(0)
    if bad.tolist() != [i == 33 for i in range(40)]:
        raise GradingError("based_prefill mixes rows\n  case:     one NaN query at row 33 of 40\n"
                           f"  expected: NaN in output row 33 only\n  got:      NaN rows {bad.nonzero().flatten().tolist()}\n"
                           "  hint:     each output row must read its own query only")


# ---------------------------------------------------------------- task 3: recurrent decode

def _decode_from(state, q, k, v, start: int):
    """Decode tokens start.. one at a time; return their outputs stacked on dim 2."""
    outs = []
    for t in range(start, q.shape[2]):
        outs.append(L.based_decode_step(q[:, :, t], k[:, :, t], v[:, :, t], state))
    return torch.stack(outs, 2)


@task(3, "based_decode_step")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_decode_from_an_empty_state(device, seed, dtype):
    q, k, v = make_qkv(2, 2, 9, 32, dtype, device, seed)
    state = L.empty_state(2, 2, 32, device)
    got = _decode_from(state, q, k, v, 0)
    case = describe(q=q, k=k, v=v) + ", one token at a time from an empty state"
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)
    assert_close(got, ref_based(q, k, v), name="the output of based_decode_step", dtype=dtype, case=case,
                 atol=atol, rtol=rtol, hint="add phi(k) v^T and phi(k) to the state first (a token sees itself), then "
                                            "out = phi(q) @ kv / (phi(q) . k)")
    check_state(state, k, v, case, atol=1e-4, rtol=1e-4, hint="update the state in place")


@task(3, "based_decode_step")
@pytest.mark.parametrize("prefix", [16, 17, 300])
def test_prefill_then_decode_equals_the_parallel_form(device, seed, prefix):
    q, k, v = make_qkv(1, 2, prefix + 4, 64, torch.float32, device, seed)
    out, state = check_tuple(L.based_prefill(q[:, :, :prefix], k[:, :, :prefix], v[:, :, :prefix], chunk_size=16),
                             "based_prefill")
    got = torch.cat([out, _decode_from(state, q, k, v, prefix)], 2)
    assert_close(got, ref_based(q, k, v), name="prefill then decode", dtype=torch.float32,
                 case=f"{describe(q=q, k=k, v=v)}: prefill {prefix} tokens, decode 4",
                 atol=2e-5, rtol=1e-4, hint="decode must continue from the state the prefill returns, adding "
                 "each token into it in place (state.kv.add_, state.k.add_): the caller keeps the same state object")


@task(3, "based_decode_step")
def test_decode_keeps_constant_memory(device, seed):
    q, k, v = make_qkv(1, 2, 6, 16, torch.float32, device, seed)
    state = L.empty_state(1, 2, 16, device)
    kv_ptr, k_ptr, shapes = state.kv.data_ptr(), state.k.data_ptr(), (state.kv.shape, state.k.shape)
    _decode_from(state, q, k, v, 0)
    if (state.kv.data_ptr(), state.k.data_ptr()) != (kv_ptr, k_ptr) or (state.kv.shape, state.k.shape) != shapes:
        raise GradingError("based_decode_step must update the state in place\n"
                           "  expected: the same two tensors, same shapes, after every step\n"
                           "  got:      new tensors\n  hint:     state.kv.add_(...), state.k.add_(...)")


# ---------------------------------------------------------------- task 4: bad input

@task(4, "check_based_inputs")
def test_check_rejects_bad_prefill_input(device, seed):
    q, k, v = make_qkv(1, 2, 8, 32, torch.float32, device, seed)
    bad = [
        ("feature dimension 32 (the kernel is built for 16)", dict(q=torch.cat([q, q], -1), k=torch.cat([k, k], -1))),
        ("feature dimension 8", dict(q=q[..., :8], k=k[..., :8])),
        ("q is 3-D", dict(q=q[0])),
        ("k shorter than q", dict(k=k[:, :, :4])),
        ("v with other heads", dict(v=torch.cat([v, v], 1))),
        ("v with another length", dict(v=v[:, :, :5])),
        ("mixed dtypes", dict(k=k.half())),
        ("integer tensors", dict(q=q.long(), k=k.long(), v=v.long())),
        ("value dimension 512", dict(v=torch.zeros(1, 2, 8, 512, device=device))),
        ("zero tokens", dict(q=q[:, :, :0], k=k[:, :, :0], v=v[:, :, :0])),
    ]
    for what, change in bad:
        args = {**dict(q=q, k=k, v=v), **change}
        expect_value_error(L.check_based_inputs, args["q"], args["k"], args["v"], what=what)


@task(4, "check_based_inputs")
def test_prefill_and_decode_reject_bad_input(device, seed):
    q, k, v = make_qkv(1, 2, 8, 32, torch.float32, device, seed)
    expect_value_error(L.based_prefill, torch.cat([q, q], -1), torch.cat([k, k], -1), v,
                       what="based_prefill with feature dimension 32")
    state = L.empty_state(1, 2, 32, device)
    state.kv.normal_()
    before = state.kv.clone()
    expect_value_error(L.based_decode_step, q[:, :, 0], k[:, :, 0], v[:, :, 0, :16], state,
                       what="decode with a value of 16 columns for a state of 32")
    expect_value_error(L.based_decode_step, q[:, :, 0], k[:, :, 0], v[:, :, 0],
                       L.empty_state(1, 3, 32, device), what="decode with a state of 3 heads for 2")
    expect_value_error(L.based_decode_step, q[:, :, 0], k[:, :, 0], v[:, :, 0],
                       type(state)(state.kv.double(), state.k.double()), what="decode with a float64 state")
    expect_value_error(L.based_decode_step, q[:, :, :2], k[:, :, :2], v[:, :, :2], state,
                       what="decode with 4-D q (two tokens)")
    if not torch.equal(before, state.kv):
        raise GradingError("bad input changed the state\n  hint:     check everything before the first add_")
