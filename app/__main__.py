"""python -m app [--host 127.0.0.1] [--port 8000] [--model smollm2-135m] [--setting NAME VALUE ...]

Serves sendlens with gunicorn: one worker process owns the one engine (so every reader's request
is batched into it), and a thread per connection serves the websockets (gunicorn's gthread
worker, which flask-sock supports). On SIGTERM the worker stops taking connections, ends every
request in flight with `abort`, closes the websockets, stops the engine and exits. `--debug` runs
werkzeug's development server instead. Settings come from `--setting`, then SENDLENS_<NAME>
environment variables, then their defaults (docs/settings.md).
"""

import argparse
import gc
import logging
import signal

from .config import ServerConfig, from_environment, parse_setting

GRACEFUL_TIMEOUT_S = 20   # after SIGTERM, the most a worker waits for its connections to end


def build_config(args) -> ServerConfig:
    values = {"model": args.model, **from_environment()}
    for name, text in args.setting:
        values[name] = parse_setting(name, text)
    return ServerConfig.from_mapping(values)


def freeze_startup_objects() -> None:
    """Once the app is loaded: every object alive now (the model's modules, the tokenizer, the
    libraries) lives as long as the process, so it leaves the garbage collector's passes
    (gc.freeze, as vLLM does after start-up). A full pass over them all would be a stall landing
    on whichever engine step the collector chose (the README's benchmark notes say how long)."""
    gc.collect()
    gc.freeze()


def serve_gunicorn(config: ServerConfig, host: str, port: int) -> None:
    from gunicorn.app.base import BaseApplication

    from . import create_app

    def post_worker_init(worker):
        freeze_startup_objects()
        # gunicorn's SIGTERM only stops accepting; our websockets would run until the graceful
        # timeout. Tell the app first, so every connection ends cleanly and quickly.
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum, frame):
            worker.wsgi.extensions["sendlens"].begin_shutdown()
            rooms = worker.wsgi.extensions.get("sendlens_rooms")
            if rooms is not None:
                rooms.abort_all()
            if callable(previous):
                previous(signum, frame)
        signal.signal(signal.SIGTERM, on_term)

    class Server(BaseApplication):
        def load_config(self):
            options = {
                "bind": f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
                "workers": 1,                   # one process owns the one engine
                "worker_class": "gthread",
                "threads": config.max_connections + 16,  # a thread per websocket, plus page loads
                "graceful_timeout": GRACEFUL_TIMEOUT_S,
                "timeout": 0,                   # the engine's own thread keeps the worker busy; no watchdog kills
                "keepalive": 5,
                "limit_request_line": 8190,
                "limit_request_fields": 100,
                "post_worker_init": post_worker_init,
                "accesslog": None,
                "errorlog": "-",
                "loglevel": "info",
            }
            if "control_socket_disable" in self.cfg.settings:  # gunicorn >= 25: no socket in ~/.gunicorn
                options["control_socket_disable"] = True
            for key, value in options.items():
                self.cfg.set(key, value)

        def load(self):
            return create_app(config)           # in the worker, after the fork: torch starts there

    Server().run()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app", description="Serve the sendlens explainer.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default=ServerConfig.model, help="smollm2-135m (default) or tiny")
    parser.add_argument("--setting", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="any setting of docs/settings.md, e.g. --setting max_connections 32")
    parser.add_argument("--debug", action="store_true", help="werkzeug's development server instead of gunicorn")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(args)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"sendlens: serving {config.model} at http://{args.host}:{args.port}/", flush=True)
    if args.debug:
        from werkzeug.serving import run_simple

        from . import create_app
        application = create_app(config)
        freeze_startup_objects()
        run_simple(args.host, args.port, application, threaded=True, use_reloader=False)
    else:
        serve_gunicorn(config, args.host, args.port)


if __name__ == "__main__":
    main()
