"""Vendored JavaScript served from installed packages (plotly.js from the `plotly` wheel).

No CDN: the site must work with the network unplugged. The file is read once, gzipped once, and
served with an ETag and a long cache lifetime.
"""

import gzip
import hashlib
from pathlib import Path

from flask import Blueprint, Response, abort, current_app, request

bp = Blueprint("assets", __name__, url_prefix="/vendor")

MAX_AGE = 7 * 24 * 3600  # a week; the ETag changes with the installed version


def plotly_path() -> Path:
    import plotly
    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def plotly_style_hashes() -> list[str]:
    """CSP hashes of the style sheets plotly.js writes into <style> elements by itself (the map
    library's, at load), read from the installed file, so the policy follows the installed version."""
    import base64
    import re

    pattern = r"""createElement\("style"\);\w+\.id="[0-9a-f]+",\w+\.textContent='((?:[^'\\]|\\.)*)'"""
    out = []
    for m in re.finditer(pattern, plotly_path().read_text()):
        text = m.group(1).encode().decode("unicode_escape") if "\\" in m.group(1) else m.group(1)
        out.append("'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'")
    return out


def load(name: str) -> dict:
    cache = current_app.extensions.setdefault("sendlens_assets", {})
    if name not in cache:
        data = plotly_path().read_bytes()
        cache[name] = {"raw": data, "gzip": gzip.compress(data, 6),
                       "etag": hashlib.sha256(data).hexdigest()[:16]}
    return cache[name]


@bp.get("/<name>")
def vendor(name: str):
    if name != "plotly.min.js":
        abort(404)
    asset = load(name)
    if request.if_none_match.contains(asset["etag"]):
        return Response(status=304)
    gz = "gzip" in request.headers.get("Accept-Encoding", "")
    resp = Response(asset["gzip"] if gz else asset["raw"], mimetype="text/javascript")
    if gz:
        resp.headers["Content-Encoding"] = "gzip"
    resp.headers["Vary"] = "Accept-Encoding"
    resp.set_etag(asset["etag"])
    resp.cache_control.public = True
    resp.cache_control.max_age = MAX_AGE
    return resp
