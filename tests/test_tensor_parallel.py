"""Tensor parallelism on the CPU (gloo): the sharding, the engine over 2 ranks against 1 rank and transformers,
a rank that dies or hangs, and the start-up checks. Each test starts its own worker processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from yaie.engine import LLM, SamplingParams
from yaie.model.config import load_config
from yaie.model.loader import load_weights
from yaie.model.sharding import load_shard, shard
from yaie.model.testing import hf_greedy, save_random_model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A random Llama with grouped-query attention (4 heads over 2 KV heads) and a vocabulary (96) that
    splits into 2 equal halves, and one (97) that does not."""
    path = tmp_path_factory.mktemp("tp") / "llama"
    hf = save_random_model("llama", path, seed=11)
    return path, hf


@pytest.fixture(scope="module")
def odd_vocab_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp_odd") / "llama"
    save_random_model("llama3", path, seed=12, vocab_size=97)     # tied embeddings too
    return path


def prompts(vocab: int) -> list[list[int]]:
    shared = [1] + [(7 * i) % (vocab - 3) + 3 for i in range(40)]   # 40 tokens shared: prefix-cache hits
    return [[1, 5, 9, 33, 12], shared + [4, 5], shared + [6], [1] + list(range(3, 60))]


def ids(llm: LLM, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(batch, params)]


def worker_pids(llm: LLM) -> list[int]:
    return [proc.pid for proc in llm._workers.procs]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:                                     # a zombie still answers: read its state
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_shards_of_every_weight_make_up_the_whole(model_dir, odd_vocab_dir):
    for path in (model_dir[0], odd_vocab_dir):
        config = load_config(path)
        whole = load_weights(path, config)
        parts = [load_shard(path, config, rank, 2) for rank in range(2)]
        for name, tensor in whole.items():
            if name.endswith(("o_proj.bias", "down_proj.bias")):
                continue
            pieces = [part[name] for part in parts]
            for rank, piece in enumerate(pieces):          # read slice by slice = cut from the whole
                assert torch.equal(piece, shard(name, tensor, config, rank, 2)), name
            if "norm" in name:
                assert all(torch.equal(p, tensor) for p in pieces), name
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                assert torch.equal(torch.cat(pieces, dim=1), tensor), name
            else:                                           # rows; the vocabulary padded with zero rows
                joined = torch.cat(pieces, dim=0)
                assert torch.equal(joined[:tensor.shape[0]], tensor), name
                assert not joined[tensor.shape[0]:].any(), name
                assert pieces[0].shape[0] == pieces[1].shape[0], name


def test_two_ranks_give_one_ranks_greedy_ids_and_transformers(model_dir, reference_lessons):
    path, hf = model_dir
    batch = prompts(96)
    single = LLM(path, device="cpu", cuda_graphs=True, graph_capture=False, max_num_batched_tokens=32)
    expected = ids(single, batch)
    assert expected == [hf_greedy(hf, p, GREEDY.max_tokens, []) for p in batch]
    # Fixed-buffer decode steps (the CUDA-graph path, run eagerly), looked-ahead steps whose input ids are
    # broadcast, chunked prefill (32-token steps) and prefix-cache hits, on both ranks.
    llm = LLM(path, device="cpu", cuda_graphs=True, graph_capture=False, max_num_batched_tokens=32,
              tensor_parallel_size=2, tensor_parallel_timeout_s=30)
    try:
        assert ids(llm, batch) == expected
        assert llm.prefix_cache_stats().cached_tokens > 0
        with pytest.raises(RuntimeError, match="a tensor-parallel engine is open in this process already"):
            LLM(path, device="cpu", tensor_parallel_size=2)
        llm.settings.chunked_prefill = False           # a new runner on every rank, plain eager steps
        assert ids(llm, batch) == expected
        pids = worker_pids(llm)
    finally:
        llm.close()
    assert all(gone(pid) for pid in pids)


