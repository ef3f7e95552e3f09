"""Shared fixtures. Fast tests use the `tiny` model; tests on the real model share one load.

Markers: `real_model` (smollm2-135m), `browser` (Chromium against a live server).
"""

import core  # noqa: F401  (first: it sets OpenMP's spin before anything loads torch)

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import simple_websocket
from simple_websocket import ConnectionClosed

from bench.replicas import stop_process, wait_until

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = Path(os.environ.get("SENDLENS_ARTIFACTS", ROOT / "artifacts"))


def pytest_sessionstart(session):
    """Build the engine's C++ decoder once, before any test or server starts an engine (the first
    build takes minutes; later runs load it from torch's extensions cache)."""
    from core.kernels import loader
    loader.extension()


# Modules that start worker processes or a server of their own, wait out the server's own
# timeouts (pings, idle connections, a stopped process), or run the engine on an emulated CPU
# (minutes of qemu): `make test` runs them, `make fast` (the
# inner loop, -m "not slow") leaves them out. Matched by file name, in tests/ and tests/widgets/;
# a single test elsewhere that does the same carries @pytest.mark.slow itself.
SLOW_MODULES = {"test_live.py", "test_main.py", "test_load.py", "test_workers.py", "test_replicas.py",
                "test_tensor_parallel.py", "test_pipeline.py", "test_expert_parallel.py", "test_worker_failed.py",
                "test_emulated_cpu.py"}


# Fixtures of this file that load the real model (in this process or in `python -m app`) or start
# Chromium: a test that needs one, directly or through another fixture, gets the marker even where
# its decorator was left off, so `make fast` never loads SmolLM2 or starts a browser.
REAL_MODEL_FIXTURES = {"smollm_loaded", "hf_reference", "server"}
BROWSER_FIXTURES = {"browser"}


def uses_conftest_fixture(item, names: set[str]) -> bool:
    """The test needs one of this file's fixtures `names` (a test module's own fixture of the
    same name, such as test_live's tiny `server`, does not count)."""
    defs = item._fixtureinfo.name2fixturedefs
    return any(d.func.__module__ == __name__ for name in names & set(item.fixturenames)
               for d in defs.get(name, ())[-1:])


# `make test` runs the suite in two processes (pytest-xdist; tests/xdist_groups.py schedules):
# one test module is one group, so a module's own server or engine starts once; every test of the
# real-model server (`python -m app`, whose first jobs take minutes) is one group, so one server
# computes them once; and the tests that load transformers' reference share a process too. The
# real-model server's group is the longest: nothing else joins it.
XDIST_GROUPS = (("real-server", {"server"}), ("transformers", {"hf_reference", "logit_bounds"}))


def xdist_group(item) -> str:
    return next((group for group, fixtures in XDIST_GROUPS if uses_conftest_fixture(item, fixtures)),
                item.path.relative_to(ROOT).as_posix())


@pytest.hookimpl(trylast=True)    # after xdist's own, which registers the controller's session
def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        import xdist_groups
        xdist_groups.configure(config)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if uses_conftest_fixture(item, REAL_MODEL_FIXTURES) and not item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.real_model)
        if uses_conftest_fixture(item, BROWSER_FIXTURES) and not item.get_closest_marker("browser"):
            item.add_marker(pytest.mark.browser)
    if config.pluginmanager.hasplugin("xdist"):
        import xdist_groups
        xdist_groups.write_groups(config, items, xdist_group)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def tiny_loaded():
    from toy_models import load_model
    return load_model("tiny")


@pytest.fixture(scope="session")
def smollm_loaded():
    """SmolLM2-135M-Instruct, loaded once for the whole session."""
    from toy_models import load_model
    return load_model("smollm2-135m")


@pytest.fixture
def make_tiny_llm(tiny_loaded):
    """LLM(\"tiny\", **engine settings) sharing the session's weights."""
    from core import LLM

    def make(**kwargs):
        return LLM("tiny", loaded=tiny_loaded, **kwargs)
    return make


