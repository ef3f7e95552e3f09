"""Recording files: writing one (checked first), reading one, and serving a folder of them.

A folder holds `<widget>.json` (the widget's default options), `<widget>--<n>.json` (its
presets, n from 1) and `index.json`, which lists every file with its widget and options. The live
server serves `<recordings_dir>/<widget>.json` at /recordings/<widget>.json: a plain file read,
so it answers while the engine is busy (an embed's fallback, static/js/source.js).
"""

import json
from pathlib import Path

from flask import Blueprint, Flask, abort, current_app, send_file

from .schema import validate

bp = Blueprint("recordings", __name__, url_prefix="/recordings")


def file_name(widget: str, n: int) -> str:
    """The file of the widget's default options (n=0) or of its n-th preset."""
    return f"{widget}.json" if n == 0 else f"{widget}--{n}.json"


def write(folder: Path, name: str, recording: dict) -> Path:
    validate(recording)
    path = folder / name
    path.write_text(json.dumps(recording, ensure_ascii=False, separators=(",", ":")) + "\n")
    return path


def read(path: Path) -> dict:
    return validate(json.loads(Path(path).read_text()))


def write_index(folder: Path, entries: list[dict]) -> Path:
    """entries: {widget, options, file} in recording order."""
    path = folder / "index.json"
    path.write_text(json.dumps({"format": "sendlens-recordings/1", "recordings": entries}, indent=1) + "\n")
    return path


@bp.get("/<name>.json")
def served(name: str):
    from ..widgets import BY_NAME
    folder = current_app.config["SENDLENS"].recordings_dir
    if not folder or name not in BY_NAME:
        abort(404)
    path = Path(folder) / file_name(name, 0)
    if not path.is_file():
        abort(404)
    resp = send_file(path.resolve(), mimetype="application/json", max_age=300)
    return resp


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)
