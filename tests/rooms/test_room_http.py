"""The rooms' HTTP routes: creating a room, the presenter's key, joining by name (errors named,
rate-limited, unknown codes told nothing), the QR code, and the presenter-only export."""

import json

import pytest

from app.rooms import codes

from .rooms_server import cookie, join, new_room, request, start


@pytest.fixture(scope="module")
def srv(tiny_loaded, tmp_path_factory):
    server = start(tiny_loaded, tmp_path_factory.mktemp("rooms") / "rooms.sqlite3",
                   room_max_students=3, room_max_rooms=3, room_join_rate_per_minute=1000)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def no_open_rooms(srv):
    """Each test starts with no room open (the room limit is small)."""
    for room in list(srv.rooms.rooms.values()):
        srv.rooms.close(room)


def test_a_new_room_sets_the_presenters_cookie_and_redirects_to_its_page(srv):
    status, headers, _ = request(srv, "GET", "/room/new")
    assert status == 303
    code = headers["location"][0].split("/")[-2]
    assert headers["location"][0].endswith(f"/room/{code}/present") and codes.normalize_code(code) == code
    line = next(c for c in headers["set-cookie"] if c.startswith(f"sendlens_presenter_{code}="))
    assert "HttpOnly" in line and "SameSite=Lax" in line and "Path=/" in line
    key = cookie(headers, f"sendlens_presenter_{code}")
    status, _, body = request(srv, "GET", f"/room/{code}/present", cookies={f"sendlens_presenter_{code}": key})
    assert status == 200
    assert f'data-view="presenter" data-room="{code}" data-source="live"' in body
    assert f"/room/{code}/qr.svg" in body and f"{srv.http}/room/{code}" in body


def test_the_present_page_needs_the_key_and_the_presenter_link_sets_it(srv):
    code, cookies = new_room(srv)
    key = next(iter(cookies.values()))
    assert request(srv, "GET", f"/room/{code}/present")[0] == 403
    assert request(srv, "GET", f"/room/{code}/present", cookies={f"sendlens_presenter_{code}": "guess"})[0] == 403
    assert request(srv, "GET", f"/room/{code}/present?key=wrong")[0] == 403
    status, headers, _ = request(srv, "GET", f"/room/{code}/present?key={key}")
    assert status == 303 and cookie(headers, f"sendlens_presenter_{code}") == key
    status, _, body = request(srv, "GET", f"/room/{code}/export")
    assert status == 403


def test_the_qr_code_is_an_svg_of_the_join_link(srv):
    code, _ = new_room(srv)
    status, headers, body = request(srv, "GET", f"/room/{code}/qr.svg")
    assert status == 200 and headers["content-type"][0].startswith("image/svg+xml")
    assert body.lstrip().startswith("<svg") and f"{srv.http}/room/{code}" in body


def test_joining_sets_the_students_cookie_and_the_page_becomes_the_chat(srv):
    code, _ = new_room(srv)
    status, _, body = request(srv, "GET", f"/room/{code}")
    assert status == 200 and 'name="display_name"' in body and f'action="/room/{code}/join"' in body
    student = join(srv, code, "Ada")
    status, _, body = request(srv, "GET", f"/room/{code}", cookies=student)
    assert status == 200 and 'data-widget="chat"' in body and 'data-student="Ada"' in body
    line = next(c for c in request(srv, "POST", f"/room/{code}/join", form={"display_name": "Bo"})[1]["set-cookie"])
    assert "HttpOnly" in line and "SameSite=Lax" in line


@pytest.mark.parametrize("name, words", [
    ("", "empty"), ("x" * 25, "at most"), ("<script>alert(1)</script>", "letters"), ("a\x07b", "control"),
])
def test_a_bad_name_rerenders_the_form_naming_display_name(srv, name, words):
    code, _ = new_room(srv)
    status, headers, body = request(srv, "POST", f"/room/{code}/join", form={"display_name": name})
    assert status == 400 and "set-cookie" not in headers
    assert 'data-error-param="display_name"' in body and "display_name" in body and words in body
    assert "<script>alert" not in body


def test_a_duplicate_name_and_a_full_room_are_refused(srv):
    code, _ = new_room(srv)
    join(srv, code, "Ada")
    status, _, body = request(srv, "POST", f"/room/{code}/join", form={"display_name": " ADA "})
    assert status == 400 and "already taken" in body
    join(srv, code, "Grace")
    join(srv, code, "Alan")
    status, _, body = request(srv, "POST", f"/room/{code}/join", form={"display_name": "Edsger"})
    assert status == 409 and "room_max_students" in body


def test_unknown_closed_and_malformed_codes_get_the_same_404(srv):
    code, _ = new_room(srv)
    room = srv.rooms.get(code)
    srv.rooms.close(room)
    never = "ZZZZZZZZ" if code != "ZZZZZZZZ" else "YYYYYYYY"
    pages = []
    for c in (code, never, "bad", "%3Cb%3Ex%22"):
        status, _, body = request(srv, "POST", f"/room/{c}/join", form={"display_name": "Ada"})
        assert status == 404 and 'data-error="room_not_found"' in body
        status, _, body = request(srv, "GET", f"/room/{c}")
        assert status == 404
        pages.append(body.replace(c, "CODE"))
        assert request(srv, "GET", f"/room/{c}/present")[0] == 404
    assert pages[0] == pages[1]


def test_the_room_limit_is_named(srv):
    for _ in range(3):
        new_room(srv)
    status, _, body = request(srv, "GET", "/room/new")
    assert status == 503 and "room_max_rooms" in body


def test_joins_are_rate_limited_per_address(tiny_loaded, tmp_path):
    server = start(tiny_loaded, tmp_path / "rooms.sqlite3", room_join_rate_per_minute=3)
    try:
        code, _ = new_room(server)
        statuses = [request(server, "POST", f"/room/{code}/join", form={"display_name": f"s{i}"})[0]
                    for i in range(3)] + [request(server, "POST", f"/room/ZZZZZZZZ/join",
                                                  form={"display_name": "x"})[0]]
        assert statuses == [303, 303, 303, 429]
    finally:
        server.stop()


def test_the_export_is_the_presenters_and_follows_the_schema(srv):
    code, cookies = new_room(srv)
    join(srv, code, "Ada")
    status, headers, body = request(srv, "GET", f"/room/{code}/export", cookies=cookies)
    assert status == 200 and headers["content-type"][0].startswith("application/json")
    data = json.loads(body)
    assert data["schema"] == "sendlens.room/1"
    assert data["room"]["code"] == code and data["room"]["students"] == ["Ada"]
    assert data["steps"] == [] and data["requests"] == [] and data["settings_log"]
    status, _, body = request(srv, "GET", f"/room/{code}/replay", cookies=cookies)
    assert status == 200 and 'data-source="recording"' in body and f'data-room="{code}"' in body
    student = join(srv, code, "Grace")
    assert request(srv, "GET", f"/room/{code}/export", cookies=student)[0] == 403
    assert request(srv, "GET", f"/room/{code}/replay", cookies=student)[0] == 403
