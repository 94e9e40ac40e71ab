"""The benchmark harness on a machine without a GPU: the command's refusal, Row figures, result files.

Nothing here times anything on a GPU (benchmarks never run in the test suite); the result files are
written from hand-made rows with made-up times, which only exercise the file writing.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import yaie.bench as bench
from yaie.bench import harness
from yaie.bench.harness import Row

from tests.helpers import ROOT


def _rows() -> list[Row]:
    nbytes = 2 * 1024 * 4096 * 2
    return [
        Row("lesson02", "rms_norm", "triton", "1024x4096", "bf16", 0.010, bytes_moved=nbytes),
        Row("lesson02", "rms_norm", "torch eager", "1024x4096", "bf16", 0.040, bytes_moved=nbytes),
        Row("lesson06", "attention", "triton", "1x8x1024x64", "bf16", 0.5, flops=10 ** 9),
    ]


PEAKS = {"copy_GBps": 3000.0, "bf16_matmul_TFLOPs": 700.0}


def test_no_gpu_message_and_status(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["lesson02"]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [bench.NO_GPU_MESSAGE]
    assert "CUDA GPU" in out[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path of the installed command")
def test_cli_without_gpu_exits_2():
    proc = subprocess.run([sys.executable, "-m", "yaie.cli", "bench", "lesson02"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout.strip() == bench.NO_GPU_MESSAGE


def test_unknown_lessons_are_refused(capsys):
    assert bench.main(["lesson2x"]) == 2
    assert "cannot read lesson" in capsys.readouterr().err
    assert bench.main(["lesson09"]) == 2
    assert "no benchmark for lesson09" in capsys.readouterr().err


def test_lesson_names():
    assert bench.lesson_module_name("lesson02") == "lesson02"
    assert bench.lesson_module_name("2") == "lesson02"
    assert bench.lesson_module_name("Lesson6") == "lesson06"
    with pytest.raises(ValueError):
        bench.lesson_module_name("two")


def test_row_rates():
    row = Row("l", "k", "i", "s", "bf16", ms=2.0, bytes_moved=6 * 10 ** 9, flops=4 * 10 ** 12)
    assert row.gbps == pytest.approx(3000.0)
    assert row.tflops == pytest.approx(2000.0)
    assert Row("l", "k", "i", "s", "bf16", ms=1.0).gbps is None
    assert Row("l", "k", "i", "s", "bf16", ms=1.0).tflops is None


def test_measure_peaks_needs_cuda():
    with pytest.raises(ValueError):
        harness.measure_peaks("cpu")


def test_gpu_slug():
    assert harness.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert harness.gpu_slug("NVIDIA H200") == "h200"
    assert harness.gpu_slug("NVIDIA A100-SXM4-80GB") == "a100"
    assert harness.gpu_slug("Some Odd Card") == "some-odd-card"


def test_environment_names_versions_and_command():
    env = harness.environment()
    for key in ("gpu", "torch", "triton", "cuda", "command", "date_utc", "git_commit"):
        assert key in env
    assert env["torch"] == torch.__version__


def test_write_results_files(tmp_path):
    rows = _rows()
    paths = harness.write_results("lesson02_test", rows, PEAKS, tmp_path)
    names = sorted(p.name for p in paths)
    assert names[:2] == ["lesson02_test.json", "lesson02_test.md"]
    for path in paths:
        assert path.exists() and path.stat().st_size > 0
    data = json.loads((tmp_path / "lesson02_test.json").read_text())
    assert data["peaks"] == PEAKS
    assert set(data["environment"]) >= {"gpu", "torch", "triton", "command"}
    first = data["rows"][0]
    # 16 MiB in 10 us = 1678 GB/s = 55.9% of 3000 GB/s
    assert first["GBps"] == pytest.approx(rows[0].gbps)
    assert first["share_of_copy_bandwidth"] == pytest.approx(rows[0].gbps / 3000.0)
    assert data["rows"][2]["share_of_bf16_matmul"] == pytest.approx(rows[2].tflops / 700.0)
    md = (tmp_path / "lesson02_test.md").read_text()
    assert "GPU:" in md and "versions:" in md and "command:" in md and "1024x4096" in md
    # the eager row is 4x the fastest of its group
    assert "| 4.00 |" in md


def test_results_round_trip_and_replot(tmp_path):
    pytest.importorskip("matplotlib")
    harness.write_results("lesson02_rt", _rows(), PEAKS, tmp_path)
    rows, peaks, env = harness.load_results(tmp_path / "lesson02_rt.json")
    assert rows == _rows() and peaks == PEAKS and "gpu" in env
    (tmp_path / "lesson02_rt.png").unlink()
    assert harness.replot(tmp_path / "lesson02_rt.json").exists()


def test_write_results_rejects_bad_names(tmp_path):
    with pytest.raises(ValueError):
        harness.write_results("../escape", _rows(), PEAKS, tmp_path)


def test_decode_chain_tool_checks_its_variants_on_the_cpu():
    """scripts/bench_decode_chain.py --check runs a layer under each variant in the Triton interpreter and
    compares it with the engine's; a variant that computes something else ends the run with its error."""
    tool = [sys.executable, str(ROOT / "scripts" / "bench_decode_chain.py"), "--check"]
    variants = "engine;attention in 4 splits;whole row;one product"
    done = subprocess.run(tool + ["--variants", variants], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checked 4 variants against engine on the CPU (batch 1)" in done.stdout
    batched = subprocess.run(tool + ["--batch", "3", "--variants", "engine;attention in 2 splits;one product"],
                             capture_output=True, text=True, timeout=300)
    assert batched.returncode == 0, batched.stdout + batched.stderr
    assert "checked 3 variants against engine on the CPU (batch 3)" in batched.stdout
    unknown = subprocess.run(tool + ["--variants", "engine;no such variant"], capture_output=True, text=True,
                             timeout=120)
    assert unknown.returncode == 2 and "unknown variants" in unknown.stderr
    # A batched layer has its own variants: the batch-1 launch settings are refused there.
    refused = subprocess.run(tool + ["--batch", "3", "--variants", "engine;whole row"], capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode == 2 and "unknown variants" in refused.stderr
