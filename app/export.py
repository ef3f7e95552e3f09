"""`python -m app.export --out DIR`: the walkthrough and every widget's embed as static files,
whose widgets play recordings made on this machine's engine (docs/export.md).

DIR gets index.html, embed/<name>/index.html for every widget, static/ (the ES modules, the CSS,
the data files), vendor/plotly.min.js (from the installed plotly package, as app/assets.py
serves it) and recordings/ (each widget's default options and the presets docs/widgets.md names
under "Recorded for the export"). Every URL is relative, so any static host serves DIR
(`python -m http.server -d DIR`). --server URL names a live server for "Run it live" (a page's
?server= wins); that server's allowed_origins decide whether the page may use it.

The recorder (app/recordings/recorder.py) starts this project's server on a free loopback port
with the model and settings given, and drives each widget's page in Chromium; it fetches nothing
from the network and prints its progress to stderr.
"""

import argparse
import re
import shutil
import sys
import time
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from core.errors import InvalidParameter

from .loopback import serve
from .recordings import meta, store
from .recordings.recorder import record

ROOT = Path(__file__).resolve().parent.parent
WIDGET_DOCS = ROOT / "docs" / "widgets.md"
PRESETS_LINE = re.compile(r"^Recorded for the export:(.*)$", re.M)


def presets(name: str, docs: str | None = None) -> list[dict]:
    """The presets docs/widgets.md names for `name`: its section's line "Recorded for the export:
    `?option=value&...`, ..." as option dicts."""
    docs = WIDGET_DOCS.read_text() if docs is None else docs
    m = re.search(rf"^## `{re.escape(name)}`\n(.*?)(?=^## |\Z)", docs, re.M | re.S)
    if not m:
        return []
    line = PRESETS_LINE.search(m.group(1))
    return [dict(parse_qsl(q.lstrip("?"), keep_blank_values=True))
            for q in re.findall(r"`([^`]+)`", line.group(1))] if line else []


def jobs_for(names: list[str]) -> list[tuple[str, dict]]:
    return [(name, options) for name in names for options in [{}] + presets(name)]


def check_server(server: str | None) -> str | None:
    if server is None:
        return None
    parts = urlsplit(server)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InvalidParameter("server", f"must be an http:// or https:// URL, got {server!r}")
    return server.rstrip("/")


def relative(html: str, prefix: str) -> str:
    """The page's site-absolute URLs (/static/..., /vendor/...) made relative to it."""
    return re.sub(r'(href|src)="/(static|vendor)/', rf'\1="{prefix}\2/', html)


def write_pages(app, out: Path, names: list[str], server: str | None) -> None:
    from flask import render_template

    from .sections import SECTIONS, by_widget
    runtime = app.extensions["sendlens"]
    origin = server or ""
    with app.test_request_context("/"):
        for path, prefix, render in [
            (out / "index.html", "", lambda src: render_template(
                "index.html", sections=SECTIONS, info=runtime.facts(), origin=origin, source=src, export=True)),
            *[(out / "embed" / name / "index.html", "../../", lambda src, name=name: render_template(
                "embed.html", name=name, section=by_widget(name), info=runtime.facts(), source=src, export=True))
              for name in names],
        ]:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(relative(render(meta.export_source(f"{prefix}recordings/", server)), prefix))


def write_assets(out: Path) -> None:
    from .assets import plotly_path
    shutil.copytree(ROOT / "static", out / "static", dirs_exist_ok=True)
    (out / "vendor").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(plotly_path(), out / "vendor" / "plotly.min.js")


def write_recordings(out: Path, recordings: list[dict]) -> None:
    folder = out / "recordings"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    entries, seen = [], {}
    for r in recordings:
        n = seen[r["widget"]] = seen.get(r["widget"], -1) + 1
        name = store.file_name(r["widget"], n)
        store.write(folder, name, r)
        entries.append({"widget": r["widget"], "options": r["options"], "file": name})
    store.write_index(folder, entries)


def export(out: Path, *, app, base: str, names: list[str] | None = None, server: str | None = None,
           log=sys.stderr, browser=None) -> list[dict]:
    """Record `names` (default: every widget) from the running server `base` (serving `app`), in
    `browser` (None: a Chromium started for it), and write the export to `out`. Returns the
    recordings."""
    from .widgets import BY_NAME
    names = list(BY_NAME) if names is None else names
    for name in names:
        if name not in BY_NAME:
            raise InvalidParameter("widgets", f"there is no widget called {name!r}")
    server = check_server(server)
    out = Path(out)
    recordings = record(base, jobs_for(names), log=log, browser=browser)
    write_recordings(out, recordings)
    write_pages(app, out, list(BY_NAME), server)
    write_assets(out)
    return recordings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the folder to write (made if missing)")
    parser.add_argument("--server", default=None, help="a live server's URL for \"Run it live\"")
    parser.add_argument("--model", default=None, help="the model to record with (default: the server's)")
    parser.add_argument("--widgets", default=None, help="comma-separated widget names to record (default: all; "
                        "the other widgets' pages are written too, and say the export holds no recording of them)")
    parser.add_argument("--setting", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="a server setting for the recording server, as python -m app takes it")
    args = parser.parse_args(argv)

    from . import create_app
    from .config import parse_setting
    from .widgets import BY_NAME
    check_server(args.server)                    # refused before the engine starts, not after
    names = args.widgets.split(",") if args.widgets else None
    for name in names or []:
        if name not in BY_NAME:
            raise InvalidParameter("widgets", f"there is no widget called {name!r}")
    values = {name: parse_setting(name, text) for name, text in args.setting}
    if args.model:
        values["model"] = args.model
    started = time.monotonic()
    print("starting the engine …", file=sys.stderr, flush=True)
    app = create_app(values)
    base, _, _, stop = serve(app, name="export-server")
    try:
        recordings = export(args.out, app=app, base=base, names=names, server=args.server)
    finally:
        stop()
        app.extensions["sendlens"].shutdown()
    print(f"wrote {args.out} ({len(recordings)} recordings) in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
