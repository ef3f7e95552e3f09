"""Which widgets exist: an embed name from the walkthrough whose ES module is in static/js/widgets."""

from pathlib import Path

from flask import current_app

from .sections import SECTIONS

NAMES = tuple(name for s in SECTIONS for name in s.widgets)  # the embed contract of OUTLINE.md


def built_widgets() -> frozenset[str]:
    return current_app.extensions["sendlens_widgets"]


def find_built(static_folder) -> frozenset[str]:
    folder = Path(static_folder) / "js" / "widgets"
    return frozenset(n for n in NAMES if (folder / f"{n}.js").is_file())
