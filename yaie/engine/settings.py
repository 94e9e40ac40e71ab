"""The engine's settings: what ``LLM(...)`` takes beside the model, checked once, defaults filled in.

Args (all keyword, as ``LLM`` takes them):
    cpu_threads: torch threads while the engine steps on the CPU. Default: 1 for models under 100M
        parameters, whose matrices are too small to split, else torch's own setting.
    block_size: tokens per KV-cache block (lesson 03; lesson 04's kernel takes 8 to 128).
    num_blocks: device blocks of the KV cache; default: 256 MiB worth on the CPU, half the free GPU memory
        on CUDA, at most what ``max_num_seqs`` full contexts need and never fewer than one context.
    num_cpu_blocks: host blocks for swap preemption; default: as many as the device (CPU) or 1 GiB worth
        (CUDA, pinned) with ``preemption="swap"``, none with ``"recompute"``.
    preemption: what happens to the newest running request when blocks run out: ``"recompute"`` (free its
        blocks, prefill it again later) or ``"swap"`` (copy its blocks to host memory).
    max_num_seqs: requests running at once at most (the rows of a constant-state model).
    max_num_batched_tokens: tokens one step feeds: the running decodes (one each), then prompt chunks in
        what is left.
    chunked_prefill: cut prompts into chunks of the step's budget (default on). Off: the budget counts
        prefill tokens only and a longer prompt runs whole in one step.
    cuda_graphs: replay decode steps from CUDA graphs; default: on CUDA. ``True`` without CUDA: ValueError,
        unless ``graph_capture`` is False.
    graph_capture: False runs the CUDA-graph steps from their fixed buffers eagerly, recording nothing (tests
        of that path on the CPU).
    prefix_caching: automatic prefix caching (lesson 05's radix tree) for paged models.
    tensor_parallel_size: ranks the model is split over, one process and one GPU each (rank 0 is this
        process; the others are started by the engine). It must divide the attention heads, the KV heads and
        the MLP width, and be at most the GPUs present on CUDA; a paged (Llama-family) model only, with
        ``preemption="recompute"`` (swapping would move blocks on rank 0 alone). See docs/tensor_parallel.md.
    tensor_parallel_timeout_s: how long a rank waits for the others in a collective before the engine raises
        ``RuntimeError`` naming the rank that failed or hung (a start waits at least 10 minutes: loading).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from yaie import ops
from yaie.engine.sampling import is_int
from yaie.model.sharding import check_tensor_parallel

PREEMPTION_MODES = ("recompute", "swap")
DEFAULT_KV_CACHE_BYTES_CPU = 256 * 2**20     # the CPU cache is allocated lazily: pages are touched as used
DEFAULT_KV_CACHE_FRACTION_CUDA = 0.5         # of the GPU memory free after the weights are loaded
DEFAULT_SWAP_BYTES = 1 * 2**30               # host blocks for swapping (pinned memory on CUDA)
SMALL_MODEL_PARAMETERS = 100_000_000         # below: one CPU thread by default


@dataclass
class EngineSettings:
    cpu_threads: int | None = None
    block_size: int = 16
    num_blocks: int | None = None
    num_cpu_blocks: int | None = None
    preemption: str = "recompute"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    chunked_prefill: bool = True
    cuda_graphs: bool | None = None
    graph_capture: bool = True
    prefix_caching: bool = True
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 120.0

    def __post_init__(self):
        if self.cpu_threads is not None and (not is_int(self.cpu_threads) or self.cpu_threads < 1):
            raise ValueError(f"cpu_threads must be an int >= 1, got {self.cpu_threads!r}")
        if not is_int(self.block_size) or not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be an int in 1..1024, got {self.block_size!r}")
        if self.num_blocks is not None and (not is_int(self.num_blocks) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be a positive int, got {self.num_blocks!r}")
        if self.num_cpu_blocks is not None and (not is_int(self.num_cpu_blocks) or self.num_cpu_blocks < 0):
            raise ValueError(f"num_cpu_blocks must be an int >= 0, got {self.num_cpu_blocks!r}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.chunked_prefill, self.prefix_caching = bool(self.chunked_prefill), bool(self.prefix_caching)
        if not is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}")
        timeout = self.tensor_parallel_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"tensor_parallel_timeout_s must be a positive number of seconds, got {timeout!r}")

    def check_parallel(self, config, device: torch.device) -> None:
        """``ValueError`` unless ``tensor_parallel_size`` fits the model and the machine (see the module
        docstring); before any process starts."""
        n = self.tensor_parallel_size
        check_tensor_parallel(config, n)
        if n == 1:
            return
        if self.preemption != "recompute":
            raise ValueError(f"tensor parallelism needs preemption='recompute', got {self.preemption!r}")
        if device.type not in ("cpu", "cuda") or device.index not in (None, 0):
            raise ValueError(f"tensor parallelism runs rank 0 on 'cuda' (GPU 0) or 'cpu', got device {device}")
        if device.type == "cuda" and n > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={n} exceeds the {torch.cuda.device_count()} GPUs present")

    def runner_key(self) -> tuple:
        """What a runner is made under: the settings that shape its memory and graphs, and the kernels the
        lesson switch picks now (recorded graphs replay the kernels they recorded)."""
        return (self.cuda_graphs, self.graph_capture, self.prefix_caching, self.preemption, self.chunked_prefill,
                ops.selection())

    def resolve(self, config, dtype: torch.dtype, device: torch.device, num_parameters: int) -> None:
        """Fill in the defaults that depend on the model and the device (see the module docstring)."""
        if self.cuda_graphs and device.type != "cuda" and self.graph_capture:
            raise ValueError("cuda_graphs=True needs a CUDA device")
        self.cuda_graphs = device.type == "cuda" if self.cuda_graphs is None else bool(self.cuda_graphs)
        if self.cpu_threads is None and num_parameters < SMALL_MODEL_PARAMETERS:
            self.cpu_threads = 1
        kv_heads = config.num_kv_heads // self.tensor_parallel_size      # each rank holds its heads' blocks
        block_bytes = 2 * config.num_layers * self.block_size * kv_heads * config.head_dim \
            * torch.empty((), dtype=dtype).element_size()
        if self.num_blocks is None:
            if device.type == "cuda":
                budget = int(torch.cuda.mem_get_info(device)[0] * DEFAULT_KV_CACHE_FRACTION_CUDA)
            else:
                budget = DEFAULT_KV_CACHE_BYTES_CPU
            one_context = -(-config.max_position_embeddings // self.block_size)
            # No more than max_num_seqs full contexts could ever use, however much memory is free.
            self.num_blocks = max(one_context, min(budget // block_bytes, self.max_num_seqs * one_context))
        if self.num_cpu_blocks is None:
            if self.preemption != "swap":
                self.num_cpu_blocks = 0
            elif device.type == "cpu":
                self.num_cpu_blocks = self.num_blocks
            else:
                self.num_cpu_blocks = min(self.num_blocks, DEFAULT_SWAP_BYTES // block_bytes)
