"""Pages: the walkthrough at / and the health check."""

from flask import Blueprint, jsonify, render_template, request

from .runtime import get_runtime
from .sections import SECTIONS
from .widgets import built_widgets

bp = Blueprint("pages", __name__)


@bp.get("/")
def index():
    runtime = get_runtime()
    return render_template("index.html", sections=SECTIONS, built=built_widgets(),
                           info=runtime.model_info(), origin=request.host_url.rstrip("/"))


@bp.get("/healthz")
def healthz():
    runtime = get_runtime()
    engine = runtime.engine
    kv = engine.kv_stats()
    return jsonify({
        "status": "ok" if runtime.loop.alive else "engine_stopped",
        "model": runtime.config.model,
        "kv": {"total_blocks": kv["total_blocks"], "free_blocks": kv["free_blocks"],
               "cached_blocks": kv["cached_blocks"], "block_size": kv["block_size"]},
        "running": len(engine.scheduler.running),
        "waiting": len(engine.scheduler.waiting),
        "connections": runtime.num_connections,
        "steps": engine.num_steps,
    }), 200 if runtime.loop.alive else 503
