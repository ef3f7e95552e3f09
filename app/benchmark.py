"""The benchmark page, /benchmark: what `python -m bench` measured on this project's machine.

It reads the JSON that bench/__main__.py writes (the `bench_results` setting; by default the
bench/results/latest.json in the repository, a real run) on every request, so a new run shows up
without a restart. Every number is the median of the run's interleaved rounds, as bench/report.py
prints it, badged "measured on <machine>, <date of the run>"; the targets are the file's own, or
bench/report.py's targets() over its results for a file written before it stored them. A missing or
unreadable file gives a page that says how to make one (404), never a server error.

The page: a table per question (decode alone, with speculative decoding, beside a busy process, prefill, aggregate
decode at 8/32/64 requests with TTFT and TPOT p50/p99, the machine's limits with each system's
decode alone as a share of its bandwidth limit, the classroom in each weight format beside the
stored rows, the targets with each ratio's spread over its rounds and its verdict: yes, no or not
decided), each number an element with data-figure/data-value; static/js/benchmark.js draws the
plots from the same view, embedded in the page as JSON.
"""

import json
import statistics
from pathlib import Path

from flask import Blueprint, current_app, render_template

from bench import report

from . import ROOT

bp = Blueprint("benchmark", __name__)

SINGLE = tuple(sc for sc, _ in report.ROWS if not sc.startswith("serve_"))   # one number per system, README order
SERVE = (8, 32, 64)                                                         # concurrent requests
LATENCY = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")
LIMITS = (("memory_bandwidth_gb_s", "memory read bandwidth", "GB/s"),
          ("matmul_fp32_gflop_s", "matmul peak, fp32", "GFLOP/s"),
          ("matmul_bf16_gflop_s", "matmul peak, bf16", "GFLOP/s"))
LABELS = dict(report.ROWS)


class Unusable(Exception):
    """The results file is missing or not what `python -m bench` writes."""


def results_path() -> Path:
    path = Path(current_app.config["SENDLENS"].bench_results)
    return path if path.is_absolute() else ROOT / path


