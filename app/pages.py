"""Pages: the walkthrough at /, the site's icon and the health check."""

from flask import Blueprint, current_app, jsonify, render_template, request

from .runtime import get_runtime
from .sections import SECTIONS

bp = Blueprint("pages", __name__)


@bp.get("/")
def index():
    runtime = get_runtime()
    return render_template("index.html", sections=SECTIONS, info=runtime.facts(),
                           origin=request.host_url.rstrip("/"))


@bp.get("/favicon.ico")
def favicon():
    """The site's icon (static/favicon.svg; the pages link it): browsers also ask for /favicon.ico
    by themselves, for a page with no link such as /healthz's JSON, and log a 404 as a page error."""
    return current_app.send_static_file("favicon.svg")


@bp.get("/healthz")
def healthz():
    runtime = get_runtime()
    stats = runtime.loop.stats()
    kv = stats["kv"]
    alive = runtime.loop.alive
    return jsonify({
        "status": "ok" if alive else "engine_stopped",
        "model": runtime.config.model,
        "replica": runtime.config.replica_id,
        "kv": {"total_blocks": kv["total_blocks"], "free_blocks": kv["free_blocks"],
               "cached_blocks": kv["cached_blocks"], "block_size": kv["block_size"]},
        "running": stats["running"],
        "waiting": stats["waiting"],
        "connections": runtime.num_connections,
        "steps": stats["steps"],
        "jobs": runtime.jobs.stats(),
        "process": process_stats(),
    }), 200 if alive else 503


def process_stats() -> dict:
    """This server process's memory and threads (for load tests: both must come back down)."""
    import os
    import threading
    rss = None
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    return {"rss_bytes": rss, "threads": threading.active_count()}
