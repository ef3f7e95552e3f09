"""The walkthrough's text as content: content/sections/*.md loaded, checked and rendered.

app/sections.py reads and checks the files (a ValueError names the file and the field), app/prose.py
renders their Markdown with raw HTML off and fills in the engine's figures, escaped.
"""

import pytest
import yaml
from markupsafe import Markup

from app import create_app
from app.facts import facts
from app.prose import PLACEHOLDER, fill, render
from app.sections import CONTENT, FIELDS, SECTIONS, load

ONE = {"number": 1, "slug": "one", "title": "One", "widgets": ["chat"], "badges": ["live"],
       "summary": "A chat with {model_label}."}
TWO = {"number": 2, "slug": "two", "title": "Two", "widgets": ["tokenizer"], "badges": ["computed"],
       "summary": "Tokens."}


def write(folder, fields: dict, text: str = "Some text, see [two](#two).\n\nMore.\n", name: str | None = None):
    name = name or f"{fields['number']:02d}-{fields['slug']}.md"
    (folder / name).write_text("---\n" + yaml.safe_dump(fields, sort_keys=False) + "---\n" + text)
    return folder


def folder_with(tmp_path, one: dict | None = None, **kwargs):
    """A content folder of two good sections, the first replaced by `one` (and written with kwargs)."""
    write(tmp_path, TWO, "The second. Back to [one](#one).\n")
    return write(tmp_path, ONE if one is None else one, **kwargs)


def error(folder) -> str:
    with pytest.raises(ValueError) as info:
        load(folder)
    return str(info.value)


# ---- loading ---------------------------------------------------------------------------------
def test_a_good_folder_loads_in_order(tmp_path):
    sections = load(folder_with(tmp_path))
    assert [(s.number, s.slug, s.widgets, s.badges, s.coming) for s in sections] == [
        (1, "one", ("chat",), ("live",), ()), (2, "two", ("tokenizer",), ("computed",), ())]
    one = sections[0]
    assert one.prose == ("Some text, see [two](#two).", "More.")
    assert one.html == '<p>Some text, see <a href="#two">two</a>.</p>\n<p>More.</p>\n'
    assert one.path.endswith("01-one.md")
    assert load(tmp_path) is sections   # rendered once, then cached


@pytest.mark.parametrize("field", [f for f in FIELDS if f != "coming"])
def test_a_missing_field_is_named(tmp_path, field):
    one = {k: v for k, v in ONE.items() if k != field}
    message = error(folder_with(tmp_path, one, name="01-one.md"))
    assert "01-one.md" in message and f"missing field {field!r}" in message


def test_an_unknown_field_is_named(tmp_path):
    message = error(folder_with(tmp_path, {**ONE, "sumary": "typo"}))
    assert "01-one.md" in message and "unknown field 'sumary'" in message


@pytest.mark.parametrize("field, value", [("number", "1"), ("number", True), ("widgets", "chat"),
                                          ("badges", [1]), ("title", ["One"]), ("summary", None)])
def test_a_field_of_the_wrong_kind_is_named(tmp_path, field, value):
    message = error(folder_with(tmp_path, {**ONE, field: value}, name="01-one.md"))
    assert "01-one.md" in message and f"field {field!r}" in message


@pytest.mark.parametrize("field, two", [("number", {**TWO, "number": 1, "slug": "bis"}),
                                        ("slug", {**TWO, "slug": "one"}),
                                        ("widgets", {**TWO, "widgets": ["chat"]})])
def test_a_duplicate_is_named(tmp_path, field, two):
    write(tmp_path, ONE)
    write(tmp_path, two, "Other text.\n")
    name = f"{two['number']:02d}-{two['slug']}.md"
    message = error(tmp_path)
    assert name in message and f"field {field!r}" in message and "01-one.md" in message


def test_an_unknown_widget_is_named(tmp_path):
    message = error(folder_with(tmp_path, {**ONE, "widgets": ["chat", "nope"]}))
    assert "01-one.md" in message and "field 'widgets'" in message and "'nope'" in message


def test_a_coming_widget_needs_no_registration_until_it_is_built(tmp_path):
    sections = load(folder_with(tmp_path, {**ONE, "widgets": ["chat", "nope"], "coming": ["nope"]}))
    assert sections[0].widgets == ("chat", "nope") and sections[0].coming == ("nope",)


@pytest.mark.parametrize("coming", [["chat"], ["elsewhere"]])
def test_coming_lists_only_unbuilt_widgets_of_the_section(tmp_path, coming):
    message = error(folder_with(tmp_path, {**ONE, "coming": coming}))
    assert "01-one.md" in message and "field 'coming'" in message and repr(coming[0]) in message


def test_an_unknown_badge_is_named(tmp_path):
    message = error(folder_with(tmp_path, {**ONE, "badges": ["live", "guessed"]}))
    assert "01-one.md" in message and "field 'badges'" in message and "'guessed'" in message


def test_a_bad_slug_is_named(tmp_path):
    message = error(folder_with(tmp_path, {**ONE, "slug": "One Two"}, name="01-one.md"))
    assert "01-one.md" in message and "field 'slug'" in message


