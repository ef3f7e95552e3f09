"""python -m bench: our engine against transformers and llama.cpp on this machine, in one run.

    python -m bench              # the full run (16 to 25 minutes on two quiet cores), JSON + table
    python -m bench --quick      # a short one for iterating (a few minutes)
    python -m bench --readme     # ... and write the tables into README.md

Every system gets the same token ids, the same number of threads and the same output lengths.
Systems take turns (each round runs every system once per scenario, in an order that rotates
from round to round) and rounds repeat, so a burst of load from another process hits them alike;
every round's number is kept, with the machine's load average before each measurement, and each
target line is a ratio per round, given as its median and spread (bench/report.py). Decode alone,
the cheapest scenario, runs the most rounds. First the classroom: `python -m bench.load`'s clients
against a server of each weight format in turn (bench/classroom.py). Writes
bench/results/latest.json and prints the table with ratios to each peer and the issue's targets.
"""

import os

# libgomp reads how long a waiting thread spins once, when torch loads it: core sets a short spin
# before torch comes (core/cpu_share.py says why and how the engine then shares the CPU).
# llama.cpp loads the system's own libgomp later, and gets its defaults back, as a user has them.
from core.config import OMP_DEFAULTS_SET  # noqa: E402  (before torch)

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

for _name in OMP_DEFAULTS_SET:  # torch's libgomp has read them; llama.cpp's has not
    os.environ.pop(_name, None)

from . import classroom, limits, quality, report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FORMATS = ("fp32", "bf16", "q8_0", "q4_1")


def busy() -> None:
    """A competing CPU-bound process."""
    x = 0
    while True:
        x += 1


def prompt(length: int, seed: int) -> list[int]:
    """Token ids, the same for every system: BOS then a fixed pseudo-random walk."""
    return [1] + [100 + (seed * 7919 + i * 104729) % 40000 for i in range(length - 1)]


