"""Lesson 08, going further: the Based route's boundary states on Hopper GPUs (H100, H200), in Gluon.

This is an advanced variant of one kernel of the reference route in ``based.py``, not a task: it computes the
same boundary states (``phi(K)^T V`` and ``sum phi(K)`` before every segment, and the final state) with the same
roundings, and ``_launch_segmented`` takes it on a Hopper GPU where it applies. The route's queries stay the
Triton kernel of ``based.py``.

**Why another language.** The Triton state kernel builds the order-2 features ``k_a k_b`` of a tile of tokens as
a ``[tokens, 8, 16]`` broadcast product, and Triton moves both factors into that layout through shared memory:
about 300 shared-memory loads per warp and step, the kernel's bound (``bench/results/lesson08_state_ncu_h200.txt``).
Gluon is Triton's lower-level dialect (``triton.experimental.gluon``): every tensor names its layout, so the
features can be built *in* the layout the tensor cores read them in, and nothing moves.

**The layout.** Hopper's warp-group product (wgmma) may take its first operand ``A [128 rows, tokens]`` from
registers; which thread holds which element is fixed by the instruction. Name the rows ``r = 16 a + b`` (feature
``a`` of the program's 8, feature ``b`` of 16) and split that operand's layout along ``r``: the result is a 3-D
layout of ``[8, 16, tokens]`` (:func:`feature_layout`, its bases written out) whose reshape to ``[128, tokens]``
*is* the operand's layout (``convert_layout(..., assert_trivial=True)`` checks it when the kernel compiles).
Sliced along ``b`` it says which ``k_a`` a thread needs (2 features, its tokens), along ``a`` which ``k_b`` (2
features, its tokens). So each thread loads just those values from a transposed copy of the k tile in shared
memory (padded so that the 8 rows a warp reads at once fall in different banks), multiplies them, and hands
the products to wgmma: 64 four-byte shared-memory loads per thread and step of 128 tokens (two features of each
kind, two tokens a load), where the Triton kernel's warps issue about 300 loads each.

**The rest of a program** (two per (sequence, head): program ``P`` owns features ``a = 8P .. 8P + 7``, i.e.
state rows ``17 + 128 P ..``, and half the value columns of the order-0/1 rows, so both do the same work):

* k and v tiles arrive by TMA (the copy engine) into two alternating buffers: the next tile is in flight while
  this one is multiplied. Each program makes its descriptors in the kernel, over its own (sequence, head)'s
  ``[tokens, d]`` rows with their strides: strided inputs need no copy, a call costs the host no more than a
  launch, and rows past the sequence's end come as zeros and add nothing;
* three products per step, all wgmma: ``S2 += F^T V`` (the 128 order-2 rows), ``S01 += [k; 1; 0] V`` (the
  order-1 rows and ``sum v`` from a 64-row operand in shared memory whose row 16 is ones), and the normaliser
  ``G += [k; 1; 0] k`` (its order-2 rows are the Gram matrix ``k^T k``, its order-1 row ``sum k``; exact products
  of bfloat16 values, summed in float32, as the Triton kernel sums them);
* at a segment's end the program's 128 order-2 rows go out by TMA (bfloat16, as the route reads them), the
  small rows by plain stores; the final state in float32.

Measured on an H200 (``bench/results/lesson08_h200.md``; ``docs/based_prefill.md``): this kernel takes 1.8x (1k
tokens) to 2.4x (16k) less time than the Triton state kernel, and the route with it 1.3-1.4x less.

Gluon is experimental and renames things between Triton versions: the kernel was measured with Triton 3.6 (the
lent GPUs) and ``tests/test_lesson08_hopper.py`` compiles it for sm_90 with whatever Triton is installed (3.9 with
the README's torch), through the aliases ``_tma_load``, ``_tma_store`` and ``_sync_threads``.

Inputs it does not take (not a Hopper GPU, not bfloat16, value dims other than 32 and 64, segments that are not
a multiple of 128 tokens, strides the copy engine cannot address, Gluon missing from the installed Triton) go to
the Triton kernel: :func:`fast_path_reason` says why.
"""

from __future__ import annotations

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.runtime.jit import constexpr_function
    GLUON = True
except ImportError:          # an older Triton: the route keeps its Triton state kernel
    GLUON = False

from yaie.device import is_hopper, tma_addressable, triton_interpreted, use_triton_scratch

BLOCK_T = 128                # tokens a step
VALUE_DIMS = (32, 64)        # the order-2 accumulator is [128, d_v] float32 in registers: 64 at most
ORDER2_SCALE = 0.17677669529663687      # 1 / (4 sqrt 2): (k/2)_a (k/2)_b / sqrt 2


