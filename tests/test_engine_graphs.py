"""The CUDA-graph decode path (yaie/engine/cuda_graphs.py), checked on the CPU.

A CUDA graph cannot be recorded without a GPU, but everything around it can be checked here: the runner
can run its fixed-buffer steps eagerly (``capture=False``), through lesson 04's kernel in the Triton
interpreter, with padding rows (context 0, a scratch slot), the whole block table as the context bound,
buckets that change as requests finish, and preemption. Those steps must give exactly the engine's own
tokens. (The recording itself is checked on the GPU: scripts/gpu_engine_batching.py compares the engine,
graphs on, with transformers.)
"""

import weakref

import pytest
import torch

from yaie import ops
from yaie.engine import DEFAULT_MODEL, LLM, SamplingParams
from yaie.engine.cuda_graphs import SCRATCH_SEQ, DecodeGraphs
from yaie.engine.request import Request
from yaie.engine.scheduler import Scheduler
from yaie.model.graphs import buckets
from yaie.model.testing import fresh_seed, hf_greedy, save_random_model, single_thread

PROMPTS = [
    "Once upon a time, there was a little fox named",
    "Lily was afraid of the dark.",
    "Ben found a shiny red ball under the big tree.",
    "The little owl could not sleep.",
    "A small dog named Max lived on a farm.",
]

pytestmark = pytest.mark.usefixtures("reference_lessons")


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(8) == [1, 2, 4, 8]


def eager_graphs(llm: LLM) -> LLM:
    """Turn the CUDA-graph path on for a CPU engine, with the fixed-buffer steps run eagerly."""
    llm.settings.cuda_graphs, llm.settings.graph_capture = True, False
    return llm


def new_manager(llm: LLM, num_blocks: int):
    """A lesson 03 cache of ``num_blocks`` blocks shaped for ``llm``'s model."""
    cfg = llm.config
    return ops.kv_cache_manager(num_blocks, llm.settings.block_size, cfg.num_layers, cfg.num_kv_heads,
                                cfg.head_dim, llm.model.dtype, llm.device)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_fixed_buffer_decode_steps_give_the_engines_tokens(preemption):
    # Different lengths: 5 requests decode in the bucket of 6 (one padding row), then 4, 2, 1 as they end.
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 14, 6, 10, 8)]
    with single_thread():
        plain = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=64, max_num_seqs=6)
        want = [out.token_ids for out in plain.generate(PROMPTS, params)]
        # 16 blocks of 4 tokens: all 5 requests start together, then the cache runs out and one is preempted.
        llm = eager_graphs(LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=16, max_num_seqs=6,
                               preemption=preemption))
        calls = []
        runner_run = DecodeGraphs.run

        def spy(self, seq_ids, *args):
            calls.append(len(seq_ids))
            return runner_run(self, seq_ids, *args)

        DecodeGraphs.run = spy
        try:
            got = [out.token_ids for out in llm.generate(PROMPTS, params)]
        finally:
            DecodeGraphs.run = runner_run
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{preemption}: request {i} differs with the fixed-buffer decode steps:\n{g}\n{w}"
    runner, scheduler = llm.last_core.runner.graphs, llm.last_core.scheduler
    used = {next(b for b in buckets(6) if b >= n) for n in calls}
    assert {1, 4} <= used and any(n not in buckets(6) for n in calls), calls   # buckets change, padding used
    assert {bucket for bucket, _, _ in runner.graphs} == used
    assert {bound for _, bound, _ in runner.graphs} == {runner.capacity}   # the bundled model: 512 tokens
    stats = scheduler.stats
    assert stats.preempted_by_swap + stats.preempted_by_recompute > 0, stats
    manager = scheduler.manager
    assert manager.num_blocks == 16 + 1                                     # the scratch block is extra
    scheduler.prefix_cache.clear()                                          # cached prefixes, unlocked
    assert manager.seq_ids() == [SCRATCH_SEQ] and manager.num_free_blocks == 16
    # The next call keeps the cache and the runner (recorded graphs stay valid: same addresses).
    again = [out.token_ids for out in llm.generate(PROMPTS[:2], params[:2])]
    assert again == want[:2]
    assert llm.last_core.scheduler.manager is manager and llm.last_core.runner.graphs is runner


