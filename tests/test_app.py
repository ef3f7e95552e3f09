"""The Flask app over HTTP (tiny model, Flask's test client): pages, embeds, headers, assets, config.

One app per module: every create_app starts an engine thread, shut down at teardown.
"""

import gzip
import re
from html.parser import HTMLParser

import pytest

from app import create_app
from app.config import ServerConfig
from app.facts import facts
from app.sections import BADGES, SECTIONS
from app.widgets import BY_NAME
from core.errors import InvalidParameter

# The walkthrough's outline: (number, section title, widget names), in page order.
OUTLINE = [
    (1, "What happens when you press Send", ("chat",)),
    (2, "Tokens", ("tokenizer",)),
    (3, "Embeddings", ("embedding",)),
    (4, "Positions", ("positions",)),
    (5, "The transformer block", ("block",)),
    (6, "Attention", ("attention",)),
    (7, "Prefill once, decode one token at a time", ("generation",)),
    (8, "Two phases", ("phases",)),
    (9, "The KV cache", ("kv-cache",)),
    (10, "KV memory", ("kv-memory",)),
    (11, "Paged KV", ("paging", "sharing")),  # sharing: issue 27's widget beside paging
    (12, "Batching turns a trickle into a matrix", ("gemm",)),
    (13, "Throughput against latency", ("throughput-latency",)),
    (14, "Static against continuous batching", ("batching",)),
    (15, "Chunked prefill", ("chunked-prefill",)),
    (16, "Prefix caching", ("prefix-cache",)),
    (17, "Tensor parallelism", ("tensor-parallel",)),
    (18, "Pipeline parallelism", ("pipeline",)),
    (19, "Mixture of experts", ("moe",)),
    (20, "Efficiency tricks", ("quantization", "kv-eviction", "speculative")),
    (21, "Optimize the metric you care about", ("slo",)),
    (22, "Why a giant MoE is cheap at scale and dear for one user", ("economics",)),
    (23, "The mental model to keep", ()),
]
OUTLINE_NAMES = [name for _, _, widgets in OUTLINE for name in widgets]
BUILT = set(BY_NAME)
UNBUILT = [name for name in OUTLINE_NAMES if name not in BUILT]

TEST_SETTINGS = {"model": "tiny", "num_kv_blocks": 64, "testing": True}


def csp(headers) -> dict[str, str]:
    """The Content-Security-Policy header as {directive: sources}."""
    parts = (p.strip().split(None, 1) for p in headers["Content-Security-Policy"].split(";") if p.strip())
    return {p[0]: (p[1] if len(p) > 1 else "") for p in parts}


# ---- a small HTML tree (the standard library has a parser, not a DOM) ------------------------
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Node:
    def __init__(self, tag, attrs, parent=None):
        self.tag, self.attrs, self.parent, self.children = tag, dict(attrs), parent, []

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def iter(self):
        for c in self.children:
            if isinstance(c, Node):
                yield c
                yield from c.iter()

    def find_all(self, tag=None, **attrs):
        """Descendants with this tag whose attributes equal attrs (class_ matches one class)."""
        out = []
        for n in self.iter():
            if tag is not None and n.tag != tag:
                continue
            ok = True
            for key, value in attrs.items():
                if key == "class_":
                    ok = ok and value in (n.attrs.get("class") or "").split()
                else:
                    ok = ok and n.attrs.get(key.replace("_", "-")) == value
            if ok:
                out.append(n)
        return out

    def find(self, tag=None, **attrs):
        found = self.find_all(tag, **attrs)
        return found[0] if found else None

    def ancestors(self):
        n = self.parent
        while n is not None:
            yield n
            n = n.parent


