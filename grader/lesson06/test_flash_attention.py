"""Grader of lesson 06: FlashAttention forward, backward, autograd, the variable-length form and its
sliding window.

References are written here, independently of the solution: attention in float64, one head at a
time, query head h reading KV head h // group, gradients by float64 autograd.

Two kinds of accuracy check:

* float32 (and the CPU interpreter): close to float64 within the course's float32 tolerance;
* float16 / bfloat16, the FlashAttention rule: the kernel's largest error against float64 may be at
  most twice the largest error of the same math done by PyTorch in that precision (plus the error of
  merely rounding the exact answer to that dtype, which no kernel can beat).

On a CPU the kernels run in the Triton interpreter: sizes stay small, and every case runs in float32 (fp16 on
some). bf16 checks need a GPU (the interpreter's bf16 tl.dot is broken).

On a GPU every distinct compiled variant of a kernel costs seconds of Triton compile, and an exact float32
("ieee") one several times more. So on a GPU float32 has one forward and one backward case (with the autograd
check); the shape, varlen and window checks run in bf16 or fp16 under the FlashAttention rule and the tile-edge
checks in fp16 within its tolerances, on cases chosen to share compiled variants (see GPU_CASES).
"""

from __future__ import annotations

import pytest
import torch

from grader.checks import GradingError, assert_close, describe, expect_value_error, randn, task, tolerances
from grader.edges import tile
from yaie.switch import LessonProxy

L = LessonProxy(6)

# The device the ``device`` fixture picks (grader/framework.py asks the same): the GPU has case lists of its own.
ON_GPU = torch.cuda.is_available()

# (batch, heads, kv_heads, seq_q, seq_k, head_dim, causal): lengths off the block sizes on purpose.
CPU_CASES = [
    (2, 2, 2, 37, 37, 64, False),
    (1, 4, 2, 45, 45, 64, True),     # grouped-query, causal
    (1, 2, 1, 19, 50, 32, True),     # new tokens after a cached context
    (1, 3, 3, 33, 21, 40, False),    # head_dim 40 (padded), seq_q > seq_k without a mask
    (1, 2, 2, 17, 17, 128, True),
]
# GPU cases of the fp16/bf16 checks, each in its own dtype (GPU_DTYPES). Why these: Triton compiles a kernel once
# per set of constexprs (dtype, head_dim, causal, varlen, window, tiles) and once more per specialisation of its
# integer arguments (an integer equal to 1, or a multiple of 16, compiles a variant of its own: lengths, heads x
# length (the lse strides), the group size, the window), at seconds a variant. So the cases share variants:
# * fp16, head_dim 128 (8 warps), causal, grouped heads: cases 0 and 4 (lengths, and heads x lengths, off multiples
#   of 16) share one forward variant with the "2 tiles + 1" edge check; case 2 (lengths that are multiples of 16
#   but not of the tiles) shares one with the whole-tile edge checks, and its backward with the backward's edge
#   checks. fp16 because the edge checks compare within a dtype's tolerances, which bf16's coarser rounding of P
#   and dS comes close to on its own;
# * bf16, head_dim 64: case 1 (no mask, the engine's strided q layout; forward, backward and the autograd check);
# * bf16, case 3 (forward only): head_dim 96, padded to 128;
# * the varlen and window checks run fp16 at head_dim 64 on lengths kept off multiples of 16 (off_sixteen, and the
#   last sequence of their tile-edge checks): one variant with a causal mask, one without, one with a window (and
#   one more for the window of a whole key tile, 64).
# Grouped heads everywhere (a group of 1 is a variant of its own): GPU_FLOAT32_CASES has the one group of 1.
GPU_CASES = [
    (2, 8, 2, 301, 301, 128, True),     # GQA 4:1, two sequences
    (1, 8, 2, 513, 513, 64, False),     # no mask, q strided
    (2, 4, 1, 112, 720, 128, True),     # MQA, new tokens after a cached context
    (1, 6, 3, 257, 257, 96, True),      # head_dim 96 (padded)
    (1, 4, 2, 999, 999, 128, True),     # eight query tiles
]
GPU_DTYPES = [torch.float16, torch.bfloat16, torch.float16, torch.bfloat16, torch.float16]
# The GPU's float32 case: the exact ("ieee") path, in one forward, one backward and one autograd check that share
# its compiled variants. Its dots compile several times slower than fp16/bf16 ones, the more so the wider the head
# (head_dim 128: tens of seconds a kernel), hence head_dim 16; one head per KV head, two sequences, new tokens after
# a cached context. The CPU interpreter checks float32 on every case.
GPU_FLOAT32_CASES = [(2, 3, 3, 190, 301, 16, True)]


def case_id(case) -> str:
    b, h, hk, sq, sk, d, causal = case
    return f"b{b}h{h}kv{hk}q{sq}k{sk}d{d}" + ("causal" if causal else "")