def repetitive(length: int, seed: int, period: int = 12) -> list[int]:
    """BOS then a short pseudo-random walk repeated: text that repeats itself, as code and lists
    do, where prompt lookup finds what comes next in the context."""
    walk = prompt(period + 1, seed)[1:]
    return [1] + (walk * (length // period + 1))[: length - 1]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def rounds_of(args) -> dict[str, int]:
    """Rounds per kind of scenario: decode alone, the cheapest, runs the most, since the target lines
    that read it (llama.cpp, the bandwidth limit) are the ones whose ratios moved most between runs."""
    if args.quick:
        return {"decode_1": 3, "prefill_512": 2, "serve_64": 2, "other": 1, "serve": 1, "prefill_4096": 1}
    r = args.rounds
    return {"decode_1": 2 * r + 1, "prefill_512": r + 2, "serve_64": r, "other": r, "serve": 2, "prefill_4096": r}


def plan(args) -> list[dict]:
    """The scenarios: name, the method each system runs, its arguments, which systems, rounds."""
    n = 32 if args.quick else 128
    rounds = rounds_of(args)
    other = rounds["other"]
    out = 16 if args.quick else 32
    ours = {f"ours {f}" for f in FORMATS}
    scenarios = [
        dict(name="decode_1", kind="decode", args=(prompt(32, 1), n), rounds=rounds["decode_1"], unit="tok/s"),
        # speculative decoding (ours only): the same request, and one whose prompt repeats itself
        dict(name="decode_1_ngram", kind="decode_ngram", args=(prompt(32, 1), n), rounds=other, unit="tok/s"),
        dict(name="decode_1_self", kind="decode_self", args=(prompt(32, 1), n), rounds=other, unit="tok/s"),
        dict(name="decode_repeat", kind="decode", args=(repetitive(64, 5), n), rounds=other, unit="tok/s",
             only=ours),
        dict(name="decode_repeat_ngram", kind="decode_ngram", args=(repetitive(64, 5), n), rounds=other,
             unit="tok/s"),
        dict(name="decode_repeat_self", kind="decode_self", args=(repetitive(64, 5), n), rounds=other,
             unit="tok/s"),
        dict(name="prefill_512", kind="prefill", args=(prompt(512, 2),), rounds=rounds["prefill_512"], unit="tok/s"),
    ]
    if not args.quick:
        scenarios.append(dict(name="prefill_4096", kind="prefill", args=(prompt(4096, 3),),
                              rounds=rounds["prefill_4096"], unit="tok/s"))
    scenarios.append(dict(name="decode_1_contended", kind="decode", args=(prompt(32, 4), n), rounds=other,
                          unit="tok/s", only={"ours q4_1", "ours bf16", "llama.cpp Q4_1"}, competitors=1))
    for batch in ((8, 64) if args.quick else (8, 32, 64)):
        scenarios.append(dict(name=f"serve_{batch}", kind="serve",
                              args=([prompt(32, 100 + i) for i in range(batch)], out),
                              rounds=rounds["serve_64" if batch == 64 else "serve"], unit="tok/s",
                              skip={"llama.cpp Q4_1"}))
    return scenarios


def turns(systems: list, rnd: int) -> list:
    """The order the systems take their turns in round `rnd`: every system once, the list rotated by
    the round, so over len(systems) rounds each goes first once and follows each other system alike."""
    if not systems:
        return []
    k = rnd % len(systems)
    return systems[k:] + systems[:k]


def run_classroom(args) -> tuple[dict | None, str | None]:
    """The classroom in each format (bench/classroom.py), before any engine loads here: -> (results,
    why not)."""
    if args.no_classroom:
        return None, "skipped (--no-classroom)"
    seconds = args.classroom_seconds or (20 if args.quick else 60)
    try:
        formats = classroom.parse_formats(args.classroom_formats)
        before = os.getloadavg()
        result = classroom.measure(formats, args.classroom_clients, seconds)
    except (OSError, RuntimeError, ValueError) as e:
        return None, f"the classroom could not run ({e})"
    result["load_before"], result["load_after"] = before, os.getloadavg()
    return result, None


def load_systems(args, threads: int):
    from toy_models import load_model

    from . import systems

    found, missing = [], {}
    loaded = load_model("smollm2-135m")
    for fmt in args.formats:
        found.append(systems.Ours(loaded, fmt, threads))
    for dtype in (torch.float32, torch.bfloat16):
        found.append(systems.Transformers(dtype))
    try:
        found.append(systems.LlamaCpp(threads, n_ctx=4096 + 256))
    except ImportError:
        missing["llama.cpp Q4_1"] = "llama-cpp-python is not installed (pip install -e '.[bench]')"
    return found, missing


def run(args) -> dict:
    threads = args.threads
    torch.set_num_threads(threads)
    started = time.perf_counter()
    load_before = os.getloadavg()
    room, why_not = run_classroom(args)
    systems, missing = load_systems(args, threads)
    if why_not:
        missing["the classroom (bench.load)"] = why_not
    machine_limits = limits.measure(args.quick)
    systems.append(limits.MemoryBandwidth())  # a turn in decode alone's rounds (its only scenario)
    # Every system lives in this one process: the garbage collector's full pass over all of their
    # objects would land on whichever turn it chose. What the systems loaded leaves its passes
    # now, and each turn starts with the leftovers of the last one collected.
    gc.collect()
    gc.freeze()
    results: dict = {}
    for rnd in range(max(s["rounds"] for s in plan(args))):
        for scenario in plan(args):
            if rnd >= scenario["rounds"]:
                continue
            chosen = [s for s in systems if s.name not in scenario.get("skip", ())
                      and ("only" not in scenario or s.name in scenario["only"])
                      and hasattr(s, scenario["kind"])]
            chosen = turns(chosen, rnd)
            for system in chosen:
                rivals = [multiprocessing.Process(target=busy, daemon=True)
                          for _ in range(scenario.get("competitors", 0))]
                for p in rivals:
                    p.start()
                gc.collect()                    # the last turn's garbage, not during this one
                load = os.getloadavg()[0]
                torch.set_num_threads(threads)  # ours may have dropped to fewer beside a busy process
                try:
                    value = getattr(system, scenario["kind"])(*scenario["args"])
                finally:
                    for p in rivals:
                        p.kill()
                        p.join()
                entry = results.setdefault(scenario["name"], {}).setdefault(system.name, {"runs": [], "load": []})
                entry["runs"].append(value)
                entry["load"].append(load)
                shown = value["output_tok_s"] if isinstance(value, dict) else value
                print(f"  round {rnd + 1} {scenario['name']:<20} {system.name:<18} {shown:9.1f} "
                      f"{getattr(system, 'unit', scenario['unit'])}"
                      f"  (load {load:.2f})", flush=True)
    for scenario in results.values():
        for entry in scenario.values():
            summarize(entry)
    decode_bytes = {s.name: s.weight_bytes_per_token for s in systems if hasattr(s, "weight_bytes_per_token")}
    print("  quantization table: held-out perplexity, top-5 agreement and KL per format", flush=True)
    quantization = quality.quantization_table(systems)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": threads,
                    "torch": torch.__version__, "python": platform.python_version(),
                    "omp": {"ours and transformers (torch's libgomp)": OMP_DEFAULTS_SET or "the user's",
                            "llama.cpp (the system's libgomp)": "its defaults"},
                    "load_before": load_before, "load_after": os.getloadavg()},
        "quick": args.quick,
        "duration_s": time.perf_counter() - started,
        "limits": machine_limits,
        "weight_bytes_per_token": decode_bytes,
        "quantization": quantization,
        "missing": missing,
        "results": results,
        "classroom": room,
    }


def summarize(entry: dict) -> None:
    runs = entry["runs"]
    if isinstance(runs[0], dict):
        entry["median"] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        entry["min"] = {k: min(r[k] for r in runs) for k in runs[0]}
    else:
        entry["median"], entry["min"] = statistics.median(runs), min(runs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs, few rounds, no 4,096-token prefill (for iterating)")
    parser.add_argument("--threads", type=int, default=2, help="threads for every system (default 2)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of the full run (default 3; decode alone runs 2 x this + 1, prefill 512 this + 2)")
    parser.add_argument("--classroom-formats", default=",".join(FORMATS),
                        help="the weight formats the classroom runs against, in turn (default all)")
    parser.add_argument("--classroom-clients", type=int, default=50, help="the classroom's clients (default 50)")
    parser.add_argument("--classroom-seconds", type=float, default=None,
                        help="the classroom's seconds per format (default 60; 20 with --quick)")
    parser.add_argument("--no-classroom", action="store_true", help="skip the classroom runs")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS,
                        help="our engine's weight formats to run")
    parser.add_argument("--out", type=Path, default=RESULTS / "latest.json")
    parser.add_argument("--readme", action="store_true", help="write the table into README.md")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be 1 or more")
    try:
        classroom.parse_formats(args.classroom_formats)
    except ValueError as e:
        parser.error(str(e).replace("--formats", "--classroom-formats"))
    data = run(args)
    data["targets"] = report.targets(data)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1))
    table = report.markdown(data)
    print()
    print(table)
    print(f"\nwritten: {args.out}")
    if data["classroom"]:
        room = classroom.table(data["classroom"], data["date"][:10])
        print()
        print(room)
    if args.readme:
        report.write_readme(table)
        if data["classroom"]:
            classroom.write_readme(room)


if __name__ == "__main__":
    main()
