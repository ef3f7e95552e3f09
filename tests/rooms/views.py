"""Helpers for the room views' browser tests: a room page rendered from its template and served on
the test server's origin (with the server's own content security policy), and a websocket that
plays a recorded room (room_fixture.py) instead of the server's, so the views can be checked
without the server's rooms. The tests with the real rooms use the server's pages and socket.
"""

import json
import re
import threading
import urllib.request
from types import SimpleNamespace

from flask import render_template

HELLO = {"type": "hello", "protocol": 1, "job_types": [], "request_types": ["generate"], "weight_format": "q4_1",
         "limits": {"max_jobs_per_connection": 1, "max_requests_per_connection": 1,
                    "max_tokens_limit": 64, "default_max_tokens": 16}}


def page_server(live_server) -> SimpleNamespace:
    """live_server (tests/conftest.py) in the shape conftest's Page takes: base and port."""
    return SimpleNamespace(base=live_server.http, port=live_server.port)


def server_csp(live_server) -> str:
    with urllib.request.urlopen(live_server.http + "/healthz", timeout=10) as resp:
        return resp.headers["Content-Security-Policy"]


def serve_template(context, live_server, path: str, template: str, **values) -> None:
    """Answer GET <path> on the server's origin with `template` rendered by the app, under the
    server's own content security policy (so inline styles or scripts would fail as they would live)."""
    app = live_server.app
    with app.test_request_context(path, base_url=live_server.http):
        html = render_template(template, **values)
    csp = server_csp(live_server)
    context.route(live_server.http + path, lambda route: route.fulfill(
        status=200, body=html, headers={"Content-Type": "text/html; charset=utf-8", "Content-Security-Policy": csp}))


def serve_qr(context, live_server, code: str) -> None:
    """A stand-in for the room's QR code (the recorded room has no room on the server)."""
    svg = '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 10 10"><rect width="10" height="10" fill="#fff"/></svg>'
    context.route(f"{live_server.http}/room/{code}/qr.svg",
                  lambda route: route.fulfill(status=200, body=svg, headers={"Content-Type": "image/svg+xml"}))


def serve_json(context, url: str, payload: dict) -> None:
    body = json.dumps(payload)
    context.route(url, lambda route: route.fulfill(status=200, body=body, headers={"Content-Type": "application/json"}))


class FakeRoomSocket:
    """The page's /ws played from recorded updates. Every room_watch gets `updates` (each under
    the watch's id); every room_control is recorded in `controls` and answered room_control_ok,
    and `on_control(msg)` may return more updates to push after it (a switch to static batching)."""

    def __init__(self, page, updates: list[dict], on_control=None):
        self.updates = updates
        self.on_control = on_control
        self.controls: list[dict] = []
        self.watches: list[dict] = []
        self.others: list[dict] = []
        self.lock = threading.Lock()
        self.urls: list[str] = []                # the URLs the page opened its socket at
        page.route_web_socket(re.compile(r"/ws(\?.*)?$"), self._connect)

    def _connect(self, ws) -> None:
        self.urls.append(ws.url)
        ws.on_message(lambda raw: self._message(ws, json.loads(raw)))
        ws.send(json.dumps(HELLO))

    def _message(self, ws, msg: dict) -> None:
        with self.lock:
            if msg["type"] == "room_watch":
                self.watches.append(msg)
                self.watch_id = msg["id"]
                for u in self.updates:
                    ws.send(json.dumps({**u, "id": msg["id"]}))
            elif msg["type"] == "room_control":
                self.controls.append(msg)
                ws.send(json.dumps({"type": "room_control_ok", "id": msg["id"], "action": msg["action"],
                                    "settings": self.updates[-1]["settings"]}))
                for u in (self.on_control(msg) if self.on_control else None) or []:
                    ws.send(json.dumps({**u, "id": self.watch_id}))
            else:
                self.others.append(msg)


def strip_signature(page, root: str = "[data-view]") -> list:
    """The step strip as data: per row (newest first) its step, batch size, and each cell's
    (student, kind)."""
    return page.evaluate("""(root) => [...document.querySelectorAll(root + ' .rs-row[data-step]')].map((row) => [
        Number(row.dataset.step), Number(row.dataset.batch),
        [...row.querySelectorAll('.rs-cell')].map((c) => [c.dataset.student ?? null, c.dataset.kind])])""", root)


def expected_signature(steps: list[dict], slots: int, limit: int = 200) -> list:
    """strip_signature as the trace says it must be."""
    rows = []
    for s in reversed(steps[-limit:]):
        cells = [[c["student"], c["kind"]] if c else [None, "empty"] for c in s["slots"]]
        cells += [[None, "empty"]] * (slots - len(cells))
        rows.append([s["step"], sum(1 for c in s["slots"] if c and c["kind"] != "idle"), cells])
    return rows


def strip_content(page, root: str = "[data-view]") -> dict:
    """The step strip's DOM content, for comparing two drawings of it: the column heads (slot
    numbers), then per row (newest first) its step, batch size and students (data-*), its head's
    text (step number, batch, time) and each cell's kind, student, request, label, title and colour."""
    return page.evaluate("""(root) => {
        const strip = document.querySelector(root + ' .room-strip');
        return {
            columns: [...strip.querySelectorAll('.rs-columns .rs-slot')].map((c) => c.textContent),
            rows: [...strip.querySelectorAll('.rs-row[data-step]')].map((row) => ({
                step: row.dataset.step, batch: row.dataset.batch, students: row.dataset.students,
                head: row.querySelector('.rs-head').textContent,
                cells: [...row.querySelectorAll('.rs-cell')].map((c) => [c.className, c.dataset.kind, c.dataset.student ?? null,
                    c.dataset.request ?? null, c.textContent, c.title, c.getAttribute('style')]),
            })),
        };
    }""", root)


def shown_settings(page, root: str = "[data-view]") -> dict | None:
    """The settings the view shows (the settings line's data-settings), or None if it shows none."""
    raw = page.get_attribute(f"{root} .room-settings", "data-settings")
    return json.loads(raw) if raw else None
