"""Where kernels run: a CUDA GPU when there is one, otherwise the CPU with the Triton interpreter.

Triton reads ``TRITON_INTERPRET`` once, when ``triton`` is first imported, so
:func:`prepare_triton` must run before anything imports triton. The graders' and the course tests'
``conftest.py`` call it first thing; so does the ``yaie`` CLI.
"""

from __future__ import annotations

import functools
import os
import sys

import torch


def has_cuda() -> bool:
    return torch.cuda.is_available()


def default_device() -> torch.device:
    return torch.device("cuda" if has_cuda() else "cpu")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to run on: ``None`` is :func:`default_device`; else ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    ``ValueError`` for another name, or a CUDA device this machine does not have."""
    if device is None:
        return default_device()
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if resolved.type == "cuda":
        if not has_cuda():
            raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU on this machine "
                             "(torch.cuda.is_available() is False); use the CPU: device='cpu' (--device cpu)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} "
                             "CUDA GPU(s)")
    return resolved


def prepare_triton() -> bool:
    """Turn the Triton interpreter on when there is no GPU. Returns True when the interpreter is used.

    Call before ``import triton``. If triton was already imported without the interpreter on a
    machine with no GPU, this raises ``RuntimeError`` rather than letting kernels fail obscurely later.
    """
    if has_cuda() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before the Triton interpreter was switched on and there is no GPU; "
            "set TRITON_INTERPRET=1 in the environment, or call yaie.device.prepare_triton() first")
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# What ``YAIE_PDL`` may say: "0" turns programmatic dependent launch off.
PDL_ENV_VAR = "YAIE_PDL"


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels that support it may launch with programmatic dependent launch (PDL) on ``device``.

    PDL lets a kernel start while the one before it on the stream is still finishing; the kernel then
    calls ``gdc_wait`` before it touches anything that kernel wrote (``docs/engine.md``, "Fused kernels
    of a decode step"). True on a CUDA GPU of compute capability 9.0 or newer (Hopper), when this Triton
    can launch so and ``YAIE_PDL`` is not ``"0"``; False on the CPU and under the Triton interpreter.
    ``ValueError`` when ``YAIE_PDL`` is set to anything but ``"0"`` or ``"1"``.
    """
    setting = os.environ.get(PDL_ENV_VAR, "1")
    if setting not in ("0", "1"):
        raise ValueError(f"{PDL_ENV_VAR} must be 0 (off) or 1 (on where the GPU supports it), got {setting!r}")
    if setting == "0" or device.type != "cuda" or triton_interpreted():
        return False
    return _pdl_supported(_index(device))


def programmatic_launch_options(device: torch.device) -> dict:
    """Keyword arguments for launching a Triton kernel that takes a ``PDL: tl.constexpr`` flag on ``device``:
    ``{"PDL": True, "launch_pdl": True}`` where :func:`programmatic_launch` allows it, else ``{"PDL": False}``.

    A kernel launched so must call ``tl.extra.cuda.gdc_wait()`` before it reads or writes anything an
    earlier kernel may touch; it may call ``gdc_launch_dependents()`` to let the next kernel start early.
    """
    return {"PDL": True, "launch_pdl": True} if programmatic_launch(device) else {"PDL": False}


@functools.lru_cache(maxsize=None)
def _pdl_supported(index: int) -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        triton_can = "launch_pdl" in CUDAOptions.__dataclass_fields__
    except ImportError:
        triton_can = False
    return triton_can and _capability(index)[0] >= 9


def is_hopper(device: torch.device) -> bool:
    """True for a CUDA device of compute capability 9.x (H100, H200), whose kernels may use wgmma and TMA."""
    if device.type != "cuda":
        return False
    return _capability(_index(device))[0] == 9


def _index(device: torch.device) -> int:
    """A CUDA device's index ("cuda" alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def tma_addressable(t: torch.Tensor, row_dims: int | None = None) -> bool:
    """Whether Hopper's copy engine (TMA) can address ``t``: a 16-byte aligned base, a contiguous last dim, and
    16-byte multiples for the ``row_dims`` strides before it (``None``: every stride but the last)."""
    size = t.element_size()
    strides = t.stride()[:-1] if row_dims is None else t.stride()[-1 - row_dims:-1]
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all((s * size) % 16 == 0 for s in strides)


def triton_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Triton's allocator for a launch's global scratch (:func:`use_triton_scratch`): a torch buffer."""
    return torch.empty(size, device="cuda", dtype=torch.int8)


def use_triton_scratch() -> None:
    """Let kernels that make tensor descriptors in the kernel (a few bytes of global scratch each) get their
    scratch from torch. Call it before every such launch, not once: Triton keeps the allocator per thread (a
    context variable), and autograd runs backward passes in a thread of its own, where a once-set allocator is
    missing."""
    import triton
    triton.set_allocator(triton_scratch)
