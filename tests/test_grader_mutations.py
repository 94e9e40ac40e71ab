"""The graders catch the subtle mistakes: bugs of the kind students write, planted one at a time into the
reference (a patched copy of one function or method), must fail the check written for them, and the
unpatched reference must pass the same check. In-process and on small CPU shapes: well under a minute.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from grader.checks import GradingError, fresh_seed


@pytest.fixture(autouse=True)
def reference(monkeypatch):
    monkeypatch.setenv("YAIE_SOLUTIONS", "all")


def must_fail(check, *args, expect: str, **kwargs) -> str:
    """``check(*args)`` must raise a GradingError whose message contains ``expect``; returns the message."""
    try:
        check(*args, **kwargs)
    except GradingError as err:
        message = str(err)
        assert expect in message, message
        return message
    raise AssertionError(f"{check.__name__} passed on a planted bug")


# ---------------------------------------------------------------- lesson 01: rounding order

def test_lesson01_rms_norm_weight_in_the_storage_dtype(monkeypatch):
    import grader.lesson01.test_cpu_kernels as g
    import solutions.kernels.cpu_kernels as ref

    seed = fresh_seed()
    g.test_rms_norm_matches_float64((4, 1000), torch.bfloat16, seed)

    def weight_after_the_cast(x, w, epsilon=1e-6):
        xf = x.float()
        return (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + epsilon)).to(x.dtype) * w   # BUG: rounds twice

    monkeypatch.setattr(ref, "cpu_rms_norm", weight_after_the_cast)
    must_fail(g.test_rms_norm_matches_float64, (4, 1000), torch.bfloat16, seed, expect="not bit-exact")


# ---------------------------------------------------------------- lesson 02: rounding order

@triton.jit
def _add_norm_of_the_float32_sum(x_ptr, res_ptr, w_ptr, n_cols, x_stride, res_stride, epsilon,
                                 BLOCK_SIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
    h = x + res
    tl.store(res_ptr + row * res_stride + cols, h.to(res_ptr.dtype.element_ty), mask=mask)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / n_cols + epsilon)     # BUG: the float32 sum, not the stored one
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * x_stride + cols, (h * inv_rms * w).to(x_ptr.dtype.element_ty), mask=mask)


def _fused_norm_of_the_float32_sum(input_tensor, residual, weight, epsilon=1e-6):
    x, res = input_tensor.view(-1, input_tensor.shape[-1]), residual.view(-1, residual.shape[-1])
    hidden = x.shape[-1]
    _add_norm_of_the_float32_sum[(x.shape[0],)](x, res, weight, hidden, x.stride(0), res.stride(0), float(epsilon),
                                                BLOCK_SIZE=triton.next_power_of_2(hidden))
    return input_tensor, residual


def test_lesson02_fused_norm_of_the_unrounded_sum(monkeypatch):
    import grader.lesson02.test_gpu_elementwise as g
    import solutions.kernels.gpu_elementwise as ref

    seed = fresh_seed()
    g.test_fused_add_rms_norm_in_place(torch.float16, 200, "cpu", seed)          # the reference passes
    monkeypatch.setattr(ref, "fused_add_rms_norm", _fused_norm_of_the_float32_sum)
    message = must_fail(g.test_fused_add_rms_norm_in_place, torch.float16, 200, "cpu", seed, expect="not bit-exact")
    assert "normalise exactly what you stored" in message and "expected" in message


def test_lesson02_silu_rounded_before_the_product(monkeypatch):
    import grader.lesson02.test_gpu_elementwise as g
    import solutions.kernels.gpu_elementwise as ref

    seed = fresh_seed()
    g.test_silu_and_mul_matches_float64(torch.float16, 64, "cpu", seed)

    def silu_rounded_twice(x):
        d = x.shape[-1] // 2
        gate = torch.nn.functional.silu(x[..., :d].float()).to(x.dtype)     # BUG: rounded before the product
        return (gate.float() * x[..., d:].float()).to(x.dtype)

    monkeypatch.setattr(ref, "silu_and_mul", silu_rounded_twice)
    must_fail(g.test_silu_and_mul_matches_float64, torch.float16, 64, "cpu", seed, expect="not bit-exact")


def test_lesson02_norm_and_rope_that_round_twice(monkeypatch):
    import grader.lesson02.test_gpu_elementwise as g
    import solutions.kernels.gpu_elementwise as ref

    seed = fresh_seed()
    g.test_rms_norm_matches_float64(torch.float16, 100, "cpu", seed)
    g.test_rope_ragged_batch(torch.float16, 4, 2, 16, "cpu", seed)

    def norm_then_weight_in_storage_dtype(x, w, epsilon=1e-6):
        xf = x.float()
        normed = (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + epsilon)).to(x.dtype)
        return normed * w.to(x.dtype)                                        # BUG: a second rounding

    def rope_with_rounded_products(q, k, cos, sin, position_ids):
        for x in (q, k):
            half = x.shape[-1] // 2
            c, s_ = cos[position_ids.long(), None, :half], sin[position_ids.long(), None, :half]
            x1, x2 = x[..., :half].float(), x[..., half:].float()
            first = (x1 * c).to(x.dtype).float() - (x2 * s_).to(x.dtype).float()  # BUG: products rounded first
            second = (x2 * c).to(x.dtype).float() + (x1 * s_).to(x.dtype).float()
            x.copy_(torch.cat([first, second], -1).to(x.dtype))
        return q, k

    monkeypatch.setattr(ref, "rms_norm", norm_then_weight_in_storage_dtype)
    monkeypatch.setattr(ref, "apply_rope_qk", rope_with_rounded_products)
    must_fail(g.test_rms_norm_matches_float64, torch.float16, 100, "cpu", seed, expect="not bit-exact")
    must_fail(g.test_rope_ragged_batch, torch.float16, 4, 2, 16, "cpu", seed, expect="not bit-exact")


# ---------------------------------------------------------------- lesson 03: ids that coincide

def _swap_in_by_device_id(monkeypatch):
    import solutions.kernels.kv_cache as ref

    class Manager(ref.KVCacheManager):
        def swap_blocks_from_cpu(self, block_ids):
            cpu_ids = list(block_ids)
            ids = self._take_blocks(len(cpu_ids))
            for device_caches, host_caches in ((self.k_cache, self.cpu_k_cache), (self.v_cache, self.cpu_v_cache)):
                for device_cache, host_cache in zip(device_caches, host_caches):
                    for block_id in ids:
                        device_cache[block_id].copy_(host_cache[block_id])      # BUG: the host block by its device id
            for cpu_id in cpu_ids:
                self.cpu_blocks[cpu_id].ref_count = 0
                self._cpu_free.append(cpu_id)
            return ids

    monkeypatch.setattr(ref, "KVCacheManager", Manager)


def test_lesson03_swap_in_reads_the_host_block_by_its_device_id(monkeypatch):
    import grader.lesson03.test_kv_cache as g

    seed = fresh_seed()
    g.test_swap_in_reads_the_host_blocks_not_the_device_ids("cpu", seed)
    _swap_in_by_device_id(monkeypatch)
    # The fixed swap test still passes (both pools hand out the same ids there): why the new check exists.
    g.test_swap_blocks_round_trip_is_bit_identical("cpu", seed, torch.float16)
    must_fail(g.test_swap_in_reads_the_host_blocks_not_the_device_ids, "cpu", seed, expect="a device id is not a host id")
    # The random programs' fixed case reaches the same state before any random program runs.
    message = must_fail(g.test_swap_random_programs, "cpu", seed, expect="does not read back what was written")
    assert "fixed case 1 of 1" in message and "YAIE_PROGRAM=" in message and "swap_in(1)" in message


# ---------------------------------------------------------------- lesson 05a: bookkeeping in more than one round

def test_lesson05_make_room_that_evicts_once(monkeypatch):
    import grader.lesson05.test_radix_tree as g
    import solutions.kernels.radix_attention as ref

    g.test_make_room_keeps_evicting_until_blocks_are_free("cpu")

    def make_room_once(self, num_blocks):
        if self.manager.num_free_blocks < num_blocks:
            self.evict(num_blocks - self.manager.num_free_blocks)          # BUG: one round
        return self.manager.num_free_blocks >= num_blocks

    monkeypatch.setattr(ref.RadixAttentionWithPagedKVCache, "make_room", make_room_once)
    must_fail(g.test_make_room_keeps_evicting_until_blocks_are_free, "cpu", expect="evict again")
    # The random programs fork too, and their second fixed case reaches the same state.
    message = must_fail(g.test_random_programs_share_blocks_correctly, "cpu", fresh_seed(),
                        expect="evicting every unlocked cached prefix makes room")
    assert "manager.fork('s0', 's0f1')" in message and "fixed case 2 of 2" in message, message


def test_lesson05_append_slots_that_evicts_once(monkeypatch):
    import grader.lesson05.test_radix_tree as g
    import solutions.kernels.radix_attention as ref

    def append_slots_once(self, seq_id, n=1):
        try:
            return self.manager.append_slots(seq_id, n)
        except self._out_of_blocks:
            self.evict(1 + n // self.manager.block_size)                   # BUG: one round, then give up
            return self.manager.append_slots(seq_id, n)

    monkeypatch.setattr(ref.RadixAttentionWithPagedKVCache, "append_slots", append_slots_once)
    must_fail(g.test_make_room_keeps_evicting_until_blocks_are_free, "cpu", expect="append_slots('d', 4) raised")


# ---------------------------------------------------------------- lesson 05b/05c: paths the CPU never took

def test_lesson05_fp8_cache_without_k_scale(monkeypatch):
    import grader.lesson05.test_prefix_prefill as g
    import solutions.kernels.prefix_prefill as ref

    seed = fresh_seed()
    g.test_kernel_fp8_cache_fp16("cpu", seed)
    real = ref.prefix_prefill_attention

    def without_k_scale(*args, k_scale=None, **kwargs):
        return real(*args, **kwargs)                                     # BUG: k_scale dropped (1.0)

    monkeypatch.setattr(ref, "prefix_prefill_attention", without_k_scale)
    must_fail(g.test_kernel_fp8_cache_fp16, "cpu", seed, expect="prefix_prefill_attention(fp8 cache, float16 q)")


def test_lesson05_heuristic_chunks_that_drop_keys(monkeypatch):
    import grader.lesson05.test_flashinfer as g
    import numpy as np
    import solutions.kernels.flashinfer as ref

    seed = fresh_seed()
    real = ref._chunks

    def floor_chunks(length, chunk, exact):
        if exact:
            return real(length, chunk, exact)
        lengths = np.asarray(length, dtype=np.int64)
        count = np.maximum(1, np.round(lengths / chunk).astype(np.int64))
        size = np.where(lengths > 0, lengths // count, chunk)               # BUG: floor, the last keys are lost
        return (int(count), int(size)) if lengths.ndim == 0 else (count, size)

    with monkeypatch.context() as m:
        g.test_paged_split_kv_by_the_heuristic("cpu", seed, 0, m)
    monkeypatch.setattr(ref, "_chunks", floor_chunks)
    # An explicit chunk size never takes this path: the old split checks pass.
    g.test_paged_split_kv("cpu", seed, 7)
    with monkeypatch.context() as m:
        must_fail(g.test_paged_split_kv_by_the_heuristic, "cpu", seed, 0, m, expect="EQUAL chunks")


# ---------------------------------------------------------------- random programs: no hypothesis internals

def test_a_flaky_program_is_reported_as_the_failing_check():
    """A failure that does not replay (state kept between objects) is shown as the check that failed, not
    as hypothesis's "Flaky" or "Inconsistent data generation"."""
    from grader.programs import run_programs

    calls = [0]

    def body(pick):
        calls[0] += 1
        n = pick(0, 5)
        pick.log(f"allocate({n})")
        if calls[0] == 3:                  # fails once, never again: hypothesis cannot replay it
            raise GradingError(f"slot mapping of allocate({n})\n  expected: [0, 1]\n  got:      [1, 0]")

    with pytest.raises(GradingError) as info:
        run_programs(body, 1, 20)
    message = str(info.value)
    assert "slot mapping of allocate" in message and "expected: [0, 1]" in message, message
    assert "Flaky" not in message and "Inconsistent" not in message and "hypothesis" not in message.split("\n")[0]


