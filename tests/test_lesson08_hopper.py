"""Lesson 08's Hopper state kernel (``solutions/kernels/based_hopper.py``): the route's boundary states in Gluon.

On a Hopper GPU (``gpu`` marker) the kernel's states and the route's outputs are checked against the Triton state
kernel (``hopper=False``: equal up to float32 summation order) and against float64 (PyTorch's feature map and
quadratic form), on lengths off the 128-token tile, one and several segments, value dims 32 and 64, several
sequences and heads, and strided inputs. Without one, the dispatch is checked (the inputs go to the Triton kernel,
asking for the Hopper kernel raises a clear error) and the kernel is compiled for sm_90 with the installed Triton.
"""

from __future__ import annotations

import pytest
import torch

from solutions.kernels import based as ref
from solutions.kernels import based_hopper as hopper
from yaie.device import is_hopper

ON_HOPPER = torch.cuda.is_available() and is_hopper(torch.device("cuda")) and hopper.GLUON


def _inputs(batch, heads, seq, value_dim, seed, device="cuda"):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, seq, 16, generator=gen) for _ in range(2))
    v = torch.randn(batch, heads, seq, value_dim, generator=gen)
    return (t.to(device, torch.bfloat16) for t in (q, k, v))


def test_cpu_inputs_go_to_the_triton_kernel_with_a_reason():
    q, k, v = _inputs(1, 2, 40, 64, 0, device="cpu")
    assert hopper.fast_path_reason(k, v, 256) is not None
    with pytest.raises(ValueError, match="Hopper state kernel does not take these inputs"):
        ref._launch_segmented(q, k, v, torch.empty_like(v), 256, True, hopper=True)


@pytest.mark.parametrize("dtype,value_dim,segment,why", [
    (torch.float16, 64, 256, "bfloat16"), (torch.bfloat16, 48, 256, "value dim"),
    (torch.bfloat16, 64, 192, "segments")])
def test_inputs_the_kernel_does_not_take_are_named(dtype, value_dim, segment, why):
    device = "cuda" if ON_HOPPER else "cpu"
    k = torch.zeros(1, 1, 8, 16, dtype=dtype, device=device)
    v = torch.zeros(1, 1, 8, value_dim, dtype=dtype, device=device)
    reason = hopper.fast_path_reason(k, v, segment)
    assert reason is not None
    if ON_HOPPER:
        assert why in reason, reason


@pytest.mark.gpu
@pytest.mark.parametrize("batch,heads,seq,value_dim,segment", [
    (2, 3, 1000, 64, 256), (1, 4, 777, 32, 128), (1, 2, 2049, 64, 512), (3, 2, 100, 64, 256),
    (1, 3, 256, 32, 256), (2, 2, 1280, 64, 256)])
def test_hopper_states_equal_the_triton_kernel_and_float64(batch, heads, seq, value_dim, segment):
    if not ON_HOPPER:
        pytest.skip("needs a Hopper GPU and Gluon")
    q, k, v = _inputs(batch, heads, seq, value_dim, seq)
    out_h, out_t = torch.full_like(v, float("nan")), torch.full_like(v, float("nan"))
    state_h = ref._launch_segmented(q, k, v, out_h, segment, True, hopper=True)
    state_t = ref._launch_segmented(q, k, v, out_t, segment, True, hopper=False)
    torch.testing.assert_close(state_h.kv, state_t.kv, atol=1e-3 * seq ** 0.5, rtol=1e-5)
    torch.testing.assert_close(state_h.k, state_t.k, atol=1e-3 * seq ** 0.5, rtol=1e-5)
    torch.testing.assert_close(out_h.float(), out_t.float(), atol=1e-2, rtol=1e-2)
    exact = ref.based_attention_reference(q.double(), k.double(), v.double())
    torch.testing.assert_close(out_h.double(), exact, atol=2e-2, rtol=1.6e-2)
    phi_k = ref.taylor_feature_map(k.double())
    torch.testing.assert_close(state_h.kv.double(), phi_k.transpose(-1, -2) @ v.double(),
                               atol=1e-2 * seq ** 0.5, rtol=2e-2)
    torch.testing.assert_close(state_h.k.double(), phi_k.sum(-2), atol=1e-2 * seq ** 0.5, rtol=2e-2)


