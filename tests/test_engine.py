"""The engine's behaviour: sampling, stopping, bad input, the lesson switch (spies, auto mode), the CLI."""

import functools
import random

import pytest
import torch

import solutions.kernels.cpu_kernels as reference
import yaie.kernels.cpu_kernels as student
from yaie import cli, ops, switch
from yaie.engine import DEFAULT_MODEL, LLM, SamplingParams
from yaie.engine.sampling import filtered_probs
from yaie.model.testing import fresh_seed, single_thread

LESSON01 = ("build_rope_cache", "cpu_rope_embeddings", "cpu_rms_norm", "cpu_attention_forward")


pytestmark = pytest.mark.usefixtures("reference_lessons")


@pytest.fixture(scope="module")
def llm():
    with pytest.MonkeyPatch.context() as mp, single_thread():
        mp.setenv("YAIE_SOLUTIONS", "all")
        return LLM(DEFAULT_MODEL, device="cpu")


# ----------------------------------------------------------------------------- sampling
def naive_filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Float64, one token at a time: the definition the sampler must follow."""
    scaled = logits.double() / temperature
    order = sorted(range(len(scaled)), key=lambda i: -scaled[i].item())
    keep = order[:top_k] if top_k > 0 else order
    probs = torch.softmax(scaled[keep], dim=0)
    kept, mass = [], 0.0
    for token, p in zip(keep, probs.tolist()):
        if mass >= top_p:
            break
        kept.append(token)
        mass += p
    out = torch.zeros_like(scaled)
    out[kept] = torch.softmax(scaled[kept], dim=0)
    return out


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.7), (8, 0.5), (1, 1.0)])
def test_filtered_probs_match_definition(top_k, top_p):
    seed = fresh_seed()
    logits = torch.randn(50, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    got = filtered_probs(logits, params).double()
    want = naive_filtered_probs(logits, 0.8, top_k, top_p)
    assert torch.allclose(got, want, atol=1e-6), f"seed={seed}"


def test_sampling_frequencies_follow_probabilities(llm):
    seed = fresh_seed()
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    params = SamplingParams(temperature=1.0, seed=seed)
    from yaie.engine.sampling import sample
    counts = torch.bincount(torch.tensor([sample(logits, params, index=i) for i in range(4000)]), minlength=4)
    expected = torch.softmax(logits, 0) * 4000
    sigma = (expected * (1 - expected / 4000)).sqrt()
    assert ((counts - expected).abs() < 5 * sigma).all(), f"seed={seed}: {counts.tolist()} vs {expected.tolist()}"


def test_seeded_sampling_is_reproducible(llm):
    seed = fresh_seed()
    params = SamplingParams(max_tokens=40, temperature=1.2, top_p=0.95, seed=seed)
    first = llm.generate("Once upon a time,", params)[0]
    again = llm.generate("Once upon a time,", params)[0]
    assert first.token_ids == again.token_ids and first.text == again.text, f"seed={seed}"
    others = {tuple(llm.generate("Once upon a time,", SamplingParams(max_tokens=40, temperature=1.2, seed=s))[0]
                    .token_ids) for s in range(seed + 1, seed + 5)}
    assert len(others | {tuple(first.token_ids)}) > 1, "different seeds should give different stories"


def test_top_k_1_and_tiny_top_p_are_greedy(llm):
    prompt = "Once upon a time, there was a little bear named"
    greedy = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0))[0].token_ids
    assert llm.generate(prompt, SamplingParams(max_tokens=30, temperature=1.5, top_k=1, seed=1))[0].token_ids == greedy
    assert llm.generate(prompt, SamplingParams(max_tokens=30, temperature=1.5, top_p=1e-6, seed=2))[0].token_ids == greedy


# ----------------------------------------------------------------------------- stopping
def test_stops(llm):
    prompt = "Once upon a time, there was a little fox named"
    full = llm.generate(prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))[0]
    assert len(full.token_ids) == 60 and full.outputs[0].finish_reason == "length"
    # a stop string: the text ends where it begins
    cut = full.text.index(" lived")
    out = llm.generate(prompt, SamplingParams(max_tokens=60, temperature=0, stop=[" lived", "zzz"]))[0]
    assert out.text == full.text[:cut] and out.outputs[0].finish_reason == "stop"
    # a stop token id: generation ends before it
    stop_id = full.token_ids[7]
    first = full.token_ids.index(stop_id)
    out = llm.generate(prompt, SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full.token_ids[:first] and out.outputs[0].finish_reason == "stop"
    # streaming gives the same text, piece by piece
    pieces = list(llm.stream(prompt, SamplingParams(max_tokens=60, temperature=0, stop=[" lived"])))
    assert "".join(pieces) == full.text[:cut]
    pieces = list(llm.stream(prompt, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, stop=["zzz"])))
    assert "".join(pieces) == full.text and len(pieces) > 20


def test_end_of_sequence_stops(llm):
    out = llm.generate("Once upon a time,", SamplingParams(max_tokens=400, temperature=0))[0]
    assert out.outputs[0].finish_reason == "stop" and len(out.token_ids) < 400  # a story ends with </s>


def test_context_limit(llm):
    context = llm.config.max_position_embeddings
    ids = [llm.config.bos_token_id] + [random.randrange(2, 900) for _ in range(context - 5)]
    out = llm.generate([ids], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="context"):
        llm.generate([ids + [5] * 4], SamplingParams(max_tokens=5))


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,what", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-3), "top_k"), (dict(stop=[""]), "stop"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="0.5"), "temperature"), (dict(top_p=float("nan")), "top_p"),
])
def test_bad_sampling_params(kwargs, what):
    with pytest.raises(ValueError, match=what):
        SamplingParams(**kwargs)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="at least one prompt"):
        llm.generate([])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 1024\)"):
        llm.generate([[0, 5000]])
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.generate("hi \ud800")


def test_a_tiny_temperature_samples_greedily(llm):
    """Dividing logits by a temperature under MIN_TEMPERATURE would overflow float32 into NaN."""
    prompt = "Lily was afraid of the dark."
    greedy = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    tiny = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=1e-40, seed=1))[0].token_ids
    assert tiny == greedy


# ----------------------------------------------------------------------------- the student's kernels run
def _spy(monkeypatch, module, names):
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(module, name)

        @functools.wraps(real)
        def wrapper(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapper)
    return calls


def test_spies_on_lesson01_are_called(monkeypatch):
    monkeypatch.setenv("YAIE_SOLUTIONS", "1,3")
    calls = _spy(monkeypatch, reference, LESSON01)
    llm = LLM(DEFAULT_MODEL, device="cpu")
    steps, layers = 3, llm.config.num_layers
    llm.generate("Once upon a time,", SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
    # Per forward pass: one norm before the layers and two in each; RoPE on q and on k; one attention.
    assert calls == {"build_rope_cache": 1, "cpu_rope_embeddings": 2 * layers * steps,
                     "cpu_rms_norm": (1 + 2 * layers) * steps, "cpu_attention_forward": layers * steps}


def test_student_code_runs_when_the_switch_says_so(monkeypatch):
    """YAIE_SOLUTIONS=3: lesson 01's functions in yaie/kernels/ are the ones called."""
    monkeypatch.setenv("YAIE_SOLUTIONS", "3")
    for name in LESSON01:
        monkeypatch.setattr(student, name, getattr(reference, name))  # a student who finished lesson 01
    calls = _spy(monkeypatch, student, LESSON01)
    ref_calls = _spy(monkeypatch, reference, LESSON01)  # the solutions module's attributes: must stay unused
    LLM(DEFAULT_MODEL, device="cpu").generate("Once", SamplingParams(max_tokens=2, temperature=0))
    assert all(calls.values()) and not any(ref_calls.values()), (calls, ref_calls)