def cases(device: str, dtype: torch.dtype):
    """The cases of ``dtype`` checks: on a GPU float32 has GPU_FLOAT32_CASES, fp16/bf16 GPU_CASES."""
    if device != "cuda":
        return CPU_CASES
    return GPU_FLOAT32_CASES if dtype == torch.float32 else GPU_CASES


def float32_params(cpu_indices) -> list:
    """Case indices of the float32 checks: ``cpu_indices`` on a CPU, the GPU's one float32 case on a GPU."""
    return list(range(len(GPU_FLOAT32_CASES))) if ON_GPU else list(cpu_indices)


DTYPE_IDS = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def low_precision_params(cpu_indices, gpu_indices) -> list:
    """(dtype, case_index) of the fp16/bf16 checks: on a CPU fp16 and bf16 on ``cpu_indices`` (bf16 is skipped
    there); on a GPU each of ``gpu_indices`` in its GPU_DTYPES dtype."""
    if ON_GPU:
        return [pytest.param(GPU_DTYPES[i], i, id=f"{DTYPE_IDS[GPU_DTYPES[i]]}-{i}") for i in gpu_indices]
    return [pytest.param(dtype, i, id=f"{DTYPE_IDS[dtype]}-{i}",
                         marks=[pytest.mark.gpu] if dtype == torch.bfloat16 else [])
            for dtype in (torch.float16, torch.bfloat16) for i in cpu_indices]


def skip_bf16_on_cpu(dtype, device) -> None:
    if dtype == torch.bfloat16 and device != "cuda":
        pytest.skip("bf16 tl.dot is broken in the Triton interpreter: bf16 runs on a GPU")


def off_sixteen(lens_q: list[int], lens_k: list[int]) -> None:
    """GPU: lengthen random sequences (in place) until the longest query and key lengths and the query token count
    are not multiples of 16. Triton compiles a kernel again for integer arguments that are; so every random-length
    varlen check runs one compiled variant of its kind (the tile-edge checks have whole tiles of their own)."""
    while True:
        if max(lens_k) % 16 == 0:
            lens_k[lens_k.index(max(lens_k))] += 1
        elif max(lens_q) % 16 == 0 or sum(lens_q) % 16 == 0:
            i = lens_q.index(max(lens_q))
            if lens_q[i] == lens_k[i]:
                lens_k[i] += 1                  # q <= k per sequence (causal); a whole prompt stays one
            lens_q[i] += 1
        else:
            return


def make_inputs(case, dtype, device, seed, strided_q=False):
    b, h, hk, sq, sk, d, _ = case
    if strided_q:
        # The engine's layout [batch, seq, heads, head_dim] seen as [batch, heads, seq, head_dim].
        q = randn(b, sq, h, d, dtype=dtype, device=device, seed=seed).transpose(1, 2)
    else:
        q = randn(b, h, sq, d, dtype=dtype, device=device, seed=seed)
    k = randn(b, hk, sk, d, dtype=dtype, device=device, seed=seed + 1)
    v = randn(b, hk, sk, d, dtype=dtype, device=device, seed=seed + 2)
    return q, k, v


# ---------------------------------------------------------------- references

