"""Who may use this server, and what a page may do: trusted hosts, the websocket's origin check,
and the security headers of every response.

- Trusted hosts (DNS rebinding): a request whose Host header is not one of this machine's names
  (localhost forms, its hostname and addresses, and the `trusted_hosts` setting) is refused with
  400, through Flask's TRUSTED_HOSTS.
- Origin (cross-site websocket hijacking, OWASP ASVS 4.4): browsers send any page's websocket
  handshake with that page's Origin, cookies or not. /ws is refused with 403 before the upgrade
  unless the origin is this site (a trusted host on the same port, with the same scheme: an https
  page may open wss:// only and an http page ws:// only) or in `allowed_origins`;
  `null` and `file://` never pass. Embeds keep working on any site: the iframe's page, and so its
  socket, comes from this server. A client that sends no Origin is not a browser page and is let in.
  Behind a proxy that ends TLS, the scheme is the one a trusted proxy forwards (app/clients.py).
- Headers: a content security policy for every response (scripts, style sheets and sockets from
  this site only, style attributes allowed for plotly.js; frames of /embed/ pages from `frame_ancestors`, of the rest from this site), and the
  usual companions.
"""

import socket
from urllib.parse import urlsplit

from flask import Flask, abort, request

from .clients import client_scheme, parse_networks

WS_PATH = "/ws"

# plotly.js styles its charts through style attributes (d3's .attr("style")), adds its rules to an
# empty <style> element through the CSSOM, and writes its map library's sheet into another. Allowed:
# style attributes, an empty <style> element (the hash of the empty string), and exactly the
# sheets the installed plotly.js carries (hashed at start). Scripts are never inline.
EMPTY_STYLE_HASH = "'sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU='"


def style_policy() -> str:
    from .assets import plotly_style_hashes
    return (f"style-src-elem 'self' {' '.join([EMPTY_STYLE_HASH, *plotly_style_hashes()])}; "
            "style-src-attr 'unsafe-inline'")


def machine_names() -> list[str]:
    """Names this machine answers to: loopback forms, its hostname and the addresses it resolves to."""
    names = {"localhost", "127.0.0.1", "::1"}
    try:
        hostname = socket.gethostname()
        names.update({hostname, socket.getfqdn()})
        names.update(socket.gethostbyname_ex(hostname)[2])
    except OSError:
        pass
    return sorted(n for n in names if n)


def origin_allowed(origin: str | None, host: str, trusted: list[str], allowed: set[str], scheme: str = "http") -> bool:
    """May a page of `origin` open the websocket of this server, reached as `scheme`://`host`?"""
    if origin is None:
        return True                      # not a browser page: no cross-site risk
    if origin in allowed:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False                     # null, file://, chrome-extension:// ...
    if parts.scheme != scheme:
        return False                     # an https page opens wss:// only, an http page ws:// only
    try:
        want = urlsplit(f"//{host}")
        origin_port = parts.port or (443 if parts.scheme == "https" else 80)
        host_port = want.port or (443 if scheme == "https" else 80)
    except ValueError:
        return False
    return parts.hostname in trusted and origin_port == host_port


def init_app(app: Flask, cfg) -> None:
    trusted = machine_names() + cfg.trusted_hosts.split()
    allowed = set(cfg.allowed_origins.split())
    app.extensions["sendlens_allowed_origins"] = allowed   # the set the origin check reads (a test may add one)
    proxies = parse_networks(cfg.trusted_proxies)
    app.config["TRUSTED_HOSTS"] = trusted
    styles = style_policy()

    @app.before_request
    def check_host_and_origin():
        host = request.host               # raises SecurityError (400) for an untrusted Host
        if request.path != WS_PATH:
            return
        scheme = client_scheme(request.remote_addr, request.headers, request.scheme, proxies)
        if not origin_allowed(request.headers.get("Origin"), host, trusted, allowed, scheme):
            abort(403, description="This page's origin may not open sendlens' websocket.")

    @app.after_request
    def security_headers(resp):
        embed = request.path.startswith("/embed/")
        ancestors = cfg.frame_ancestors if embed else "'self'"
        try:
            host = request.host
        except Exception:                 # the untrusted-host error page itself
            host = None
        sockets = f" ws://{host} wss://{host}" if host else ""
        resp.headers["Content-Security-Policy"] = (
            f"default-src 'self'; script-src 'self'; style-src 'self'; {styles}; img-src 'self' data:; "
            f"font-src 'self'; connect-src 'self'{sockets}; object-src 'none'; base-uri 'none'; "
            f"form-action 'self'; frame-ancestors {ancestors}")
        if not embed:
            resp.headers["X-Frame-Options"] = "SAMEORIGIN"
        resp.headers["X-Content-Type-Options"] = "nosniff"
        resp.headers["Referrer-Policy"] = "no-referrer"
        resp.headers["Permissions-Policy"] = "camera=(), microphone=(), geolocation=(), payment=(), usb=()"
        resp.headers["Cross-Origin-Opener-Policy"] = "same-origin"
        return resp