@pytest.fixture
def make_smollm(smollm_loaded):
    """LLM(\"smollm2-135m\", **engine settings) sharing the session's weights."""
    from core import LLM

    def make(**kwargs):
        return LLM("smollm2-135m", loaded=smollm_loaded, **kwargs)
    return make


@pytest.fixture(scope="session")
def smollm(smollm_loaded):
    """One LLM on the real model with default settings, shared by the session."""
    from core import LLM
    return LLM("smollm2-135m", loaded=smollm_loaded)


@pytest.fixture(scope="session")
def smollm_served(smollm_loaded):
    """One LLM on the real model in the server's weight format (what `python -m app` serves),
    shared by the session: the widgets' live numbers come from this computation."""
    from app.config import ServerConfig
    from core import LLM
    return LLM("smollm2-135m", loaded=smollm_loaded, num_kv_blocks=64,
               weight_format=ServerConfig().engine.weight_format)


@pytest.fixture(scope="session")
def hf_reference():
    """transformers' LlamaForCausalLM and tokenizer, loaded from the same GGUF file."""
    import warnings

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toy_models.gguf_loader import find_gguf

    path = find_gguf()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own deprecation chatter is not ours
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def logit_bounds(smollm_loaded, tmp_path_factory):
    """bounds.LogitBounds of SmolLM2 in fp32 on the first 64 tokens of bounds.REFERENCE_PROMPT:
    `.bound(fmt, isa)` bounds |engine logit - transformers' fp32 logit| per weight format, derived
    against float64 (tests/bounds.py), for test_parity and the widgets that compare with transformers.
    In an xdist run, a format's redraws (a minute of work) are computed by one process and read
    by the others (shared_redraws), once for the kernel paths that round alike (bounds.rounding_path)."""
    from bounds import REFERENCE_PROMPT, LogitBounds

    from core.model.model import Transformer
    ids = smollm_loaded.tokenizer.encode(REFERENCE_PROMPT)[:64]
    if len(ids) != 64:
        raise ValueError(f"REFERENCE_PROMPT: {len(ids)} tokens, want 64")
    bounds = LogitBounds(Transformer.from_state_dict(smollm_loaded.config, smollm_loaded.state_dict), ids)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")         # the same in every process of this run
    if run:
        shared_redraws(bounds, tmp_path_factory.getbasetemp().parent / f"redraws-{run}")
    return bounds


def shared_redraws(bounds, folder: Path) -> None:
    """bounds.compute_runs(fmt, isa) (the redraws and their quality figures), computed once for all
    of this run's xdist processes (they share the run's base temporary folder; `folder` is named
    by the run, so a run never reads an older run's files, even with a fixed --basetemp): the
    first to ask computes it under a file lock and saves it; a process asking while it computes
    waits for the lock, then reads. The same function of the same model and tokens with a fixed
    seed: each process would compute the same tensors."""
    import functools

    import torch
    from filelock import FileLock
    folder.mkdir(exist_ok=True)
    compute = bounds.compute_runs

    @functools.cache
    def compute_runs(fmt: str, isa: str):
        path = folder / f"{fmt}-{isa or 'torch'}.pt"
        with FileLock(str(path) + ".lock"):
            if not path.exists():
                torch.save(compute(fmt, isa), path)
            return torch.load(path)
    bounds.compute_runs = compute_runs


# ---- a live server for the websocket tests ---------------------------------------------------
# Small limits, so each one can be reached in a test.
LIVE_SETTINGS = {
    "model": "tiny",
    "num_kv_blocks": 256,               # 4096 token slots: the tiny model's 2048-token window fits
    "max_connections": 4,
    "max_requests_per_connection": 2,
    "max_queue": 3,
    "max_message_bytes": 4096,
    "max_tokens_limit": 64,
    "default_max_tokens": 16,
    "max_inspect_tokens": 64,
    "max_messages": 8,
    "testing": True,
}