def test_the_file_name_follows_number_and_slug(tmp_path):
    message = error(folder_with(tmp_path, name="1-one.md"))
    assert "1-one.md" in message and "'number'" in message and "'slug'" in message and "01-one.md" in message


@pytest.mark.parametrize("text, words", [
    ("Just text, no front matter.\n", "no front matter"),
    ("---\n- a\n- list\n---\nText.\n", "no front matter"),
    ("---\nnumber: [1\n---\nText.\n", "not YAML"),
    ("---\n" + yaml.safe_dump(ONE) + "---\n\n", "no text"),
])
def test_a_malformed_file_is_named(tmp_path, text, words):
    (tmp_path / "01-one.md").write_text(text)
    message = error(tmp_path)
    assert "01-one.md" in message and words in message


def test_a_link_to_no_section_is_named(tmp_path):
    message = error(folder_with(tmp_path, text="See [three](#three).\n"))
    assert "01-one.md" in message and "'#three'" in message


# ---- rendering: Markdown with raw HTML off, links only within this site -----------------------
def test_raw_html_in_a_file_is_escaped(tmp_path):
    text = '<script>alert("x")</script>\n\nA <b onclick="steal()">bold</b> & <img src=x onerror=alert(1)> move.\n'
    html = load(folder_with(tmp_path, text=text))[0].html
    assert "<script" not in html and "<b" not in html and "<img" not in html
    assert "&lt;script&gt;" in html and "&lt;b onclick=&quot;steal()&quot;&gt;" in html and "&amp;" in html


def test_html_is_escaped_inside_and_around_links():
    html, links = render('<i>[<img src=x onerror=alert(1)>](#chat)</i>', "t.md")
    assert "<img" not in html and "<i>" not in html
    assert '<a href="#chat">&lt;img src=x onerror=alert(1)&gt;</a>' in html and links == ["#chat"]


def test_links_to_sections_and_pages_of_this_site():
    html, links = render("See [the KV cache](#kv-cache), [tokens](#tokenizer) and [the benchmark](/benchmark).", "t.md")
    assert html == ('<p>See <a href="#kv-cache">the KV cache</a>, <a href="#tokenizer">tokens</a> and '
                    '<a href="/benchmark">the benchmark</a>.</p>\n')
    assert links == ["#kv-cache", "#tokenizer", "/benchmark"]


@pytest.mark.parametrize("text", [
    "[x](javascript:alert(1))",
    "[x](#UPPER)",
    "[x](http://example.com)",
    "[x](//example.com)",
    "[x](//evil)",
    "[x](/Upper)",
    "<http://example.com>",
    "![x](http://example.com/a.png)",
])
def test_a_link_off_this_site_is_refused(text):
    with pytest.raises(ValueError) as info:
        render(text, "t.md")
    assert str(info.value).startswith("t.md: link ")


@pytest.mark.parametrize("text", ['[x](#a" onmouseover="alert(1))', '[x](/a" onclick="alert(1))'])
def test_a_quote_never_leaves_an_attribute(text):
    html, links = render(text, "t.md")
    assert "<a " not in html and links == []
    assert '"' not in html.replace("&quot;", "")


def test_a_placeholder_changed_by_markdown_is_refused():
    with pytest.raises(ValueError, match=r"t\.md: a \{placeholder\}"):
        render("The {kv\\_bytes} figure.", "t.md")


# ---- the engine's figures ----------------------------------------------------------------------
def test_figures_are_formatted_and_escaped():
    out = fill(Markup("<p>{model_label} has {n:,} and {x:.1f}; {not a placeholder}</p>"),
               {"model_label": "<b>&</b>", "n": 1234567, "x": 3.14159}, "t.md")
    assert isinstance(out, Markup)
    assert out == "<p>&lt;b&gt;&amp;&lt;/b&gt; has 1,234,567 and 3.1; {not a placeholder}</p>"


def test_an_unknown_figure_or_format_is_named():
    with pytest.raises(ValueError, match=r"t\.md: unknown fact \{nope\}"):
        fill(Markup("{nope}"), {}, "t.md")
    with pytest.raises(ValueError, match=r"t\.md: \{n:q\}"):
        fill(Markup("{n:q}"), {"n": 1}, "t.md")


@pytest.fixture(scope="module")
def model_facts(tiny_loaded):
    app = create_app({"model": "tiny", "num_kv_blocks": 8, "testing": True}, loaded=tiny_loaded)
    yield facts(app.extensions["sendlens"].facts())
    app.extensions["sendlens"].shutdown()


def test_the_content_folder_is_the_walkthrough():
    assert SECTIONS == load(CONTENT / "sections") and len(SECTIONS) == 23
    assert (CONTENT / "README.md").is_file()


@pytest.mark.parametrize("section", SECTIONS, ids=lambda s: s.slug)
def test_every_section_renders_with_the_running_models_figures(section, model_facts):
    prose, summary = section.prose_html(model_facts), section.summary_text(model_facts)
    assert prose.count("<p>") >= len(section.prose) >= 1
    for text, source in ((prose, section.html), (summary, section.summary)):
        assert not PLACEHOLDER.search(text), section.path
        for name, spec in PLACEHOLDER.findall(source):   # each figure is in, as its format writes it
            assert format(model_facts[name], spec) in text.unescape(), (section.path, name)
