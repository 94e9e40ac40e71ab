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
from yaie.model import parallel
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


@pytest.fixture
def block_copies(monkeypatch):
    """Every block copy lesson 03's reference cache makes in this process (rank 0's), as a list of pair lists."""
    from solutions.kernels.kv_cache import KVCacheManager
    made, copy_blocks = [], KVCacheManager.copy_blocks

    def recorded(self, pairs):
        made.append(list(pairs))
        copy_blocks(self, pairs)
    monkeypatch.setattr(KVCacheManager, "copy_blocks", recorded)
    return made


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


def test_two_ranks_give_one_ranks_greedy_ids_and_transformers(model_dir, reference_lessons, block_copies):
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
        assert parallel.all_reduce_path() == "gloo"      # on the CPU: no one-shot path, the reference
        with pytest.raises(RuntimeError, match="a tensor-parallel engine is open in this process already"):
            LLM(path, device="cpu", tensor_parallel_size=2)
        llm.settings.chunked_prefill = False           # a new runner on every rank, plain eager steps
        assert ids(llm, batch) == expected
        pids = worker_pids(llm)
    finally:
        llm.close()
    assert all(gone(pid) for pid in pids)
    # Prefix-cache hits share whole blocks only, so lesson 03 never copies one (copy-on-write): rank 0 has no
    # copy to repeat on the workers (yaie/engine/tp_runner.py).
    assert block_copies == []


def test_an_uneven_vocabulary_and_few_blocks_still_give_one_ranks_ids(odd_vocab_dir, reference_lessons, block_copies):
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
    assert block_copies == []


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


def test_the_watchdog_ends_rank_0_when_its_gpu_waits_for_a_dead_rank(model_dir):
    # The one-shot all-reduce spins on the GPU until its peers arrive: a dead peer would block rank 0 in its
    # next read from the GPU for ever. The watchdog (on with that path) ends the process instead, as NCCL's
    # does. Here on the CPU, with the GPU's "still busy" given.
    code = ("import os, signal, sys, time\nfrom yaie.engine import LLM\n"
            "llm = LLM(sys.argv[1], device='cpu', tensor_parallel_size=2, tensor_parallel_timeout_s=2)\n"
            "llm._workers.watch(gpu_busy=lambda: True)\n"
            "print(llm._workers.procs[0].pid, flush=True)\n"
            "os.kill(llm._workers.procs[0].pid, signal.SIGKILL)\ntime.sleep(60)\nprint('still here')\n")
    rank0 = subprocess.Popen([sys.executable, "-c", code, str(model_dir[0])], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=dict(os.environ, YAIE_SOLUTIONS="all"))
    try:
        pid = int(rank0.stdout.readline())
        start = time.monotonic()
        out, err = rank0.communicate(timeout=30)
    finally:
        rank0.kill()
    assert time.monotonic() - start < 15
    assert rank0.returncode == 1 and "still here" not in out
    assert "tensor-parallel rank(s) [1] died or did not finish step 0 within 2 s" in err
    assert gone(pid)


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


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of one rank in this process (the all-reduce's set-up runs its collectives on it)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_all_reduce_is_nccl_or_gloo_where_the_one_shot_path_is_unavailable(one_rank_group, monkeypatch):
    from yaie.model import all_reduce
    monkeypatch.setenv(all_reduce.ENV_VAR, "one-shot")
    monkeypatch.setattr(all_reduce, "_one_shot_tried", False)     # as in a fresh process: it is tried
    # The set-up for NCCL tries symmetric memory, which a CPU tensor cannot have: NCCL it is, for any message.
    reduce = all_reduce.AllReduce("nccl", torch.device("cpu"))
    assert all_reduce._one_shot_tried and reduce.buffer is None and reduce.name == "nccl"
    assert reduce.path_for(torch.zeros(1, 4096, dtype=torch.bfloat16)) == "nccl"
    assert all_reduce.AllReduce("gloo", torch.device("cpu")).name == "gloo"
    # Where the buffer exists: small bf16 / float32 messages go one-shot, others to the reference.
    reduce.buffer = torch.empty(all_reduce.ONE_SHOT_MAX_BYTES, dtype=torch.uint8)
    assert reduce.path_for(torch.zeros(1, 4096, dtype=torch.bfloat16)) == "one-shot"
    assert reduce.path_for(torch.zeros(128, 4096, dtype=torch.bfloat16)) == "one-shot"
    assert reduce.path_for(torch.zeros(129, 4096, dtype=torch.bfloat16)) == "nccl"      # past the buffer
    assert reduce.path_for(torch.zeros(1, 4096, dtype=torch.float16)) == "nccl"         # not a dtype it adds
    assert reduce.path_for(torch.zeros(4096, 2, dtype=torch.bfloat16).t()) == "nccl"    # not contiguous
    monkeypatch.delenv(all_reduce.ENV_VAR)                           # the default: the reference
    monkeypatch.setattr(all_reduce, "_one_shot_tried", False)
    assert all_reduce.AllReduce("nccl", torch.device("cpu")).name == "nccl"
    assert all_reduce._one_shot_tried is False                       # not even tried


def test_the_all_reduce_setting(one_rank_group, monkeypatch):
    from yaie.model import all_reduce
    x = torch.ones(3)
    assert all_reduce.AllReduce("gloo", torch.device("cpu"))(x) is x and x.tolist() == [1, 1, 1]   # one rank
    monkeypatch.setenv(all_reduce.ENV_VAR, "skip")
    skip = all_reduce.AllReduce("gloo", torch.device("cpu"))
    assert skip.name == "skip" and skip.path_for(x) == "skip" and skip(x) is x
    monkeypatch.setenv(all_reduce.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="YAIE_TP_ALL_REDUCE must be one of"):
        all_reduce.AllReduce("gloo", torch.device("cpu"))
    assert parallel.all_reduce_path() == "none"                      # this process is no engine's rank