class TreeBuilder(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = self.current = Node("#document", {})

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs, self.current)
        self.current.children.append(node)
        if tag not in VOID:
            self.current = node

    def handle_startendtag(self, tag, attrs):
        self.current.children.append(Node(tag, attrs, self.current))

    def handle_endtag(self, tag):
        n = self.current
        while n is not None and n.tag != tag:
            n = n.parent
        assert n is not None, f"</{tag}> closes nothing"
        self.current = n.parent

    def handle_data(self, data):
        self.current.children.append(data)


def parse_html(text: str) -> Node:
    builder = TreeBuilder()
    builder.feed(text)
    builder.close()
    assert builder.current is builder.root, f"unclosed <{builder.current.tag}>"
    return builder.root


# ---- fixtures --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def app(tiny_loaded):
    app = create_app(TEST_SETTINGS, loaded=tiny_loaded)
    yield app
    app.extensions["sendlens"].shutdown()


@pytest.fixture(scope="module")
def client(app):
    return app.test_client()


@pytest.fixture(scope="module")
def index(client):
    resp = client.get("/")
    assert resp.status_code == 200
    return resp, parse_html(resp.get_data(as_text=True))


# ---- /healthz --------------------------------------------------------------------------------
def test_the_site_has_an_icon_where_browsers_look(client):
    """Pages link static/favicon.svg, and /favicon.ico (asked for by browsers on their own, for a
    page that links none, such as /healthz) serves it: a 404 there is an error in the page's log."""
    page = client.get("/").get_data(as_text=True)
    assert '<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">' in page
    with client.get("/favicon.ico") as icon, client.get("/static/favicon.svg") as linked:
        assert icon.status_code == 200 and icon.mimetype == "image/svg+xml"
        assert icon.get_data() == linked.get_data()


def test_healthz_reports_engine_and_kv_pool(client, app):
    resp = client.get("/healthz")
    assert resp.status_code == 200
    assert resp.mimetype == "application/json"
    body = resp.get_json()
    assert body["status"] == "ok"
    assert body["model"] == "tiny"
    kv = body["kv"]
    assert {"total_blocks", "free_blocks", "block_size"} <= set(kv)
    assert kv["total_blocks"] == 64  # the configured pool
    assert kv["block_size"] == app.extensions["sendlens"].engine.config.block_size == 16
    assert 0 <= kv["free_blocks"] <= kv["total_blocks"]
    assert kv["free_blocks"] == kv["total_blocks"]  # nothing is running
    assert body["running"] == 0 and body["waiting"] == 0
    assert all(isinstance(kv[k], int) for k in ("total_blocks", "free_blocks", "block_size"))


# ---- / ---------------------------------------------------------------------------------------
def test_app_sections_follow_the_outline():
    """The sections read from content/ are the outline's, in order, with unique anchors."""
    assert [(s.number, s.title, s.widgets) for s in SECTIONS] == OUTLINE
    slugs = [s.slug for s in SECTIONS]
    assert len(set(slugs)) == len(slugs) == 23
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", s) for s in slugs)
    assert [n for s in SECTIONS for n in s.widgets] == OUTLINE_NAMES
    for s in SECTIONS:
        assert set(s.badges) <= set(BADGES)
        assert s.prose and all(p.strip() for p in s.prose)


def test_index_has_all_23_sections_in_order(index):
    resp, doc = index
    assert resp.mimetype == "text/html"
    sections = doc.find("main").find_all("section")
    assert len(sections) == 23
    for node, (number, title, _), spec in zip(sections, OUTLINE, SECTIONS):
        assert node.attrs["id"] == spec.slug
        assert node.attrs["data-section"] == str(number)
        heading = node.find("h2")
        assert " ".join(heading.text().split()) == f"{number} {title}"
        assert [" ".join(p.text().split()) for p in node.find("div", class_="prose").find_all("p")]
    ids = [n.attrs["id"] for n in doc.iter() if "id" in n.attrs]
    assert len(ids) == len(set(ids)), "duplicate ids on the page"


