"""Session-7 experiment: paged decode with a warp-specialised loader, in Gluon (Triton's lower-level language).

Not the lesson's kernel (``solutions/kernels/paged_attention.py`` is): a probe of one question. Session 7's
``ceiling`` section found that the solution's loop takes the same time with its online softmax taken out, so
what is left against cuDNN is how the K/V bytes are fetched, not the arithmetic. Triton decides that by itself
(``cp.async`` issued by every thread, a software pipeline of ``num_stages`` buffers). Gluon lets a kernel say it:

* a **loader** partition of ONE warp walks the block table and copies each tile of K and V (64 keys = 4 blocks
  of 16) into a ring of ``STAGES`` shared-memory buffers, either with the TMA engine (``LOADER="tma"``: one
  instruction per 16 x 64 box of a 4-D descriptor over the cache; nothing per element) or with ``cp.async``
  (``LOADER="cpasync"``, 16 bytes per lane and instruction); it signals a "ready" mbarrier per buffer;
* the **compute** partition (4 warps) waits for "ready", runs the same online softmax as the solution (two
  ``mma.sync`` products on 16 padded query rows), and frees the buffer with an "empty" mbarrier.

The loader never waits for arithmetic and the compute warps never issue a copy, so the ring stays full as long
as memory keeps up. One program per (sequence, KV head); no split (the probe is timed at the shapes where the
solution uses none). bf16/fp16, head_dim 64 or 128, block sizes that divide 64 or (TMA) are multiples of it, so
SDPA's own contiguous tensors can be read as one block per sequence; no CPU path (the Triton
interpreter does not run Gluon), so ``section_gluon`` of ``gpu_lesson04_tune.py`` checks it against float64 on
the GPU before it is timed (and ``tests/test_lesson04.py`` on a Hopper GPU).

Result (``bench/README.md``, "Session 7"): correct, and within about 1% of the solution's time, so still 1-3%
behind cuDNN on the paged cache; on SDPA's contiguous tensors it is level with cuDNN to within about 1%.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634
TILE = gl.constexpr(64)          # keys per ring buffer
ROWS = gl.constexpr(16)          # query rows per program (the group, padded for mma.sync)


@gluon.jit
def _load_tiles_tma(k_desc, v_desc, table, seq_len, n_tiles, k_ring, v_ring, ready, empty, kv_head,
                    BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """The loader warp, TMA flavour: per tile, one box of ``[1, BOX_ROWS, 1, BOX_W]`` per run of rows and box column.

    A box holds ``BOX_ROWS = min(BLOCK_SIZE, TILE)`` tokens of one block (a whole block of 16 or 32, or 64 tokens
    of a bigger one). The ring's buffers are 128-byte swizzled (so that the compute warps read them without
    bank conflicts), and a swizzled ``[TILE, HEAD_DIM]`` tile lies in memory as ``HEAD_DIM / 64`` column halves of
    ``[TILE, 64]``: a box is 64 wide (128 bytes, the swizzle width) and box (half c, run j) lands at
    ``c * RUNS + j`` of the buffer seen as boxes. (An unswizzled ring with whole-row boxes gave NaN on the H200:
    that box-to-buffer mapping is not the one the compute warps read. It was dropped.)"""
    BOX_ROWS: gl.constexpr = k_desc.block_shape[1]
    BOX_W: gl.constexpr = k_desc.block_shape[3]
    HALVES: gl.constexpr = HEAD_DIM // BOX_W
    RUNS: gl.constexpr = TILE // BOX_ROWS
    BOXES: gl.constexpr = RUNS * HALVES
    k_boxes = k_ring._reinterpret(k_desc.dtype, [STAGES * BOXES, 1, BOX_ROWS, 1, BOX_W], k_desc.layout)
    v_boxes = v_ring._reinterpret(v_desc.dtype, [STAGES * BOXES, 1, BOX_ROWS, 1, BOX_W], v_desc.layout)
    used_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    for i in range(n_tiles):
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)   # 1st lap: a fresh barrier passes parity 1
        mbarrier.expect(ready.index(stage), 2 * TILE * HEAD_DIM * k_desc.dtype.primitive_bitwidth // 8)
        for j in gl.static_range(RUNS):
            token = i * TILE + j * BOX_ROWS
            logical = token // BLOCK_SIZE
            # Past the sequence's last block the table may hold anything: point those boxes at block 0 (any
            # real block will do; the compute warps zero those rows).
            block = gl.load(table + logical, mask=logical < used_blocks, other=0)
            for c in gl.static_range(HALVES):
                box = stage * BOXES + c * RUNS + j
                at = [block, token % BLOCK_SIZE, kv_head, c * BOX_W]
                tma.async_copy_global_to_shared(k_desc, at, ready.index(stage), k_boxes.index(box))
                tma.async_copy_global_to_shared(v_desc, at, ready.index(stage), v_boxes.index(box))


@gluon.jit
def _load_tiles_cpasync(k_cache, v_cache, table, seq_len, n_tiles, k_ring, v_ring, ready, empty, kv_head,
                        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                        BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """The loader warp, ``cp.async`` flavour: one block (``[BLOCK_SIZE, HEAD_DIM]``) at a time, 16 bytes per lane
    and instruction; every lane arrives on the stage's "ready" barrier when its own copies have landed."""
    BLOCKS: gl.constexpr = TILE // BLOCK_SIZE
    rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [1, 1], [1, 0])
    rows = gl.arange(0, BLOCK_SIZE, layout=gl.SliceLayout(1, rows_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, rows_layout))
    k_in_block = rows[:, None] * stride_kt + kv_head * stride_kh + cols[None, :]
    v_in_block = rows[:, None] * stride_vt + kv_head * stride_vh + cols[None, :]
    used_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    for i in range(n_tiles):
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        for j in gl.static_range(BLOCKS):
            logical = i * BLOCKS + j
            block = gl.load(table + logical, mask=logical < used_blocks, other=0).to(gl.int64)
            async_copy.async_copy_global_to_shared(k_ring.index(stage).slice(j * BLOCK_SIZE, BLOCK_SIZE),
                                                   k_cache + block * stride_kb + k_in_block)
            async_copy.async_copy_global_to_shared(v_ring.index(stage).slice(j * BLOCK_SIZE, BLOCK_SIZE),
                                                   v_cache + block * stride_vb + v_in_block)
        async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)


