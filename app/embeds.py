"""Embeds: /embed/<name> is one widget alone, sized to its frame, for an author's iframe."""

from flask import Blueprint, abort, render_template

from .sections import by_widget
from .widgets import NAMES, built_widgets

bp = Blueprint("embeds", __name__, url_prefix="/embed")


@bp.get("/<name>")
def embed(name: str):
    if name not in NAMES:
        abort(404, description=f"There is no widget called {name!r}.")
    section = by_widget(name)
    if name not in built_widgets():
        return render_template("coming.html", name=name, section=section), 404
    return render_template("embed.html", name=name, section=section)