@pytest.mark.gpu
def test_hopper_route_takes_strided_inputs_and_no_state():
    """The engine's layout (``[1, heads, t, d]`` views of ``[t, heads, d]`` tensors) and ``return_state=False``."""
    if not ON_HOPPER:
        pytest.skip("needs a Hopper GPU and Gluon")
    tokens_first = [x[0].transpose(0, 1).contiguous() for x in _inputs(1, 4, 600, 64, 3)]   # [t, heads, d]
    q, k, v = (x.transpose(0, 1)[None] for x in tokens_first)                                # [1, heads, t, d] views
    assert not k.is_contiguous()
    out, state = ref.based_prefill(q, k, v)
    out_c, state_c = ref.based_prefill(q.contiguous(), k.contiguous(), v.contiguous())
    torch.testing.assert_close(out, out_c, atol=0, rtol=0)
    torch.testing.assert_close(state.kv, state_c.kv, atol=0, rtol=0)
    assert ref.based_prefill(q, k, v, return_state=False)[1] is None


@pytest.mark.gpu
def test_hopper_states_read_nothing_of_the_next_sequence():
    """Sequences side by side in one tensor, the length off the tile: NaN in the second sequence's keys and
    values must not reach the first one's state (the copy engine fills rows past a sequence's end with zeros)."""
    if not ON_HOPPER:
        pytest.skip("needs a Hopper GPU and Gluon")
    q, k, v = _inputs(2, 1, 300, 64, 5)
    k[1], v[1] = float("nan"), float("nan")
    state = ref._launch_segmented(q, k, v, torch.empty_like(v), 256, True, hopper=True)
    assert torch.isfinite(state.kv[0]).all() and torch.isfinite(state.k[0]).all()
    clean = ref._launch_segmented(q[:1], k[:1], v[:1], torch.empty_like(v[:1]), 256, True, hopper=True)
    torch.testing.assert_close(state.kv[0], clean.kv[0], atol=0, rtol=0)


# Compiles the Gluon kernel for sm_90 and prints its PTX. Run in a process of its own: after any kernel has run
# in Triton's interpreter, a later real compile in the same process fails inside the interpreter's semantics
# (Triton 3.9: "'block_argument' object has no attribute 'dtype'"), and most of the suite runs the interpreter.
_COMPILE_FOR_SM90 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from solutions.kernels import based_hopper as hopper

kernel = hopper._based_states_hopper_kernel
names = kernel.arg_names
pointers = {"K": "*bf16", "V": "*bf16", "PREFIX_KV": "*bf16", "PREFIX_K": "*fp32", "STATE_KV": "*fp32",
            "STATE_K": "*fp32"}
signature = {n: pointers.get(n, "constexpr" if n in ("DV", "BT") else "i32") for n in names}
constexprs = {(names.index("DV"),): int(sys.argv[1]), (names.index("BT"),): hopper.BLOCK_T}
attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers or n.startswith("stride")}
compiled = triton.compile(GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "enable_fp_fusion": True})   # as launches default to
sys.stdout.write(compiled.asm["ptx"])
"""


@pytest.mark.skipif(not hopper.GLUON, reason="this Triton has no Gluon")
@pytest.mark.parametrize("value_dim", [32, 64])
def test_hopper_kernel_compiles_for_sm90_without_a_gpu(value_dim):
    """Compile the Gluon kernel for an H100/H200 on any machine with the installed Triton: catches a renamed or
    removed Gluon API (Triton 3.6 on the lent GPUs, 3.9 with the README's torch) before a Hopper user meets it.
    The compiler also checks that the features' layout is wgmma's operand layout (``assert_trivial``)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90, str(value_dim)], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"compiling for sm_90 failed:\n{done.stderr[-3000:]}"
    ptx = done.stdout
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
