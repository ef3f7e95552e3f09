"""python -m app --host 127.0.0.1 --port 8000 [--model smollm2-135m]: serve sendlens."""

import argparse
import logging

from werkzeug.serving import run_simple

from . import create_app
from .config import ServerConfig


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m app", description="Serve the sendlens explainer.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default) or tiny")
    parser.add_argument("--max-connections", type=int, default=ServerConfig.max_connections)
    parser.add_argument("--frame-ancestors", default=ServerConfig.frame_ancestors,
                        help="who may frame /embed/ pages (CSP frame-ancestors), default *")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(ServerConfig(model=args.model, max_connections=args.max_connections,
                                  frame_ancestors=args.frame_ancestors))
    print(f"sendlens: serving {args.model} at http://{args.host}:{args.port}/", flush=True)
    run_simple(args.host, args.port, app, threaded=True, use_reloader=False)


if __name__ == "__main__":
    main()
