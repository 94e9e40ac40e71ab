"""Mistakes a student or a new user makes get one line that says what is wrong, not a traceback: in the
Python API, the CLI and the notebooks."""

from __future__ import annotations

import shutil

import pytest
import torch

from yaie.engine import DEFAULT_MODEL, SamplingParams


@pytest.mark.parametrize("kwargs, what", [
    (dict(seed="x"), "seed"), (dict(seed=1.5), "seed"), (dict(seed=2**70), "seed"), (dict(seed=True), "seed"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=7), "stop_token_ids"), (dict(stop=[3]), "stop"), (dict(max_tokens=True), "max_tokens"),
    (dict(top_k=2.0), "top_k"),
], ids=repr)
def test_bad_sampling_params_are_refused_when_made(kwargs, what):
    with pytest.raises(ValueError, match=what):
        SamplingParams(**kwargs)


def test_good_sampling_params_are_kept():
    params = SamplingParams(seed=-3, stop_token_ids=(5, 6), stop="the")
    assert params.seed == -3 and params.stop_token_ids == [5, 6] and params.stop == ["the"]
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_a_device_that_is_not_there_is_one_line(capsys):
    from yaie.device import resolve_device
    from yaie.engine.cli import main

    with pytest.raises(ValueError, match="'cpu', 'cuda'"):
        resolve_device("gpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert main(["Hi", "--device", "gpu", "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'" in err
    if not torch.cuda.is_available():
        assert main(["Hi", "--device", "cuda", "--max-tokens", "2"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "no CUDA GPU" in err and "--device cpu" in err


def test_a_truncated_checkpoint_names_its_file(tmp_path, capsys):
    from yaie.engine.cli import main

    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["Hi", "--model", str(model), "--max-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(weights) in err and "not a readable safetensors file" in err


def test_a_mistyped_command_says_so(capsys):
    from yaie.cli import main

    assert main(["generat"]) == 2
    err = capsys.readouterr().err
    assert "invalid command 'generat'" in err and "did you mean 'generate'?" in err
    assert main(["--help"]) == 0 and "generate" in capsys.readouterr().out


def test_a_notebook_cell_needing_an_earlier_lesson_prints_one_line(capsys):
    from yaie.notebook import try_it
    from yaie.ops import KernelMissing

    def engine_demo():
        raise KernelMissing("lesson 03: KVCacheManager is not implemented yet in yaie/kernels/kv_cache.py.\n"
                            "Implement it (`pytest grader/lesson03` checks it).")

    assert try_it(engine_demo) is None
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and "lesson 03: KVCacheManager is not implemented yet" in out


def test_the_grader_report_in_a_notebook_has_no_colour_codes(monkeypatch, capsys):
    from yaie.grade import run_grader

    monkeypatch.setenv("FORCE_COLOR", "1")          # as Jupyter sets it
    monkeypatch.setenv("PY_COLORS", "1")
    run_grader(1, extra_args=["-k", "task1"])
    out = capsys.readouterr().out
    assert "task 1" in out and "\x1b[" not in out


def test_yaie_grade_grades_lessons_in_one_process_and_keeps_its_columns(tmp_path):
    """``yaie grade 1 7`` runs both graders in one pytest process and splits the report by lesson; a task name
    longer than the column is cut, so every state starts in the same column."""
    import json
    import subprocess
    import sys

    from yaie.grade import ROOT, TASK_COLUMN

    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "yaie.cli", "grade", "1", "7", "--results-json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "YAIE_SOLUTIONS": "none"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert sorted(report) == ["lesson01", "lesson07"]
    for key, lesson in (("lesson01", 1), ("lesson07", 7)):
        tests = report[key]["tests"]
        assert len(tests) == 4 and all(t["extra_data"]["lesson"] == lesson for t in tests)
        assert report[key]["max_score"] == sum(t["max_score"] for t in tests) > 0
    rows = [line for line in proc.stdout.splitlines() if line.startswith("  lesson ")]
    assert len(rows) == 8 and {row.index("not implemented") for row in rows} == {len("  lesson 01 ") + TASK_COLUMN + 1}


def test_n_completions_per_prompt_each_with_its_own_seed():
    """``SamplingParams(n=3, seed=s)`` gives three completions per prompt, completion i as ``seed=s + i`` alone;
    ``stream`` refuses n > 1 (it yields one completion)."""
    from yaie.engine import LLM
    from yaie.model.testing import single_thread

    llm = LLM(DEFAULT_MODEL, device="cpu")
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3)
    with single_thread():
        outs = llm.generate(["Once upon a time", "Tom had a red kite."], params)
        alone = [llm.generate("Tom had a red kite.", SamplingParams(max_tokens=6, temperature=1.0, seed=11 + i))[0]
                 for i in range(3)]
    assert [len(o.outputs) for o in outs] == [3, 3]
    assert [c.token_ids for c in outs[1].outputs] == [a.token_ids for a in alone]
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1, "three completions, three different seeds"
    with pytest.raises(ValueError, match="n=3"):
        next(llm.stream("Once upon a time", params))
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)


def test_the_run_summary_says_which_lessons_ran_and_whose_code(monkeypatch, capsys):
    """``yaie generate``'s last line names the lessons whose code ran, yours or the reference's; lesson 05 left
    unfinished in strict mode turns prefix caching off with one line, and is not counted as run."""
    from yaie import ops
    from yaie.engine.cli import main

    monkeypatch.setenv("YAIE_SOLUTIONS", "1,3")
    ops.reset_auto_fallback()
    assert main(["Hi there", "--max-tokens", "2", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "prefix caching is off" in err and "lesson 05: RadixAttentionWithPagedKVCache" in err
    summary = err.splitlines()[-1]
    assert "reference solutions for lessons 1,3" in summary and "lessons run: 01, 03;" in summary
