"""The app served on a free loopback port by werkzeug in a thread, for a process that needs its own
server for a while: the exporter's recorder (app/export.py) and the tests' servers.

werkzeug's threaded server is what `flask run` uses; production serving is gunicorn's
(app/__main__.py). The request log is off: its users print their own progress."""

import threading

from werkzeug.serving import WSGIRequestHandler, make_server


class _Quiet(WSGIRequestHandler):
    def log_request(self, *args, **kwargs):
        pass


def serve(app, name: str = "loopback-server"):
    """Serve `app` on 127.0.0.1 at a free port. Returns (base URL, stop); stop() shuts the server
    and waits for its thread (the app's own engine is the caller's to shut down)."""
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=_Quiet)
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()

    def stop():
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    return f"http://127.0.0.1:{server.server_port}", stop