def _stub(name):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"lesson 01, task 3: implement {name}")
    return stub


def test_auto_mode_falls_back_with_one_notice(monkeypatch, capsys, llm):
    monkeypatch.delenv("YAIE_SOLUTIONS")
    for name in LESSON01:
        monkeypatch.setattr(student, name, getattr(reference, name))
    monkeypatch.setattr(student, "cpu_rms_norm", _stub("cpu_rms_norm"))  # one task left undone
    params = SamplingParams(max_tokens=20, temperature=0)
    out = LLM(DEFAULT_MODEL, device="cpu").generate("Lily was afraid of the dark.", params)[0]
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith("lesson 01")]
    assert notices == ["lesson 01: cpu_rms_norm is not implemented yet in yaie/kernels/cpu_kernels.py; "
                       "using the reference for it"]
    assert out.token_ids == llm.generate("Lily was afraid of the dark.", params)[0].token_ids


def test_auto_mode_without_reference_says_so(monkeypatch):
    """A student copy has no solutions/: an unfinished task then has nothing to fall back to."""
    monkeypatch.delenv("YAIE_SOLUTIONS")
    monkeypatch.setattr(student, "build_rope_cache", _stub("build_rope_cache"))

    def no_reference(lesson, which=0):
        raise switch.LessonUnavailable("lesson 01: no reference in this copy")

    monkeypatch.setattr(ops.lessons, "reference_module", no_reference)
    with pytest.raises(ops.KernelMissing, match="build_rope_cache is not implemented yet .* no reference solution"):
        LLM(DEFAULT_MODEL, device="cpu")