def test_index_has_a_table_of_contents(index):
    _, doc = index
    toc = doc.find("nav", class_="toc")
    assert toc is not None
    links = toc.find_all("a")
    assert [a.attrs["href"] for a in links] == [f"#{s.slug}" for s in SECTIONS]
    assert [a.text().strip() for a in links] == [title for _, title, _ in OUTLINE]


def test_index_prose_links_point_at_sections(index, client):
    _, doc = index
    anchors = {s.slug for s in SECTIONS}
    links = [a for sec in doc.find("main").find_all("section") for a in sec.find_all("a")]
    assert links, "the prose links sections to each other"
    for a in links:
        href = a.attrs["href"]
        if href.startswith("/"):                         # another page of this site (the benchmark)
            assert client.get(href).status_code == 200, href
        else:
            assert href.lstrip("#") in anchors, href
    assert "[" not in "".join(p.text() for p in doc.find_all("div", class_="prose")).replace("[0]", "")


def test_index_badges_explain_every_source(index):
    _, doc = index
    header = doc.find("header", class_="site-header")
    shown = {b.attrs["class"].split()[1] for b in header.find_all("span", class_="badge")}
    assert shown == {f"badge-{key}" for key in BADGES}
    for b in doc.find_all("span", class_="badge"):
        key = b.attrs["class"].split()[1].removeprefix("badge-")
        assert b.text().strip() == BADGES[key][0]
        assert b.attrs["title"] == BADGES[key][1]


def test_index_built_widgets_have_an_embed_snippet(index, app):
    assert "chat" in BUILT
    _, doc = index
    for name in BUILT:
        roots = doc.find_all("div", data_widget=name)
        assert len(roots) == 1
        root = roots[0]
        assert root.attrs["data-state"] == "loading"
        frame = root.parent
        assert "widget-frame" in frame.attrs["class"].split()
        section = next(a for a in root.ancestors() if a.tag == "section")
        assert section.attrs["id"] == next(s.slug for s in SECTIONS if name in s.widgets)
        snippet = frame.find("details", class_="embed-snippet").find("code", class_="snippet").text()
        m = re.fullmatch(r'<iframe src="([^"]+)" width="100%" height="\d+" style="border:0" title="[^"]+"></iframe>',
                         snippet)
        assert m, snippet
        assert m.group(1) == f"http://localhost/embed/{name}"  # the page's own origin
        assert frame.find("button", class_="copy-snippet") is not None


def test_index_coming_panels_for_unbuilt_widgets(index, app):
    _, doc = index
    panels = doc.find_all("figure", class_="coming")
    assert [p.attrs["data-coming"] for p in panels] == UNBUILT
    for panel in panels:
        name = panel.attrs["data-coming"]
        spec = next(s for s in SECTIONS if name in s.widgets)
        section = next(a for a in panel.ancestors() if a.tag == "section")
        assert section.attrs["id"] == spec.slug
        assert name in panel.text()
        summary = spec.summary.format_map(facts(app.extensions["sendlens"].facts()))
        assert " ".join(summary.split()) in " ".join(panel.text().split())
        keys = [b.attrs["class"].split()[1].removeprefix("badge-") for b in panel.find_all("span", class_="badge")]
        assert keys == list(spec.badges)
        assert panel.find("div", data_widget=name) is None
        assert panel.find("details") is None  # no embed snippet for a placeholder
    last = doc.find("section", id=SECTIONS[-1].slug)
    assert last.find("figure") is None and last.find("div", class_="widget") is None


def test_index_security_headers(index):
    resp, _ = index
    policy = csp(resp.headers)
    assert policy["frame-ancestors"] == "'self'"
    assert policy["script-src"] == "'self'" and policy["style-src"] == "'self'"
    assert policy["default-src"] == "'self'" and policy["object-src"] == "'none'"
    assert policy["connect-src"] == "'self' ws://localhost wss://localhost"
    assert resp.headers["Cross-Origin-Opener-Policy"] == "same-origin"
    assert "camera=()" in resp.headers["Permissions-Policy"]
    assert resp.headers["X-Frame-Options"] == "SAMEORIGIN"
    assert resp.headers["X-Content-Type-Options"] == "nosniff"


