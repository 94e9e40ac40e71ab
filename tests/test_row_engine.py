"""The engine core over the constant-state models: Based (lesson 08) and telescoping (lesson 07).

A :class:`yaie.engine.row_runner.RowRunner` gives each request one row of the model's state (Based:
``BasedRows``; telescoping: a cache per row), requests beyond the rows wait. The core's answers are compared
with ``LLM.generate`` on an engine of its own (greedy and seeded sampled requests), step by step and through
the server's engine loop (the bundled tiny models, more requests than rows), with look-ahead and chunked
prefill. The server itself over these models: ``tests/test_serve_based.py``. No ``openai`` or ``httpx``
here, so the GPU test runs where only the engine's packages are.
"""

from __future__ import annotations

import asyncio
import re

import pytest
import torch

from tests.helpers import fail_once
from yaie.engine import LLM, SamplingParams
from yaie.engine.async_engine import AsyncEngine
from yaie.engine.core import EngineCore
from yaie.engine.llm import DEFAULT_MODEL
from yaie.engine.row_runner import RowRunner
from yaie.model.based_rows import BasedRows
from yaie.model.testing import fresh_seed, single_thread

BASED = DEFAULT_MODEL.parent / "tiny-based"
TELESCOPING = DEFAULT_MODEL.parent / "tiny-telescoping"
ROWS = 2
PROMPTS = ["Once upon a time", "Tom had a red kite.", "One day, Lucy the cat went to the park.", "Sam ran",
           "Mia and Ben found a box"]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def sampled(seed: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.95, top_k=50, seed=seed)


def texts_of(events, request) -> str:
    return "".join(event.text for event in events if event.request is request)