@pytest.fixture(scope="session")
def live_server(tiny_loaded):
    """The app (tiny model, LIVE_SETTINGS) served on loopback by werkzeug in a thread.

    Yields a namespace: app, runtime, port, http (base URL), ws (the /ws URL).
    """
    yield from serve_app(dict(LIVE_SETTINGS), tiny_loaded)


# ---- engine helpers for the core tests --------------------------------------------------------

@pytest.fixture
def make_tiny_engine(tiny_loaded):
    """LLMEngine on the tiny model with EngineConfig(**settings), sharing the session's weights."""
    from core import EngineConfig, LLMEngine

    def make(**settings):
        return LLMEngine(EngineConfig(model="tiny", **settings), loaded=tiny_loaded)
    return make


def _assert_pool_clean(engine):
    """Nothing running or queued, every KV block free, every reference count 0."""
    stats = engine.view.kv_stats()
    assert not engine.has_unfinished_requests()
    assert stats["free_blocks"] == stats["total_blocks"]
    assert stats["used_blocks"] == 0
    assert set(engine.block_manager.ref_counts()) == {0}
    assert all(slot is None for slot in engine.scheduler.slots)


@pytest.fixture(scope="session")
def assert_pool_clean():
    """A check to call at the end of a test: the engine gave every block and slot back."""
    return _assert_pool_clean