def test_a_failing_program_names_its_operations_and_a_fixed_case(monkeypatch):
    from grader.programs import PROGRAM_ENV, run_programs

    def body(pick):
        for _ in range(pick(1, 6)):
            n = pick(0, 9)
            pick.log(f"append({n})")
            if n == 7:
                raise GradingError("append of 7 tokens\n  expected: 2 blocks\n  got:      1 block")

    with pytest.raises(GradingError) as info:
        run_programs(body, 1, 200)
    message = str(info.value)
    assert "append(7)" in message and "expected: 2 blocks" in message and f"{PROGRAM_ENV}=" in message, message
    draws = message.split(f"{PROGRAM_ENV}=")[1].split()[0]
    monkeypatch.setenv(PROGRAM_ENV, draws)                   # the fixed case replays the same failure
    with pytest.raises(GradingError, match="append of 7 tokens"):
        run_programs(body, 2, 200)


def test_a_stub_stops_the_programs_at_once():
    from grader.programs import run_programs

    calls = [0]

    def body(pick):
        calls[0] += 1
        pick(0, 3)
        raise NotImplementedError("lesson 03, task 2: implement allocate")

    with pytest.raises(NotImplementedError):
        run_programs(body, 1, 50, fixed=[[1, 2]])
    assert calls[0] == 1
    calls[0] = 0
    with pytest.raises(NotImplementedError):
        run_programs(body, 1, 50)          # no fixed case: hypothesis stops after the first stub, no shrinking
    assert calls[0] == 1