def test_index_loads_nothing_from_outside(index):
    resp, doc = index
    for n in doc.iter():
        for attr in ("src", "href"):
            value = n.attrs.get(attr)
            if value and n.tag != "a":
                assert value.startswith(("/", "#", "data:")), f"<{n.tag} {attr}={value}>"


# ---- /embed/<name> ---------------------------------------------------------------------------
def test_embed_chat_is_frameable_by_anyone(client):
    resp = client.get("/embed/chat")
    assert resp.status_code == 200
    assert csp(resp.headers)["frame-ancestors"] == "*"
    assert "X-Frame-Options" not in resp.headers
    doc = parse_html(resp.get_data(as_text=True))
    assert "embed" in doc.find("body").attrs["class"].split()
    roots = doc.find_all(data_widget="chat")
    assert len(roots) == 1
    assert roots[0].attrs["data-state"] == "loading"
    css = [n.attrs["href"] for n in doc.find_all("link") if n.attrs.get("rel") == "stylesheet"]
    assert "/static/css/widgets/chat.css" in css                  # the widget's own stylesheet
    assert doc.find("nav") is None and doc.find("section") is None  # the widget alone


def test_embed_frame_ancestors_is_configurable(tiny_loaded):
    other = create_app({**TEST_SETTINGS, "num_kv_blocks": 8, "frame_ancestors": "https://school.example"},
                       loaded=tiny_loaded)
    try:
        c = other.test_client()
        resp = c.get("/embed/chat")
        assert resp.status_code == 200
        assert csp(resp.headers)["frame-ancestors"] == "https://school.example"
        assert csp(c.get("/").headers)["frame-ancestors"] == "'self'"
    finally:
        other.extensions["sendlens"].shutdown()


def test_embed_unbuilt_widget_is_a_404_coming_page(client, app, monkeypatch):
    """A section may name a widget not built yet (front matter 'coming'); every widget of the
    outline is built today, so the test gives the last section one that is not."""
    import dataclasses

    import app.sections as sections
    name = "not-built-yet"
    last = sections.SECTIONS[-1]
    monkeypatch.setattr(sections, "SECTIONS", (*sections.SECTIONS[:-1], dataclasses.replace(
        last, widgets=(*last.widgets, name), coming=(*last.coming, name))))
    SECTIONS = sections.SECTIONS
    resp = client.get(f"/embed/{name}")
    assert resp.status_code == 404
    assert csp(resp.headers)["frame-ancestors"] == "*"
    doc = parse_html(resp.get_data(as_text=True))
    panel = doc.find("figure", class_="coming")
    assert panel is not None and panel.attrs["data-coming"] == name
    spec = next(s for s in SECTIONS if name in s.widgets)
    summary = spec.summary.format_map(facts(app.extensions["sendlens"].facts()))
    assert " ".join(summary.split()) in " ".join(panel.text().split())
    assert doc.find(data_widget=name) is None


@pytest.mark.parametrize("path", ["/embed/nope", "/embed/CHAT", "/embed/chat.js", "/embed/mental-model"])
def test_embed_unknown_name_is_404(client, path):
    resp = client.get(path)
    assert resp.status_code == 404
    text = resp.get_data(as_text=True)
    assert "data-coming" not in text and "data-widget" not in text


def test_embed_names_are_exactly_the_outline(client):
    """Every outline name answers 200 (built) or 404 with a coming page, never a plain 404."""
    for name in OUTLINE_NAMES:
        resp = client.get(f"/embed/{name}")
        assert resp.status_code == (200 if name in BUILT else 404), name
        assert f'data-widget="{name}"' in resp.get_data(as_text=True) or name not in BUILT