@pytest.mark.parametrize("kind,overrides,windows_seen", [
    ("mistral", {}, {8}),                                                     # every layer windowed
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), {None, 8}),   # layer 0 full
])
def test_sliding_window_model_decodes_through_the_kernel_like_transformers(tmp_path, monkeypatch, kind, overrides,
                                                                            windows_seen):
    """Models with windowed layers (window 8), with the fixed-buffer decode steps: a windowed layer's decode
    goes to lesson 04 with its window (task 4), through the Triton interpreter, and the greedy tokens equal
    transformers'."""
    pytest.importorskip("transformers")
    seed = fresh_seed()
    hf = save_random_model(kind, tmp_path, seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed)
    prompts = [[1] + torch.randint(3, 96, (n,), generator=gen).tolist() for n in (5, 13)]  # shorter, longer than 8
    windows = []
    real_call = ops.lessons.call

    def spy(lesson, name, *args, **kwargs):
        if lesson == 4:
            windows.append(kwargs.get("sliding_window"))
        return real_call(lesson, name, *args, **kwargs)

    monkeypatch.setattr(ops.lessons, "call", spy)
    with single_thread():
        llm = eager_graphs(LLM(tmp_path, device="cpu", block_size=4, num_blocks=32))
        got = [out.token_ids for out in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                              ignore_eos=True))]
    want = [hf_greedy(hf, ids, 12, []) for ids in prompts]
    assert got == want, f"seed={seed}: engine {got} vs transformers {want}"
    assert set(windows) == windows_seen, windows
    assert llm.last_core.runner.graphs.graphs, "the decode steps ran through the fixed-buffer runner"


def test_decode_steps_over_a_shared_prefix_run_as_cascades_and_give_transformers_tokens(tmp_path, monkeypatch):
    """Requests that share cached blocks decode through the cascade (lesson 05: the shared blocks once for
    all queries, each request's own blocks apart, states merged), in the fixed-buffer steps; greedy tokens
    equal transformers'. The shared length is rounded down to the granule (16 tokens here, instead of 256,
    to keep the interpreter's work small), so 40 shared tokens give a 32-token cascade prefix."""
    pytest.importorskip("transformers")
    from yaie.engine import cuda_graphs
    monkeypatch.setattr(cuda_graphs, "CASCADE_MIN_SHARED_TOKENS", 16)
    seed = fresh_seed()
    hf = save_random_model("llama", tmp_path, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    prefix = [1] + torch.randint(3, 96, (39,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 96, (n,), generator=gen).tolist() for n in (2, 5, 9, 3)]
    cascades = []
    real = ops.attention_backends.CASCADE_DECODE.run

    def spy(q, k, v, step, *args):
        cascades.append(step.cascade.pages)
        return real(q, k, v, step, *args)

    monkeypatch.setattr(ops.attention_backends.CASCADE_DECODE, "run", spy)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with single_thread():
        llm = eager_graphs(LLM(tmp_path, device="cpu", dtype=torch.float32, block_size=4, num_blocks=64))
        got = [llm.generate(prompts[0], params)[0].token_ids]      # caches the prefix for the others
        got += [out.token_ids for out in llm.generate(prompts[1:], params)]
    want = [hf_greedy(hf, ids, 6, []) for ids in prompts]
    assert got == want, f"seed={seed}: engine {got} vs transformers {want}"
    assert cascades and set(cascades) == {8}, cascades           # 32 of the 40 shared tokens: 8 blocks of 4
    assert any(shared == 8 for _, _, shared in llm.last_core.runner.graphs.graphs)


def test_a_stream_dropped_half_way_gives_its_blocks_back_and_the_cache_serves_again():
    llm = eager_graphs(LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=32))
    stream = llm.stream(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    next(stream)
    next(stream)                       # the request holds blocks; the stream is dropped half-way
    manager = llm.last_core.scheduler.manager
    assert set(manager.seq_ids()) != {SCRATCH_SEQ}
    stream.close()
    assert manager.seq_ids() == [SCRATCH_SEQ]
    llm.generate(PROMPTS[1], SamplingParams(max_tokens=3, temperature=0))
    assert llm.last_core.scheduler.manager is manager


def test_a_closed_runner_refuses_steps_and_gives_its_block_back():
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=8)
    manager = new_manager(llm, 8 + 1)
    runner = DecodeGraphs(llm.model, manager, 4, capture=False)
    assert runner.fits(3) and not runner.fits(5) and manager.num_free_blocks == 8
    runner.close()
    assert not runner.fits(1) and manager.num_free_blocks == 9 and not manager.has_seq(SCRATCH_SEQ)