# ---------------------------------------------------------------- lesson 04: edges that line up

def test_lesson04_window_that_reads_one_key_early_on_tile_edges(monkeypatch):
    """A decode kernel whose window mask misses only when the first visible key is a tile's first key
    (it starts one tile early there and keeps that tile's last key): random windows never line up."""
    import grader.lesson04.test_paged_attention as g
    import solutions.kernels.paged_attention as ref

    seed = fresh_seed()
    g.test_window_starts_on_a_tile_edge("cpu", seed, 1)
    real = ref.paged_attention_forward
    tile_n = g.tile_n("cpu", 32)

    def window_off_on_edges(q, k_cache, v_cache, block_tables, context_lens, max_context_len, *args,
                            sliding_window=None, **kwargs):
        if sliding_window is None:
            return real(q, k_cache, v_cache, block_tables, context_lens, max_context_len, *args, **kwargs)
        outs = []
        for b, n in enumerate(context_lens.tolist()):
            first = n - sliding_window
            window = sliding_window + 1 if first > 0 and first % tile_n == 0 else sliding_window   # BUG
            outs.append(real(q[b:b + 1], k_cache, v_cache, block_tables[b:b + 1], context_lens[b:b + 1],
                             max_context_len, *args, sliding_window=window, **kwargs))
        return torch.cat(outs)

    monkeypatch.setattr(ref, "paged_attention_forward", window_off_on_edges)
    for case_index in range(3):                      # the windows of the earlier checks never line up
        g.test_window_forward_matches_float64("cpu", seed, case_index, 1)
    must_fail(g.test_window_starts_on_a_tile_edge, "cpu", seed, 1, expect="first visible keys")


# ---------------------------------------------------------------- lesson 08: ids that coincide

def test_lesson08_prefill_that_ignores_the_batch_stride(monkeypatch):
    """A prefill whose programs offset k and v by the head only: with one sequence (every earlier CPU check)
    batch and head ids coincide and it passes."""
    import grader.lesson08.test_based as g
    import solutions.kernels.based as ref

    seed = fresh_seed()
    real = ref.based_prefill

    def keys_of_the_first_sequence(q, k, v, chunk_size=None, return_state=True):
        outs, states = [], []
        for b in range(q.shape[0]):
            out, state = real(q[b:b + 1], k[:1], v[:1], chunk_size=chunk_size)       # BUG: k, v of sequence 0
            outs.append(out)
            states.append(state)
        state = ref.BasedState(torch.cat([s.kv for s in states]), torch.cat([s.k for s in states]))
        return torch.cat(outs), (state if return_state else None)

    monkeypatch.setattr(ref, "based_prefill", keys_of_the_first_sequence)
    g.test_prefill_float32("cpu", seed, 17)
    must_fail(g.test_prefill_batch_and_heads_apart, "cpu", seed, 16, expect="based_prefill output is wrong")
