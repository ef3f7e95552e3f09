"""sendlens' web app: the walkthrough, embeddable widgets and the live websocket.

    app = create_app({"model": "tiny"})   # or a ServerConfig

Flask's application-factory pattern: the factory builds the config, starts the one engine
(runtime.init_app) and registers the blueprints: pages (/ and /healthz), embeds (/embed/<name>),
live (/ws), assets (/vendor/...), benchmark (/benchmark), recordings (/recordings/...) and the classroom rooms (/room/...); text responses go out gzipped
(compress).
"""

from pathlib import Path

from flask import Flask

from .config import ServerConfig

ROOT = Path(__file__).resolve().parent.parent


def create_app(config: ServerConfig | dict | None = None, loaded=None) -> Flask:
    """loaded: an already loaded model (toy_models.load_model) to share, e.g. between tests."""
    cfg = config if isinstance(config, ServerConfig) else ServerConfig.from_mapping(config or {})
    app = Flask(__name__, template_folder=str(ROOT / "templates"), static_folder=str(ROOT / "static"))
    app.config["SENDLENS"] = cfg
    app.config["TESTING"] = cfg.testing
    # The websocket library closes a connection outright above this size; smaller excess is
    # answered with a protocol error (max_message_bytes) and the connection stays open. Pings
    # come from our own writer thread (live.py): the library's would race our frames.
    app.config["SOCK_SERVER_OPTIONS"] = {"ping_interval": None, "max_message_size": 16 * cfg.max_message_bytes}

    from . import assets, benchmark, compress, embeds, live, pages, rooms, runtime, security

    rt = runtime.init_app(app, loaded)
    rooms.init_app(app, cfg, rt)
    security.init_app(app, cfg)
    compress.init_app(app)
    app.register_blueprint(pages.bp)
    app.register_blueprint(embeds.bp)
    app.register_blueprint(live.bp)
    app.register_blueprint(assets.bp)
    app.register_blueprint(benchmark.bp)
    live.sock.init_app(app)
    from .recordings import meta, store
    store.init_app(app)

    from .facts import facts
    from .sections import BADGES
    from .widgets import BY_NAME

    source = lambda: meta.page_source(cfg.model, cfg.engine.num_threads,  # noqa: E731
                                      "/recordings/" if cfg.recordings_dir else None)
    app.context_processor(lambda: {"badges": BADGES, "built": BY_NAME, "source": source(),
                                   "facts": facts(app.extensions["sendlens"].facts())})
    return app

