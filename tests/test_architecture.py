"""The house as a stack: the import graph of core/ and app/, read from the source with ast.

- no import cycle among core's modules, and none among its packages (engine -> model -> kernels);
- LLMEngine.step() stays at most 12 lines (schedule -> run -> postprocess -> record);
- core/kernels imports nothing from core (a leaf);
- core imports nothing from app (nor from toy_models, which provides models through entry points);
- no widget module imports another widget module (only shared seams).
"""

import ast
import inspect
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WIDGET_SEAMS = {"app.widgets", "app.widgets.base", "app.widgets.seam"}   # what any widget may import from app/widgets


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(*packages: str) -> dict[str, Path]:
    return {module_name(p): p for pkg in packages for p in sorted((ROOT / pkg).rglob("*.py"))}


KNOWN = modules("core", "app", "bench", "toy_models")


def imported(name: str, path: Path) -> set[str]:
    """The modules `name` imports anywhere in its source (inside functions too): for
    `from X import y`, X.y where that is a module, else X."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = {f"{base}.{alias.name}" for alias in node.names} & KNOWN.keys()
            out.update(subs or {base})
    return out


def graph(prefix: str) -> dict[str, set[str]]:
    """Edges between the known modules whose names start with `prefix`."""
    inside = {n: p for n, p in KNOWN.items() if n == prefix or n.startswith(prefix + ".")}
    return {n: {m for m in imported(n, p) if m in inside and m != n} for n, p in inside.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph (its nodes in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n):
        state[n] = 1
        path.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        path.pop()
        return None

    for n in sorted(edges):
        if n not in state and (found := visit(n)):
            return found
    return None


def layer(module: str) -> str:
    """core.engine.scheduler -> core.engine.llm_engine; a top-level module (core.config) is its own layer."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_graph_sees_imports():
    # the scanner itself: if it read nothing, every test below would pass vacuously
    core = graph("core")
    assert "core.model.model_runner" in core["core.engine.llm_engine"]
    assert "core.kernels.loader" in core["core.model.linear"]
    assert "core.inspect.probes" in imported("app.widgets.attention", KNOWN["app.widgets.attention"])


def test_no_import_cycle_in_core():
    cycle = find_cycle(graph("core"))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_packages_form_a_stack():
    edges: dict[str, set[str]] = {}
    for n, targets in graph("core").items():
        if n == "core":      # the package's __init__ re-exports the public API from the top
            continue
        edges.setdefault(layer(n), set()).update(layer(m) for m in targets if layer(m) != layer(n))
    cycle = find_cycle(edges)
    assert cycle is None, "packages import each other: " + " -> ".join(cycle)


def test_kernels_is_a_leaf():
    for name, path in KNOWN.items():
        if name.startswith("core.kernels"):
            outside = {m for m in imported(name, path)
                       if m.split(".")[0] == "core" and not m.startswith("core.kernels")}
            assert not outside, f"{name} imports {sorted(outside)} from core"


def test_the_engine_step_reads_as_its_four_stages():
    # schedule -> run -> postprocess -> record, each done elsewhere: the step itself stays short
    from core.engine.llm_engine import LLMEngine
    lines = inspect.getsource(LLMEngine.step).strip().splitlines()
    assert len(lines) <= 12, f"LLMEngine.step is {len(lines)} lines"


def test_core_imports_nothing_from_app():
    for name, path in KNOWN.items():
        if name.split(".")[0] == "core":
            above = {m for m in imported(name, path) if m.split(".")[0] in ("app", "bench", "toy_models")}
            assert not above, f"{name} imports {sorted(above)}"


def test_no_widget_imports_another_widget():
    widgets = {n for n in KNOWN if n.startswith("app.widgets.") and n not in WIDGET_SEAMS}
    found = sorted(f"{n} -> {m}" for n in widgets for m in imported(n, KNOWN[n]) if m in widgets and m != n)
    assert not found, "widgets importing widgets: " + ", ".join(found)
