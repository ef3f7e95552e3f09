"""The classroom in each weight format: `python -m bench.load`'s N clients for M seconds against a
server of each format, one after the other in one run, beside the row stored from an earlier day.

    python -m bench.load --formats fp32,bf16,q8_0,q4_1 [--clients 50 --seconds 60] [--readme]

Each format gets a server of its own (bench/replicas.py's Deployment, one `python -m app` alone
with `--setting weight_format F`), started after the last one stopped, so the servers never share
the cores; the same clients (bench/load.py's run) play against each. The baseline, the issue's
"today's q4_1 row", is a file in bench/results/ with its date and commit, never a number in the
code: the `python -m bench` target line holds the best format's output tokens/s against it.
`python -m bench` runs this too, and writes the table into the README between the classroom
markers (beside the rows it was measured against).
"""

import json
import tempfile
from pathlib import Path

from core.config import WeightFormat

from .load import MAX_CLIENTS, run
from .report import write_readme as write_section

RESULTS = Path(__file__).resolve().parent / "results"
BASELINE = RESULTS / "classroom_baseline.json"
README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- classroom:begin -->", "<!-- classroom:end -->"
FORMATS = tuple(f.value for f in WeightFormat)


def parse_formats(text: str) -> list[str]:
    """"fp32,bf16,q8_0,q4_1" -> ["fp32", "bf16", "q8_0", "q4_1"], in the order given, each once."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--formats: name one or more of {', '.join(FORMATS)}, separated by commas")
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        raise ValueError(f"--formats: {', '.join(unknown)} is not a weight format (one of {', '.join(FORMATS)})")
    if len(set(names)) != len(names):
        raise ValueError(f"--formats: each format once, got {text!r}")
    return names


def load_baseline(path: Path = BASELINE) -> dict:
    """The stored rows: {date, commit, machine, clients, seconds, formats: {f: {output_tokens_per_s, ...}}}."""
    data = json.loads(Path(path).read_text())
    for key in ("date", "commit", "formats"):
        if key not in data:
            raise ValueError(f"baseline {path}: lacks {key!r}")
    if "q4_1" not in data["formats"]:
        raise ValueError(f"baseline {path}: has no q4_1 row")
    return data


def measure(formats: list[str], clients: int, seconds: float, max_tokens: int = 32,
            model: str = "smollm2-135m", run_dir: str | None = None, log=print) -> dict:
    """One server per format, one after the other, the same classroom against each."""
    from .replicas import Deployment

    base = Path(run_dir or tempfile.mkdtemp(prefix="sendlens-classroom-"))
    settings = {"max_connections_per_address": MAX_CLIENTS}
    rows = {}
    for fmt in formats:
        log(f"  classroom: {clients} clients x {seconds:g} s against a {fmt} server", flush=True)
        with Deployment(base / fmt, replicas=1, model=model, settings={**settings, "weight_format": fmt},
                        balanced=False) as server:
            rows[fmt] = run(server.ws, clients, seconds, max_tokens, drop=False)
        r = rows[fmt]
        log(f"  classroom {fmt}: {r['output_tokens_per_s']} tok/s, sent {r['sent']}, completed {r['completed']}, "
            f"lost {r['lost']}", flush=True)
    return {"model": model, "clients": clients, "seconds": seconds, "max_tokens": max_tokens,
            "formats": rows, "baseline": load_baseline()}


def _ms(pair: dict) -> str:
    if pair.get("p50") is None:
        return "—"
    return f"{pair['p50']:,.0f} / {pair['p99']:,.0f} ms"


def load_text(classroom: dict) -> str:
    """The machine's load average around the runs, where the run stored it (python -m bench does)."""
    if "load_before" not in classroom:
        return ""
    return (f"; load average {classroom['load_before'][0]:.1f} before and "
            f"{classroom['load_after'][0]:.1f} after")


def table(classroom: dict, date: str) -> str:
    """The README's rows: this run's formats, then the stored baseline's rows, one table."""
    base = classroom["baseline"]
    out = [f"Measured {date} by `python -m bench.load --formats {','.join(classroom['formats'])} --clients "
           f"{classroom['clients']} --seconds {classroom['seconds']:g}` ({classroom['max_tokens']} tokens per answer, "
           f"one server per format, one after the other{load_text(classroom)}), then the rows stored on {base['date']} "
           f"({base['commit'][:7]}, {base['machine']}), whose q4_1 row the classroom target holds the best "
           f"format against:", "",
           "| run | `weight_format` | sent | completed | lost | output tok/s | TTFT p50 / p99 | TPOT p50 / p99 |",
           "|---|---|---|---|---|---|---|---|"]
    for fmt, r in classroom["formats"].items():
        out.append(f"| {date} | {fmt} | {r['sent']} | {r['completed']} | {r['lost']} | {r['output_tokens_per_s']} | "
                   f"{_ms(r['ttft_ms'])} | {_ms(r['tpot_ms'])} |")
    for fmt, r in base["formats"].items():
        out.append(f"| {base['date']} (stored) | {fmt} | {r['sent']} | {r['completed']} | {r['lost']} | "
                   f"{r['output_tokens_per_s']} | {_ms(r['ttft_ms'])} | {_ms(r['tpot_ms'])} |")
    return "\n".join(out)


def write_readme(text: str, path: Path = README) -> None:
    """Replace the README's classroom section (between its markers) with the table."""
    write_section(text, path, BEGIN, END)