@gluon.jit
def _attend_tiles(q_ptr, out_ptr, seq, kv_head, seq_len, n_tiles, scale_log2, k_ring, v_ring, ready, empty,
                  stride_qb, stride_qh, num_heads,
                  GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """The compute warps: the solution's online softmax over the ring's tiles (scores and P @ V by ``mma.sync``)."""
    WARPS: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, WARPS], instr_shape=[16, 8])
    a_operand: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    b_operand: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // HEAD_DIM, HEAD_DIM // 8], [WARPS, 1], [1, 0])

    q_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
    q_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    heads = kv_head * GROUP + q_rows
    q = gl.load(q_ptr + seq.to(gl.int64) * stride_qb + heads[:, None] * stride_qh + q_cols[None, :],
                mask=(q_rows < GROUP)[:, None], other=0.0)
    q = gl.convert_layout(q, a_operand)

    m = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma))
    l = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, mma))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=mma)
    keys = gl.arange(0, TILE, layout=gl.SliceLayout(0, mma))
    v_rows = gl.arange(0, TILE, layout=gl.SliceLayout(1, b_operand))
    for i in range(n_tiles):
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        k = k_ring.index(stage).permute((1, 0)).load(b_operand)          # K^T: [HEAD_DIM, TILE]
        scores = mma_v2(q, k, gl.zeros([ROWS, TILE], gl.float32, layout=mma)) * scale_log2
        valid = i * TILE + keys < seq_len
        scores = gl.where(valid[None, :], scores, float("-inf"))
        m_new = gl.maximum(m, gl.max(scores, axis=1))
        alpha = gl.exp2(m - m_new)
        p = gl.exp2(scores - m_new[:, None])
        l = l * alpha + gl.sum(p, axis=1)
        v = v_ring.index(stage).load(b_operand)                          # V: [TILE, HEAD_DIM]
        # Rows past the context hold whatever the cache had there (even NaN): 0 * NaN would poison acc.
        v = gl.where((i * TILE + v_rows < seq_len)[:, None], v, 0.0)
        acc = mma_v2(gl.convert_layout(p.to(v.dtype), a_operand), v, acc * alpha[:, None])
        m = m_new
        gl.thread_barrier()                    # every compute warp is done with this stage's buffers ...
        mbarrier.arrive(empty.index(stage))    # ... before one thread hands them back to the loader

    out = acc / gl.where(l > 0, l, 1.0)[:, None]       # an empty context gives 0
    o_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    o_cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, mma))
    row = seq.to(gl.int64) * num_heads + kv_head * GROUP + o_rows
    gl.store(out_ptr + row[:, None] * HEAD_DIM + o_cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(o_rows < GROUP)[:, None])


