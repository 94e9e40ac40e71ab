"""Lesson 06, going further: the FlashAttention forward tuned for Hopper GPUs (H100, H200).

This is an advanced variant of the reference in ``flash_attention.py``, not a task: it computes the same
function with the same online softmax, and the student's kernel stays the simple one. What changes is how
the tiles reach the tensor cores:

* **Tensor descriptors (TMA).** Each program describes its (sequence, head) slice of q, k, v and out as a
  2-D tensor ``[tokens, head_dim]`` with ``tl.make_tensor_descriptor``. A load of a ``[BLOCK_N, head_dim]``
  tile is then one instruction to Hopper's tensor memory accelerator, which copies the tile into shared
  memory on its own (no address arithmetic in the threads, no per-element masks) and fills rows past the
  sequence's end with zeros. A store is clipped at the end the same way, so no row of the next sequence is
  ever written.
* **wgmma-sized tiles.** 128 query rows x 64 or 128 keys with 8 warps: two warp groups, each driving
  Hopper's warp-group matrix instruction on 64 rows.
* **Software pipelining.** ``num_stages`` keeps the next key/value tiles in flight while the current one
  is multiplied; with ``warp_specialize`` (where the compiler supports it for the
  loop) producer warps issue the copies and consumer warps do the math.
* **Scores one block ahead (option).** ``PREFETCH_S`` issues block j+1's ``q k^T`` before block j's softmax,
  so that the tensor cores and the exponentials could overlap (FlashAttention-3's intra-warp-group trick).
* **Fewer instructions per score.** The scale is folded into the exponent (``exp2(s * c - m)`` is one fused
  multiply-add and one ``exp2``), and only the blocks on the causal diagonal or at the ragged end pay for a
  mask: the full blocks run a loop with no mask code at all.

Inputs this variant does not take (float32, head dims that are not a power of two from 16 to 128, strides
the copy engine cannot address, a sliding window, a GPU that is not a Hopper) go to the reference kernel,
so every call gets a correct answer. The backward pass is the reference's.

Measured on an H100 (``bench/results/lesson06_cudnn_h100.md``): no consistent gain over the reference (both
0.73-0.84x of cuDNN's forward at head dim 128 in the benchmark). Per tile, the matrix products and the softmax take about as long as each
other, and each warp group here runs them one after the other; cuDNN and FlashAttention-3 overlap them across
warp groups, which plain Triton does not let a kernel arrange. The engine therefore keeps the reference.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from solutions.kernels import flash_attention as reference
from yaie.device import triton_interpreted

LOG2E = reference.LOG2E
FAST_DTYPES = (torch.float16, torch.bfloat16)
FAST_HEAD_DIMS = (16, 32, 64, 128)


def is_hopper(device: torch.device) -> bool:
    """True for a CUDA device of compute capability 9.x (H100, H200)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _aligned(t: torch.Tensor, row_dims: int) -> bool:
    """The copy engine needs a 16-byte aligned base and 16-byte multiples for every stride but the last."""
    size = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((s * size) % 16 == 0 for s in t.stride()[-1 - row_dims:-1]))


def fast_path_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str = "dense") -> str | None:
    """Why these (already valid) inputs go to the reference kernel, or None if the fast kernel takes them."""
    if q.dtype not in FAST_DTYPES:
        return f"dtype {q.dtype} (the fast kernel takes float16 and bfloat16)"
    if q.shape[-1] not in FAST_HEAD_DIMS:
        return f"head_dim {q.shape[-1]} (the fast kernel takes {', '.join(map(str, FAST_HEAD_DIMS))})"
    if not triton_interpreted() and not is_hopper(q.device):
        return "not a Hopper GPU (compute capability 9)"
    rank = 3 if layout == "dense" else 2
    if not all(_aligned(t, rank) for t in (q, k, v)):
        return "strides or base addresses not 16-byte aligned"
    return None