def ref_attention(q, k, v, causal: bool, scale: float | None = None, window: int | None = None):
    """Attention head by head in the inputs' dtype (float64 copies give the reference). Returns (out, lse).
    ``window`` (with causal): query at position p sees keys p - window < j <= p only."""
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    group = h // hk
    scale = d ** -0.5 if scale is None else scale
    outs, lses = [], []
    for head in range(h):
        s = q[:, head] @ k[:, head // group].transpose(-1, -2) * scale      # [b, sq, sk]
        if causal:
            pos_q = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
            pos_k = torch.arange(sk, device=q.device)[None, :]
            hidden = pos_k > pos_q
            if window is not None:
                hidden = hidden | (pos_k <= pos_q - window)
            s = s.masked_fill(hidden, float("-inf"))
        lses.append(torch.logsumexp(s.float() if s.dtype != torch.float64 else s, dim=-1))
        outs.append(torch.softmax(s, dim=-1) @ v[:, head // group])
    return torch.stack(outs, 1), torch.stack(lses, 1)


def ref_grads(q, k, v, dout, causal: bool, dtype=torch.float64):
    """(out, dq, dk, dv) of the reference computed in ``dtype`` by PyTorch autograd."""
    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out, _ = ref_attention(*leaves, causal)
    grads = torch.autograd.grad(out, leaves, dout.to(dtype))
    return (out.detach(), *grads)


def rounding_floor(exact: torch.Tensor, dtype: torch.dtype) -> float:
    """The error of just storing the exact answer in ``dtype``: no kernel can do better."""
    return float((exact.to(dtype).double() - exact).abs().max())


def check_flash_rule(got, exact, torch_lowp, *, name: str, case: str, hint: str) -> None:
    """Largest |got - exact| <= 2 * largest |torch_lowp - exact| + rounding floor."""
    if tuple(got.shape) != tuple(exact.shape):
        raise GradingError(f"{name} is wrong\n  case:     {case}\n  expected: shape {list(exact.shape)}\n"
                           f"  got:      shape {list(got.shape)}")
    if got.dtype != torch_lowp.dtype:
        raise GradingError(f"{name} is wrong\n  case:     {case}\n  expected: dtype {torch_lowp.dtype}\n"
                           f"  got:      dtype {got.dtype}")
    g = got.detach().double().cpu()
    e = exact.detach().double().cpu()
    err = float((g - e).abs().max()) if g.numel() else 0.0
    if torch.isnan(g).any():
        err = float("inf")
    torch_err = float((torch_lowp.detach().double().cpu() - e).abs().max())
    bound = 2 * torch_err + rounding_floor(e, got.dtype)
    if not err <= bound:
        raise GradingError(
            f"{name} is less accurate than allowed (FlashAttention rule)\n  case:     {case}\n"
            f"  expected: largest error vs float64 <= 2 x PyTorch's own {got.dtype} error + rounding = {bound:.3g}\n"
            f"  got:      largest error {err:.3g} (PyTorch in {got.dtype}: {torch_err:.3g})\n"
            f"  hint:     {hint}")


def check_value_errors(fn, good: dict, bad: list[tuple[str, dict]]) -> None:
    for what, change in bad:
        expect_value_error(fn, **{**good, **change}, what=what)


# ---------------------------------------------------------------- task 1: forward

@task(1, "flash_attention_forward")
@pytest.mark.parametrize("case_index", float32_params(range(5)))
def test_forward_float32_matches_float64(device, seed, case_index):
    case = cases(device, torch.float32)[case_index]
    causal = case[-1]
    q, k, v = make_inputs(case, torch.float32, device, seed, strided_q=case_index == 1)
    out, lse = L.flash_attention_forward(q, k, v, causal=causal)
    ref_out, ref_lse = ref_attention(q.double(), k.double(), v.double(), causal)
    text = f"{case_id(case)}, {describe(q=q, k=k, v=v)}, causal={causal}"
    assert_close(out, ref_out, name="flash_attention_forward output", dtype=torch.float32, case=text,
                 atol=2e-5, rtol=1e-5,
                 hint="online softmax: rescale acc and l by exp(m_old - m_new) when the row max grows; "
                      "divide by l once at the end")
    assert_close(lse, ref_lse, name="flash_attention_forward lse", dtype=torch.float32, case=text,
                 atol=2e-5, rtol=1e-5, hint="lse = m + log(l) in natural log, shape [batch, heads, seq_q]")


@task(1, "flash_attention_forward")
@pytest.mark.parametrize("dtype,case_index", low_precision_params([0, 1, 2], range(len(GPU_CASES))))
def test_forward_low_precision_flash_rule(device, seed, dtype, case_index):
    skip_bf16_on_cpu(dtype, device)
    case = cases(device, dtype)[case_index]
    causal = case[-1]
    q, k, v = make_inputs(case, dtype, device, seed, strided_q=case_index == 1)
    out, lse = L.flash_attention_forward(q, k, v, causal=causal)
    exact, exact_lse = ref_attention(q.double(), k.double(), v.double(), causal)
    torch_lowp, _ = ref_attention(q, k, v, causal)
    text = f"{case_id(case)}, {describe(q=q, k=k, v=v)}, causal={causal}"
    check_flash_rule(out, exact, torch_lowp, name="flash_attention_forward output", case=text,
                     hint="accumulate scores, l and acc in float32; cast P to the input dtype only for P @ V")
    assert_close(lse, exact_lse, name="flash_attention_forward lse", dtype=torch.float32, case=text,
                 atol=1e-3, rtol=1e-3, hint="keep m and l in float32")


def kernel_tiles(device: str, kind: str, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the kernel (the module's ``_fixed_config``, as the reference has it)."""
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    defaults = {"BLOCK_M": 128 if device == "cuda" else 32, "BLOCK_N": 64 if device == "cuda" else 32}
    return tuple(tile(6, 0, lambda m: m._fixed_config(kind, block_d)[name], defaults[name])
                 for name in ("BLOCK_M", "BLOCK_N"))


EDGE_HINT = ("a length that fills its last tile exactly has no partial tile: the loops must stop there (not "
             "one tile later, not one tile sooner); the causal diagonal may fall on a tile edge")


def edge_setup(device: str, layout: str) -> tuple[torch.dtype, int]:
    """(dtype, head_dim) of the tile-edge checks: float32 at head_dim 32 on a CPU; on a GPU fp16 at the head_dim of
    compiled variants other checks share (see GPU_CASES): 128 for the dense form, 64 for varlen."""
    if device != "cuda":
        return torch.float32, 32
    return torch.float16, 128 if layout == "dense" else 64


def edge_close(got, exact, dtype: torch.dtype, *, name: str, case: str, hint: str, atol: float = 2e-5,
               rtol: float = 1e-5) -> None:
    """A tile-edge result of ``dtype`` against float64: float32 within ``atol + rtol |exact|``, fp16 (the GPU's) within
    the course's tolerances of its dtype (grader/checks.py): a tile skipped, or visited twice, is off by far more."""
    if dtype != torch.float32:
        atol, rtol = tolerances(dtype)
    assert_close(got, exact, name=name, dtype=dtype, case=case, atol=atol, rtol=rtol, hint=hint)


@task(1, "flash_attention_forward")
@pytest.mark.parametrize("shape", ["q=k=2 tiles", "q=1 tile, k=3 tiles", "q=k=2 tiles + 1"])
def test_forward_lengths_on_tile_edges(device, seed, shape):
    """Query and key lengths of whole tiles (the kernel's own), and one more."""
    dtype, head_dim = edge_setup(device, "dense")
    block_m, block_n = kernel_tiles(device, "fwd", head_dim)
    t = max(block_m, block_n)
    sq, sk = {"q=k=2 tiles": (2 * t, 2 * t), "q=1 tile, k=3 tiles": (t, 3 * t),
              "q=k=2 tiles + 1": (2 * t + 1, 2 * t + 1)}[shape]
    case = (1, 2, 1, sq, sk, head_dim, True)
    q, k, v = make_inputs(case, dtype, device, seed)
    out, lse = L.flash_attention_forward(q, k, v, causal=True)
    ref_out, ref_lse = ref_attention(q.double(), k.double(), v.double(), True)
    text = f"{case_id(case)}, {describe(q=q)}, causal=True; tiles of {block_m} queries x {block_n} keys"
    edge_close(out, ref_out, dtype, name="flash_attention_forward output", case=text, hint=EDGE_HINT)
    atol, rtol = (2e-5, 1e-5) if dtype == torch.float32 else (1e-4, 1e-4)     # lse: float32 from the same scores
    assert_close(lse, ref_lse, name="flash_attention_forward lse", dtype=torch.float32, case=text,
                 atol=atol, rtol=rtol, hint=EDGE_HINT)


@task(1, "flash_attention_forward")
def test_forward_rejects_bad_input(device, seed):
    q, k, v = make_inputs((1, 4, 2, 8, 8, 16, False), torch.float32, device, seed)
    good = dict(q=q, k=k, v=v)
    check_value_errors(L.flash_attention_forward, good, [
        ("q is 3-D", dict(q=q[0])),
        ("k and v of different shapes", dict(v=v[:, :, :4])),
        ("6 query heads with 4 KV heads", dict(q=torch.cat([q, q[:, :2]], 1), k=torch.cat([k, k], 1),
                                                v=torch.cat([v, v], 1))),
        ("head_dim of q differs from k", dict(q=q[..., :8])),
        ("batch of q differs from k", dict(q=torch.cat([q, q], 0))),
        ("mixed dtypes", dict(k=k.double() if device == "cpu" else k.half())),
        ("integer tensors", dict(q=q.long(), k=k.long(), v=v.long())),
        ("causal with seq_q > seq_k", dict(k=k[:, :, :4], v=v[:, :, :4], causal=True)),
        ("scale = 0", dict(scale=0.0)),
    ])


# ---------------------------------------------------------------- task 2: backward

@task(2, "flash_attention_backward")
@pytest.mark.parametrize("case_index", float32_params(range(4)))
def test_backward_float32_matches_float64(device, seed, case_index):
    case = cases(device, torch.float32)[case_index]
    causal = case[-1]
    q, k, v = make_inputs(case, torch.float32, device, seed)
    dout = randn(*q.shape, dtype=torch.float32, device=device, seed=seed + 3)
    out, lse = ref_attention(q.double(), k.double(), v.double(), causal)
    # The backward is graded on its own: it gets the exact forward results.
    grads = L.flash_attention_backward(dout, q, k, v, out.float(), lse.float(), causal=causal)
    _, dq, dk, dv = ref_grads(q, k, v, dout, causal)
    text = f"{case_id(case)}, {describe(q=q, k=k, v=v)}, causal={causal}"
    if not isinstance(grads, tuple) or len(grads) != 3:
        raise GradingError("flash_attention_backward must return a tuple (dq, dk, dv)")
    for name, got, ref in zip(("dq", "dk", "dv"), grads, (dq, dk, dv)):
        assert_close(got, ref, name=f"flash_attention_backward {name}", dtype=torch.float32, case=text,
                     atol=5e-5, rtol=1e-4,
                     hint="P = exp(S - lse); dP = dout V^T; dS = P * (dP - rowsum(dout * out)); "
                          "dQ = scale dS K, dK = scale dS^T Q, dV = P^T dout; sum dK, dV over each KV group")


def check_grads(grads, q, k, v, dout, causal: bool, *, names: tuple[str, str, str], case: str, hint: str) -> None:
    """(dq, dk, dv) against float64 autograd: float32 within 5e-5 + 1e-4 |exact|, fp16/bf16 by the FlashAttention
    rule against PyTorch's autograd in that dtype."""
    if not isinstance(grads, tuple) or len(grads) != 3:
        raise GradingError("flash_attention_backward must return a tuple (dq, dk, dv)")
    exact = ref_grads(q, k, v, dout, causal)[1:]
    if q.dtype == torch.float32:
        for name, got, ref in zip(names, grads, exact):
            assert_close(got, ref, name=name, dtype=torch.float32, case=case, atol=5e-5, rtol=1e-4, hint=hint)
    else:
        lowp = ref_grads(q, k, v, dout, causal, dtype=q.dtype)[1:]
        for name, got, ref, torch_lowp in zip(names, grads, exact, lowp):
            check_flash_rule(got, ref, torch_lowp, name=name, case=case, hint=hint)


BACKWARD_NAMES = ("flash_attention_backward dq", "flash_attention_backward dk", "flash_attention_backward dv")


@task(2, "flash_attention_backward")
# GPU: case 1 in bf16 (no mask) and case 2 in fp16 (causal, MQA; the variant of the backward's tile-edge checks).
@pytest.mark.parametrize("dtype,case_index", low_precision_params([1, 2], [1, 2]))
def test_backward_low_precision_flash_rule(device, seed, dtype, case_index):
    skip_bf16_on_cpu(dtype, device)
    case = cases(device, dtype)[case_index]
    causal = case[-1]
    q, k, v = make_inputs(case, dtype, device, seed)
    dout = randn(*q.shape, dtype=dtype, device=device, seed=seed + 3)
    out, lse = ref_attention(q.double(), k.double(), v.double(), causal)
    grads = L.flash_attention_backward(dout, q, k, v, out.to(dtype), lse.float(), causal=causal)
    text = f"{case_id(case)}, {describe(q=q, k=k, v=v)}, causal={causal}"
    check_grads(grads, q, k, v, dout, causal, names=BACKWARD_NAMES, case=text,
                hint="accumulate dq, dk, dv in float32; cast P and dS to the input dtype only as matmul operands")


@task(2, "flash_attention_backward")
@pytest.mark.parametrize("shape", ["q=k=2 tiles", "q=1 tile, k=2 tiles"])
def test_backward_lengths_on_tile_edges(device, seed, shape):
    """The backward's own tiles (its ``_fixed_config("bwd")``): lengths of whole tiles, causal."""
    dtype, head_dim = edge_setup(device, "dense")
    block_m, block_n = kernel_tiles(device, "bwd", head_dim)
    t = max(block_m, block_n)
    sq, sk = {"q=k=2 tiles": (2 * t, 2 * t), "q=1 tile, k=2 tiles": (t, 2 * t)}[shape]
    case = (1, 2, 1, sq, sk, head_dim, True)
    q, k, v = make_inputs(case, dtype, device, seed)
    dout = randn(*q.shape, dtype=dtype, device=device, seed=seed + 3)
    out, lse = ref_attention(q.double(), k.double(), v.double(), True)
    grads = L.flash_attention_backward(dout, q, k, v, out.to(dtype), lse.float(), causal=True)
    _, dq, dk, dv = ref_grads(q, k, v, dout, True)
    if not isinstance(grads, tuple) or len(grads) != 3:
        raise GradingError("flash_attention_backward must return a tuple (dq, dk, dv)")
    text = f"{case_id(case)}, {describe(q=q)}, causal=True; tiles of {block_m} x {block_n}"
    for name, got, ref in zip(BACKWARD_NAMES, grads, (dq, dk, dv)):
        edge_close(got, ref, dtype, name=name, case=text, atol=5e-5, rtol=1e-4, hint=EDGE_HINT)


@task(2, "flash_attention_backward")
def test_backward_rejects_bad_input(device, seed):
    q, k, v = make_inputs((1, 2, 2, 8, 8, 16, False), torch.float32, device, seed)
    out = randn(*q.shape, device=device, seed=seed + 4)
    lse = randn(1, 2, 8, device=device, seed=seed + 5)
    good = dict(dout=out.clone(), q=q, k=k, v=v, out=out, lse=lse)
    check_value_errors(L.flash_attention_backward, good, [
        ("dout of the wrong shape", dict(dout=out[:, :, :4])),
        ("lse of the wrong shape", dict(lse=lse[:, :1])),
        ("lse in float64", dict(lse=lse.double())),
        ("k and v of different shapes", dict(v=v[:, :, :4])),
    ])


# ---------------------------------------------------------------- task 3: autograd

# On a CPU float32 on two cases; on a GPU the float32 case and case 1 in bf16, on the compiled variants of the
# float32 and bf16 checks (no compile of their own).
AUTOGRAD_PARAMS = ([pytest.param(torch.float32, 0, id="fp32-0"), pytest.param(torch.bfloat16, 1, id="bf16-1")]
                   if ON_GPU else [pytest.param(torch.float32, i, id=str(i)) for i in (1, 3)])


@task(3, "FlashAttentionFunction")
@pytest.mark.parametrize("dtype,case_index", AUTOGRAD_PARAMS)
def test_autograd_loss_backward(device, seed, dtype, case_index):
    case = cases(device, dtype)[case_index]
    causal = case[-1]
    q, k, v = make_inputs(case, dtype, device, seed)
    weight = randn(*q.shape, dtype=dtype, device=device, seed=seed + 3)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = L.flash_attention(*leaves, causal=causal)
    (out * weight).sum().backward()
    ref_out, _ = ref_attention(q.double(), k.double(), v.double(), causal)
    text = f"{case_id(case)}, {describe(q=q)}, causal={causal}, loss = (out * w).sum()"
    if dtype == torch.float32:
        assert_close(out, ref_out, name="flash_attention output", dtype=dtype, case=text, atol=2e-5, rtol=1e-5)
    else:
        check_flash_rule(out, ref_out, ref_attention(q, k, v, causal)[0], name="flash_attention output", case=text,
                         hint="")
    for name, leaf in zip(("q.grad", "k.grad", "v.grad"), leaves):
        if leaf.grad is None:
            raise GradingError(f"{name} is None after loss.backward()\n  hint:     FlashAttentionFunction.forward "
                               "must save q, k, v, out, lse on ctx and backward must return (dq, dk, dv, None, None)")
    check_grads(tuple(leaf.grad for leaf in leaves), q, k, v, weight, causal, names=("q.grad", "k.grad", "v.grad"),
                case=text, hint="")


# ---------------------------------------------------------------- task 4: variable-length batch

def varlen_inputs(lens_q, lens_k, heads, kv_heads, head_dim, dtype, device, seed):
    q = randn(sum(lens_q), heads, head_dim, dtype=dtype, device=device, seed=seed)
    k = randn(sum(lens_k), kv_heads, head_dim, dtype=dtype, device=device, seed=seed + 1)
    v = randn(sum(lens_k), kv_heads, head_dim, dtype=dtype, device=device, seed=seed + 2)

    def offsets(lens):
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        return torch.tensor(cu, dtype=torch.int32, device=device)
    return q, k, v, offsets(lens_q), offsets(lens_k)


@task(4, "flash_attention_varlen_forward")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_varlen_matches_per_sequence_reference(device, seed, causal):
    gen = torch.Generator().manual_seed(seed)
    big = 400 if device == "cuda" else 48
    lens_k = [int(x) for x in torch.randint(1, big, (4,), generator=gen)]
    lens_q = [int(torch.randint(1, n + 1, (1,), generator=gen)) for n in lens_k]
    lens_q[1] = lens_k[1]                               # one plain prompt (seq_q == seq_k)
    if device == "cuda":
        off_sixteen(lens_q, lens_k)
    dtype = torch.float16 if device == "cuda" else torch.float32
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, 4, 2, 64, dtype, device, seed)
    out, lse = L.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    text = f"lens_q={lens_q}, lens_k={lens_k}, heads 4, kv_heads 2, head_dim 64, {dtype}, causal={causal}"
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (4, sum(lens_q)):
        raise GradingError(f"flash_attention_varlen_forward lse must be [num_heads, total_q] = [4, {sum(lens_q)}]"
                           f"\n  got:      {getattr(lse, 'shape', type(lse).__name__)}")
    for b in range(len(lens_q)):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[rq], k[rk], v[rk]))
        ref_out, ref_lse = ref_attention(qs.double(), ks.double(), vs.double(), causal)
        seq_text = f"{text}; sequence {b}"
        if dtype == torch.float32:
            assert_close(out[rq].transpose(0, 1)[None], ref_out, name="varlen output", dtype=dtype,
                         case=seq_text, atol=2e-5, rtol=1e-5,
                         hint="each program must read its sequence's start and length from cu_seqlens")
        else:
            lowp, _ = ref_attention(qs, ks, vs, causal)
            check_flash_rule(out[rq].transpose(0, 1)[None], ref_out, lowp, name="varlen output", case=seq_text,
                             hint="each program must read its sequence's start and length from cu_seqlens")
        assert_close(lse[:, rq][None], ref_lse, name="varlen lse", dtype=torch.float32, case=seq_text,
                     atol=1e-4, rtol=1e-4)


@task(4, "flash_attention_varlen_forward")
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_varlen_lengths_on_tile_edges(device, seed, causal):
    """Sequences of whole tiles, one more and one less: each next sequence starts on, or just off, a tile edge.
    The last, one query after two tiles and one key, also keeps the longest lengths and the query token count off
    multiples of 16: on a GPU the kernel then runs the compiled variant of the random-length check."""
    dtype, head_dim = edge_setup(device, "varlen")
    block_m, block_n = kernel_tiles(device, "fwd", head_dim)
    t = max(block_m, block_n)
    lens_k = [t, 2 * t, t + 1, t - 1, 2 * t + 1]
    lens_q = [t, t, t + 1, t - 1, 1]
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, 2, 1, head_dim, dtype, device, seed)
    out, lse = L.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
    text = (f"lens_q={lens_q}, lens_k={lens_k}, heads 2, kv_heads 1, head_dim {head_dim}, {dtype}, causal={causal}; "
            f"tiles of {block_m} queries x {block_n} keys")
    for b in range(len(lens_q)):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[rq], k[rk], v[rk]))
        ref_out, ref_lse = ref_attention(qs.double(), ks.double(), vs.double(), causal)
        edge_close(out[rq].transpose(0, 1)[None], ref_out, dtype, name="varlen output", case=f"{text}; sequence {b}",
                   hint=EDGE_HINT)
        assert_close(lse[:, rq][None], ref_lse, name="varlen lse", dtype=torch.float32, case=f"{text}; sequence {b}",
                     atol=1e-4, rtol=1e-4, hint=EDGE_HINT)