def test_two_streams_at_once_get_two_caches():
    llm = eager_graphs(LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=32))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [llm.generate(p, params)[0].token_ids for p in PROMPTS[:2]]
    kept = llm.last_core.scheduler.manager
    a, b = llm.stream(PROMPTS[0], params), llm.stream(PROMPTS[1], params)
    text_a, text_b = next(a), next(b)          # both running: b could not take a's cache
    assert llm.last_core.scheduler.manager is not kept
    text_a += "".join(a)
    text_b += "".join(b)
    tokenizer = llm.tokenizer
    assert [text_a, text_b] == [tokenizer.decode(w) for w in want]
    llm.generate(PROMPTS[0], params)
    assert llm.last_core.scheduler.manager is kept  # the kept cache serves the next call again


def test_a_new_lesson_switch_gets_a_new_cache_and_the_old_one_is_released_first(monkeypatch):
    llm = eager_graphs(LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=32))
    params = SamplingParams(max_tokens=3, temperature=0)
    llm.generate(PROMPTS[0], params)
    first = weakref.ref(llm.last_core.scheduler.manager)
    closed, built = [], []
    close, kv_cache_manager = DecodeGraphs.close, ops.kv_cache_manager
    monkeypatch.setattr(DecodeGraphs, "close", lambda self: (closed.append(self.failed), close(self)))

    def spy(*args, **kwargs):
        built.append(first() is None)       # is the old cache gone before the new one is allocated?
        return kv_cache_manager(*args, **kwargs)

    monkeypatch.setattr(ops, "kv_cache_manager", spy)
    monkeypatch.setenv("YAIE_SOLUTIONS", "1-4,6")   # graphs replay the kernels they recorded: record anew
    llm.generate(PROMPTS[0], params)
    assert built == [True] and closed == [None]     # the old runner was closed (and was still open)
    assert llm.last_core.scheduler.manager.seq_ids() == [SCRATCH_SEQ]


def test_the_scratch_block_is_not_promised_to_requests():
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=5)
    manager = new_manager(llm, 5 + 1)
    scheduler = Scheduler(manager, reserved_blocks=1)
    scheduler.add(Request(0, [1] * 11, 10))            # 20 tokens cached at most: the 5 usable blocks
    with pytest.raises(ValueError, match="5 blocks"):
        scheduler.add(Request(1, [1] * 12, 10))        # 21 tokens cached at most: 6 blocks, only with the scratch one


def test_cuda_graphs_need_cuda():
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        LLM(DEFAULT_MODEL, device="cpu", cuda_graphs=True)
    assert LLM(DEFAULT_MODEL, device="cpu").settings.cuda_graphs is False


def test_looked_ahead_decode_steps_give_the_same_tokens_and_leak_nothing(monkeypatch):
    """Greedy decode steps are planned and launched before the last step's tokens reach the host, their input
    ids fed from the device: the tokens equal the plain engine's, for requests that end by length, by an
    end-of-sequence id and by a stop string (each ran one step too many, dropped), with prefix caching on
    (the extra token's K/V counted as computed); every block comes back."""
    from yaie.engine.core import EngineCore as Engine
    prompts = PROMPTS[:4]
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (60, 7, 60, 25)]
    params[2] = SamplingParams(max_tokens=60, temperature=0, stop=[" the"])
    with single_thread():
        plain = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=256)
        # Request 0 ends at a stop id: the 12th token it would write (the first time that id comes).
        stop_id = plain.generate(prompts[0], params[0])[0].token_ids[11]
        params[0] = SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[stop_id])
        want = plain.generate(prompts, params)
        llm = eager_graphs(LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=256))
        ahead = []
        real = Engine._look_ahead
        monkeypatch.setattr(Engine, "_look_ahead", lambda self, *a: ahead.append(real(self, *a)) or ahead[-1])
        got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    reasons = [o.outputs[0].finish_reason for o in got]
    assert reasons == ["stop", "length", "stop", "length"], reasons
    assert len(got[0].token_ids) <= 11 and len(got[2].token_ids) < 60
    assert sum(a is not None for a in ahead) >= 10, "decode steps were looked ahead"
    scheduler = llm.last_core.scheduler
    cached = scheduler.prefix_cache.tree.num_evictable_blocks
    assert set(scheduler.manager.seq_ids()) == {SCRATCH_SEQ}
    assert scheduler.manager.num_free_blocks + cached == scheduler.usable_blocks