# yaie: solution-only
@triton.jit
def _fold_block(acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, k_len, causal_shift, qk_scale_log2,
                MASK: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Fold one block of keys into the running (acc, l, m) of the query rows: the online softmax step."""
    k = k_desc.load([start_n, 0])                       # [BLOCK_N, HEAD_DIM], zeros past the end
    s = tl.dot(q, k.T)                                  # raw scores q . k, float32
    if MASK:
        cols = start_n + tl.arange(0, BLOCK_N)
        keep = cols[None, :] < k_len
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None] + causal_shift)
        s = tl.where(keep, s * qk_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen only masked keys keeps max -inf: subtract 0 instead (exp2(-inf) = 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
    else:
        # Scale folded into the exponent: exp2(s * c - m) is one fused multiply-add per score.
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
        m_safe = m_new
        p = tl.math.exp2(s * qk_scale_log2 - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([start_n, 0])
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


# yaie: solution-only
@triton.jit
def _softmax_step(acc, l_i, m_i, s, v, qk_scale_log2):
    """The online softmax step of an unmasked block whose raw scores ``s`` are already computed."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale_log2)
    p = tl.math.exp2(s * qk_scale_log2 - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


# yaie: solution-only
@triton.jit
def _full_blocks_prefetched(acc, l_i, m_i, q, k_desc, v_desc, full_end, qk_scale_log2,
                            BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """The unmasked blocks [0, full_end), with the next block's ``q k^T`` issued before this block's softmax.

    FlashAttention-3's intra-warp-group overlap written at the source level: the tensor cores can work on
    block j+1's scores while the same warps compute block j's exponentials, if the compiler leaves the
    matrix instruction in flight until ``s`` is used in the next iteration. Costs one more score tile of
    registers. An option (PREFETCH_S, off by default) that ``python -m yaie.bench.lesson06 sweep`` times;
    checked in the interpreter, not yet measured on a GPU.
    """
    if full_end > 0:
        s = tl.dot(q, k_desc.load([0, 0]).T)
        for start_n in tl.range(BLOCK_N, full_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            s_next = tl.dot(q, k_desc.load([start_n, 0]).T)
            acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v_desc.load([start_n - BLOCK_N, 0]), qk_scale_log2)
            s = s_next
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v_desc.load([full_end - BLOCK_N, 0]), qk_scale_log2)
    return acc, l_i, m_i


# yaie: solution-only
@triton.jit
def _hopper_fwd_kernel(
    Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs, stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, stride_ls,
    seqlen_q, seqlen_k, group_size, qk_scale_log2, tune_len,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    VARLEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PREFETCH_S: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (sequence, head). Grid: (query blocks, heads, batch)."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m          # the longest programs first (fewer stragglers)
    if VARLEN:
        q_start = tl.load(CU_SEQLENS_Q + batch)
        q_len = tl.load(CU_SEQLENS_Q + batch + 1) - q_start
        k_start = tl.load(CU_SEQLENS_K + batch)
        k_len = tl.load(CU_SEQLENS_K + batch + 1) - k_start
    else:
        q_start = tl.full([], 0, tl.int32)
        q_len = seqlen_q
        k_start = tl.full([], 0, tl.int32)
        k_len = seqlen_k
    start_m = pid_m * BLOCK_M
    if start_m >= q_len:
        return
    kv_head = (head // group_size).to(tl.int64)
    head64 = head.to(tl.int64)
    batch64 = batch.to(tl.int64)
    # Descriptors of this (sequence, head): [tokens, HEAD_DIM] row-major tensors the copy engine reads.
    q_desc = tl.make_tensor_descriptor(Q + batch64 * stride_qb + head64 * stride_qh + q_start.to(tl.int64) * stride_qs,
                                       shape=[q_len, HEAD_DIM], strides=[stride_qs, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    k_desc = tl.make_tensor_descriptor(K + batch64 * stride_kb + kv_head * stride_kh + k_start.to(tl.int64) * stride_ks,
                                       shape=[k_len, HEAD_DIM], strides=[stride_ks, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V + batch64 * stride_vb + kv_head * stride_vh + k_start.to(tl.int64) * stride_vs,
                                       shape=[k_len, HEAD_DIM], strides=[stride_vs, 1],
                                       block_shape=[BLOCK_N, HEAD_DIM])
    o_desc = tl.make_tensor_descriptor(O + batch64 * stride_ob + head64 * stride_oh + q_start.to(tl.int64) * stride_os,
                                       shape=[q_len, HEAD_DIM], strides=[stride_os, 1],
                                       block_shape=[BLOCK_M, HEAD_DIM])
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q = q_desc.load([start_m, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # Query row i sits at key position i + causal_shift. Blocks before full_end are seen whole by every
    # row of this program: no mask. The rest (causal diagonal, ragged last block) are masked.
    causal_shift = k_len - q_len
    full_end = (k_len // BLOCK_N) * BLOCK_N
    if CAUSAL:
        full_end = tl.minimum(full_end, (tl.maximum(start_m + causal_shift + 1, 0) // BLOCK_N) * BLOCK_N)
        end = tl.minimum(k_len, start_m + BLOCK_M + causal_shift)
    else:
        end = k_len
    if PREFETCH_S:
        acc, l_i, m_i = _full_blocks_prefetched(acc, l_i, m_i, q, k_desc, v_desc, full_end, qk_scale_log2,
                                                BLOCK_N, WARP_SPECIALIZE)
    else:
        for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            acc, l_i, m_i = _fold_block(acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, k_len, causal_shift,
                                        qk_scale_log2, False, CAUSAL, BLOCK_N)
    for start_n in range(full_end, end, BLOCK_N):
        acc, l_i, m_i = _fold_block(acc, l_i, m_i, q, k_desc, v_desc, start_n, offs_m, k_len, causal_shift,
                                    qk_scale_log2, True, CAUSAL, BLOCK_N)

    # Normalise once; a row with no visible key (l == 0) outputs zeros and lse = -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o_desc.store([start_m, 0], (acc / l_safe[:, None]).to(O.dtype.element_ty))   # rows past q_len: clipped
    lse = tl.where(l_i == 0.0, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    l_ptrs = LSE + batch64 * stride_lb + head64 * stride_lh + (q_start + offs_m).to(tl.int64) * stride_ls
    tl.store(l_ptrs, lse, mask=offs_m < q_len)


# yaie: solution-only
def _padded(config: tuple) -> tuple:
    """A configuration with its missing switches (warp_specialize, prefetch_s) set to off."""
    return (*(int(x) for x in config[:4]), *(bool(x) for x in config[4:]), *(False,) * (6 - len(config)))


def parse_config(text: str) -> tuple[int, int, int, int, bool, bool]:
    """"128,64,8,3,1,0" -> (128, 64, 8, 3, True, False); the two switches default to off."""
    fields = [int(x) for x in text.split(",")]
    if len(fields) < 4 or len(fields) > 6:
        raise ValueError(f"a configuration is BLOCK_M,BLOCK_N,num_warps,num_stages[,warp_specialize[,prefetch]], "
                         f"got {text!r}")
    return _padded(tuple(fields))


def _configs() -> list[tuple[int, int, int, int, bool, bool]]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize, prefetch_s) the GPU autotuner tries.

    128 query rows over 8 warps (two warp groups of 64 rows for wgmma); keys 64 or 128 at a time; two or
    three tiles in flight. ``YAIE_FA_HOPPER_CONFIGS`` ("128,128,8,2;128,64,8,3,1,0") replaces the list.
    """
    text = os.environ.get("YAIE_FA_HOPPER_CONFIGS")
    if text:
        return [parse_config(part) for part in text.split(";") if part.strip()]
    return [(128, 128, 8, 2, False, False), (128, 128, 8, 3, False, False), (128, 64, 8, 3, False, False),
            (128, 64, 8, 4, False, False)]


# yaie: solution-only
@functools.lru_cache(maxsize=None)
def _tuned():
    configs = [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "WARP_SPECIALIZE": ws, "PREFETCH_S": pf},
                             num_warps=w, num_stages=s)
               for m, n, w, s, ws, pf in _configs()]
    return triton.autotune(configs=configs, key=["HEAD_DIM", "CAUSAL", "VARLEN", "tune_len"])(_hopper_fwd_kernel)


def tuned_configs() -> str:
    """The autotuner's last choice (for the benchmark's log)."""
    best = getattr(_tuned(), "best_config", None) if not triton_interpreted() else None
    return str(best) if best is not None else ""


# yaie: solution-only
@functools.lru_cache(maxsize=None)
def _set_allocator() -> None:
    """Descriptors made inside a kernel live in a small global scratch buffer that torch allocates."""
    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, device="cuda", dtype=torch.int8)
    triton.set_allocator(alloc)


def _new_output(q: torch.Tensor) -> torch.Tensor:
    """The output buffer: contiguous like q's shape (the descriptor store needs 16-byte aligned rows)."""
    return torch.empty(q.shape, device=q.device, dtype=q.dtype)


# yaie: solution-only
def _launch(args: tuple, grid_rows: int, heads: int, batch: int, config: tuple | None = None, **constexprs) -> None:
    """Fixed small blocks in the interpreter; on a GPU ``config`` if given (BLOCK_M, BLOCK_N, num_warps,
    num_stages, warp_specialize, prefetch_s), the first configuration for short sequences, else the autotuner."""
    if triton_interpreted():
        # Small fixed blocks on the CPU (the interpreter runs every program in numpy); config's switches apply.
        grid = ((grid_rows + 31) // 32, heads, batch)
        prefetch = config is not None and _padded(config)[5]
        _hopper_fwd_kernel[grid](*args, BLOCK_M=32, BLOCK_N=32, WARP_SPECIALIZE=False, PREFETCH_S=prefetch,
                                 **constexprs)
        return
    _set_allocator()
    if config is not None or grid_rows <= 1024 or os.environ.get("YAIE_FA_AUTOTUNE", "1") == "0":
        # Short sequences: one good configuration (tuning would cost more than it saves), as the reference.
        block_m, block_n, warps, stages, ws, prefetch = _padded(config or _configs()[0])
        grid = ((grid_rows + block_m - 1) // block_m, heads, batch)
        _hopper_fwd_kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=block_n, WARP_SPECIALIZE=ws, PREFETCH_S=prefetch,
                                 num_warps=warps, num_stages=stages, **constexprs)
        return

    def grid(meta):
        return ((grid_rows + meta["BLOCK_M"] - 1) // meta["BLOCK_M"], heads, batch)
    _tuned()[grid](*args, **constexprs)


def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                            scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`solutions.kernels.flash_attention.flash_attention_forward`; the fast kernel
    where :func:`fast_path_reason` allows it, the reference elsewhere."""
    return forward_with_config(q, k, v, causal, scale, None)


def forward_with_config(q, k, v, causal: bool, scale: float | None, config: tuple | None):
    """:func:`flash_attention_forward` with the GPU blocks fixed to ``config`` (None: the usual choice);
    the benchmark's sweep times each configuration through it."""
    reference.check_attention_inputs(q, k, v, causal, scale)
    if fast_path_reason(q, k, v) is not None:
        return reference.flash_attention_forward(q, k, v, causal=causal, scale=scale)
    batch, num_heads, seq_q, head_dim = q.shape
    num_kv_heads, seq_k = k.shape[1], k.shape[2]
    scale = head_dim ** -0.5 if scale is None else float(scale)
    out = _new_output(q)
    lse = torch.empty((batch, num_heads, seq_q), device=q.device, dtype=torch.float32)
    args = (q, k, v, out, lse, lse, lse,     # the cu_seqlens pointers are unused in the dense layout
            *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *lse.stride(),
            seq_q, seq_k, num_heads // num_kv_heads, scale * LOG2E, reference._tune_bucket(seq_q))
    _launch(args, seq_q, num_heads, batch, config, HEAD_DIM=head_dim, CAUSAL=bool(causal), VARLEN=False)
    return out, lse


def flash_attention_varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                                   max_seqlen_q: int, max_seqlen_k: int, causal: bool = True,
                                   scale: float | None = None,
                                   sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`solutions.kernels.flash_attention.flash_attention_varlen_forward` (the
    engine's prefill); a sliding window goes to the reference."""
    reference.check_attention_inputs(q, k, v, causal, scale, layout="varlen")
    if sliding_window is not None or fast_path_reason(q, k, v, layout="varlen") is not None:
        return reference.flash_attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                        max_seqlen_k, causal=causal, scale=scale,
                                                        sliding_window=sliding_window)
    total_q, num_heads, head_dim = q.shape
    total_k, num_kv_heads = k.shape[0], k.shape[1]
    reference._check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k, int(max_seqlen_q),
                                int(max_seqlen_k), causal, q.device)
    batch = cu_seqlens_q.numel() - 1
    scale = head_dim ** -0.5 if scale is None else float(scale)
    out = _new_output(q)
    lse = torch.empty((num_heads, total_q), device=q.device, dtype=torch.float32)
    args = (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
            0, q.stride(1), q.stride(0), 0, k.stride(1), k.stride(0), 0, v.stride(1), v.stride(0),
            0, out.stride(1), out.stride(0), 0, lse.stride(0), lse.stride(1),
            int(max_seqlen_q), int(max_seqlen_k), num_heads // num_kv_heads, scale * LOG2E,
            reference._tune_bucket(int(max_seqlen_q)))
    _launch(args, int(max_seqlen_q), num_heads, batch, HEAD_DIM=head_dim, CAUSAL=bool(causal), VARLEN=True)
    return out, lse


class FlashAttentionHopperFunction(torch.autograd.Function):
    """Autograd op: this module's forward, the reference's backward (from the saved out and lse)."""

    @staticmethod
    def forward(ctx, q, k, v, causal=False, scale=None):
        out, lse = flash_attention_forward(q, k, v, causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = reference.flash_attention_backward(dout, q, k, v, out, lse, causal=ctx.causal, scale=ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """Differentiable attention: the Hopper forward, the reference backward."""
    return FlashAttentionHopperFunction.apply(q, k, v, causal, scale)