@task(4, "flash_attention_varlen_forward")
def test_varlen_rejects_bad_offsets(device, seed):
    q, k, v, cu_q, cu_k = varlen_inputs([3, 5], [4, 6], 2, 2, 16, torch.float32, device, seed)
    good = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6)
    check_value_errors(L.flash_attention_varlen_forward, good, [
        ("int64 offsets", dict(cu_seqlens_q=cu_q.long())),
        ("offsets that do not end at the token count", dict(cu_seqlens_k=cu_k - 1)),
        ("max_seqlen_q below the longest sequence", dict(max_seqlen_q=4)),
        ("q and k offsets of different batch sizes", dict(cu_seqlens_k=cu_k[:2])),
        ("causal with more queries than keys", dict(cu_seqlens_k=torch.tensor([0, 2, 10], dtype=torch.int32,
                                                                              device=device))),
        ("4-D q", dict(q=q[None])),
    ])
    # validate=False (the engine on CUDA) skips only the checks that read the offsets' values on the host.
    check_value_errors(L.flash_attention_varlen_forward, dict(good, validate=False), [
        ("int64 offsets, validate=False", dict(cu_seqlens_q=cu_q.long())),
        ("4-D q, validate=False", dict(q=q[None])),
        ("max_seqlen_q of 0, validate=False (a launch grid of no program)", dict(max_seqlen_q=0)),
        ("max_seqlen_k of 0, validate=False", dict(max_seqlen_k=0)),
    ])


