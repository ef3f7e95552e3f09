"""app/widgets: the one registration point, checked against the sections, the files and the docs."""

import re

import pytest

from app import ROOT
from app.protocol import TRANSPORT_FIELDS
from app.sections import SECTIONS
from app.widgets import BY_NAME, MESSAGE_TYPES, WIDGETS

SECTION_NAMES = [n for s in SECTIONS for n in s.widgets]
PROTOCOL = (ROOT / "docs" / "protocol.md").read_text()
WIDGET_DOC = (ROOT / "docs" / "widgets.md").read_text()


def doc_section(text: str, heading: str) -> str:
    """The text under a markdown heading, up to the next heading of the same or higher level."""
    m = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert m, f"no heading {heading!r}"
    level = len(m.group(1))
    rest = text[m.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start() if end else len(rest)]


def test_every_widget_is_a_section_widget_once():
    names = [w.name for w in WIDGETS]
    assert len(names) == len(set(names))
    assert set(names) <= set(SECTION_NAMES)
    assert names == [n for n in SECTION_NAMES if n in BY_NAME], "registered in the walkthrough's order"


def test_message_types_are_unique_and_not_the_transports():
    types = [m.type for w in WIDGETS for m in w.messages]
    assert len(types) == len(set(types))
    assert not set(types) & set(TRANSPORT_FIELDS)
    assert set(MESSAGE_TYPES) == set(types)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_each_widget_has_its_own_files(name):
    module = name.replace("-", "_")
    assert (ROOT / "app" / "widgets" / f"{module}.py").is_file()
    js = (ROOT / "static" / "js" / "widgets" / f"{name}.js").read_text()
    assert re.search(r"export function mount\(root, ctx\)", js), "mount(root, ctx)"
    assert "innerHTML" not in js, "model text goes in with textContent"
    css = re.sub(r"/\*.*?\*/", "", (ROOT / "static" / "css" / "widgets" / f"{name}.css").read_text(), flags=re.S)
    selectors = [s.strip() for block in re.findall(r"(?:^|})\s*([^{}@]+)\{", css) for s in block.split(",")]
    scoped = f'[data-widget="{name}"]'
    assert selectors and all(s.startswith(scoped) for s in selectors if s), "CSS scoped to the widget"
    assert (ROOT / "tests" / "widgets" / f"test_{module}.py").is_file()


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_each_widget_is_documented(name):
    doc = doc_section(PROTOCOL, f"Widget `{name}`")
    for m in BY_NAME[name].messages:
        assert f"`{m.type}`" in doc, f"docs/protocol.md: widget {name} does not describe {m.type}"
        for field in m.fields:
            assert f"`{field}`" in doc or f'"{field}"' in doc, f"docs/protocol.md: {m.type}.{field}"
    section = doc_section(WIDGET_DOC, f"`{name}`")
    assert "| option |" in section and "| figure |" in section


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_documented_figures_are_the_ones_the_widget_shows_and_tests_read(name):
    section = doc_section(WIDGET_DOC, f"`{name}`")
    figures = re.findall(r"^\| `([a-z0-9_]+)` \| (?:live|measured|computed|simulated)", section, re.M)
    assert figures, f"docs/widgets.md lists no figures for {name}"
    js = (ROOT / "static" / "js" / "widgets" / f"{name}.js").read_text()
    tests = "".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for key in figures:
        assert f'"{key}"' in js, f"{name}.js does not show figure {key}"
        assert key in tests, f"no test reads figure {key}"


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_documented_options_are_read_by_the_widget(name):
    section = doc_section(WIDGET_DOC, f"`{name}`")
    options = re.findall(r"^\| `([a-z0-9_]+)` \| (?!live|measured|computed|simulated)", section, re.M)
    js = (ROOT / "static" / "js" / "widgets" / f"{name}.js").read_text()
    for option in options:
        assert re.search(rf"\b{option}: \{{", js), f"{name}.js has no URL option {option}"
