"""The rooms' HTTP routes (a Flask blueprint); the templates are rooms-ui's.

- GET  /room/new               a new room; the presenter key goes in a cookie; 303 to its present page
- GET  /room/<code>/present    the presenter view (403 without the key; `?key=` sets the cookie)
- GET  /room/<code>/qr.svg     the join link as a QR code (segno, SVG)
- GET  /room/<code>            the student's page: the join form, or the chat once joined
- POST /room/<code>/join       join with a display name (400 naming display_name, 404, 429)
- GET  /room/<code>/export     the session as JSON (replay.py), presenter only
- GET  /room/<code>/replay     the presenter view driven by the recording, presenter only

An unknown code and a closed room get the same page and status (404), so trying codes tells
nothing; joins are rate-limited per client address.
"""

from flask import Blueprint, Response, abort, current_app, jsonify, redirect, render_template, request

from core.errors import InvalidParameter

from ..clients import client_address, parse_networks
from . import codes, qr, replay
from .errors import RoomError
from .messages import PRESENTER_COOKIE, STUDENT_COOKIE

bp = Blueprint("rooms", __name__)
COOKIE_AGE_S = 7 * 24 * 3600


def registry():
    return current_app.extensions["sendlens_rooms"]


def set_cookie(resp, name: str, value: str) -> None:
    resp.set_cookie(name, value, max_age=COOKIE_AGE_S, path="/", httponly=True, samesite="Lax",
                    secure=request.is_secure)


def join_url(code: str) -> str:
    return f"{request.host_url}room/{code}"


def open_room(code):
    try:
        return registry().get(code)
    except RoomError:
        return None


@bp.get("/room/new")
def new_room():
    try:
        room = registry().create()
    except RoomError as exc:
        abort(503, description=str(exc))
    resp = redirect(f"/room/{room.code}/present", 303)
    set_cookie(resp, PRESENTER_COOKIE.format(room.code), room.presenter_key)
    return resp


@bp.get("/room/<code>/present")
def present(code):
    room = open_room(code)
    if room is None:
        abort(404)
    given = request.args.get("key")
    if given is not None and codes.same_secret(given, room.presenter_key):
        resp = redirect(f"/room/{room.code}/present", 303)      # the key leaves the address bar
        set_cookie(resp, PRESENTER_COOKIE.format(room.code), room.presenter_key)
        return resp
    if not codes.same_secret(request.cookies.get(PRESENTER_COOKIE.format(room.code)), room.presenter_key):
        abort(403, description="Only the room's presenter may open this page (the presenter link or cookie).")
    return render_template("room_present.html", code=room.code, source="live", join_url=join_url(room.code),
                           qr_url=f"/room/{room.code}/qr.svg", export_url=f"/room/{room.code}/export")


@bp.get("/room/<code>/qr.svg")
def qr_svg(code):
    room = open_room(code)
    if room is None:
        abort(404)
    return Response(qr.svg(join_url(room.code)), mimetype="image/svg+xml")


@bp.get("/room/<code>")
def student(code):
    room = open_room(code)
    if room is None:
        return render_template("room_student.html", code=code[:16], joined=False, not_found=True), 404
    name = room.member(request.cookies.get(STUDENT_COOKIE.format(room.code)))
    return render_template("room_student.html", code=room.code, joined=name is not None, name=name,
                           error=None, value="")


@bp.post("/room/<code>/join")
def join(code):
    reg = registry()
    config = current_app.config["SENDLENS"]
    address = client_address(request.remote_addr, request.headers, parse_networks(config.trusted_proxies),
                             config.client_address_header)   # through trusted_proxies (app/clients.py)
    if not reg.allow_join(address):
        return render_template("room_student.html", code=code[:16], joined=False, error=(
            f"Too many join attempts from your address; wait a minute (room_join_rate_per_minute "
            f"{current_app.config['SENDLENS'].room_join_rate_per_minute})."), value=""), 429
    room = open_room(code)
    if room is None:
        return render_template("room_student.html", code=code[:16], joined=False, not_found=True), 404
    typed = request.form.get("display_name", "")
    try:
        token, _ = reg.join(room, typed, address)
    except InvalidParameter as exc:
        status = 409 if getattr(exc, "code", "") == "room_full" else 400
        return render_template("room_student.html", code=room.code, joined=False, error=str(exc),
                               value=typed[:64]), status
    resp = redirect(f"/room/{room.code}", 303)
    set_cookie(resp, STUDENT_COOKIE.format(room.code), token)
    return resp


def recorded_or_abort(code):
    stored = registry().recorded(code)
    if stored is None:
        abort(404)
    if not codes.same_secret(request.cookies.get(PRESENTER_COOKIE.format(stored["code"])), stored["presenter_key"]):
        abort(403, description="Only the room's presenter may export or replay it.")
    return stored


@bp.get("/room/<code>/export")
def export(code):
    stored = recorded_or_abort(code)
    resp = jsonify(replay.export(registry(), stored))
    resp.headers["Content-Disposition"] = f'attachment; filename="sendlens-room-{stored["code"]}.json"'
    return resp


@bp.get("/room/<code>/replay")
def replay_page(code):
    stored = recorded_or_abort(code)
    return render_template("room_present.html", code=stored["code"], source="recording",
                           export_url=f"/room/{stored['code']}/export")