@pytest.fixture(scope="module")
def reference():
    """``LLM.generate``'s answers, from engines of their own."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("YAIE_SOLUTIONS", "all")
        return {"based": LLM(BASED, device="cpu"), "telescoping": LLM(TELESCOPING, device="cpu")}


def generate(llm, prompts, params):
    with single_thread():
        return llm.generate(prompts, params)


# ----------------------------------------------------------------------------- the engine, step by step
@pytest.mark.parametrize("graph_buffers", [False, True], ids=["plain", "graph-buffers"])
def test_rows_give_generates_tokens_with_arrivals_waits_and_an_abort(reference, reference_lessons, graph_buffers):
    """Seven requests through four rows, arriving at different steps: the ones beyond the rows wait, one is
    aborted mid-way (its row goes to a waiting one), the others get exactly ``LLM.generate``'s tokens and text
    (greedy, a stop string, seeded sampling, logprobs). ``graph-buffers``: the decode steps of CUDA graphs'
    fixed, bucket-padded buffers (run eagerly here): three rows decode in the bucket of four while a prompt
    goes into the fourth, the padding row."""
    graphs = dict(cuda_graphs=True, graph_capture=False) if graph_buffers else {}
    llm = LLM(BASED, device="cpu", max_num_seqs=4, **graphs)
    engine = llm.open_core()
    if graph_buffers:                   # as served: every bucket's step first (recorded on a GPU)
        assert engine.warm_up() == 3 and sorted(engine.runner.rows.graphs) == [1, 2, 4]
        assert engine.requests == {} and engine.scheduler.running == [] and not engine.flush()
    arrivals_waits_and_an_abort(llm, engine, reference["based"], logprob_atol=1e-4)


@pytest.mark.gpu
def test_rows_on_cuda_graphs_give_generates_tokens(reference_lessons):
    """The same on CUDA as served (every bucket's graph recorded by the warm-up first), float32, beside
    ``LLM.generate`` on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    llm = LLM(BASED, device="cuda", dtype=torch.float32, max_num_seqs=4)
    engine = llm.open_core()
    assert engine.warm_up() == 3 and engine.runner.rows.failed is None          # buckets 1, 2, 4
    assert engine.requests == {} and engine.scheduler.running == [] and not engine.flush()
    arrivals_waits_and_an_abort(llm, engine, LLM(BASED, device="cuda", dtype=torch.float32), logprob_atol=2e-3)


def arrivals_waits_and_an_abort(llm: LLM, engine: EngineCore, reference_llm: LLM, logprob_atol: float) -> None:
    """The scenario of the two tests above, on a four-row engine."""
    seed = fresh_seed()
    params = [greedy(14), sampled(seed, 12),
              greedy(40),                                                         # aborted
              SamplingParams(max_tokens=16, temperature=0, stop=[" the"]),
              greedy(6),                                                          # with logprobs
              greedy(10), sampled(seed + 1, 9)]
    prompts = PROMPTS + ["The sun was hot", "Ella saw a fox"]
    want = generate(reference_llm, prompts, params)
    ids = [llm.tokenizer.encode(p) for p in prompts]
    arrivals = {0: [0, 1, 2], 2: [3], 4: [4, 5, 6]}
    requests, events, scored, waited = {}, [], [], 0
    aborted_at = None
    for step in range(200):
        for i in arrivals.get(step, []):
            requests[i] = engine.add(ids[i], params[i], logprobs=2 if i == 4 else None)
        if aborted_at is None and 4 in requests and len(requests[2].output_ids) >= 5:
            assert engine.scheduler.waiting, "nothing waits for the aborted request's row"
            running_before = len(engine.scheduler.running)
            assert engine.abort(requests[2].request_id) and not engine.abort(requests[2].request_id)
            assert len(engine.scheduler.running) == running_before - 1, "the aborted request kept its row"
            aborted_at = step
        if not engine.has_unfinished() and step > max(arrivals):
            break
        waited += bool(engine.scheduler.waiting)
        if engine.has_unfinished():
            events += engine.step()
        assert len(engine.scheduler.running) <= engine.scheduler.capacity
        if 4 in requests:
            scored += engine.take_logprobs(requests[4].request_id) or []
    events += engine.flush()
    scored += engine.take_logprobs(requests[4].request_id) or []
    for i in (0, 1, 3, 4, 5, 6):
        assert requests[i].output_ids == want[i].token_ids, f"request {i} (seed={seed})"
        assert texts_of(events, requests[i]) == want[i].text, f"request {i} (seed={seed})"
        assert [e.finish_reason for e in events if e.request is requests[i]][-1] == want[i].outputs[0].finish_reason
    assert aborted_at is not None and 5 <= len(requests[2].output_ids) < 40
    assert waited > 0, "no request ever waited for a row"
    assert engine.scheduler.running == [] and not engine.scheduler.waiting
    assert engine.requests == {} and engine.states == {} and engine.logprobs == {}
    # Logprobs: the sampled token's log-probability under the model, each one checked against a prompt
    # prefilled up to it (the prefill path, not the decode step that produced it).
    assert [token for token, _, _ in scored] == want[4].token_ids
    check = BasedRows(llm.model, 1, graphs=False)
    for j, (token, logprob, top) in enumerate(scored):
        exact = torch.log_softmax(check.prefill(0, ids[4] + want[4].token_ids[:j])[0].double(), -1)
        assert logprob == pytest.approx(exact[token].item(), abs=logprob_atol), f"token {j}"
        assert [t for t, _ in top] == exact.topk(2).indices.tolist(), f"token {j}"   # greedy: the top one
        assert top[0] == (token, logprob)


def test_rows_refuse_bad_prompts_without_touching_the_rows(reference, reference_lessons):
    """A prompt the model cannot read gets a ValueError at ``add`` (never a failed step beside others), and a
    request aborted while it waits for a row leaves the queue; the requests running meanwhile finish as
    ``LLM.generate`` gives them."""
    llm = LLM(BASED, device="cpu", max_num_seqs=ROWS)
    engine = llm.open_core()
    params = greedy(8)
    want = generate(reference["based"], PROMPTS[:2], params)
    requests = [engine.add(llm.tokenizer.encode(p), params) for p in PROMPTS[:3]]
    events = engine.step()
    assert list(engine.scheduler.waiting) == [requests[2]]
    assert engine.abort(requests[2].request_id) and not engine.scheduler.waiting
    context = llm.config.max_position_embeddings
    vocab = llm.config.vocab_size
    in_vocab = re.escape(f"[0, {vocab})")
    for bad, what in (([], "empty"), ([5, vocab], in_vocab), ([5, -1], in_vocab), ([True, 5], "token ids"),
                      ([3] * context, "context")):
        with pytest.raises(ValueError, match=what):
            engine.add(bad, params)
    with pytest.raises(ValueError, match="logprobs"):
        engine.add([5], params, logprobs=-1)
    assert not engine.scheduler.waiting and len(engine.requests) == 2
    while engine.has_unfinished():
        events += engine.step()
    events += engine.flush()
    for request, w in zip(requests, want):
        assert request.output_ids == w.token_ids and texts_of(events, request) == w.text
    assert requests[2].output_ids == [] and not texts_of(events, requests[2])


def test_a_failure_while_freeing_a_row_leaves_nothing_stuck(reference, reference_lessons, monkeypatch):
    """A request ends and freeing its row fails (``move`` raises once): the step raises with every request of it
    still known, so the engine loop's failure path (``AsyncEngine._fail``: abort each one) frees every row; a
    request added afterwards finishes as ``LLM.generate`` gives it."""
    llm = LLM(BASED, device="cpu", max_num_seqs=ROWS)
    engine = llm.open_core()
    short = engine.add(llm.tokenizer.encode(PROMPTS[0]), greedy(1))
    long = engine.add(llm.tokenizer.encode(PROMPTS[1]), greedy(6))
    move = fail_once(engine.scheduler.move, "a device fault while moving a row")
    monkeypatch.setattr(engine.scheduler, "move", move)
    with pytest.raises(RuntimeError, match="moving a row"):
        engine.step()           # both prefilled; the short one ends at its first token and its row must go
    assert move.calls == [(1, 0)]
    assert engine.abort(short.request_id) and engine.abort(long.request_id), "both requests still known"
    assert engine.scheduler.running == [] and engine.requests == {} and engine.states == {}
    engine.flush()              # the failed step's events: the engine loop drops those of failed requests
    third = engine.add(llm.tokenizer.encode(PROMPTS[2]), greedy(4))
    while engine.has_unfinished():
        engine.step()
    assert third.output_ids == generate(reference["based"], PROMPTS[2:3], greedy(4))[0].token_ids
    assert engine.scheduler.running == [] and engine.requests == {}


def test_telescoping_rows_each_hold_a_cache_of_their_own(reference, reference_lessons):
    """A telescoping model's caches do not batch: each row holds its own, a decode step runs each row's forward
    pass; beyond the rows, requests wait; each gets ``LLM.generate``'s tokens."""
    llm = LLM(TELESCOPING, device="cpu", max_num_seqs=ROWS)
    engine = llm.open_core()
    assert engine.scheduler.capacity == ROWS
    seed = fresh_seed()
    params = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), sampled(seed, 8),
              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)]
    want = generate(reference["telescoping"], PROMPTS[:3], params)
    requests = [engine.add(llm.tokenizer.encode(p), q) for p, q in zip(PROMPTS[:3], params)]
    events = []
    while engine.has_unfinished():
        assert len(engine.scheduler.running) <= ROWS
        events += engine.step()
    events += engine.flush()
    for i, (request, w) in enumerate(zip(requests, want)):
        assert request.output_ids == w.token_ids and texts_of(events, request) == w.text, f"{i} (seed={seed})"