def test_strict_mode_names_the_missing_task(monkeypatch):
    monkeypatch.setenv("YAIE_SOLUTIONS", "3")
    for name in LESSON01:
        monkeypatch.setattr(student, name, getattr(reference, name))
    monkeypatch.setattr(student, "cpu_attention_forward", _stub("cpu_attention_forward"))
    llm = LLM(DEFAULT_MODEL, device="cpu")
    with pytest.raises(ops.KernelMissing) as err:
        llm.generate("Once", SamplingParams(max_tokens=2))
    message = str(err.value)
    for part in ("lesson 01: cpu_attention_forward is not implemented yet in yaie/kernels/cpu_kernels.py",
                 "YAIE_SOLUTIONS=1", "yaie generate --solutions 1", "pytest grader/lesson01"):
        assert part in message, message


# ----------------------------------------------------------------------------- CLI
def test_cli_generate_prints_text(monkeypatch, capsys):
    monkeypatch.setenv("YAIE_SOLUTIONS", "all")  # restored after the test, whatever --solutions sets
    rc = cli.main(["generate", "Once upon a time, there was a little cat named", "--max-tokens", "12",
                   "--temperature", "0", "--solutions", "1,3", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith("Once upon a time, there was a little cat named ") and len(out.split()) >= 16
    assert "tiny-stories on cpu" in err


def test_cli_reports_a_missing_kernel_plainly(monkeypatch, capsys):
    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    monkeypatch.setattr(student, "build_rope_cache", _stub("build_rope_cache"))
    rc = cli.main(["generate", "Hi", "--max-tokens", "2", "--solutions", "none", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "build_rope_cache is not implemented yet" in err and "Traceback" not in err


def test_cli_rejects_bad_options(monkeypatch, capsys):
    monkeypatch.setenv("YAIE_SOLUTIONS", "all")
    assert cli.main(["generate", "Hi", "--max-tokens", "0", "--device", "cpu"]) == 1
    assert "max_tokens must be" in capsys.readouterr().err
    assert cli.main(["generate", "Hi", "--model", "/nonexistent/model"]) == 1
    assert "not a directory" in capsys.readouterr().err


@pytest.mark.parametrize("folder, lesson, stub_file", [("tiny-telescoping", 7, "yaie/kernels/telescoping.py"),
                                                       ("tiny-based", 8, "yaie/kernels/based.py")])
def test_constant_memory_models_fall_back_on_unfinished_lessons(monkeypatch, capsys, folder, lesson, stub_file):
    """The telescoping and Based models reach their lesson through ops: on the stubs, auto mode runs the
    reference for each stubbed function (one notice each) and gives the reference's tokens; strict mode names
    the missing task."""
    model = DEFAULT_MODEL.parent / folder
    params = SamplingParams(max_tokens=6, temperature=0)
    expected = LLM(model, device="cpu").generate("Once upon a time", params)[0].token_ids
    monkeypatch.delenv("YAIE_SOLUTIONS")
    ops.reset_auto_fallback()
    got = LLM(model, device="cpu").generate("Once upon a time", params)[0].token_ids
    notices = [line for line in capsys.readouterr().err.splitlines() if line.startswith(f"lesson {lesson:02d}")]
    # One notice per stubbed function the model called, each naming the student's file.
    assert notices and len(set(notices)) == len(notices), notices
    assert all(stub_file in line and line.endswith("using the reference for it") for line in notices), notices
    assert got == expected
    monkeypatch.setenv("YAIE_SOLUTIONS", "1-6")       # strict: lessons 07 and 08 run the student's stubs
    ops.reset_auto_fallback()
    with pytest.raises(ops.KernelMissing, match=f"lesson {lesson:02d}: .* is not implemented yet"):
        LLM(model, device="cpu").generate("Once upon a time", params)