# ---- the real server in Chromium (browser tests) -----------------------------------------------
CHROMIUM = Path(os.environ.get("SENDLENS_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
BAD_WORDS = re.compile(r"\bundefined\b|\bNaN\b|\[object Object\]")


def drain(gen):
    """Run a job's generator to the end, as the job runner would: (what it yielded, its result)."""
    items = []
    while True:
        try:
            items.append(next(gen))
        except StopIteration as stop:
            return items, stop.value


def assert_writes_its_section(write_readme, begin: str, end: str, text: str, tmp_path) -> None:
    """write_readme(text, path) puts `text` between a README's `begin` and `end` markers and keeps
    the rest: checked on a small README in tmp_path."""
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{begin}\nold\n{end}\nb\n")
    write_readme(text, readme)
    assert readme.read_text() == f"a\n{begin}\n{text}\n{end}\nb\n"


def lm_head_bytes_per_weight_q4_1() -> float:
    """Bytes a weight of q4_1's LM head takes: Q8_0 (a byte, and an fp16 scale per 32) where its
    kernel runs, else two Q4_1 halves (half a byte and an fp16 scale and minimum per 32, twice)."""
    from core.model.linear import PackedQ8_0
    import torch
    return 1 + 2 / 32 if PackedQ8_0(torch.ones(16, 32)).prepacked else 2 * (0.5 + 4 / 32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


@pytest.fixture(scope="session")
def server(artifacts_dir):
    """`python -m app` on a free port with the real model; stopped at the end of the session."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = artifacts_dir / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "--host", "127.0.0.1", "--port", str(port), "--model", "smollm2-135m"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        # Hang-stopping only: a fresh machine's first start converts the model and may build the
        # C++ decoder (minutes on two busy cores).
        wait_until(lambda: get_json(base + "/healthz")["status"] == "ok", proc, "the server", log_path, timeout=600)
        yield SimpleNamespace(base=base, port=port, proc=proc)
    finally:
        stop_process(proc, timeout=15)
        log.close()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two replicas of `python -m app` (the tiny model), Redis and nginx on free loopback ports
    (bench/replicas.py), each replica allowing 3 connections per address; stopped after the module.
    Skipped where Debian's nginx or redis-server is missing (`make test` installs both)."""
    from bench.replicas import Deployment, missing_binaries
    missing = missing_binaries()
    if missing:
        pytest.skip(f"the replica test needs Debian's {' and '.join(missing)} (apt-get install nginx "
                    "redis-server; make test installs them)")
    with Deployment(tmp_path_factory.mktemp("replicas"), replicas=2, model="tiny",
                    settings={"max_connections_per_address": 3}) as deployment:
        yield deployment


@pytest.fixture(scope="session")
def browser():
    if not CHROMIUM.exists():  # `make test` installs it; a missing browser must not pass quietly
        pytest.fail(f"no Chromium at {CHROMIUM}: install Debian's chromium package (make test does)")
    from playwright.sync_api import sync_playwright

    pw = sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()
    finally:
        pw.stop()


class Page:
    """A page whose console errors, page errors, websockets and outside requests are recorded:
    a new page of `context` (its requests outside the server aborted), or with `tab`, a kept tab
    (Tabs) reused as it is."""

    def __init__(self, context, server, tab=None):
        self.server = server
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        self.blocked: list[str] = []
        self.sockets: list[str] = []
        if tab is None:
            context.route("**/*", self._route)
            tab = context.new_page()
        self.page = page = tab
        self._listeners = [("console", lambda m: self.console_errors.append(m.text) if m.type == "error" else None),
                           ("pageerror", lambda e: self.page_errors.append(str(e))),
                           ("websocket", lambda ws: self.sockets.append(ws.url)),
                           ("request", lambda r: None if self._ours(r.url) else self.blocked.append(r.url))]
        for event, listener in self._listeners:
            page.on(event, listener)
        page.set_default_timeout(30_000)

    def _ours(self, url: str) -> bool:
        return (url == self.server.base or url.startswith(self.server.base + "/")
                or url.startswith(("data:", "blob:", "about:")))

    def _route(self, route):
        url = route.request.url
        if url == self.server.base or url.startswith(self.server.base + "/"):
            route.continue_()
        else:
            route.abort()   # the request listener records it

    def detach(self) -> None:
        """Stop recording (a kept tab goes on to the next test)."""
        for event, listener in self._listeners:
            self.page.remove_listener(event, listener)

    def goto(self, path: str):
        return self.page.goto(self.server.base + path)

    def assert_clean(self):
        assert self.console_errors == [], self.console_errors
        assert self.page_errors == [], self.page_errors
        assert self.blocked == [], f"requests outside the server: {self.blocked}"
        ws_base = f"ws://127.0.0.1:{self.server.port}/"
        assert all(u.startswith(ws_base) for u in self.sockets), self.sockets
        text = self.page.inner_text("body")
        assert not BAD_WORDS.search(text), BAD_WORDS.search(text).group(0)


CLEARED = "local_storage,indexeddb,cookies,service_workers,cache_storage,websql"   # CDP Storage types
VIEWPORT = {"width": 1280, "height": 900}


class Tabs:
    """Browser tabs kept for the session, one per server and CSP rule, each reused test after
    test. Chromium keeps a tab's renderer process across navigations within one site, and with it
    the JavaScript the process has compiled: plotly.js above all, which a fresh context compiles
    again (a widget page with a plot costs Chromium about a quarter of its CPU in a kept tab).
    Between tests the tab goes to the server's /healthz (the same site, so the process stays; the
    old page ends, with its sockets and workers), the origin's storage is cleared (localStorage,
    IndexedDB, cookies, service workers, the Cache API; this app keeps nothing in sessionStorage),
    and the viewport and the emulated media are set as a new context would have them. A test that
    needs a context of its own (a fake clock, listeners of its own) is marked `fresh_page`; a
    module whose pages all need the same init script keeps a Tabs of its own (test_reconnect), so
    that no other test's tab runs it."""

    def __init__(self, browser):
        self.browser, self.kept = browser, {}

    def page(self, server, viewport=None, bypass_csp: bool = False, color_scheme: str = "light",
             reduced_motion: str = "no-preference") -> Page:
        key = (server.base, bypass_csp)
        if key in self.kept and self.kept[key][1].is_closed():
            self.kept.pop(key)[0].close()
        if key not in self.kept:
            context = self.browser.new_context(viewport=VIEWPORT, bypass_csp=bypass_csp)
            tab = context.new_page()
            self.kept[key] = (context, tab, context.new_cdp_session(tab))
        context, tab, cdp = self.kept[key]
        tab.goto(server.base + "/healthz")
        cdp.send("Storage.clearDataForOrigin", {"origin": server.base, "storageTypes": CLEARED})
        context.clear_cookies()
        tab.set_viewport_size(viewport or VIEWPORT)
        tab.emulate_media(media="screen", color_scheme=color_scheme, reduced_motion=reduced_motion)
        return Page(context, server, tab=tab)

    def close(self) -> None:
        for context, _, _ in self.kept.values():
            context.close()


@pytest.fixture(scope="session")
def tabs(browser):
    kept = Tabs(browser)
    yield kept
    kept.close()


@pytest.fixture
def pg(request, tabs, browser, server):
    if request.node.get_closest_marker("fresh_page"):
        context = browser.new_context(viewport=VIEWPORT)
        try:
            yield Page(context, server)
        finally:
            context.close()
        return
    page = tabs.page(server)
    try:
        yield page
    finally:
        page.detach()


def wait_ready(page, selector: str, timeout: float = 60_000):
    page.wait_for_selector(f'{selector}[data-state="ready"]', timeout=timeout)




def figure_value(page, key: str, root: str = "") -> float:
    """The raw number of a badged figure: data-value of [data-figure=key]."""
    return float(page.get_attribute(f'{root} [data-figure="{key}"]'.strip(), "data-value"))


def on_a_phone(pg, name: str, query: str, artifacts_dir, ready_timeout: float = 90_000) -> str:
    """The walkthrough at 390 px wide with `name`'s options in the URL (/?<name>.<option>=...):
    the widget scrolled into view and ready, a screenshot of it, no sideways scrolling. Returns
    the text of its "Embed this widget" snippet, which must carry the reader's settings."""
    page = pg.page
    page.set_viewport_size({"width": 390, "height": 844})
    pg.goto(f"/{query}#{name}")
    root = f'[data-widget="{name}"]'
    page.locator(root).scroll_into_view_if_needed()
    wait_ready(page, root, ready_timeout)
    page.locator(root).screenshot(path=str(artifacts_dir / f"{name}-phone-390.png"))
    overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the walkthrough scrolls sideways by {overflow}px on a phone"
    return page.locator(f'.widget-frame:has({root}) .snippet').text_content()


def shoot_widget(pg, name: str, artifacts_dir, query: str = "", ready_timeout: float = 90_000) -> None:
    """Screenshots a person looks at: the widget at 1280x800 on its embed page, and in a 600x450
    iframe on a page of another site (about:blank here). Both must reach ready, cleanly."""
    page = pg.page
    page.set_viewport_size({"width": 1280, "height": 800})
    pg.goto(f"/embed/{name}{query}")
    wait_ready(page, f'[data-widget="{name}"]', ready_timeout)
    page.screenshot(path=str(artifacts_dir / f"{name}-1280.png"))
    pg.assert_clean()
    src = f"{pg.server.base}/embed/{name}{query}"
    page.set_content(f'<iframe src="{src}" width="600" height="450" style="border:1px solid #ccc"></iframe>')
    frame = page.frame_locator("iframe")
    frame.locator(f'[data-widget="{name}"][data-state="ready"]').wait_for(timeout=ready_timeout)
    page.locator("iframe").screenshot(path=str(artifacts_dir / f"{name}-iframe-600x450.png"))
    overflow = page.frames[1].evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"{name} scrolls sideways by {overflow}px in a 600 px frame"
    assert pg.console_errors == [] and pg.page_errors == [], (pg.console_errors, pg.page_errors)


def axe_blocking(page) -> list[str]:
    """axe-core's serious and critical violations on the page (a page served
    with the site's CSP needs a context with bypass_csp=True to let axe in)."""
    from axe_playwright_python.sync_playwright import Axe
    found = Axe().run(page, options={"resultTypes": ["violations"]}).response["violations"]
    return [f"{v['id']} ({v['impact']}): {v['nodes'][0]['target']}" for v in found if v["impact"] in ("serious", "critical")]


def author_page(html: str, host: str = "127.0.0.1") -> str:
    """A page of `html` served on a free port of loopback address `host` until the process ends
    (another address, such as 127.0.0.2, is another site): its URL."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = ThreadingHTTPServer((host, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://{host}:{server.server_port}/"


# ---- worker processes (core/parallel/workers.py) left behind? -------------------------------------------

def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


FORKSERVER = "multiprocessing.forkserver"   # in the command line of the forkserver and of what it forks


def worker_processes(root: int) -> list[int]:
    """Live descendants of process `root` that are worker processes, found by scanning /proc:
    WorkerGroup's workers, forked by multiprocessing's forkserver (a child of a forkserver; the
    forkserver itself, which stays for the next group, and the resource tracker are not workers),
    and any process started by multiprocessing's spawn."""
    children: dict[int, list[int]] = {}
    parent: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read().rsplit(")", 1)[-1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if stat[0] == "Z":
            continue
        children.setdefault(int(stat[1]), []).append(int(entry))
        parent[int(entry)] = int(stat[1])
        cmdlines[int(entry)] = cmdline
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if "spawn_main" in cmdlines.get(pid, "") or (FORKSERVER in cmdlines.get(pid, "")
                                                      and FORKSERVER in cmdlines.get(parent.get(pid), "")):
            found.append(pid)
        todo.extend(children.get(pid, []))
    return sorted(found)


# ---- a websocket client for the protocol and widget tests --------------------------------------
TIMEOUT = 30.0  # seconds to wait for one message (the machine may be busy with other tests)


# ---- a small client --------------------------------------------------------------------------
class Stream:
    def __init__(self, accepted=None, tokens=(), done=None, error=None):
        self.accepted, self.tokens, self.done, self.error = accepted, list(tokens), done, error

    @property
    def token_ids(self):
        return [t["token_id"] for t in self.tokens]

    @property
    def text(self):
        return "".join(t["text"] for t in self.tokens)


class Client(simple_websocket.Client):
    """simple_websocket's client, minus a race: its handshake reads the server's first frames
    together with the handshake reply and keeps only the reply's event, so a server that speaks
    first (our hello) is not heard until more data arrives. Hand the rest to the input buffer.
    Those frames may end with the server's close (a refused connection: its error, then close):
    the connection still counts as open here, so that the constructor does not raise and the
    error can be read; the reader thread then finds the socket closed."""

    def handshake(self):
        super().handshake()
        self._handle_events()
        self.connected = True


class WS:
    """A websocket client that keeps replies to other ids aside while waiting for one id."""

    def __init__(self, url: str, headers: dict | None = None):
        self.client = Client.connect(url, headers=headers)
        self.backlog: list[dict] = []
        self.counter = 0
        raw = self.client.receive(TIMEOUT)
        assert raw is not None, "no hello from the server"
        self.hello = json.loads(raw)

    def next_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    def send(self, msg) -> None:
        self.client.send(msg if isinstance(msg, (str, bytes)) else json.dumps(msg))

    def recv_for(self, mid, timeout: float = TIMEOUT) -> dict:
        """The next message whose id is mid (None matches errors without a usable id)."""
        for i, m in enumerate(self.backlog):
            if m.get("id") == mid:
                return self.backlog.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            raw = self.client.receive(max(left, 0.01))
            if raw is None:
                raise AssertionError(f"no message for id {mid!r} within {timeout} s")
            m = json.loads(raw)
            if m.get("id") == mid and type(m.get("id")) is type(mid):
                return m
            self.backlog.append(m)

    def quiet(self, seconds: float = 0.2) -> bool:
        """True if nothing arrives for `seconds`."""
        return not self.backlog and self.client.receive(seconds) is None

    def start(self, mid=None, **fields):
        mid = self.next_id() if mid is None else mid
        self.send({"type": "generate", "id": mid, **fields})
        return mid

    def accepted(self, mid) -> dict:
        m = self.recv_for(mid)
        assert m["type"] == "accepted", m
        return m

    def finish(self, mid, accepted=None) -> Stream:
        """Collect a generate request's replies up to done (or an error)."""
        s = Stream(accepted=accepted)
        while True:
            m = self.recv_for(mid)
            if m["type"] == "error":
                s.error = m
                return s
            if m["type"] == "accepted":
                assert s.accepted is None and not s.tokens, "accepted comes first, once"
                s.accepted = m
            elif m["type"] == "token":
                assert s.accepted is not None, "a token before accepted"
                s.tokens.append(m)
            elif m["type"] == "done":
                assert s.accepted is not None, "done before accepted"
                s.done = m
                return s
            else:
                raise AssertionError(f"unexpected reply {m}")

    def generate(self, **fields) -> Stream:
        return self.finish(self.start(**fields))

    def call(self, kind, **fields) -> dict:
        mid = self.next_id()
        self.send({"type": kind, "id": mid, **fields})
        return self.recv_for(mid)

    def call_within_rate(self, kind, tries: int = 50, **fields) -> dict:
        """call(), honouring the server's message-rate refusals: each `overloaded` (param `rate`)
        names how long to wait ("retry after X s"); wait that long and send again. Counts tries,
        not time: the server must let the message through once its allowance has refilled."""
        for _ in range(tries):
            reply = self.call(kind, **fields)
            if not (reply["type"] == "error" and reply.get("param") == "rate"):
                return reply
            assert reply["code"] == "overloaded", reply
            time.sleep(float(re.search(r"retry after ([0-9.]+) s", reply["message"]).group(1)))
        raise AssertionError(f"still refused for its rate after {tries} tries: {reply}")

    def job(self, kind, timeout: float = 120, **fields) -> dict:
        """A job's final reply, past its progress messages (each checked on the way)."""
        mid = self.next_id()
        self.send({"type": kind, "id": mid, **fields})
        while True:
            m = self.recv_for(mid, timeout=timeout)
            if m["type"] != "progress":
                return m
            assert 0 <= m["done"] <= m["total"] and m["note"]

    def error(self, msg, mid=None) -> dict:
        """Send a message that must be refused; return the error."""
        self.send(msg)
        m = self.recv_for(mid)
        assert m["type"] == "error", m
        return m

    def close(self) -> None:
        """Close our side; a connection the server has already closed is left as it is (the
        client's reader thread may have closed the socket a moment before `connected` turns
        false, so sending our close frame can meet EBADF)."""
        try:
            self.client.close()
        except (ConnectionClosed, OSError):
            pass


def healthz(server) -> dict:
    with urllib.request.urlopen(server.http + "/healthz", timeout=10) as resp:
        return json.load(resp)


def wait_for(predicate, timeout: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def ws(live_server):
    wait_for(lambda: healthz(live_server)["connections"] == 0, what="earlier connections to close")
    client = WS(live_server.ws)
    yield client
    client.close()



@pytest.fixture
def real_ws(server):
    """A websocket client on the real-model server (the browser tests' `python -m app`)."""
    client = WS(f"ws://127.0.0.1:{server.port}/ws")
    yield client
    client.close()


def serve_app(settings: dict, loaded):
    """A werkzeug server of the app on a free loopback port, for a module's fixture to yield from:
    yields (app, runtime, port, http, ws), then shuts the server and the engine down."""
    from types import SimpleNamespace

    from app import create_app
    from app.loopback import serve
    app = create_app(settings, loaded=loaded)
    served = serve(app, name="live-server")
    yield SimpleNamespace(app=app, runtime=app.extensions["sendlens"], port=served.port, http=served.http, ws=served.ws)
    served.stop()
    app.extensions["sendlens"].shutdown()
