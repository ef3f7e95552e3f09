"""/benchmark: the latest `python -m bench` results as a page. Every number on it is checked against
the JSON itself (the file in the repository is a real run); a missing or broken file gives a page
that says how to make one, never a server error."""

import json
import statistics
from pathlib import Path
import re
from datetime import date
from html.parser import HTMLParser

import pytest

from app import ROOT, create_app
from bounds import f64_rel
from bench import report

LATEST = ROOT / "bench" / "results" / "latest.json"
SETTINGS = {"model": "tiny", "num_kv_blocks": 16, "testing": True}


class Figures(HTMLParser):
    """data-figure -> data-value of every element, and the page's text."""

    def __init__(self):
        super().__init__()
        self.values: dict[str, float] = {}
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "data-figure" in a:
            assert a["data-figure"] not in self.values, f"figure {a['data-figure']} twice"
            self.values[a["data-figure"]] = float(a["data-value"])

    def handle_data(self, data):
        self.text.append(data)


def figures(html: str) -> Figures:
    f = Figures()
    f.feed(html)
    return f


@pytest.fixture(scope="module")
def app(tiny_loaded):
    app = create_app(SETTINGS, loaded=tiny_loaded)
    yield app
    app.extensions["sendlens"].shutdown()


@pytest.fixture
def showing(app, monkeypatch):
    """Point the bench_results setting at a path for one test; returns a GET of /benchmark."""
    def show(path):
        monkeypatch.setattr(app.config["SENDLENS"], "bench_results", str(path))
        return app.test_client().get("/benchmark")
    return show


def slug(system: str) -> str:
    return re.sub(r"[^a-z0-9]", "_", system.lower())


def expected(data: dict) -> dict:
    """Every figure the page must show, computed here from the JSON."""
    out = {}
    for scenario, systems in data["results"].items():
        for system, entry in systems.items():
            if system == "memory bandwidth":             # a limit measured in each round, not a system
                continue
            median = entry["median"]
            key = f"{scenario}.{slug(system)}"
            if isinstance(median, dict):
                out[key] = median["output_tok_s"]
                for metric in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"):
                    out[f"{key}.{metric}"] = median[metric]
            else:
                out[key] = median
    for name, value in data["limits"].items():
        out[f"limits.{name}"] = value
    rounds = data["results"].get("decode_1", {}).get("memory bandwidth", {}).get("runs")
    if rounds:                                           # the bandwidth of each round of decode alone
        out["limits.memory_bandwidth_rounds_median_gb_s"] = statistics.median(rounds)
        out["limits.memory_bandwidth_rounds_lowest_gb_s"] = min(rounds)
        out["limits.memory_bandwidth_rounds_highest_gb_s"] = max(rounds)
    bandwidth = (statistics.median(rounds) if rounds else data["limits"]["memory_bandwidth_gb_s"]) * 1e9
    for system, nbytes in data["weight_bytes_per_token"].items():
        out[f"weight_bytes.{slug(system)}"] = nbytes
        out[f"decode_limit.{slug(system)}"] = bandwidth / nbytes
    same = {"transformers fp32": "ours fp32", "transformers bf16": "ours bf16", "llama.cpp Q4_1": "ours q4_1"}
    for system, entry in data["results"].get("decode_1", {}).items():
        nbytes = data["weight_bytes_per_token"].get(same.get(system, system))
        if nbytes:
            out[f"share_of_limit.{slug(system)}"] = entry["median"] * nbytes / bandwidth
    for i, t in enumerate(data["targets"]):
        if t["measured"] is not None:                    # not measured: a dash, no figure
            out[f"target.{i}"] = t["measured"]
        if t.get("spread"):                              # the ratio's spread over its rounds
            out[f"target.{i}.min"], out[f"target.{i}.max"] = t["spread"]
        out[f"target.{i}.goal"] = t["goal"]
    room = data.get("classroom")
    if room:                                             # this run's formats, then the stored rows
        for prefix, rows in (("classroom", room["formats"]), ("classroom_baseline", room["baseline"]["formats"])):
            for fmt, r in rows.items():
                out[f"{prefix}.{fmt}.output_tokens_per_s"] = r["output_tokens_per_s"]
                for metric in ("ttft", "tpot"):
                    for pct in ("p50", "p99"):
                        if r[f"{metric}_ms"][pct] is not None:
                            out[f"{prefix}.{fmt}.{metric}_{pct}_ms"] = r[f"{metric}_ms"][pct]
    return out


