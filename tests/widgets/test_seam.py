"""app/widgets/seam.py: one seam between widgets. No widget module imports another widget module
(read from the source with ast, so a lazy import inside a function counts too), every widget's
engine request goes in through Call.submit, and a message type renamed to snake_case stays
accepted under its old name, answered by the same handler.
"""

import ast

import pytest

from app import ROOT
from app.widgets import ALIASES, MESSAGE_TYPES, WIDGETS
from app.widgets.seam import machine, ms, token_list

WIDGET_DIR = ROOT / "app" / "widgets"
SHARED = {"__init__", "base", "seam"}          # the modules of app/widgets that are not widgets
WIDGET_MODULES = sorted(p.stem for p in WIDGET_DIR.glob("*.py") if p.stem not in SHARED)
RENAMED = {"chunked-prefill": "chunked_prefill", "moe-parallel": "moe_parallel", "tensor-parallel": "tensor_parallel"}


def imported_modules(path) -> set[str]:
    """Every module a file imports, as dotted names relative to app.widgets where it is one of them."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:                               # from .x import y / from . import x
                base = node.module or ""
                names |= {f"app.widgets.{base}"} if base else {f"app.widgets.{a.name}" for a in node.names}
            elif node.level == 0 and node.module:
                names.add(node.module)
                names |= {f"{node.module}.{a.name}" for a in node.names}   # from app.widgets import x
    return names


def test_every_widget_module_defines_a_registered_widget():
    registered = {w.name.replace("-", "_") for w in WIDGETS}
    assert set(WIDGET_MODULES) == registered, "a module in app/widgets is a widget, or one of " + str(SHARED)


@pytest.mark.parametrize("module", WIDGET_MODULES)
def test_a_widget_imports_no_other_widget(module):
    imported = imported_modules(WIDGET_DIR / f"{module}.py")
    others = {f"app.widgets.{m}" for m in WIDGET_MODULES if m != module}
    assert not imported & others, f"{module}.py imports {sorted(imported & others)}: share it through seam.py"
    assert "app.widgets" not in imported, f"{module}.py imports the widget registry"


@pytest.mark.parametrize("module", WIDGET_MODULES)
def test_a_widget_enters_the_engine_only_through_call_submit(module):
    source = (WIDGET_DIR / f"{module}.py").read_text()
    for detour in ("loop.prepare", "loop.enqueue", "loop.submit", "call.generate("):
        assert detour not in source, f"{module}.py: {detour} (a request goes in through call.submit)"


def test_the_shared_modules_import_no_widget():
    for name in SHARED - {"__init__"}:
        imported = imported_modules(WIDGET_DIR / f"{name}.py")
        assert not imported & {f"app.widgets.{m}" for m in WIDGET_MODULES}, name


def test_machine_has_one_schema():
    m = machine()
    assert set(m) == {"threads", "cpu_count", "processor", "system", "torch", "measured_at"}
    assert machine(0.0)["measured_at"] == "1970-01-01 00:00:00 UTC"
    # the pages read the time as measured_at[11:16] and the date as measured_at[:10]
    assert m["measured_at"][4] == "-" and m["measured_at"][13] == ":"


def test_ms_and_token_list(tiny_loaded):
    assert ms(None) is None and ms(0.0012345) == 1.234
    ids = tiny_loaded.tokenizer.encode("hello world")
    assert [t["id"] for t in token_list(tiny_loaded.tokenizer, ids)] == ids


def test_message_types_are_snake_case_and_old_names_are_aliases():
    current = [m.type for w in WIDGETS for m in w.messages if not m.alias_of]
    assert all(t == t.lower() and "-" not in t for t in current), current
    assert ALIASES == RENAMED
    for old, new in RENAMED.items():
        a, m = MESSAGE_TYPES[old], MESSAGE_TYPES[new]
        assert a.canonical == new and m.canonical == new
        assert (a.fields, a.handle, a.job, a.request) == (m.fields, m.handle, m.job, m.request)
        assert any(a in w.messages and m in w.messages for w in WIDGETS)   # both names on one widget


@pytest.mark.parametrize("old,new", sorted(RENAMED.items()))
def test_each_old_name_still_works_and_maps_to_the_new_one(ws, old, new):
    # the hello lists both names as jobs, so an old page still waits for a free job slot
    assert old in ws.hello["job_types"] and new in ws.hello["job_types"]
    # the old name reaches the new type's handler: its checks answer, naming the field
    err = ws.error({"type": old, "id": "bad", "run": -1}, "bad")
    assert err["param"] in ("run", "texts", "layer"), err
    if old == "chunked-prefill":                     # the cheapest of the three: run it both ways
        r_new = ws.job(new, decoders=1, prompt_tokens=32, budget=16)
        r_old = ws.job(old, decoders=1, prompt_tokens=32, budget=16)
        assert r_new["type"] == new and r_old["type"] == old   # each reply carries the type its client sent
        drop = {"id", "type"}
        # one job: the old name is answered from the cache the new name filled
        assert {k: v for k, v in r_old.items() if k not in drop} == {k: v for k, v in r_new.items() if k not in drop}