# ---------------------------------------------------------------- task 5: sliding windows

WINDOW_HINT = ("query i of a sequence sits at p = len_k - len_q + i and sees keys p - window < j <= p: start each "
               "query block at the first key block its first row's window touches, mask the blocks the window's "
               "edge crosses, and never load the keys before (they are NaN here)")


@task(5, "sliding window (varlen)")
# Windows 1, 7 and 41 (GPU: 8, 56 and 328, none a multiple of 16: one compiled variant for the three).
@pytest.mark.parametrize("window", [1, 7, 41], ids=lambda w: f"window{w}")
def test_varlen_window_matches_reference(device, seed, window):
    gen = torch.Generator().manual_seed(seed)
    scale_up = 8 if device == "cuda" else 1          # GPU: contexts up to ~900 tokens, windows up to 328
    window *= scale_up
    lens_k = [int(x) * scale_up for x in torch.randint(1, 110, (4,), generator=gen)]
    lens_q = [int(torch.randint(1, n + 1, (1,), generator=gen)) for n in lens_k]
    lens_q[0] = lens_k[0]                             # a whole prompt
    lens_q[1] = lens_k[1]
    if device == "cuda":
        off_sixteen(lens_q, lens_k)
    dtype = torch.float16 if device == "cuda" else torch.float32
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, 4, 2, 64, dtype, device, seed)
    exact_inputs = [(t.clone()) for t in (k, v)]
    # Keys no query of its sequence can see (before the first query's window) are NaN: never read them.
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        hidden = max(0, lk - lq - window + 1)
        k[int(cu_k[b]): int(cu_k[b]) + hidden] = float("nan")
        v[int(cu_k[b]): int(cu_k[b]) + hidden] = float("nan")
    out, lse = L.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                sliding_window=window)
    text = f"lens_q={lens_q}, lens_k={lens_k}, heads 4, kv_heads 2, head_dim 64, {dtype}, sliding_window={window}"
    k, v = exact_inputs
    for b in range(len(lens_q)):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        qs, ks, vs = (t.transpose(0, 1)[None] for t in (q[rq], k[rk], v[rk]))
        ref_out, ref_lse = ref_attention(qs.double(), ks.double(), vs.double(), True, window=window)
        seq_text = f"{text}; sequence {b}"
        if dtype == torch.float32:
            assert_close(out[rq].transpose(0, 1)[None], ref_out, name="varlen output with a window", dtype=dtype,
                         case=seq_text, atol=2e-5, rtol=1e-5, hint=WINDOW_HINT)
        else:
            lowp, _ = ref_attention(qs, ks, vs, True, window=window)
            check_flash_rule(out[rq].transpose(0, 1)[None], ref_out, lowp, name="varlen output with a window",
                             case=seq_text, hint=WINDOW_HINT)
        assert_close(lse[:, rq][None], ref_lse, name="varlen lse with a window", dtype=torch.float32, case=seq_text,
                     atol=1e-4, rtol=1e-4, hint=WINDOW_HINT)