def test_the_page_shows_every_number_of_the_latest_run(showing):
    data = json.loads(LATEST.read_text())
    resp = showing("bench/results/latest.json")             # the default, relative to the project root
    assert resp.status_code == 200
    page = figures(resp.get_data(as_text=True))
    want = expected(data)
    assert set(page.values) == set(want)
    # each figure is the JSON's own number, or the same float64 formula in the same order as bench/report.py
    # (a product and a divide); data-value is Python's repr, which float() reads back exactly: equal
    for key, value in want.items():
        assert page.values[key] == value, key
    # spot checks against the README's table of the same run (written by bench/report.py)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    table = readme.split("<!-- bench:begin -->")[1].split("<!-- bench:end -->")[0]
    first = table.split("\n\n")[1]                         # the systems' table, after the line about the run
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in first.splitlines()
            if line.startswith("| ")}
    columns = rows[""]
    assert rows["decode, one request (tok/s)"][columns.index("ours q4_1")] == report.fmt_value(
        page.values["decode_1.ours_q4_1"])
    assert rows["decode, 64 requests (output tok/s, all)"][columns.index("ours bf16")] == report.fmt_value(
        page.values["serve_64.ours_bf16"])
    text = " ".join(page.text)
    # the badge names the machine and the date of the run, not today's
    m = data["machine"]
    assert f"measured on {m['cpu']} ({m['cores']} cores, {m['threads']} threads), {data['date'][:10]}" in text
    if data["date"][:10] != date.today().isoformat():
        assert date.today().isoformat() not in text
    for t in data["targets"]:
        assert t["target"] in text and t["how"] in text
        assert report.met_text(t) in text                # yes, no or not decided


def test_an_absolute_path_and_a_file_without_targets(showing, tmp_path):
    data = json.loads(LATEST.read_text())
    stored = data.pop("targets")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    page = figures(showing(path).get_data(as_text=True))
    computed = report.targets(data)                       # where bench/report.py takes them from
    # report.targets' ratios now against the ones the run stored: a float64 formula of at most 4 roundings
    # on positive numbers ((busy / quiet) / (threads / (threads + 1))), maybe written in another form then
    assert [t["target"] for t in computed] == [t["target"] for t in stored]
    measured = [i for i, t in enumerate(stored) if t["measured"] is not None]     # a line not measured: no figure
    assert [page.values[f"target.{i}"] for i in measured] == pytest.approx(
        [stored[i]["measured"] for i in measured], rel=f64_rel(4), abs=0)
    assert not any(f"target.{i}" in page.values for i in range(len(stored)) if i not in measured)
    assert [page.values[f"target.{i}.goal"] for i in range(len(computed))] == [t["goal"] for t in computed]


def with_classroom(data: dict) -> dict:
    """The run's JSON with a made-up classroom (bench/classroom.py's shape, the stored baseline) and a
    target line whose spread crosses its goal."""
    from bench.classroom import load_baseline

    def row(rate, ttft, tpot):
        return {"sent": 300, "completed": 300, "lost": 0, "output_tokens_per_s": rate,
                "ttft_ms": {"p50": ttft, "p99": 2 * ttft, "mean": ttft}, "tpot_ms": {"p50": tpot, "p99": 1.5 * tpot}}
    data = {**data, "classroom": {"model": "smollm2-135m", "clients": 50, "seconds": 60, "max_tokens": 32,
                                  "formats": {"bf16": row(270.5, 400.0, 170.0), "q4_1": row(205.25, 480.0, 230.0)},
                                  "baseline": load_baseline()}}
    data["targets"] = report.targets(data)
    line = data["targets"][0]
    line["spread"], line["goal"] = [1.2, 1.8], 1.5
    line["met"] = report.verdict(line["spread"], line["goal"])
    return data


def test_the_spread_the_verdicts_and_the_classroom(showing, tmp_path):
    data = with_classroom(json.loads(LATEST.read_text()))
    path = tmp_path / "room.json"
    path.write_text(json.dumps(data))
    resp = showing(path)
    assert resp.status_code == 200
    html = resp.get_data(as_text=True)
    page = figures(html)
    assert set(page.values) == set(expected(data))
    for key, value in expected(data).items():
        assert page.values[key] == value, key
    assert page.values["target.0.min"] == 1.2 and page.values["target.0.max"] == 1.8
    assert page.values["classroom.bf16.output_tokens_per_s"] == 270.5
    assert page.values["classroom_baseline.q4_1.output_tokens_per_s"] == 196.5     # the stored row
    targets = html.split('id="targets"', 1)[1]
    assert '<td class="is-undecided">not decided</td>' in targets
    room = html.split('id="classroom"', 1)[1].split("</section>", 1)[0]
    assert room.count("<tr") == 1 + 2 + 3                 # the head, this run's 2 formats, the 3 stored rows
    assert "2026-11-30" in room and "a5e1101" in room


def test_a_file_from_before_the_spreads_says_yes_or_no(showing, tmp_path):
    data = json.loads(LATEST.read_text())
    data["targets"] = [{"target": "decode alone: best format vs llama.cpp Q4_1", "measured": 1.2, "goal": 1.0,
                        "met": True, "how": "ours q4_1 / llama.cpp Q4_1"},
                       {"target": "decode alone vs the memory-bandwidth limit", "measured": 0.4, "goal": 0.6,
                        "met": False, "how": "ours q4_1"}]
    data.pop("classroom", None)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    html = showing(path).get_data(as_text=True)
    targets = html.split('id="targets"', 1)[1]
    assert '<td class="is-met">yes</td>' in targets and '<td class="is-unmet">no</td>' in targets
    assert 'id="classroom"' not in html


