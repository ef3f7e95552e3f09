"""A content file: YAML front matter, then Markdown, safe by construction, with the engine's figures.

front_matter() splits the file. render() uses markdown-it-py (CommonMark) with raw HTML off, so HTML
written in a file shows as text; a link may go to a section of the page (#slug) or a page of this
site (/path), nowhere else. The figures are placeholders, {name} or {name:format} (a key of
app.facts.facts() and Python's format spec), kept by render() and filled in by fill() on each
request, every value escaped: the Markdown is rendered once, the figures are the model's.
"""
import re

import yaml
from markdown_it import MarkdownIt
from markupsafe import Markup, escape

LINK = re.compile(r"#[a-z0-9]+(-[a-z0-9]+)*|/(?!/)[a-z0-9/-]*")
PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*)(?::([^{}<>]*))?\}")
MARKDOWN = MarkdownIt("commonmark", {"html": False})
MARKDOWN.validateLink = lambda url: True    # every link becomes a token, so render() can refuse it


def fill(text: Markup, facts: dict, where: str) -> Markup:
    """`text` with each {name} or {name:format} replaced by that fact, formatted and escaped."""
    def one(m: re.Match) -> str:
        if m[1] not in facts:
            raise ValueError(f"{where}: unknown fact {{{m[1]}}} (the facts are app.facts.facts()'s keys)")
        try:
            return str(escape(format(facts[m[1]], m[2] or "")))
        except ValueError as e:
            raise ValueError(f"{where}: {m[0]}: {e}") from None
    return Markup(PLACEHOLDER.sub(one, text))


def render(body: str, where: str) -> tuple[str, list[str]]:
    """The Markdown body as HTML (placeholders kept), and its links; ValueError for a link off the site."""
    tokens = MARKDOWN.parse(body)
    links = [t.attrGet("href") or t.attrGet("src") or "" for block in tokens for t in block.children or []
             if t.type in ("link_open", "image")]
    for url in links:
        if not LINK.fullmatch(url):
            raise ValueError(f"{where}: link {url!r}: a link goes to a section (#slug) or a page of this site (/path)")
    html = MARKDOWN.renderer.render(tokens, MARKDOWN.options, {})
    if PLACEHOLDER.findall(body) != PLACEHOLDER.findall(html):
        raise ValueError(f"{where}: a {{placeholder}} was changed by Markdown; put it in plain text")
    return html, links


def front_matter(text: str, where: str) -> tuple[dict, str]:
    """The fields of a file's YAML front matter (between two --- lines at its top), and the text after."""
    m = re.fullmatch(r"---\n(.*?)\n---\n(.*)", text, re.S)
    try:
        meta = yaml.safe_load(m[1]) if m else None
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: the front matter is not YAML: {e}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{where}: no front matter (a --- line, the fields in YAML, a --- line, then the text)")
    if not m[2].strip():
        raise ValueError(f"{where}: no text after the front matter")
    return meta, m[2]
