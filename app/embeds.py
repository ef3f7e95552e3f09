"""Embeds: /embed/<name> is one widget alone, sized to its frame, for an author's iframe.

The query string carries the widget's options (/embed/attention?text=The+cat&layer=3); the
widget's ES module reads them (see docs/widgets.md)."""

from flask import Blueprint, abort, render_template

from .runtime import get_runtime
from .sections import by_widget
from .widgets import BY_NAME

bp = Blueprint("embeds", __name__, url_prefix="/embed")


@bp.get("/<name>")
def embed(name: str):
    section = by_widget(name)
    if section is None:
        abort(404, description=f"There is no widget called {name!r}.")
    if name not in BY_NAME:
        return render_template("coming.html", name=name, section=section), 404
    return render_template("embed.html", name=name, section=section, info=get_runtime().facts())
