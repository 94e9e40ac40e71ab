"""The benchmark harness every lesson's benchmark uses.

What it gives a lesson's ``yaie/bench/lessonNN.py``:

* :func:`measure_peaks` measures the two ceilings of the GPU once per run: the device-to-device copy
  bandwidth (bytes read + bytes written per second) and the bf16 matrix-product rate. Every kernel's
  figure is then reported as a share of what *this* card really does, not of a datasheet number.
* :func:`bench_ms` times one callable: the median of many runs after a warm-up, through
  ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs); :func:`graphed` records a callable in
  a CUDA graph (GPU work only, as the engine's decode steps run) and :func:`event_times_ms` times runs alone.
* :class:`Row` is one measured point (lesson, kernel, implementation, shape, dtype, time, and the bytes
  or operations the op must at least move or do), with its achieved GB/s and TFLOP/s.
* :func:`environment` names the GPU, the versions and the command, so that a result file says where it
  comes from; :func:`write_results` writes the JSON, a Markdown table and a PNG plot.

Nothing here runs in the test suite on a GPU: benchmarks live in ``yaie bench``, never in a timed test.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]

# Sizes for the two ceilings. The copy is far larger than the L2 cache (50-60 MB on Hopper), so it
# measures device memory; the matrix product is large enough to keep every tensor core busy.
_COPY_BYTES = 1 << 30          # 1 GiB copied, i.e. 2 GiB moved (read + write)
_MATMUL_SIZE = 8192            # 8192^3 bf16 product: 1.1 TFLOP


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``|got - ref| / |ref|`` in the Frobenius norm, computed in float32 (a zero ``ref`` counts as 1e-30)."""
    got, ref = got.detach().float(), ref.detach().float()
    return float((got - ref).norm() / ref.norm().clamp(min=1e-30))


def bench_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of ``fn()`` in milliseconds, after ``warmup_ms`` of warm-up runs.

    Uses ``triton.testing.do_bench``, which times with CUDA events and clears the L2 cache before
    every run, so a kernel whose inputs would fit in the cache is still timed from device memory.
    """
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graphed(fn: Callable[[], object], warm: int = 2) -> Callable[[], None]:
    """Record ``fn()`` in a CUDA graph and return the graph's replay: GPU work only, no host Python per call.

    ``fn`` first runs ``warm`` times on the capture's side stream (compiles, allocations, a communicator's set-up
    happen there, not inside the capture). The returned callable keeps the graph alive."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph.replay


def event_times_ms(fn: Callable[[], object], runs: int) -> list[float]:
    """Milliseconds of each of ``runs`` calls of ``fn()``, each timed alone between two CUDA events (the L2 cache
    is not flushed: for a graph replay that reads more than the cache holds, as a decode step does)."""
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def measure_peaks(device: str = "cuda") -> dict:
    """Measure the device's copy bandwidth (GB/s, read + write) and bf16 matmul rate (TFLOP/s).

    Both on random data (zeros can run faster than real data on some chips). Returns
    ``{"copy_GBps": float, "bf16_matmul_TFLOPs": float}``.
    """
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"measure_peaks needs a CUDA device, got {device!r}")
    generator = torch.Generator(device=dev).manual_seed(0)
    src = torch.randn(_COPY_BYTES // 2, dtype=torch.bfloat16, device=dev, generator=generator)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    copy_gbps = 2 * src.numel() * src.element_size() / (copy_ms * 1e-3) / 1e9
    del src, dst

    n = _MATMUL_SIZE
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev, generator=generator)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev, generator=generator)
    out = torch.empty(n, n, dtype=torch.bfloat16, device=dev)
    matmul_ms = bench_ms(lambda: torch.matmul(a, b, out=out), warmup_ms=300, rep_ms=500)
    matmul_tflops = 2 * n ** 3 / (matmul_ms * 1e-3) / 1e12
    del a, b, out
    torch.cuda.empty_cache()
    return {"copy_GBps": copy_gbps, "bf16_matmul_TFLOPs": matmul_tflops,
            "copy_bytes_moved": 2 * _COPY_BYTES, "matmul_shape": f"{n}x{n}x{n}"}