def load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise Unusable(f"there is no file at {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Unusable(f"{path} could not be read as JSON ({e})") from None
    if not isinstance(data, dict):
        raise Unusable(f"{path} holds no JSON object")
    missing = [k for k in ("date", "machine", "limits", "results") if not isinstance(data.get(k), (dict, str))]
    if missing:
        raise Unusable(f"{path} lacks {', '.join(missing)}: it was not written by python -m bench")
    return data


def slug(system: str) -> str:
    """A system's name as a figure key: "llama.cpp Q4_1" -> "llama_cpp_q4_1"."""
    return "".join(c if c.isalnum() else "_" for c in system.lower())


def view(data: dict) -> dict:
    """What the page shows, in the order it shows it (for the template and the plots alike)."""
    try:
        return _view(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise Unusable(f"the results do not have the shape python -m bench writes ({type(e).__name__}: {e})") from None


def _view(data: dict) -> dict:
    results = data["results"]
    systems = [s for s in report.OURS + report.PEERS if any(s in r for r in results.values())]
    m = data["machine"]
    date = data["date"][:10]
    single = [{"scenario": sc, "label": LABELS[sc], "cells": [cell(data, sc, s) for s in systems]}
              for sc in SINGLE if sc in results]
    serve = [{"n": n, "scenario": f"serve_{n}", "label": LABELS[f"serve_{n}"],
              "cells": [serve_cell(data, f"serve_{n}", s) for s in systems]}
             for n in SERVE if f"serve_{n}" in results]
    limits = [{"key": f"limits.{k}", "label": label, "unit": unit, "value": data["limits"][k]}
              for k, label, unit in LIMITS if k in data["limits"]]
    rounds = report.per_round(data, "decode_1", report.BANDWIDTH)   # GB/s, in each round of decode alone
    memory = next((i for i, l in enumerate(limits) if l["key"] == "limits.memory_bandwidth_gb_s"), None)
    if rounds and memory is not None:            # a file from before the bandwidth took turns has none
        limits[memory]["label"] = "memory, before the rounds"
        limits[memory + 1:memory + 1] = [
            {"key": f"limits.memory_bandwidth_rounds_{name}_gb_s", "label": f"memory, rounds' {name}",
             "unit": "GB/s", "value": v}
            for name, v in (("median", statistics.median(rounds)), ("lowest", min(rounds)), ("highest", max(rounds)))]
    bandwidth = statistics.median(report.bandwidths(data)) / 1e9   # GB/s, as bench/report.py's shares take it
    weights = [{"system": s, "key": f"weight_bytes.{slug(s)}", "value": b,
                "limit_key": f"decode_limit.{slug(s)}", "limit": bandwidth * 1e9 / b}
               for s, b in data.get("weight_bytes_per_token", {}).items()]
    shares = report.bandwidth_shares(data)       # decode alone / that limit, ours and the peers
    for w in weights:
        w["share"], w["share_key"] = shares.get(w["system"]), f"share_of_limit.{slug(w['system'])}"
    weights += [{"system": s, "same_as": report.SAME_BYTES[s], "share": v, "share_key": f"share_of_limit.{slug(s)}"}
                for s, v in shares.items() if s in report.PEERS]
    targets = [target_row(i, t) for i, t in enumerate(data.get("targets") or report.targets(data))]
    return {
        "date": date,
        "when": data["date"],
        "machine": m,
        "badge": f"measured on {m['cpu']} ({m['cores']} cores, {m['threads']} threads), {date}",
        "about": (f"{m['cpu']}, {m['cores']} cores, {m['threads']} threads, torch {m['torch']}, load average "
                  f"{m['load_before'][0]:.1f} before and {m['load_after'][0]:.1f} after"
                  f"{', a quick run' if data.get('quick') else ''}; {data.get('duration_s', 0) / 60:.0f} minutes."),
        "decode_tokens": 32 if data.get("quick") else 128,    # as bench/__main__.py's plan() runs them
        "serve_tokens": 16 if data.get("quick") else 32,
        "systems": [{"name": s, "slug": slug(s)} for s in systems],
        "single": single,
        "serve": serve,
        "limits": limits,
        "weights": weights,
        "targets": targets,
        "classroom": classroom_rows(data.get("classroom")),
        "missing": data.get("missing") or {},
    }


def target_row(i: int, t: dict) -> dict:
    """A target line as the page shows it: its verdict as text (a file written before the spreads
    stored a bool), its spread and round count (none in such a file)."""
    spread = t.get("spread")
    return {**t, "key": f"target.{i}", "goal_key": f"target.{i}.goal", "met": report.met_text(t),
            "spread": spread, "low_key": f"target.{i}.min", "high_key": f"target.{i}.max",
            "rounds": len(t.get("rounds") or [])}


def classroom_rows(room: dict | None) -> dict | None:
    """This run's classroom per format, then the stored rows it is held against (bench/classroom.py)."""
    if not room:
        return None
    base = room["baseline"]
    rows = [classroom_row(f"classroom.{fmt}", "this run", fmt, r) for fmt, r in room["formats"].items()]
    rows += [classroom_row(f"classroom_baseline.{fmt}", f"{base['date']}, stored", fmt, r)
             for fmt, r in base["formats"].items()]
    return {"clients": room["clients"], "seconds": room["seconds"], "max_tokens": room["max_tokens"],
            "baseline": {"date": base["date"], "commit": base["commit"][:7], "machine": base["machine"]},
            "rows": rows}


def classroom_row(key: str, run: str, fmt: str, r: dict) -> dict:
    return {"run": run, "format": fmt, "sent": r["sent"], "completed": r["completed"], "lost": r["lost"],
            "rate": {"key": f"{key}.output_tokens_per_s", "value": r["output_tokens_per_s"]},
            "latency": [{"key": f"{key}.{metric}_{pct}_ms", "value": r[f"{metric}_ms"][pct]}
                        for metric in ("ttft", "tpot") for pct in ("p50", "p99")]}


def cell(data: dict, scenario: str, system: str) -> dict:
    v = report.value(data, scenario, system)
    return {"system": system, "key": f"{scenario}.{slug(system)}", "value": v,
            "text": report.fmt_value(v)}


def serve_cell(data: dict, scenario: str, system: str) -> dict:
    entry = data["results"][scenario].get(system)
    out = cell(data, scenario, system)
    out["latency"] = {k: (entry["median"][k] if entry else None) for k in LATENCY}
    return out


@bp.get("/benchmark")
def benchmark():
    path = results_path()
    try:
        page = view(load(path))
    except Unusable as problem:
        return render_template("benchmark.html", problem=str(problem), path=path), 404
    return render_template("benchmark.html", view=page, path=path)