def test_an_uneven_vocabulary_and_few_blocks_still_give_one_ranks_ids(odd_vocab_dir, reference_lessons):
    batch = prompts(97)
    # 24 blocks of 4 tokens: requests are preempted (recompute) and prefilled again on both ranks.
    options = dict(device="cpu", block_size=4, num_blocks=24, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = ids(LLM(odd_vocab_dir, **options), batch, params)
    llm = LLM(odd_vocab_dir, tensor_parallel_size=2, tensor_parallel_timeout_s=30, **options)
    try:
        assert ids(llm, batch, params) == expected
        assert llm.last_core.scheduler.stats.preempted_by_recompute > 0
    finally:
        llm.close()


def test_a_rank_that_dies_is_named_and_no_worker_outlives_the_engine(model_dir, reference_lessons):
    llm = LLM(model_dir[0], device="cpu", tensor_parallel_size=2, tensor_parallel_timeout_s=30)
    (pid,) = worker_pids(llm)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 exited \(exit code -9\)"):
        ids(llm, prompts(96))
    assert time.monotonic() - start < 10
    assert gone(pid) and not llm._workers.procs
    with pytest.raises(RuntimeError, match="rank 1 exited"):     # and the engine stays stopped
        ids(llm, prompts(96))


def test_workers_end_when_rank_0_is_killed(model_dir):
    code = ("import sys, time\nfrom yaie.engine import LLM\n"
            "llm = LLM(sys.argv[1], device='cpu', tensor_parallel_size=2)\n"
            "print(*[p.pid for p in llm._workers.procs], flush=True)\ntime.sleep(120)\n")
    rank0 = subprocess.Popen([sys.executable, "-c", code, str(model_dir[0])], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, YAIE_SOLUTIONS="all"))
    try:
        pids = [int(p) for p in rank0.stdout.readline().split()]
    finally:
        rank0.kill()
        rank0.wait()
    assert len(pids) == 1
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(pid) for pid in pids), "a worker outlived rank 0"


def test_a_rank_that_hangs_is_named_within_the_timeout(model_dir, reference_lessons):
    llm = LLM(model_dir[0], device="cpu", tensor_parallel_size=2, tensor_parallel_timeout_s=3)
    (pid,) = worker_pids(llm)
    assert ids(llm, prompts(96)[:1])                  # it works, then the worker stops answering
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 did not finish step \d+ within 3 s"):
        ids(llm, prompts(96))
    assert time.monotonic() - start < 15
    assert gone(pid) and not llm._workers.procs


def test_a_lesson_left_undone_in_strict_mode_is_reported_as_such(model_dir, monkeypatch):
    from yaie.ops import KernelMissing
    monkeypatch.setenv("YAIE_SOLUTIONS", "none")          # the stubs, no fallback: lesson 01's RoPE tables
    with pytest.raises(KernelMissing, match="lesson 01"):
        LLM(model_dir[0], device="cpu", tensor_parallel_size=2)
    from yaie.model import parallel
    assert parallel.world_size() == 1                     # the group was left, the worker ended


@pytest.mark.parametrize("options, message", [
    (dict(tensor_parallel_size=3), "does not divide the model's 4 attention heads"),
    (dict(tensor_parallel_size=4), "does not divide the model's 2 KV heads"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an int >= 1"),
    (dict(tensor_parallel_size=2.0), "tensor_parallel_size must be an int >= 1"),
    (dict(tensor_parallel_size=2, preemption="swap"), "needs preemption='recompute'"),
    (dict(tensor_parallel_size=2, tensor_parallel_timeout_s=0), "tensor_parallel_timeout_s must be a positive"),
])
def test_bad_tensor_parallel_settings_are_refused_before_anything_starts(model_dir, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(model_dir[0], device="cpu", **options)


def test_more_ranks_than_gpus_are_refused(model_dir, monkeypatch):
    monkeypatch.setattr("yaie.device.has_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 exceeds the 1 GPUs present"):
        LLM(model_dir[0], device="cuda", tensor_parallel_size=2)