@dataclass
class Row:
    """One measured point: ``impl`` of ``kernel`` on ``shape``/``dtype`` took ``ms`` (median).

    ``bytes_moved`` is the least traffic the op needs (each input read once, each output written
    once); ``flops`` the arithmetic it must do. Either may be ``None`` when it does not apply.
    """

    lesson: str
    kernel: str
    impl: str
    shape: str
    dtype: str
    ms: float
    bytes_moved: int | None = None
    flops: int | None = None

    @property
    def gbps(self) -> float | None:
        """Achieved bandwidth in GB/s (1e9 bytes per second), counting ``bytes_moved``."""
        if self.bytes_moved is None or not self.ms > 0:
            return None
        return self.bytes_moved / (self.ms * 1e-3) / 1e9

    @property
    def tflops(self) -> float | None:
        """Achieved arithmetic rate in TFLOP/s, counting ``flops``."""
        if self.flops is None or not self.ms > 0:
            return None
        return self.flops / (self.ms * 1e-3) / 1e12


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _command_line() -> str:
    """The command as a person would type it: ``yaie bench ...`` or ``python -m yaie.bench.lesson02 ...``."""
    script = Path(sys.argv[0])
    args = sys.argv[1:]
    if script.name == "yaie" or script.as_posix().endswith("yaie/cli.py"):
        return " ".join(["yaie", *args])
    if script.suffix != ".py":
        return " ".join(sys.argv)
    try:
        module = script.resolve().relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
    except ValueError:
        return " ".join(sys.argv)
    return " ".join(["python -m", module, *args])