# ---- /vendor/plotly.min.js -------------------------------------------------------------------
def test_plotly_is_served_gzipped_with_cache_headers(client):
    from app.assets import plotly_path

    raw = plotly_path().read_bytes()
    resp = client.get("/vendor/plotly.min.js", headers={"Accept-Encoding": "gzip, deflate"})
    assert resp.status_code == 200
    assert resp.mimetype == "text/javascript"
    assert resp.headers["Content-Encoding"] == "gzip"
    assert "Accept-Encoding" in resp.headers["Vary"]
    body = resp.get_data()
    assert len(body) < len(raw) / 2
    assert gzip.decompress(body) == raw
    cc = resp.cache_control
    assert cc.public and cc.max_age and cc.max_age >= 3600
    etag = resp.headers["ETag"]
    assert etag

    again = client.get("/vendor/plotly.min.js", headers={"Accept-Encoding": "gzip", "If-None-Match": etag})
    assert again.status_code == 304
    assert again.get_data() == b""

    plain = client.get("/vendor/plotly.min.js")
    assert plain.status_code == 200
    assert "Content-Encoding" not in plain.headers
    assert plain.get_data() == raw
    assert plain.headers["ETag"] == etag

    stale = client.get("/vendor/plotly.min.js", headers={"If-None-Match": '"not-the-etag"'})
    assert stale.status_code == 200


def test_vendor_serves_nothing_else(client):
    assert client.get("/vendor/other.js").status_code == 404
    assert client.get("/vendor/..%2Fconfig.py").status_code == 404


# ---- ServerConfig ----------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("max_connections", 0),
    ("max_requests_per_connection", -1),
    ("max_queue", "3"),
    ("max_message_bytes", True),
    ("max_tokens_limit", 1.5),
    ("default_max_tokens", 0),
    ("max_inspect_tokens", None),
    ("max_jobs_per_connection", 0),
    ("max_messages", -5),
    ("frame_ancestors", ""),
    ("frame_ancestors", "*; script-src *"),
    ("frame_ancestors", "*\r\nX-Injected: 1"),
])
def test_server_config_rejects_bad_limits(field, value):
    with pytest.raises(InvalidParameter) as info:
        ServerConfig(**{field: value})
    assert info.value.param == field
    assert field in str(info.value)
    with pytest.raises(InvalidParameter) as info:
        ServerConfig.from_mapping({"model": "tiny", field: value})
    assert info.value.param == field


def test_server_config_default_max_tokens_within_limit():
    with pytest.raises(InvalidParameter) as info:
        ServerConfig(max_tokens_limit=10, default_max_tokens=20)
    assert info.value.param == "default_max_tokens"
    cfg = ServerConfig(max_tokens_limit=10, default_max_tokens=10)
    assert cfg.default_max_tokens == 10


def test_server_config_copies_the_engine_config():
    from core.config import EngineConfig
    engine_config = EngineConfig(block_size=8)
    cfg = ServerConfig(model="tiny", engine=engine_config)
    assert cfg.engine.model == "tiny" and cfg.engine.block_size == 8
    assert engine_config.model == "smollm2-135m"  # the caller's object is left as it was


def test_server_config_from_mapping():
    cfg = ServerConfig.from_mapping({"model": "tiny", "max_queue": 5, "block_size": 8, "num_kv_blocks": 12})
    assert cfg.model == "tiny" and cfg.engine.model == "tiny"
    assert cfg.max_queue == 5
    assert cfg.engine.block_size == 8 and cfg.engine.num_kv_blocks == 12
    with pytest.raises(InvalidParameter) as info:
        ServerConfig.from_mapping({"max_qeue": 5})
    assert info.value.param == "max_qeue"
    with pytest.raises(InvalidParameter) as info:
        ServerConfig.from_mapping({"block_size": 0})
    assert info.value.param == "block_size"


def test_create_app_refuses_a_bad_config():
    with pytest.raises(InvalidParameter) as info:
        create_app({"model": "tiny", "max_connections": -5})
    assert info.value.param == "max_connections"
