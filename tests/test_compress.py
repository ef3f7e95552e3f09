"""Text assets and pages go out gzipped when accepted (app/compress.py), over Flask's test client
and over gunicorn (what `python -m app` runs)."""

import gzip
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from app import create_app
from conftest import ROOT, free_port

SETTINGS = {"model": "tiny", "num_kv_blocks": 64, "testing": True}
TEXT = ["/", "/embed/chat", "/static/js/main.js", "/static/css/sendlens.css", "/static/css/widgets/chat.css"]
GZIP = {"Accept-Encoding": "gzip, deflate, br"}


@pytest.fixture(scope="module")
def client(tiny_loaded):
    app = create_app(SETTINGS, loaded=tiny_loaded)
    yield app.test_client()
    app.extensions["sendlens"].shutdown()


@pytest.mark.parametrize("path", TEXT)
def test_text_is_gzipped_when_accepted(client, path):
    plain = client.get(path)
    resp = client.get(path, headers=GZIP)
    assert resp.status_code == 200 and plain.status_code == 200
    assert resp.headers["Content-Encoding"] == "gzip"
    assert int(resp.headers["Content-Length"]) == len(resp.get_data())
    assert gzip.decompress(resp.get_data()) == plain.get_data()
    assert len(resp.get_data()) < len(plain.get_data())
    assert resp.mimetype == plain.mimetype


@pytest.mark.parametrize("headers", [{}, {"Accept-Encoding": "identity"}, {"Accept-Encoding": "gzip;q=0, br"}])
@pytest.mark.parametrize("path", TEXT)
def test_identity_when_gzip_is_not_accepted(client, path, headers):
    resp = client.get(path, headers=headers)
    assert resp.status_code == 200
    assert "Content-Encoding" not in resp.headers
    assert int(resp.headers["Content-Length"]) == len(resp.get_data())
    assert b"<" in resp.get_data() or b"{" in resp.get_data() or b"import" in resp.get_data()


@pytest.mark.parametrize("path", TEXT)
def test_vary_on_both_encodings(client, path):
    for headers in ({}, GZIP):
        assert "Accept-Encoding" in client.get(path, headers=headers).headers["Vary"]


@pytest.mark.parametrize("path", TEXT)
def test_a_strong_etag_per_encoding_and_304_on_a_match(client, path):
    plain, packed = client.get(path), client.get(path, headers=GZIP)
    etag_plain, weak_plain = plain.get_etag()
    etag_gzip, weak_gzip = packed.get_etag()
    assert etag_plain and etag_gzip and etag_plain != etag_gzip
    assert not weak_plain and not weak_gzip
    assert client.get(path).get_etag()[0] == etag_plain        # the same bytes, the same tag
    again = client.get(path, headers={**GZIP, "If-None-Match": f'"{etag_gzip}"'})
    assert again.status_code == 304 and again.get_data() == b""
    assert again.get_etag()[0] == etag_gzip and "Accept-Encoding" in again.headers["Vary"]
    assert client.get(path, headers={"If-None-Match": f'"{etag_plain}"'}).status_code == 304
    # A tag of the other encoding is not a match: that is another representation.
    assert client.get(path, headers={**GZIP, "If-None-Match": f'"{etag_plain}"'}).status_code == 200
    assert client.get(path, headers={"If-None-Match": '"stale"'}).status_code == 200


@pytest.mark.parametrize("path", TEXT)
def test_head_has_get_s_headers_and_no_body(client, path):
    get = client.get(path, headers=GZIP)
    head = client.head(path, headers=GZIP)
    assert head.status_code == 200 and head.get_data() == b""
    for name in ("Content-Encoding", "Content-Length", "ETag", "Vary", "Content-Type"):
        assert head.headers[name] == get.headers[name], name


def test_small_and_binary_bodies_are_not_gzipped(client):
    small = client.get("/healthz", headers=GZIP)               # a few hundred bytes of JSON
    assert small.status_code == 200 and "Content-Encoding" not in small.headers
    missing = client.get("/static/css/nowhere.css", headers=GZIP)
    assert missing.status_code == 404 and "Content-Encoding" not in missing.headers


def test_static_files_are_compressed_once(client, monkeypatch):
    calls = []
    real = gzip.compress
    monkeypatch.setattr(gzip, "compress", lambda *a, **k: calls.append(1) or real(*a, **k))
    path = "/static/js/client.js"
    first = client.get(path, headers=GZIP).get_data()
    for _ in range(3):
        assert client.get(path, headers=GZIP).get_data() == first
    assert len(calls) <= 1                                     # 0 when an earlier test read it


def test_static_paths_cannot_leave_the_folder(client):
    for path in ("/static/../app/config.py", "/static/%2e%2e/app/config.py", "/static/css/..%2f..%2fapp/config.py"):
        assert client.get(path).status_code == 404, path


def test_security_headers_stay_on_compressed_files(client):
    resp = client.get("/static/js/main.js", headers=GZIP)
    assert resp.headers["X-Content-Type-Options"] == "nosniff"
    assert "default-src 'self'" in resp.headers["Content-Security-Policy"]


# ---- under gunicorn -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gunicorn_base(tmp_path_factory):
    """`python -m app --model tiny` (gunicorn) on a free port."""
    port = free_port()
    log_path = Path(tmp_path_factory.mktemp("gunicorn")) / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "app", "--port", str(port), "--model", "tiny",
                                 "--setting", "num_kv_blocks", "64"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{log_path.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(base + "/healthz", timeout=5).close()
                break
            except OSError:
                time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def fetch(url: str, method: str = "GET", **headers):
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.headers, err.read()


@pytest.mark.slow   # a server of its own (conftest.py: SLOW_MODULES says why make fast leaves it out)
@pytest.mark.parametrize("path", ["/", "/static/js/main.js"])
def test_gunicorn_serves_gzip_etag_and_304(gunicorn_base, path):
    status, plain_headers, plain = fetch(gunicorn_base + path)
    assert status == 200 and "Content-Encoding" not in plain_headers
    status, headers, body = fetch(gunicorn_base + path, **GZIP)
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(body) == plain and int(headers["Content-Length"]) == len(body)
    assert "Accept-Encoding" in headers["Vary"]
    status, _, body = fetch(gunicorn_base + path, **GZIP, **{"If-None-Match": headers["ETag"]})
    assert status == 304 and body == b""
    status, head_headers, body = fetch(gunicorn_base + path, "HEAD", **GZIP)
    assert status == 200 and body == b"" and head_headers["Content-Length"] == headers["Content-Length"]
