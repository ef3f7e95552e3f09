"""The app served on a free loopback port by werkzeug in a thread, for a process that needs its own
server for a while: the exporter's recorder (app/export.py) and the tests' servers.

werkzeug's threaded server is what `flask run` uses; production serving is gunicorn's
(app/__main__.py). The request log is off: its users print their own progress.

One fix to werkzeug's side: when a websocket handler returns, flask-sock hands werkzeug an empty
200 response, which werkzeug writes onto the socket after the websocket's close frame. A browser
that reads those bytes in the same read as the frames before them (a busy machine, a proxy that
coalesces) fails the connection and drops the frames: a refusal (`overloaded`) was lost so. Here
the request ends without that response (gunicorn's flask-sock mode writes nothing either)."""

import threading

from werkzeug.serving import WSGIRequestHandler, make_server


class _Quiet(WSGIRequestHandler):
    def log_request(self, *args, **kwargs):
        pass

    def connection_dropped(self, error, environ=None):
        self.close_connection = True    # an ended websocket's socket, or a dropped one: never read it again


class _WebSocketEnded(ConnectionError):
    """Raised past werkzeug's response writer when a websocket has ended: it takes a
    ConnectionError for a dropped connection and writes nothing more."""


def _nothing_after_a_websocket(app):
    """`app`, except that an upgraded websocket request's closing 200 is never written."""
    def wsgi(environ, start_response):
        if environ.get("HTTP_UPGRADE", "").lower() != "websocket":
            return app(environ, start_response)

        def start(status, headers, exc_info=None):
            if status.startswith("200"):   # the handshake was answered (101) and the socket is done
                raise _WebSocketEnded("the websocket has ended")
            return start_response(status, headers, exc_info)   # refused before the handshake: a real answer
        return app(environ, start)
    return wsgi


def serve(app, name: str = "loopback-server"):
    """Serve `app` on 127.0.0.1 at a free port. Returns (base URL, stop); stop() shuts the server
    and waits for its thread (the app's own engine is the caller's to shut down)."""
    server = make_server("127.0.0.1", 0, _nothing_after_a_websocket(app), threaded=True, request_handler=_Quiet)
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()

    def stop():
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    return f"http://127.0.0.1:{server.server_port}", stop
