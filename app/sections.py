"""The walkthrough's sections: content/sections/*.md, front matter and Markdown (see content/README.md).

SECTIONS: in page order, each file checked and rendered once at import (app/prose.py); a problem is a
ValueError naming the file and the field. section.prose_html(facts) fills in the engine's figures."""
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml
from markupsafe import Markup, escape

from . import ROOT
from .prose import fill, front_matter, render
from .widgets import BY_NAME

CONTENT = ROOT / "content"
FIELDS = {"number": int, "slug": str, "title": str, "widgets": list, "coming": list, "badges": list, "summary": str}
SLUG = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
BADGES = {key: (b["label"], b["meaning"])   # key -> (label, what it means)
          for key, b in yaml.safe_load((CONTENT / "badges.yaml").read_text(encoding="utf-8")).items()}


@dataclass(frozen=True)
class Section:
    number: int
    slug: str                    # the anchor, e.g. "kv-cache"
    title: str
    widgets: tuple[str, ...]     # embed names, in order (none for the last section)
    coming: tuple[str, ...]      # those of them not built yet: a placeholder panel stands in
    badges: tuple[str, ...]      # keys of BADGES its figures use
    summary: str                 # one sentence: what the reader will see in the widget
    prose: tuple[str, ...]       # the body's paragraphs, Markdown as written (whitespace joined)
    html: str                    # the body rendered, placeholders not yet filled
    path: str                    # the file, as messages name it

    def prose_html(self, facts: dict) -> Markup:
        return fill(Markup(self.html), facts, self.path)

    def summary_text(self, facts: dict) -> Markup:
        return fill(escape(self.summary), facts, self.path)


def read(path: Path) -> tuple[Section, list[str]]:
    """One section file, checked on its own: its Section and its links."""
    where = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)   # for messages
    meta, text = front_matter(path.read_text(encoding="utf-8"), where)
    meta = {"coming": [], **meta}           # the one optional field
    for problem in problems(meta, path.name):
        raise ValueError(f"{where}: {problem}")
    html, links = render(text, where)
    paragraphs = tuple(" ".join(p.split()) for p in re.split(r"\n\s*\n", text.strip()))
    meta |= {k: tuple(meta[k]) for k in ("widgets", "coming", "badges")}
    return Section(**meta, prose=paragraphs, html=html, path=where), links


def problems(meta: dict, name: str):
    """What is wrong with a file's front matter, each naming its field."""
    yield from (f"unknown field {f!r} (the fields: {', '.join(FIELDS)})" for f in meta.keys() - FIELDS.keys())
    yield from (f"missing field {f!r}" for f in FIELDS.keys() - meta.keys())
    for field, kind in FIELDS.items():
        v = meta[field]
        if not isinstance(v, kind) or isinstance(v, bool) or kind is list and not all(isinstance(x, str) for x in v):
            yield f"field {field!r} must be {'a list of names' if kind is list else kind.__name__}"
    if not SLUG.fullmatch(meta["slug"]):
        yield f"field 'slug' must be lowercase words joined by '-', not {meta['slug']!r}"
    if name != f"{meta['number']:02d}-{meta['slug']}.md":
        yield f"fields 'number' and 'slug' make the file name {meta['number']:02d}-{meta['slug']}.md"
    yield from (f"field 'widgets': {w!r} is no widget in app/widgets (nor listed in 'coming')"
                for w in meta["widgets"] if w not in BY_NAME and w not in meta["coming"])
    yield from (f"field 'coming': {w!r} is {'built now' if w in BY_NAME else 'not in widgets'}; take it out"
                for w in meta["coming"] if w in BY_NAME or w not in meta["widgets"])
    yield from (f"field 'badges': {b!r} is no badge in content/badges.yaml" for b in meta["badges"] if b not in BADGES)


@cache
def load(folder: Path = CONTENT / "sections") -> tuple[Section, ...]:
    """Every section file in `folder`, checked one by one and together, in page order."""
    sections, links, seen = [], [], {}
    for path in sorted(folder.glob("*.md")):
        s, hrefs = read(path)
        for key in [("number", s.number), ("slug", s.slug), *(("widgets", w) for w in s.widgets)]:
            if key in seen:
                raise ValueError(f"{s.path}: field {key[0]!r}: {key[1]!r} is {seen[key]}'s too")
            seen[key] = s.path
        sections.append(s)
        links += [(s.path, href) for href in hrefs if href.startswith("#")]
    for where, href in (link for link in links if ("slug", link[1][1:]) not in seen):
        raise ValueError(f"{where}: link {href!r}: no section has the slug {href[1:]!r}")
    return tuple(sorted(sections, key=lambda s: s.number))


SECTIONS = load()


def by_widget(name: str) -> Section | None:
    """The section that shows widget `name`, or None if no section embeds it."""
    return next((s for s in SECTIONS if name in s.widgets), None)
