"""The engine's layers, read from the code: every import of ``yaie`` (imports inside functions included) runs
downward, and none runs in a circle.

Layers, bottom to top: the lesson modules and the switch; ``ops``; ``model/`` (forward passes, per-sequence
state); the engine's parts (scheduler, runners, core, sampling, output processing); the front of the engine
(``LLM``, the server's engine loop and process); the server, the CLIs and the benchmarks. A module may import
its own layer or any below it. Also checked: no private name (``_x``) is imported from another module.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("yaie", "solutions")

FRONT = {"yaie.engine.llm", "yaie.engine.async_engine", "yaie.engine.serving", "yaie.engine.process_engine"}
TOP = ("yaie.server", "yaie.cli", "yaie.engine.cli", "yaie.bench", "yaie.grade", "yaie.notebook", "yaie.tools")
LAYERS = ("lessons and the switch", "ops", "model", "engine parts", "engine front", "server, CLIs, benchmarks")


def layer(module: str) -> int:
    """The layer of a module of this repository (an index into ``LAYERS``)."""
    if module.startswith(TOP) or module in ("yaie", "yaie.engine"):   # packages re-export what is above them
        return 5
    if module in FRONT:
        return 4
    if module.startswith("yaie.engine"):
        return 3
    if module.startswith("yaie.model"):
        return 2
    if module.startswith("yaie.ops") and module != "yaie.ops.lessons":
        return 1
    return 0              # yaie.kernels, solutions, yaie.switch, yaie.device, yaie.ops.lessons (the switch's door)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports(path: Path, known: dict) -> list[tuple[str, list[str], int]]:
    """``(imported module, names taken from it, line)`` for every import of a known module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names if alias.name in known]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in known:
                    found.append((sub, [], node.lineno))
                elif node.module in known:
                    found.append((node.module, [alias.name], node.lineno))
    return found


def graph() -> dict[str, list[tuple[str, list[str], int]]]:
    known = modules()
    return {name: imports(path, known) for name, path in known.items()}


def test_every_import_runs_downward():
    upward = [f"{source} (layer '{LAYERS[layer(source)]}') imports {target} (layer '{LAYERS[layer(target)]}'), "
              f"line {line}"
              for source, edges in graph().items() for target, _, line in edges if layer(target) > layer(source)]
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def test_model_imports_nothing_from_the_engine():
    wrong = [f"{source} line {line}: {target}" for source, edges in graph().items() if source.startswith("yaie.model")
             for target, _, line in edges if target.startswith(("yaie.engine", "yaie.server"))]
    assert not wrong, "model/ imports the engine:\n" + "\n".join(wrong)


def test_no_import_cycles():
    edges = {source: {target for target, _, _ in found if target != source} for source, found in graph().items()}
    # Packages' __init__ re-export their submodules: an edge into a package from inside it is not a circle.
    edges = {s: {t for t in targets if not s.startswith(t + ".")} for s, targets in edges.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(edges.get(node, ())):
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_names_across_modules():
    wrong = [f"{source} line {line}: {name} from {target}" for source, found in graph().items()
             for target, names, line in found for name in names if name.startswith("_")]
    assert not wrong, "private names imported from another module:\n" + "\n".join(wrong)


def test_the_checks_catch_what_they_look_for(tmp_path):
    """The analysis sees an upward import made inside a function, and a private name taken."""
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from yaie.engine.core import _hidden\n    import yaie.server.app\n")
    found = imports(source, {"yaie.engine.core": None, "yaie.server.app": None})
    assert ("yaie.engine.core", ["_hidden"], 2) in found and ("yaie.server.app", [], 3) in found
    assert layer("yaie.server.app") > layer("yaie.engine.core") > layer("yaie.model.llama") > layer("yaie.ops.kv") \
        > layer("yaie.kernels.based")


def test_one_request_walks_through_at_most_700_lines_of_function_bodies():
    """docs/engine.md's walk-through (scripts/request_path.py): every function it names exists, and the bodies
    on the simplest path (CPU, greedy, Llama) add up to at most its budget."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("request_path", ROOT / "scripts" / "request_path.py")
    request_path = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(request_path)
    rows = request_path.walk()
    total = sum(lines for *_, lines in rows)
    assert all(lines > 0 for *_, lines in rows), [r for r in rows if not r[3]]
    assert total <= request_path.BUDGET, f"{total} lines of function bodies on the simplest path"