@task(5, "sliding window (varlen)")
@pytest.mark.parametrize("edge", ["tile", "tile+1"])
def test_varlen_window_starts_on_a_tile_edge(device, seed, edge):
    """Windows of one key tile (and one key more): the first row of every query tile then sees a first key
    that is exactly a key tile's first key (or the last one of the tile before); lengths of whole tiles. In the
    last sequence the context is one key short of a tile, which moves every window's first key back by one: there
    the window of one tile starts on a key tile's first key. It also keeps the longest lengths and the query token
    count off multiples of 16 (on a GPU the window of one tile and one key then runs the compiled variant of
    test_varlen_window_matches_reference)."""
    dtype, head_dim = edge_setup(device, "varlen")
    block_m, block_n = kernel_tiles(device, "fwd", head_dim)
    t = max(block_m, block_n)
    window = block_n + (edge == "tile+1")
    lens_k, lens_q = [2 * t, 3 * t, 2 * t + 1, 3 * t + 1], [2 * t, t, t - 1, 2 * t + 2]
    q, k, v, cu_q, cu_k = varlen_inputs(lens_q, lens_k, 2, 1, head_dim, dtype, device, seed)
    exact = (k.clone(), v.clone())
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):          # keys no query sees: NaN
        hidden = max(0, lk - lq - window + 1)
        k[int(cu_k[b]): int(cu_k[b]) + hidden] = float("nan")
        v[int(cu_k[b]): int(cu_k[b]) + hidden] = float("nan")
    out, lse = L.flash_attention_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                                sliding_window=window)
    k, v = exact
    text = (f"lens_q={lens_q}, lens_k={lens_k}, heads 2, kv_heads 1, head_dim {head_dim}, {dtype}, "
            f"sliding_window={window}; tiles of {block_m} queries x {block_n} keys")
    for b in range(len(lens_q)):
        rq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        rk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[rq], k[rk], v[rk]))
        ref_out, ref_lse = ref_attention(qs.double(), ks.double(), vs.double(), True, window=window)
        hint = WINDOW_HINT + "; when that first key is a key tile's first key, start at that tile, not the one before"
        edge_close(out[rq].transpose(0, 1)[None], ref_out, dtype, name="varlen output with a window",
                   case=f"{text}; sequence {b}", hint=hint)
        assert_close(lse[:, rq][None], ref_lse, name="varlen lse with a window", dtype=torch.float32,
                     case=f"{text}; sequence {b}", atol=1e-4, rtol=1e-4, hint=hint)


@task(5, "sliding window (varlen)")
def test_varlen_window_rejects_bad_input(device, seed):
    q, k, v, cu_q, cu_k = varlen_inputs([3, 5], [4, 6], 2, 2, 16, torch.float32, device, seed)
    good = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=6,
                sliding_window=2)
    check_value_errors(L.flash_attention_varlen_forward, good, [
        ("sliding_window=0", dict(sliding_window=0)),
        ("sliding_window=-1", dict(sliding_window=-1)),
        ("sliding_window=2.5", dict(sliding_window=2.5)),
        ("sliding_window=True", dict(sliding_window=True)),
        ("a window without causal", dict(causal=False)),
    ])