@pytest.mark.parametrize("kind", ["based", "telescoping"])
def test_the_async_engine_serves_them_through_rows(kind, reference, reference_lessons):
    """The server's engine loop runs these models: three requests submitted at once through two rows answer
    as ``LLM.generate``."""
    llm = LLM(BASED if kind == "based" else TELESCOPING, device="cpu", max_num_seqs=ROWS)
    seed = fresh_seed()
    params = [greedy(8), sampled(seed, 8), greedy(5)]
    want = generate(reference[kind], PROMPTS[:3], params)
    engine = AsyncEngine(llm)
    engine.start()

    async def answers():
        group = await engine.submit([(llm.tokenizer.encode(p), q) for p, q in zip(PROMPTS[:3], params)])
        texts = ["", "", ""]
        async for event in group.events():
            assert event.error is None, event.error
            texts[event.index] += event.text
        return texts

    try:
        assert isinstance(engine.core.runner, RowRunner) and engine.alive
        assert engine.stats.blocks_total == engine.core.scheduler.capacity     # rows, in the metrics
        assert asyncio.run(asyncio.wait_for(answers(), timeout=30)) == [w.text for w in want], f"seed={seed}"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kind", ["based", "telescoping", "based-graph-buffers"])
def test_long_prompts_are_prefilled_in_chunks_beside_running_decodes(kind, reference, reference_lessons):
    """With a budget of 8 tokens a step, prompts longer than that grow chunk by chunk in the staging row while
    the running rows keep decoding (steps that decode and feed a partial chunk), then move down to a running
    row; every request gets ``LLM.generate``'s tokens (whole prompts, one step each). ``based-graph-buffers``:
    the decode steps of CUDA graphs' bucket-padded buffers (run eagerly), whose padding never reaches the
    staging row."""
    graphs = dict(cuda_graphs=True, graph_capture=False) if kind.endswith("graph-buffers") else {}
    kind = kind.split("-")[0]
    llm = LLM(BASED if kind == "based" else TELESCOPING, device="cpu", max_num_seqs=ROWS, max_num_batched_tokens=8,
              **graphs)
    prompts = ["Sam ran", PROMPTS[2] + " She saw a big red ball.", PROMPTS[4] + " under the old tree."]
    params = [greedy(30), greedy(10), greedy(8)]
    want = generate(reference[kind], prompts, params)
    engine = llm.open_core()
    steps = []
    execute = engine.runner.execute

    def spy(plan, device_tokens=None):
        steps.append((len(plan.decodes), [(end - start, end < len(r.prompt_ids))
                                          for r, (start, end) in zip(plan.prefills, plan.prefill_ranges)]))
        return execute(plan, device_tokens)

    engine.runner.execute = spy
    requests = [engine.add(llm.tokenizer.encode(p), q) for p, q in zip(prompts, params)]
    assert all(len(r.prompt_ids) > 8 for r in requests[1:])
    with single_thread():
        while engine.has_unfinished():
            engine.step()
    for i, (request, w) in enumerate(zip(requests, want)):
        assert request.output_ids == w.token_ids, f"request {i}"
    assert any(decodes and any(partial for _, partial in chunks) for decodes, chunks in steps), steps
    assert all(decodes + sum(n for n, _ in chunks) <= 8 for decodes, chunks in steps), steps
    assert engine.scheduler.staged is None and engine.scheduler.running == []
    engine.close()


