"""Text responses go out gzipped when the reader's browser accepts it (RFC 9110 content coding).

- Which: HTML, CSS, JavaScript, JSON and SVG of at least MIN_BYTES, with status 200. Images,
  fonts and anything already encoded are sent as they are (gzip would only add a header).
- How: the standard library's gzip, once per static file (kept in memory with both encodings,
  read again when the file changes), once per response for pages.
- Caching: every such response says `Vary: Accept-Encoding` and carries a strong ETag of the
  bytes it sends, one per encoding (RFC 9110 8.8.3: two encodings are two representations);
  a request whose If-None-Match names it is answered 304 with no body. HEAD gets the same
  headers as GET.

It is WSGI-server neutral: the static route answers from memory (no file wrapper, no sendfile),
and pages are compressed in an after_request hook, so werkzeug and gunicorn serve the same bytes.
/vendor/plotly.min.js keeps its own cache (app/assets.py).
"""

import gzip
import hashlib
import mimetypes
import os
from dataclasses import dataclass

from flask import Flask, Response, abort, request
from werkzeug.security import safe_join

MIN_BYTES = 512       # smaller bodies save a few dozen bytes at best: not worth the CPU or the header
LEVEL = 6             # zlib's default trade of size against time
TEXT_TYPES = {"text/html", "text/css", "text/javascript", "application/javascript",
              "application/json", "image/svg+xml", "text/plain"}


@dataclass(frozen=True)
class Encoded:
    """One body in both encodings with an ETag each (gzip is None when it is not worth it)."""
    identity: bytes
    gzip: bytes | None

    @classmethod
    def of(cls, body: bytes, mimetype: str) -> "Encoded":
        worth = mimetype in TEXT_TYPES and len(body) >= MIN_BYTES
        return cls(body, gzip.compress(body, LEVEL, mtime=0) if worth else None)

    def etag(self, coding: str) -> str:
        digest = hashlib.sha256(self.identity).hexdigest()[:20]
        return digest if coding == "identity" else f"{digest}-{coding}"


def accepts_gzip() -> bool:
    return request.accept_encodings["gzip"] > 0      # "gzip;q=0" refuses it; "*" accepts it


def send(resp: Response, body: Encoded) -> Response:
    """Fill resp with the encoding the request accepts, its ETag and Vary; 304 on a match."""
    coding = "gzip" if body.gzip is not None and accepts_gzip() else "identity"
    if body.gzip is not None:
        resp.vary.add("Accept-Encoding")
    etag = body.etag(coding)
    resp.set_etag(etag)
    if request.if_none_match.contains(etag):
        resp.status_code = 304
        resp.set_data(b"")
        resp.headers.pop("Content-Length", None)
        resp.headers.pop("Content-Type", None)
        return resp
    if coding == "gzip":
        resp.headers["Content-Encoding"] = "gzip"
    resp.set_data(body.gzip if coding == "gzip" else body.identity)
    return resp


class StaticCache:
    """The static folder's files, read and gzipped once each; read again when a file's mtime changes."""

    def __init__(self, folder: str):
        self.folder = folder
        self.files: dict[str, tuple[int, str, Encoded]] = {}

    def get(self, filename: str) -> tuple[str, Encoded]:
        path = safe_join(self.folder, filename)
        if path is None or not os.path.isfile(path):
            abort(404)
        mtime = os.stat(path).st_mtime_ns
        cached = self.files.get(filename)
        if cached is None or cached[0] != mtime:
            mimetype = mimetypes.guess_type(path)[0] or "application/octet-stream"
            with open(path, "rb") as f:
                cached = (mtime, mimetype, Encoded.of(f.read(), mimetype))
            self.files[filename] = cached
        return cached[1], cached[2]


def init_app(app: Flask) -> None:
    cache = StaticCache(app.static_folder)

    def static(filename: str):
        mimetype, body = cache.get(filename)
        resp = Response(mimetype=mimetype)
        resp.cache_control.no_cache = True      # revalidate by ETag: a changed file shows at once
        return send(resp, body)

    app.view_functions["static"] = static

    @app.after_request
    def compress_pages(resp: Response) -> Response:
        # Left alone: the static route (done above), errors, streams and files, bodies already
        # encoded or carrying their own ETag (/vendor), and small or binary bodies.
        if (request.endpoint == "static" or resp.status_code != 200 or resp.direct_passthrough
                or resp.is_streamed or "Content-Encoding" in resp.headers or resp.get_etag()[0]
                or resp.mimetype not in TEXT_TYPES or (resp.content_length or 0) < MIN_BYTES):
            return resp
        return send(resp, Encoded.of(resp.get_data(), resp.mimetype))