def fast_path_reason(k: torch.Tensor, v: torch.Tensor, segment_len: int) -> str | None:
    """``None`` if :func:`launch_states` takes these inputs, else why not (the route then runs Triton's kernel)."""
    if not GLUON:
        return "this Triton has no Gluon"
    if triton_interpreted() or not is_hopper(k.device):
        return "not a Hopper GPU"
    if k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return "not bfloat16"
    if v.shape[-1] not in VALUE_DIMS:
        return f"value dim {v.shape[-1]} (takes {VALUE_DIMS})"
    if segment_len % BLOCK_T:
        return f"segments of {segment_len} tokens (takes multiples of {BLOCK_T})"
    if not (tma_addressable(k) and tma_addressable(v)):
        return "strides the copy engine cannot address"
    return None


if GLUON:
    _ORDER2 = gl.constexpr(ORDER2_SCALE)
    # The TMA copies' names: async_load / async_store from Triton 3.7 on, async_copy_* before (3.6 here).
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _sync_threads = getattr(gl, "thread_barrier", None) or gl.barrier     # renamed barrier after Triton 3.6

    @constexpr_function
    def feature_layout(BT):
        """The ``[8 (a), 16 (b), BT (tokens)]`` layout whose reshape to ``[128, BT]`` (row ``16 a + b``) is
        wgmma's register operand layout for 4 warps (``DotOperandLayout(0, parent=NVMMA v3, k_width=2)``).
        Bases: which ``(a, b, t)`` a register bit, a lane bit and a warp bit each add."""
        token_regs = [[0, 0, 1 << i] for i in range(3, BT.bit_length() - 1)]      # t + 8, 16, .. BT / 2
        return gl.DistributedLinearLayout(
            reg_bases=[[0, 0, 1], [0, 8, 0]] + token_regs + [[4, 0, 0]],  # pairs of tokens, b + 8, a + 4
            lane_bases=[[0, 0, 2], [0, 0, 4], [0, 1, 0], [0, 2, 0], [0, 4, 0]],
            warp_bases=[[1, 0, 0], [2, 0, 0]],                                # each warp: one a (two with a + 4)
            block_bases=[], shape=[8, 16, BT])

    @gluon.jit
    def _store_small_rows(KV, KS, acc01, gram, count, P: gl.constexpr, MMA01: gl.constexpr, MMAG: gl.constexpr,
                          DV: gl.constexpr):
        """The rows other than this program's order-2 ones, at one boundary: ``sum v`` (state row 0) and ``sum
        k/2 v^T`` (rows 1..16) for value columns ``P * DV/2 ..``; the normaliser's order-2 entries of features
        ``8P .. 8P + 7`` (Gram rows), and for ``P == 0`` its count (row 0) and ``sum k/2`` (rows 1..16)."""
        FIRST_A: gl.constexpr = 8 * P
        r01 = gl.arange(0, 64, layout=gl.SliceLayout(1, MMA01))
        c01 = P * (DV // 2) + gl.arange(0, DV // 2, layout=gl.SliceLayout(0, MMA01))
        state_row = gl.where(r01 == 16, 0, r01 + 1)              # operand row 16 (ones) is state row 0
        vals = acc01 * gl.where(r01 == 16, 1.0, 0.5)[:, None]    # order 1 is k/2
        gl.store(KV + state_row[:, None] * DV + c01[None, :], vals.to(KV.dtype.element_ty), mask=(r01 <= 16)[:, None])
        rg = gl.arange(0, 64, layout=gl.SliceLayout(1, MMAG))
        cg = gl.arange(0, 16, layout=gl.SliceLayout(0, MMAG))
        ones_row = (rg == 16)[:, None]
        offs = gl.where(ones_row, 1 + cg[None, :] + 0 * rg[:, None], 17 + rg[:, None] * 16 + cg[None, :])
        mine = ((rg >= FIRST_A) & (rg < FIRST_A + 8))[:, None] | ((rg == 16) & (P == 0))[:, None]
        gl.store(KS + offs, gram * gl.where(ones_row, 0.5, _ORDER2), mask=mine)
        if P == 0:
            gl.store(KS + cg, gl.zeros([16], gl.float32, layout=gl.SliceLayout(0, MMAG)) + count.to(gl.float32),
                     mask=cg == 0)

    @gluon.jit
    def _state_program(P: gl.constexpr, bh, K, V, PREFIX_KV, PREFIX_K, STATE_KV, STATE_K,
                       stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, heads,
                       seq_len, segment_len, DV: gl.constexpr, BT: gl.constexpr):
        """Program ``P`` of sequence-head ``bh`` (module docstring); the buffers as ``launch_states`` takes them."""
        FIRST_A: gl.constexpr = 8 * P
        first_row: gl.constexpr = 17 + FIRST_A * 16
        L3: gl.constexpr = feature_layout(BT)
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV, 16])
        MMA01: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DV // 2, 16])
        MMAG: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
        A_OPERAND: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        K_TILE: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [4, 1], [1, 0])
        ROWS01: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        # 8 bfloat16 of padding per row of 128 tokens: the 8 rows (b) a warp reads at once start 4 banks apart
        KT_SHARED: gl.constexpr = gl.PaddedSharedLayout.with_identity_for([[BT, 8]], [16, BT], [1, 0])
        K01_SHARED: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BT], gl.bfloat16)
        K_SHARED: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, 16], gl.bfloat16)
        V_SHARED: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, DV], gl.bfloat16)
        OUT_SHARED: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, DV], gl.bfloat16)

        segments = gl.cdiv(seq_len, segment_len)
        prefix_kv = PREFIX_KV + (bh.to(gl.int64) * (segments - 1)) * (273 * DV)
        prefix_k = PREFIX_K + bh.to(gl.int64) * (segments - 1) * 273
        state_kv = STATE_KV + bh.to(gl.int64) * (273 * DV)
        state_k = STATE_K + bh.to(gl.int64) * 273
        # Descriptors of this (sequence, head)'s k and v, [seq_len, d]: tiles past the end come as zeros.
        # Made here, in the kernel (a few bytes of scratch each), so a call costs the host no more than a launch.
        batch = (bh // heads).to(gl.int64)
        head = (bh % heads).to(gl.int64)
        k_desc = tma.make_tensor_descriptor(K + batch * stride_kb + head * stride_kh, shape=[seq_len, 16],
                                            strides=[stride_ks, 1], block_shape=[BT, 16], layout=K_SHARED)
        v_desc = tma.make_tensor_descriptor(V + batch * stride_vb + head * stride_vh, shape=[seq_len, DV],
                                            strides=[stride_vs, 1], block_shape=[BT, DV], layout=V_SHARED)
        # This head's boundary states, [(segments - 1) * 273, d] (one segment: never written)
        p_desc = tma.make_tensor_descriptor(prefix_kv, shape=[gl.maximum((segments - 1) * 273, 128), DV],
                                            strides=[DV, 1], block_shape=[128, DV], layout=OUT_SHARED)

        k_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BT, 16], K_SHARED)
        v_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BT, DV], V_SHARED)
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(ready.index(0), count=1)
        mbarrier.init(ready.index(1), count=1)
        kt_smem = gl.allocate_shared_memory(gl.bfloat16, [16, BT], KT_SHARED)    # k^T, for the features
        k01_smem = gl.allocate_shared_memory(gl.bfloat16, [64, BT], K01_SHARED)  # [k^T; 1; 0], for S01 and G
        out_smem = gl.allocate_shared_memory(gl.bfloat16, [128, DV], OUT_SHARED)
        r01 = gl.arange(0, 64, layout=gl.SliceLayout(1, ROWS01))
        k01_smem.store(gl.where(r01[:, None] == 16, 1.0, 0.0).to(gl.bfloat16)
                       + gl.zeros([64, BT], gl.bfloat16, layout=ROWS01))

        s2 = gl.zeros([128, DV], gl.float32, layout=MMA)
        s01 = gl.zeros([64, DV // 2], gl.float32, layout=MMA01)
        gram = gl.zeros([64, 16], gl.float32, layout=MMAG)
        tile_bytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes
        mbarrier.expect(ready.index(0), tile_bytes)
        _tma_load(k_desc, [0, 0], ready.index(0), k_bufs.index(0))
        _tma_load(v_desc, [0, 0], ready.index(0), v_bufs.index(0))
        steps = gl.cdiv(seq_len, BT)
        for i in range(steps):
            buf = i % 2
            _sync_threads()            # every thread is done with the other buffer and with kt_smem
            if i + 1 < steps:              # the next tile, while this one is multiplied
                mbarrier.expect(ready.index(1 - buf), tile_bytes)
                _tma_load(k_desc, [(i + 1) * BT, 0], ready.index(1 - buf), k_bufs.index(1 - buf))
                _tma_load(v_desc, [(i + 1) * BT, 0], ready.index(1 - buf), v_bufs.index(1 - buf))
            mbarrier.wait(ready.index(buf), (i // 2) & 1)
            k_t = gl.permute(k_bufs.index(buf).load(K_TILE), [1, 0])
            kt_smem.store(k_t)
            k01_smem.slice(0, 16, dim=0).store(k_t)
            fence_async_shared()           # the generic-proxy stores, before wgmma reads k01_smem
            _sync_threads()
            # The features, built where wgmma wants them: k_a k_b rounded once to bfloat16.
            k_a = kt_smem.slice(FIRST_A, 8, dim=0).load(gl.SliceLayout(1, L3))     # [8, BT]
            k_b = kt_smem.load(gl.SliceLayout(0, L3))                             # [16, BT]
            feats = gl.expand_dims(k_a, 1) * gl.expand_dims(k_b, 0)               # [8, 16, BT]
            a_op = gl.convert_layout(gl.reshape(feats, [128, BT]), A_OPERAND, assert_trivial=True)
            v_tile = v_bufs.index(buf)
            s2 = warpgroup_mma(a_op, v_tile, s2, is_async=True)
            s01 = warpgroup_mma(k01_smem, v_tile.slice(P * (DV // 2), DV // 2, dim=1), s01, is_async=True)
            gram = warpgroup_mma(k01_smem, k_bufs.index(buf), gram, is_async=True)
            s2, s01, gram = warpgroup_mma_wait(num_outstanding=0, deps=(s2, s01, gram))
            boundary = (i + 1) * BT
            if (boundary % segment_len == 0) & (boundary < seq_len):      # the state before the next segment
                entry = boundary // segment_len - 1
                tma.store_wait(0)
                out_smem.store((s2 * _ORDER2).to(gl.bfloat16))
                fence_async_shared()
                _tma_store(p_desc, [entry * 273 + first_row, 0], out_smem)
                _store_small_rows(prefix_kv + entry * (273 * DV), prefix_k + entry * 273, s01, gram, boundary,
                                  P, MMA01, MMAG, DV)
        tma.store_wait(0)
        mbarrier.invalidate(ready.index(0))
        mbarrier.invalidate(ready.index(1))
        rows = gl.arange(0, 128, layout=gl.SliceLayout(1, MMA))
        cols = gl.arange(0, DV, layout=gl.SliceLayout(0, MMA))
        gl.store(state_kv + (first_row + rows[:, None]) * DV + cols[None, :], s2 * _ORDER2)
        _store_small_rows(state_kv, state_k, s01, gram, seq_len, P, MMA01, MMAG, DV)

    @gluon.jit(do_not_specialize=["seq_len", "segment_len", "heads"])     # one compile for every length
    def _based_states_hopper_kernel(K, V, PREFIX_KV, PREFIX_K, STATE_KV, STATE_K,
                                    stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, heads,
                                    seq_len, segment_len, DV: gl.constexpr, BT: gl.constexpr):
        """Grid ``(2, batch * heads)``: the two programs of each (sequence, head)."""
        bh = gl.program_id(1)
        if gl.program_id(0) == 0:
            _state_program(0, bh, K, V, PREFIX_KV, PREFIX_K, STATE_KV, STATE_K, stride_kb, stride_kh, stride_ks,
                           stride_vb, stride_vh, stride_vs, heads, seq_len, segment_len, DV, BT)
        else:
            _state_program(1, bh, K, V, PREFIX_KV, PREFIX_K, STATE_KV, STATE_K, stride_kb, stride_kh, stride_ks,
                           stride_vb, stride_vh, stride_vs, heads, seq_len, segment_len, DV, BT)


def launch_states(k: torch.Tensor, v: torch.Tensor, prefix_kv: torch.Tensor, prefix_k: torch.Tensor,
                  state_kv: torch.Tensor, state_k: torch.Tensor, segment_len: int) -> None:
    """What ``based._launch_prefix_state`` computes, for inputs :func:`fast_path_reason` accepts.

    ``k [b, h, seq, 16]``, ``v [b, h, seq, d_v]`` bfloat16 on a Hopper GPU; ``prefix_kv [b, h, segments - 1, 273,
    d_v]`` (bfloat16, contiguous) and ``prefix_k [b, h, segments - 1, 273]``, ``state_kv [b, h, 273, d_v]``,
    ``state_k [b, h, 273]`` (float32, contiguous) are written (with one segment the prefix tensors are not
    touched and may be placeholders). Raises ``ValueError`` when :func:`fast_path_reason` does not return
    ``None``."""
    reason = fast_path_reason(k, v, segment_len)
    if reason is not None:
        raise ValueError(f"the Hopper state kernel does not take these inputs: {reason}")
    launch_checked(k, v, prefix_kv, prefix_k, state_kv, state_k, segment_len)


def launch_checked(k, v, prefix_kv, prefix_k, state_kv, state_k, segment_len: int) -> None:
    """:func:`launch_states` for a caller that has had ``None`` from :func:`fast_path_reason` for these inputs."""
    batch, heads, seq, _ = k.shape
    use_triton_scratch()                # the descriptors' scratch (set at every call: see the function)
    _based_states_hopper_kernel[(2, batch * heads)](
        k, v, prefix_kv, prefix_k, state_kv, state_k, k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), heads, seq, segment_len, DV=v.shape[-1], BT=BLOCK_T, num_warps=4)