def test_rows_look_ahead_and_give_the_tokens_of_steps_read_one_at_a_time(reference_lessons, monkeypatch):
    """While the rows stay the same, the next decode step is launched before this one's tokens are read (fed
    from the device): requests ending by length, by a stop string and by a stop id (each ran one looked-ahead
    step too many) get the tokens of a core that never looks ahead."""
    llm = LLM(BASED, device="cpu", max_num_seqs=4)
    prompts = PROMPTS[:4]
    params = [greedy(20), SamplingParams(max_tokens=20, temperature=0, stop=[" the"]), greedy(12),
              sampled(fresh_seed(), 16)]
    real, ahead = EngineCore._look_ahead, []
    with single_thread():
        monkeypatch.setattr(EngineCore, "_look_ahead", lambda self, pending: None)
        want = llm.generate(prompts, params)
        stop_id = want[0].token_ids[7]                       # request 0 ends at a stop id the 8th time
        params[0] = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_id])
        want = llm.generate(prompts, params)
        monkeypatch.setattr(EngineCore, "_look_ahead", lambda self, pending: ahead.append(real(self, pending))
                            or ahead[-1])
        got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.outputs[0].finish_reason for o in got][:2] == ["stop", "stop"]
    assert sum(a is not None for a in ahead) >= 5, "decode steps were looked ahead"