def test_the_shared_slot_table_is_left_intact_by_a_run():
    """Lesson 03's reference hands out slot mappings as views of one device arange: nothing may write into
    them. After a run with prefills, decodes, graphs and prefix caching, the table is still the arange."""
    llm = eager_graphs(LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=64))
    with single_thread():
        llm.generate(PROMPTS[:3], SamplingParams(max_tokens=5, temperature=0))
    table = llm.last_core.scheduler.manager._all_slots()
    assert torch.equal(table, torch.arange(table.numel()))


def test_block_table_buffer_rewrites_only_changed_rows_and_matches_a_full_write(monkeypatch):
    """The fixed block-table buffer is written incrementally (rows that changed since the last step, in one
    copy): after any sequence of steps (tables growing, the batch shrinking and changing, a recording that
    resets the buffer) the rows the graph reads equal the tables of the step, padding rows start with the
    scratch block, and a step where no table changed writes nothing."""
    from yaie.engine import cuda_graphs
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    scratch, batch = 99, 6
    buf = cuda_graphs._Buffers(batch, 8, scratch, torch.device("cpu"))
    tables = [torch.randint(0, 50, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen).tolist()
              for _ in range(batch)]
    writes = []
    real_upload = cuda_graphs.upload

    def spy(dst, values):
        writes.append(len(values))
        real_upload(dst, values)

    monkeypatch.setattr(cuda_graphs, "upload", spy)
    for step in range(40):
        if step % 7 == 3:                    # a sequence gets a new block
            tables[step % len(tables)].append(int(torch.randint(0, 50, (1,), generator=gen)))
        if step in (15, 30) and len(tables) > 1:
            del tables[int(torch.randint(0, len(tables), (1,), generator=gen))]   # one finishes
        if step == 22:
            buf.reset()                      # a new graph of this bucket was recorded
        writes.clear()
        unchanged = [list(t) for t in tables] == buf.rows[:len(tables)] and all(
            row == [scratch] for row in buf.rows[len(tables):])
        buf.load_tables([list(t) for t in tables])
        assert not (unchanged and writes), f"seed {seed}, step {step}: nothing changed, yet rows were written"
        assert len(writes) <= 1, f"seed {seed}, step {step}: one copy at most, got {writes}"
        for i, table in enumerate(tables):
            assert buf.tables[i, :len(table)].tolist() == table, f"seed {seed}, step {step}, row {i}"
        assert (buf.tables[len(tables):, 0] == scratch).all(), f"seed {seed}, step {step}: padding rows"


def test_generate_decodes_the_text_once_and_gets_the_streamed_text():
    """``generate`` reads a request's text only at its end, so it decodes all its tokens at once; that text
    equals the stream decoder's (the pieces ``stream`` yields), also for token streams that split
    characters across tokens (the bundled byte-level tokenizer) or end inside one."""
    import random

    from yaie.engine.output import OutputState
    tokenizer = LLM(DEFAULT_MODEL, device="cpu").tokenizer
    seed = fresh_seed()
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    for _ in range(30):
        ids = [rng.randrange(3, tokenizer.vocab_size) for _ in range(rng.randint(1, 40))]
        at_once = OutputState(params, tokenizer, [], streams=False)
        streamed = OutputState(params, tokenizer, [])
        a, b = Request(0, [1], 100), Request(1, [1], 100)
        pieces = []
        for token in ids:
            at_once.accept(a, token)
            streamed.accept(b, token)
            pieces.append(streamed.piece())
        assert at_once.final_text == streamed.final_text == "".join(pieces), f"seed {seed}, ids {ids}"