@gluon.jit
def _paged_decode_ws_kernel(q_ptr, out_ptr, k_cache, v_cache, k_desc, v_desc, tables, context_lens,
                            stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                            stride_table, num_heads, scale_log2,
                            GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
                            STAGES: gl.constexpr, LOADER: gl.constexpr, LOADER_REGS: gl.constexpr):
    seq = gl.program_id(0)
    kv_head = gl.program_id(1)
    seq_len = gl.load(context_lens + seq)
    n_tiles = (seq_len + TILE - 1) // TILE
    table = tables + seq.to(gl.int64) * stride_table

    dtype: gl.constexpr = k_cache.dtype.element_ty
    ring_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TILE, HEAD_DIM], dtype)   # 128-byte swizzle
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, TILE, HEAD_DIM], ring_layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, TILE, HEAD_DIM], ring_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        # TMA: one arrive (the expect) plus the bytes; cp.async: each of the loader's 32 lanes arrives.
        mbarrier.init(ready.index(s), count=1 if LOADER == "tma" else 32)
        mbarrier.init(empty.index(s), count=1)
    fence_async_shared()                       # the barriers' initial state, visible to the TMA unit

    # (The partitions are spelled out in each branch: a function cannot be kept in a variable inside a kernel.)
    if LOADER == "tma":
        gl.warp_specialize([
            (_attend_tiles, (q_ptr, out_ptr, seq, kv_head, seq_len, n_tiles, scale_log2, k_ring, v_ring, ready, empty,
                             stride_qb, stride_qh, num_heads, GROUP, HEAD_DIM, STAGES)),
            (_load_tiles_tma, (k_desc, v_desc, table, seq_len, n_tiles, k_ring, v_ring, ready, empty, kv_head,
                               BLOCK_SIZE, HEAD_DIM, STAGES)),
        ], worker_num_warps=[1], worker_num_regs=[LOADER_REGS])
    else:
        gl.warp_specialize([
            (_attend_tiles, (q_ptr, out_ptr, seq, kv_head, seq_len, n_tiles, scale_log2, k_ring, v_ring, ready, empty,
                             stride_qb, stride_qh, num_heads, GROUP, HEAD_DIM, STAGES)),
            (_load_tiles_cpasync, (k_cache, v_cache, table, seq_len, n_tiles, k_ring, v_ring, ready, empty, kv_head,
                                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                   BLOCK_SIZE, HEAD_DIM, STAGES)),
        ], worker_num_warps=[1], worker_num_regs=[LOADER_REGS])
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))


def _box_layout(dtype: torch.dtype, block_size: int):
    """A TMA box (``[1, rows, 1, 64]``: up to 64 tokens of one block, one KV head, 64 columns) and its 128-byte
    swizzled shared-memory layout, the one the ring's buffers have."""
    gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    box = [1, min(block_size, TILE.value), 1, 64]
    return box, gl.NVMMASharedLayout.get_default_for(box, gl_dtype)