def test_a_quick_run_shows_what_it_measured(showing, tmp_path):
    data = json.loads(LATEST.read_text())
    data["quick"] = True
    for scenario in ("serve_32", "prefill_4096"):
        del data["results"][scenario]
    data["targets"] = report.targets(data)
    path = tmp_path / "quick.json"
    path.write_text(json.dumps(data))
    resp = showing(path)
    assert resp.status_code == 200
    page = figures(resp.get_data(as_text=True))
    assert set(page.values) == set(expected(data))
    assert not any(k.startswith(("serve_32", "prefill_4096")) for k in page.values)
    text = " ".join(" ".join(page.text).split())
    assert "8, 64 requests" in text and "generating 16 tokens" in text and "generating 32 tokens after" in text


def test_the_page_describes_the_run_as_the_benchmark_plans_it():
    from types import SimpleNamespace

    from bench.__main__ import plan
    from app.benchmark import view
    data = json.loads(LATEST.read_text())
    for quick in (False, True):
        scenarios = {s["name"]: s for s in plan(SimpleNamespace(quick=quick, rounds=3))}
        v = view({**data, "quick": quick})
        assert v["decode_tokens"] == scenarios["decode_1"]["args"][1]
        assert v["serve_tokens"] == scenarios["serve_8"]["args"][1]


@pytest.mark.parametrize("content, why", [
    (None, "there is no file"),
    ("{not json", "could not be read as JSON"),
    ("[1, 2]", "holds no JSON object"),
    ('{"date": "2026-11-30"}', "lacks machine, limits, results"),
    ('{"date": "2026-11-30", "machine": {}, "limits": {}, "results": {}}', "do not have the shape"),
    ('{"date": "2026-11-30", "machine": {"cpu": "x", "cores": 2, "threads": 2, "torch": "2", "load_before": [1],'
     ' "load_after": [1]}, "limits": {"memory_bandwidth_gb_s": 1}, "results": {"decode_1": {"ours fp32": '
     '{"median": "fast"}}}, "weight_bytes_per_token": {}}', "do not have the shape"),
])
def test_a_missing_or_broken_file_gives_a_page_saying_how_to_make_one(showing, tmp_path, content, why):
    path = tmp_path / "latest.json"
    if content is not None:
        path.write_text(content)
    resp = showing(path)
    assert resp.status_code == 404
    html = resp.get_data(as_text=True)
    assert why in html and "make bench" in html and "python -m bench" in html and "bench_results" in html
    assert str(path) in html
    assert "data-figure" not in html and 'data-state="error"' in html


def test_the_walkthrough_and_the_readme_link_the_page(app):
    html = app.test_client().get("/").get_data(as_text=True)
    for slug_ in ("phases", "gemm"):
        section = html.split(f'<section id="{slug_}"', 1)[1].split("</section>", 1)[0]
        assert 'href="/benchmark"' in section, slug_
    footer = html.split('<footer class="site-footer">', 1)[1]
    assert 'href="/benchmark"' in footer
    readme = (ROOT / "README.md").read_text()
    bench_section = readme.split("## Speed: the benchmark", 1)[1].split("\n## ", 1)[0]
    assert "/benchmark" in bench_section


@pytest.mark.browser
@pytest.mark.real_model
def test_the_benchmark_page_in_a_browser(pg, artifacts_dir):
    data = json.loads(LATEST.read_text())
    page = pg.page
    page.set_viewport_size({"width": 1280, "height": 800})
    pg.goto("/benchmark")
    page.wait_for_selector('main.bench[data-state="ready"]', timeout=60_000)
    page.screenshot(path=str(artifacts_dir / "benchmark-1280.png"), full_page=True)
    shown = dict(page.eval_on_selector_all("[data-figure]", "els => els.map(e => [e.dataset.figure, Number(e.dataset.value)])"))
    want = expected(data)
    assert set(shown) == set(want)
    for key, value in want.items():     # repr in the page, Number() reads it back exactly (as above)
        assert shown[key] == value, key
    for chart in ("decode", "prefill", "serve", "latency", "targets"):
        assert page.locator(f"#chart-{chart} .main-svg").count() >= 1, chart
    # the decode chart draws the medians of the JSON, system by system
    ys = page.evaluate("() => document.getElementById('chart-decode').data[0].y")
    systems = [s for s in report.OURS + report.PEERS if any(s in r for r in data["results"].values())]
    assert ys == [data["results"]["decode_1"][s]["median"] for s in systems]      # the JSON's numbers, through JSON: exact
    pg.assert_clean()
    page.set_viewport_size({"width": 390, "height": 844})
    pg.goto("/benchmark")
    page.wait_for_selector('main.bench[data-state="ready"]', timeout=60_000)
    page.screenshot(path=str(artifacts_dir / "benchmark-phone-390.png"), full_page=True)
    overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the benchmark page scrolls sideways by {overflow}px on a phone"
    pg.assert_clean()
