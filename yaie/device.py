"""Where kernels run: a CUDA GPU when there is one, otherwise the CPU with the Triton interpreter.

Triton reads ``TRITON_INTERPRET`` once, when ``triton`` is first imported, so
:func:`prepare_triton` must run before anything imports triton. The graders' and the course tests'
``conftest.py`` call it first thing; so does the ``yaie`` CLI.
"""

from __future__ import annotations

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