def ws_decode(q, k_cache, v_cache, block_tables, context_lens, scale=None, loader="tma", stages=2, descriptors=None):
    """Paged decode with the warp-specialised kernel (arguments as ``paged_attention_forward``, no split).

    ``descriptors``: the (K, V) TMA descriptors of these caches from :func:`make_descriptors` (building them
    costs host time; an engine would keep them with its cache)."""
    batch, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    if q.dtype not in (torch.float16, torch.bfloat16) or head_dim not in (64, 128) or \
            (TILE.value % block_size and block_size % TILE.value) or (loader != "tma" and TILE.value % block_size):
        raise ValueError("the Gluon probe takes fp16/bf16, head_dim 64 or 128, block sizes that divide 64 or that "
                         "64 divides (TMA only)")
    if loader not in LOADERS:
        raise ValueError(f"loader must be one of {LOADERS}, got {loader!r}")
    group = num_heads // num_kv_heads
    if group > ROWS:
        raise ValueError(f"at most {ROWS} query heads per KV head")
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.empty((batch, num_heads, head_dim), device=q.device, dtype=q.dtype)
    k_desc, v_desc = descriptors or make_descriptors(k_cache, v_cache)
    _paged_decode_ws_kernel[(batch, num_kv_heads)](
        q, out, k_cache, v_cache, k_desc, v_desc, block_tables, context_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0), num_heads,
        scale * LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, STAGES=stages, LOADER=loader,
        LOADER_REGS=24 if loader == "tma" else 80, num_warps=4,
        maxnreg=128)   # launched at 128 registers a thread, so 2 programs fit on a multiprocessor; the compute
                       # warps then take more (setmaxnreg) from the loader warp and the idle padding warps
    return out


def make_descriptors(k_cache, v_cache):
    """TMA descriptors of the two caches: a 4-D view ``[num_blocks, block_size, kv_heads, head_dim]`` (any strides
    that are multiples of 16 bytes, e.g. SDPA's ``[batch, heads, ctx, dim]`` transposed to one block per
    sequence), one box = up to 64 tokens of one block, one KV head, 64 columns."""
    box, layout = _box_layout(k_cache.dtype, k_cache.shape[1])
    return TensorDescriptor.from_tensor(k_cache, box, layout), TensorDescriptor.from_tensor(v_cache, box, layout)


LOADERS = ("tma", "cpasync")


def check_against_float64(device="cuda"):
    """Every variant against float64 on small caches whose unused rows and blocks hold NaN (contexts 0, 1, 63,
    64, 65, 300, 1000; GQA 4:1 and 8:1; blocks of 16 and 32, and 64 and 128 for TMA). One row per (case, variant)."""
    from solutions.kernels.paged_attention import paged_attention_reference

    gen = torch.Generator().manual_seed(7)
    rows = []
    for kv, group, block_size in ((8, 4, 16), (4, 8, 16), (2, 4, 32), (4, 4, 64), (2, 8, 128)):
        lens = [0, 1, 63, 64, 65, 300, 1000]
        per_seq = [(n + block_size - 1) // block_size for n in lens]
        num_blocks = sum(per_seq) + 5
        k_cache = torch.full((num_blocks, block_size, kv, 128), float("nan"), dtype=torch.bfloat16)
        v_cache = torch.full_like(k_cache, float("nan"))
        order = torch.randperm(num_blocks, generator=gen).tolist()
        tables = torch.full((len(lens), max(per_seq) + 2), order[-1], dtype=torch.int32)   # padding: a NaN block
        for b, n in enumerate(lens):
            for j in range(per_seq[b]):
                tables[b, j] = order.pop(0)
                used = min(block_size, n - j * block_size)
                k_cache[tables[b, j], :used] = torch.randn(used, kv, 128, generator=gen).bfloat16()
                v_cache[tables[b, j], :used] = torch.randn(used, kv, 128, generator=gen).bfloat16()
        q = torch.randn(len(lens), kv * group, 128, generator=gen).bfloat16()
        ctx = torch.tensor(lens, dtype=torch.int32)
        ref = paged_attention_reference(q.double(), k_cache.double(), v_cache.double(), tables, ctx)
        on_device = [t.to(device) for t in (q, k_cache, v_cache, tables, ctx)]
        for loader in LOADERS:
            if loader != "tma" and TILE.value % block_size:
                continue
            got = ws_decode(*on_device, loader=loader).double().cpu()
            rows.append({"case": f"kv {kv} group {group} block {block_size}", "loader": loader,
                         "max_abs_err": float((got - ref).abs().max()), "finite": bool(got.isfinite().all())})
    return rows


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    for row in check_against_float64():
        print(row)