def environment() -> dict:
    """Where a result comes from: GPU, versions, command line, date (UTC)."""
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is a dependency on Linux
        triton_version = None
    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "gpu_multiprocessors": props.multi_processor_count if props else None,
        "gpu_memory_GiB": round(props.total_memory / 2 ** 30, 1) if props else None,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "command": _command_line(),
        "git_commit": os.environ.get("YAIE_GIT_COMMIT") or _git_commit(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def gpu_slug(name: str | None = None) -> str:
    """A short file-name part for the GPU: ``'NVIDIA H100 80GB HBM3'`` gives ``'h100'``."""
    if name is None:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    match = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", name)
    slug = match.group(1) if match else name
    return re.sub(r"[^a-z0-9]+", "-", slug.lower()).strip("-") or "gpu"


def _shares(row: Row, peaks: dict) -> tuple[float | None, float | None]:
    """(share of copy bandwidth, share of matmul rate), as fractions."""
    bw = row.gbps / peaks["copy_GBps"] if row.gbps is not None and peaks.get("copy_GBps") else None
    tf = row.tflops / peaks["bf16_matmul_TFLOPs"] if row.tflops is not None and peaks.get("bf16_matmul_TFLOPs") else None
    return bw, tf


def _groups(rows: list[Row]) -> dict[tuple[str, str, str], list[Row]]:
    """Rows grouped by (kernel, shape, dtype), keeping their order."""
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.kernel, row.shape, row.dtype), []).append(row)
    return groups


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown_table(rows: list[Row], peaks: dict) -> str:
    """One line per row: time, achieved rate, share of the measured peaks, time over the group's best."""
    lines = ["| kernel | shape | dtype | impl | ms (median) | GB/s | % of copy | TFLOP/s | % of matmul | x best |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for group in _groups(rows).values():
        best = min(r.ms for r in group)
        for r in group:
            bw, tf = _shares(r, peaks)
            lines.append(
                f"| {r.kernel} | {r.shape} | {r.dtype} | {r.impl} | {r.ms:.4f} | {_fmt(r.gbps, '.0f')} | "
                f"{_fmt(None if bw is None else 100 * bw, '.1f')} | {_fmt(r.tflops, '.1f')} | "
                f"{_fmt(None if tf is None else 100 * tf, '.1f')} | {r.ms / best:.2f} |")
    return "\n".join(lines)


def plot_results(rows: list[Row], peaks: dict, path: Path, title: str) -> Path:
    """A bar chart: achieved GB/s (or TFLOP/s) of each implementation, one group per (kernel, shape)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(rows)
    impls = list(dict.fromkeys(r.impl for r in rows))
    use_bw = any(r.gbps is not None for r in rows)
    width = 0.8 / max(len(impls), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(groups) + 2), 4.5))
    for i, impl in enumerate(impls):
        xs, ys = [], []
        for g, group in enumerate(groups.values()):
            for r in group:
                if r.impl == impl:
                    value = r.gbps if use_bw else r.tflops
                    if value is not None:
                        xs.append(g + (i - (len(impls) - 1) / 2) * width)
                        ys.append(value)
        ax.bar(xs, ys, width=width, label=impl)
    peak = peaks.get("copy_GBps") if use_bw else peaks.get("bf16_matmul_TFLOPs")
    if peak:
        ax.axhline(peak, color="black", linestyle="--", linewidth=1,
                   label="measured copy bandwidth" if use_bw else "measured bf16 matmul")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{k}\n{s}\n{d}" for k, s, d in groups], fontsize=6, rotation=90)
    ax.set_ylabel("achieved GB/s (read + write)" if use_bw else "achieved TFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_results(name: str, rows: list[Row], peaks: dict, out_dir) -> list[Path]:
    """Write ``<name>.json``, ``<name>.md`` and ``<name>.png`` under ``out_dir``; return their paths.

    The JSON holds the environment, the measured peaks and every row with its derived figures; the
    Markdown file is the same as a table a person reads; the PNG plots achieved rates against the
    measured ceiling.
    """
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"result name {name!r}: use letters, digits, '_', '.', '-' only")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    records = []
    for r in rows:
        bw, tf = _shares(r, peaks)
        records.append({**asdict(r), "GBps": r.gbps, "TFLOPs": r.tflops,
                        "share_of_copy_bandwidth": bw, "share_of_bf16_matmul": tf})
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps({"name": name, "environment": env, "peaks": peaks, "rows": records},
                                    indent=2) + "\n")

    md_path = out / f"{name}.md"
    md = [
        f"# {name}",
        "",
        f"- GPU: {env['gpu']} ({env['gpu_multiprocessors']} SMs, {env['gpu_memory_GiB']} GiB)",
        f"- versions: torch {env['torch']}, triton {env['triton']}, CUDA {env['cuda']}, Python {env['python']}",
        f"- command: `{env['command']}` (commit {env['git_commit']}), {env['date_utc']}",
        f"- measured peaks: copy {peaks.get('copy_GBps', float('nan')):.0f} GB/s (read + write), "
        f"bf16 matmul {peaks.get('bf16_matmul_TFLOPs', float('nan')):.0f} TFLOP/s",
        "- times: median of `triton.testing.do_bench` (CUDA events, L2 cleared between runs) after warm-up; "
        "GB/s count the least bytes the op must move; `x best` is time over the fastest in its group",
        "",
        markdown_table(rows, peaks),
        "",
    ]
    md_path.write_text("\n".join(md))
    try:
        png_path = plot_results(rows, peaks, out / f"{name}.png", f"{name}: {env['gpu']}")
    except ImportError:  # a GPU machine without matplotlib: plot later with replot(json_path)
        print(f"matplotlib is missing: no {name}.png (run python -m yaie.bench.harness {json_path} to draw it)")
        return [json_path, md_path]
    return [json_path, md_path, png_path]


def load_results(json_path) -> tuple[list[Row], dict, dict]:
    """Read a results JSON back: (rows, peaks, environment)."""
    data = json.loads(Path(json_path).read_text())
    fields = Row.__dataclass_fields__
    rows = [Row(**{k: v for k, v in record.items() if k in fields}) for record in data["rows"]]
    return rows, data["peaks"], data["environment"]


def replot(json_path) -> Path:
    """Draw the PNG of a results JSON beside it (for results made where matplotlib was missing)."""
    json_path = Path(json_path)
    rows, peaks, env = load_results(json_path)
    return plot_results(rows, peaks, json_path.with_suffix(".png"), f"{json_path.stem}: {env['gpu']}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"wrote {replot(arg)}")