def test_schedule_decodes_plans_what_schedule_plans():
    """The look-ahead's planning shortcut (only the running decodes again) gives the plan and the books that
    the general ``schedule`` gives: the same requests, slots, computed tokens and block tables; with a request
    waiting it is the general planning."""
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=64)
    runs = []
    for _ in range(2):
        scheduler = Scheduler(new_manager(llm, llm.settings.num_blocks), chunked_prefill=True)
        requests = [Request(i, list(range(1, 4 + 3 * i)), 20) for i in range(3)]
        for request in requests:
            scheduler.add(request)
        scheduler.schedule()                          # the prefills
        runs.append((scheduler, requests))
    for step in range(9):
        if step == 6:                                 # a newcomer: both plan it the general way
            for scheduler, _ in runs:
                scheduler.add(Request(3, [5, 6, 7], 20))
        plans = []
        for k, (scheduler, requests) in enumerate(runs):
            for request in requests:
                request.output_ids.append(10 + step)
            plans.append(scheduler.schedule() if k == 0 else scheduler.schedule_decodes())
            if step == 6:
                requests.append(scheduler.running[-1])
        (a, reqs_a), (b, reqs_b) = runs
        pa, pb = plans
        assert [r.request_id for r in pa.decodes] == [r.request_id for r in pb.decodes], step
        assert [r.request_id for r in pa.prefills] == [r.request_id for r in pb.prefills], step
        assert [s.tolist() for s in pa.decode_slots] == [s.tolist() for s in pb.decode_slots], step
        assert [r.num_computed_tokens for r in reqs_a] == [r.num_computed_tokens for r in reqs_b], step
        assert [a.manager.block_ids(r.request_id) for r in reqs_a] == \
            [b.manager.block_ids(r.request_id) for r in reqs_b], step
        assert a.stats == b.stats, step


def test_run_next_advances_the_buffers_as_run_writes_them(monkeypatch):
    """A looked-ahead step advances the fixed buffers on the device (positions and lengths + 1, the new
    token ids from the device, a table row only where a new block opened): the buffers the step runs on equal
    those that ``run`` writes from the host for the same step, across block boundaries and a new context
    bound."""
    from yaie.engine import cuda_graphs
    llm = LLM(DEFAULT_MODEL, device="cpu", block_size=4, num_blocks=64)
    managers = [new_manager(llm, llm.settings.num_blocks + 1) for _ in range(2)]      # the same books, one per runner
    ahead, plain = (DecodeGraphs(llm.model, manager, 8, capture=False) for manager in managers)
    monkeypatch.setattr(cuda_graphs, "MIN_BOUND", 8)                    # bounds 8, 16, 32: crossed below
    seen = {}

    def snapshot(self, buf, bound, cascade=None):
        seen[id(self)] = (buf.ids.clone(), buf.tables.clone(), bound)
        return torch.zeros(buf.ids.shape[1], 3)

    monkeypatch.setattr(DecodeGraphs, "_forward", snapshot)
    seqs = [0, 1, 2]
    for manager in managers:
        for seq, length in zip(seqs, (5, 8, 2)):
            manager.allocate(seq, length + 1)                           # + the slot of the first step's token
    positions = [managers[0].num_tokens(seq) - 1 for seq in seqs]
    ahead.run(seqs, [7, 8, 9], positions)
    general = []            # steps of ``ahead`` that went through the general path
    real_run = DecodeGraphs.run

    def spy(self, *args):
        if self is ahead:
            general.append(True)
        return real_run(self, *args)

    monkeypatch.setattr(DecodeGraphs, "run", spy)
    moved = 5               # seq 2's new token opens a block (position 8) within the bound of the last step
    for step in range(12):
        for manager in managers:
            for seq in seqs:
                manager.append_slots(seq, 1)
            if step == moved:   # seq 2 opens a block, and its other blocks moved too: not a plain growth
                held = manager.num_tokens(2)
                manager.free(2)
                manager.allocate("other", 8)
                manager.allocate(2, held)
        positions = [p + 1 for p in positions]
        tokens = [20 + step, 30 + step, 40 + step]
        assert ahead.continues(seqs)
        new_graph = (4, ahead.bound(max(positions) + 1), 0) not in ahead.graphs       # recorded first: via run
        general.clear()
        ahead.run_next(seqs, torch.tensor(tokens))
        plain.run(seqs, tokens, positions)
        if step == moved:   # the moved table, not a new block alone or a new graph, sends it to the general path
            assert positions[2] % managers[0].block_size == 0 and not new_graph, positions
        assert general == ([True] if new_graph or step == moved else []), (step, general)
        (ids_a, tables_a, bound_a), (ids_b, tables_b, bound_b) = seen[id(ahead)], seen[id(plain)]
        assert torch.equal(ids_a, ids_b) and bound_a == bound_b, step
        assert torch.equal(tables_a[:, 0], tables_b[:, 0]), step                 # padding rows: the scratch block
        for row, seq in enumerate(seqs):
            width = len(managers[0].block_ids(seq))
            assert torch.equal(tables_a[row, :width], tables_b[row, :width]), (step, row)
    assert not ahead.continues([0, 1])
