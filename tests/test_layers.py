"""The package's layers: the internal import graph (imports inside functions included) has no
cycle and no import that runs upward (DESIGN: errors/tree/verify/search < model < target < nn <
drafters < engine < train/bench/server/chat < cli)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "specdraft"

# module (or package prefix) -> layer; the longest matching prefix wins
LAYERS = {
    "specdraft.errors": 0, "specdraft.paths": 0, "specdraft.tree": 0, "specdraft.verify": 0, "specdraft.search": 0,
    "specdraft.model": 1,
    "specdraft.target": 2,
    "specdraft.nn": 3,
    "specdraft.drafters": 4,
    "specdraft.generate": 5, "specdraft.engine": 5, "specdraft.batch": 5, "specdraft.replay": 5,
    "specdraft.datasets": 5,
    "specdraft.train": 6, "specdraft.bench": 6, "specdraft.server": 6, "specdraft.export": 6, "specdraft.chat": 6,
    "specdraft.cli": 7,
    "specdraft": 8,  # the package's own __init__: the public API, on top of everything
}
# users of the engine may use each other only this way (bench reads training data and prompts)
SIBLINGS = {("specdraft.bench", "specdraft.train")}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> tuple[int, str]:
    """(layer, the LAYERS key it falls under)."""
    for key in sorted(LAYERS, key=len, reverse=True):
        if module == key or module.startswith(key + "."):
            return LAYERS[key], key
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def imports(path: Path, source: str | None = None) -> list[tuple[str, int]]:
    """Every internal module ``path`` (or ``source``, as if it were that file) imports, anywhere in
    the file, with its line."""
    mod = module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base == "specdraft" or base.startswith("specdraft."):
                # `from specdraft.x import y` may import the submodule y
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    out.append((full if (ROOT.parent / (full.replace(".", "/") + ".py")).is_file()
                                or (ROOT.parent / full.replace(".", "/")).is_dir() else base, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "specdraft"]
    return out


def graph() -> dict[str, list[tuple[str, int]]]:
    return {module_name(p): imports(p) for p in sorted(ROOT.rglob("*.py"))}


def graph_modules() -> set[str]:
    return {module_name(p) for p in ROOT.rglob("*.py")}


def test_every_module_has_a_layer():
    for mod in graph():
        layer_of(mod)


def test_no_import_runs_upward_or_sideways():
    bad = []
    for mod, deps in graph().items():
        lm, km = layer_of(mod)
        for dep, line in deps:
            ld, kd = layer_of(dep)
            if ld > lm or (ld == lm and lm == 6 and km != kd and (km, kd) not in SIBLINGS):
                bad.append(f"{mod}:{line} imports {dep} (layer {ld}, {kd}) from layer {lm} ({km})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle():
    g = {m: sorted({d for d, _ in deps if d in graph_modules()}) for m, deps in graph().items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in g.get(m, []):
            if state.get(d) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in g:
        if m not in state:
            visit(m)


def test_the_checker_sees_function_level_and_relative_imports():
    """The graph must include imports inside functions (they hid the old cycles), and an upward one fails."""
    f = ROOT / "drafters" / "ngram.py"
    src = f.read_text() + "\n\ndef _probe():\n    from specdraft.bench.runner import run_bench\n    from ..chat import run_chat\n"
    found = [d for d, _ in imports(f, src)]
    assert "specdraft.bench.runner" in found and "specdraft.chat" in found
    assert layer_of("specdraft.bench.runner")[0] > layer_of(module_name(f))[0]
