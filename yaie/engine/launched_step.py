"""A launched step: its forward pass and token picks queued on the device, its tokens not read yet.

The engine core launches a step, does host work (the previous step's text, maybe the launch of the next
step) while the device runs it, and only then reads its tokens (:meth:`LaunchedStep.tokens`).
"""

from __future__ import annotations

import torch

from yaie.engine.request import Request
from yaie.engine.sampling import StepTable


class LaunchedStep:
    """Args:
        requests: the requests that get a token from the step, in row order (an entry becomes None when
            its request ended before the step's tokens were read: :meth:`drop`).
        states: their :class:`yaie.engine.output.OutputState`, in the same order.
        logits: ``[len(requests), vocab]`` on the device, or None when no row samples (prefill chunks only).
        device_tokens: the picked tokens, int64 ``[len(requests)]`` on the device (None with no logits).
        decode_only: whether the step ran decodes only (a look-ahead may follow it).
        table: the rows' :class:`StepTable` (None when all are greedy); a looked-ahead step after this one
            samples with its :meth:`StepTable.next`.
    """

    def __init__(self, requests: list[Request | None], states: list, logits: torch.Tensor | None,
                 device_tokens: torch.Tensor | None, decode_only: bool, table: StepTable | None = None):
        self.requests, self.states, self.logits = requests, states, logits
        self.device_tokens, self.decode_only, self.table = device_tokens, decode_only, table
        self._host_tokens, self._copied = None, None
        if device_tokens is not None and device_tokens.is_cuda:
            # Queue the copy to the host now, right behind this step's kernels, and mark its end with an
            # event: tokens() then waits for this step alone, not for a looked-ahead step queued after it.
            self._host_tokens = torch.empty(device_tokens.shape, dtype=device_tokens.dtype, pin_memory=True)
            self._host_tokens.copy_(device_tokens, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(device_tokens.device))

    def tokens(self) -> list[int]:
        """The picked tokens on the host, one per request (waits for the step)."""
        if self.device_tokens is None:
            return []
        if self._copied is not None:
            self._copied.synchronize()
            return self._host_tokens.tolist()
        return self.device_tokens.tolist()

    def drop(self, request: Request) -> bool:
        """Forget ``request``'s row (it ended before this step's tokens were read); whether it had one."""
        for i, r in enumerate(self.requests):
            if r is request:
                self.requests[i] = None
                return True
        return False

    @property
    def empty(self) -> bool:
        """Every row was dropped."""
        return all(r is None for r in self.requests)
