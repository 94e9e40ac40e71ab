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
