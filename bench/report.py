"""The benchmark's table, its ratios to each peer and the issue's targets, and the README section."""

import statistics
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

ROWS = [
    ("decode_1", "decode, one request (tok/s)"),
    ("decode_1_ngram", "decode, one request, prompt lookup, k = 4 (tok/s)"),
    ("decode_1_self", "decode, one request, self-speculation, k = 4 (tok/s)"),
    ("decode_repeat", "decode, one request, a prompt that repeats itself (tok/s)"),
    ("decode_repeat_ngram", "... the same, prompt lookup, k = 4 (tok/s)"),
    ("decode_repeat_self", "... the same, self-speculation, k = 4 (tok/s)"),
    ("decode_1_contended", "decode, one request, beside a busy process (tok/s)"),
    ("prefill_512", "prefill, 512-token prompt (tok/s)"),
    ("prefill_4096", "prefill, 4,096-token prompt (tok/s)"),
    ("serve_8", "decode, 8 requests (output tok/s, all)"),
    ("serve_32", "decode, 32 requests (output tok/s, all)"),
    ("serve_64", "decode, 64 requests (output tok/s, all)"),
]
OURS = ("ours fp32", "ours bf16", "ours q8_0", "ours q4_1")
PEERS = ("transformers fp32", "transformers bf16", "llama.cpp Q4_1")


# The goals of the target lines, the one place they are set (issue 29's Targets table; the fp32 and
# busy-process lines are older issues' and stay). A line's ratio is per round, so a goal is met
# ("yes") only when every round's ratio reaches it, missed ("no") when none does, and otherwise
# "not decided".
GOALS = {
    "decode alone: best format vs llama.cpp Q4_1": 1.5,
    "decode alone: fp32 vs transformers fp32": 3.0,
    "64 concurrent: best format vs transformers' best static batch": 2.0,
    "prefill 512: best format vs transformers' best format": 1.5,
    "prefill 4096: best format vs transformers' best format": 1.5,
    "beside a busy process: ours keeps its CPU share": 1.0,
    "decode alone vs the memory-bandwidth limit": 0.6,
    "50 clients x 60 s (bench.load): best format vs the stored q4_1 row": 2.0,
}
MET, MISSED, UNDECIDED = "yes", "no", "not decided"


def throughput(entry, stat: str = "median") -> float:
    value = entry[stat]
    return value["output_tok_s"] if isinstance(value, dict) else value


def value(data, scenario: str, system: str, stat: str = "median") -> float | None:
    entry = data["results"].get(scenario, {}).get(system)
    return throughput(entry, stat) if entry else None


def per_round(data, scenario: str, system: str) -> list[float]:
    """The system's number in each round of the scenario, in round order (output tok/s of a serve)."""
    entry = data["results"].get(scenario, {}).get(system)
    if not entry:
        return []
    return [r["output_tok_s"] if isinstance(r, dict) else r for r in entry["runs"]]


def round_ratios(data, scenario: str, ours: str, peer: str) -> list[float]:
    """ours / peer in each round both ran: the same round ran them on the same token ids, one
    after the other, so a burst of load from elsewhere falls on both sides of the ratio."""
    return [a / b for a, b in zip(per_round(data, scenario, ours), per_round(data, scenario, peer)) if b]


def best(data, scenario: str, systems) -> tuple[str | None, float | None]:
    found = [(value(data, scenario, s), s) for s in systems if value(data, scenario, s) is not None]
    if not found:
        return None, None
    v, s = max(found)
    return s, v


def verdict(spread: tuple[float, float] | None, goal: float) -> str | None:
    """"yes" if the whole spread reaches the goal, "no" if all of it falls short, else "not decided"."""
    if spread is None:
        return None
    low, high = spread
    if low >= goal:
        return MET
    if high < goal:
        return MISSED
    return UNDECIDED


def target(name: str, rounds: list[float] | None, how: str, goal: float | None = None) -> dict:
    """A target line from its per-round ratios: the median, the spread (min, max) and the verdict."""
    goal = GOALS[name] if goal is None else goal
    rounds = list(rounds or [])
    spread = (min(rounds), max(rounds)) if rounds else None
    return {"target": name, "measured": statistics.median(rounds) if rounds else None,
            "spread": list(spread) if spread else None, "rounds": rounds, "goal": goal, "how": how,
            "met": verdict(spread, goal)}


# The weights each system reads a decode step: a peer's are the same tensors in the same format as
# one of ours (transformers' fp32 and bf16 models, llama.cpp's Q4_1 file with its Q8_0 head).
SAME_BYTES = {"ours fp32": "ours fp32", "ours bf16": "ours bf16", "ours q8_0": "ours q8_0", "ours q4_1": "ours q4_1",
              "transformers fp32": "ours fp32", "transformers bf16": "ours bf16",
              "llama.cpp Q4_1": "ours q4_1"}


BANDWIDTH = "memory bandwidth"  # bench/limits.py's MemoryBandwidth: a turn in each round of decode alone


def bandwidths(data, rounds: int = 1) -> list[float]:
    """Bytes/s of memory read in each round of decode alone, measured in that round; a file from
    before the bandwidth took turns has the run's one measurement, repeated for `rounds` rounds."""
    measured = per_round(data, "decode_1", BANDWIDTH)
    if measured:
        return [gb * 1e9 for gb in measured]
    return [data["limits"]["memory_bandwidth_gb_s"] * 1e9] * rounds


def bandwidth_shares(data) -> dict[str, float]:
    """Every system's decode alone as a share of the memory-bandwidth limit for the bytes it reads
    a step (tokens/s x bytes / bandwidth, the median over rounds of the bandwidth measured in the
    same round): the target line holds the best format to it, this says how near each one comes,
    ours and the peers, in the same run."""
    bandwidth = statistics.median(bandwidths(data))
    out = {}
    for system in OURS + PEERS:
        v, step_bytes = value(data, "decode_1", system), data["weight_bytes_per_token"].get(SAME_BYTES[system])
        if v and step_bytes:
            out[system] = v * step_bytes / bandwidth
    return out


def bandwidth_target(data) -> dict:
    """Decode alone against the bandwidth limit, round by round: the best format's tokens/s times
    the bytes it reads a step, over the bandwidth measured in the same round."""
    name = "decode alone vs the memory-bandwidth limit"
    fmt, v = best(data, "decode_1", OURS)
    if not v:
        return target(name, [], "decode alone was not measured")
    step_bytes = data["weight_bytes_per_token"][fmt]
    decode = per_round(data, "decode_1", fmt)
    bw = bandwidths(data, len(decode))
    rounds = [r * step_bytes / b for r, b in zip(decode, bw) if b]
    low, mid, high = min(bw) / 1e9, statistics.median(bw) / 1e9, max(bw) / 1e9
    return target(name, rounds, f"{fmt}: {v:.0f} tok/s x {step_bytes / 1e6:.0f} MB a step / memory read in the same "
                                f"round, {mid:.0f} GB/s ({low:.0f}–{high:.0f}; limit {mid * 1e9 / step_bytes:.0f} tok/s)")


def targets(data) -> list[dict]:
    """The target lines, each from this run's per-round ratios (median and spread over rounds).
    "Best format" is our format with the best median in the scenario, "transformers' best" the
    transformers dtype with the best median; the ratio is then taken round by round."""
    out = []
    name = "decode alone: best format vs llama.cpp Q4_1"
    fmt, _ = best(data, "decode_1", OURS)
    out.append(target(name, round_ratios(data, "decode_1", fmt, "llama.cpp Q4_1"), f"{fmt} / llama.cpp Q4_1")
               if fmt else target(name, [], "decode alone was not measured"))
    out.append(target("decode alone: fp32 vs transformers fp32",
                      round_ratios(data, "decode_1", "ours fp32", "transformers fp32"), "ours fp32 / transformers fp32"))
    for scenario, name in (("serve_64", "64 concurrent: best format vs transformers' best static batch"),
                           ("prefill_512", "prefill 512: best format vs transformers' best format"),
                           ("prefill_4096", "prefill 4096: best format vs transformers' best format")):
        f, _ = best(data, scenario, OURS)
        peer, _ = best(data, scenario, PEERS[:2])
        if f and peer:
            out.append(target(name, round_ratios(data, scenario, f, peer), f"{f} / {peer}"))
        else:
            out.append(target(name, [], "not measured in this run" + (" (a quick run)" if data.get("quick") else "")))
    threads = data["machine"]["threads"]
    share = threads / (threads + 1)  # one busy competitor: a fair scheduler gives each thread alike
    for fmt in ("ours q4_1", "ours bf16"):
        ratios = [(busy / quiet) / share for busy, quiet in zip(per_round(data, "decode_1_contended", fmt),
                                                                per_round(data, "decode_1", fmt)) if quiet]
        if ratios:
            out.append(target(f"beside a busy process: {fmt} keeps its CPU share", ratios,
                              f"{fmt}: (contended / quiet) / share given {share:.2f}",
                              GOALS["beside a busy process: ours keeps its CPU share"]))
    out.append(bandwidth_target(data))
    out.append(classroom_target(data.get("classroom")))
    return out


def classroom_target(classroom: dict | None) -> dict:
    """The classroom line: the best format's output tok/s of `python -m bench.load` (one run of N
    clients for M seconds per format) over the q4_1 row stored in bench/results/ (its date and
    commit in the line)."""
    name = "50 clients x 60 s (bench.load): best format vs the stored q4_1 row"
    if not classroom or not classroom.get("formats"):
        return target(name, [], "the classroom was not run")
    rates = {f: r["output_tokens_per_s"] for f, r in classroom["formats"].items() if r.get("output_tokens_per_s")}
    base = classroom["baseline"]
    base_rate = base["formats"]["q4_1"]["output_tokens_per_s"]
    if not rates:
        return target(name, [], "no format completed a request")
    fmt = max(rates, key=rates.get)
    return target(name, [rates[fmt] / base_rate],
                  f"ours {fmt} {rates[fmt]:.1f} tok/s ({classroom['clients']} clients x {classroom['seconds']:g} s, "
                  f"1 run) / q4_1 {base_rate:g} tok/s ({base['date']}, {base['commit'][:7]})")


def fmt_value(v) -> str:
    if v is None:
        return "—"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def markdown(data) -> str:
    systems = [s for s in OURS + PEERS if any(s in r for r in data["results"].values())]
    m = data["machine"]
    lines = [f"Measured here: {data['date'][:10]}, {m['cpu']}, {m['cores']} cores, {m['threads']} threads, "
             f"torch {m['torch']}, load average {m['load_before'][0]:.1f} before and "
             f"{m['load_after'][0]:.1f} after{' (quick run)' if data['quick'] else ''}. "
             f"Medians of interleaved rounds (every round in the JSON).", "",
             "| | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    for scenario, label in ROWS:
        if scenario not in data["results"]:
            continue
        cells = [fmt_value(value(data, scenario, s)) for s in systems]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for scenario in ("serve_64",):
        if scenario in data["results"]:
            cells = []
            for s in systems:
                entry = data["results"][scenario].get(s)
                cells.append("—" if not entry else
                             f"{entry['median']['ttft_p50_s']:.2f} / {entry['median']['tpot_p50_s'] * 1e3:.0f} ms")
            lines.append("| 64 requests: TTFT p50 (s) / TPOT p50 | " + " | ".join(cells) + " |")
    lim = data["limits"]
    bw = [b / 1e9 for b in bandwidths(data)]
    lines += ["", f"Limits measured in the same run: memory read {lim['memory_bandwidth_gb_s']:.0f} GB/s before the "
              f"rounds, {min(bw):.0f}–{max(bw):.0f} GB/s in the rounds of decode alone; "
              f"matmul fp32 {lim['matmul_fp32_gflop_s']:.0f} GFLOP/s, bf16 {lim['matmul_bf16_gflop_s']:.0f} GFLOP/s. "
              "Weights a decode step reads: " + ", ".join(
                  f"{k} {v / 1e6:.0f} MB" for k, v in data["weight_bytes_per_token"].items()) + ".", "",
              rounds_text(data), "",
              "| target | measured (median) | spread (min–max) | rounds | goal | met | from |",
              "|---|---|---|---|---|---|---|"]
    for t in data["targets"]:
        lines.append(f"| {t['target']} | {ratio_text(t['measured'])} | {spread_text(t)} | {len(t.get('rounds') or [])} "
                     f"| {t['goal']:g}x | {met_text(t)} | {t['how']} |")
    lines += quantization_lines(data)
    shares = bandwidth_shares(data)
    if shares:
        lines.append("\nDecode alone as a share of the bandwidth limit for the bytes each system reads a step: "
                     + ", ".join(f"{s} {v:.2f}x" for s, v in shares.items()) + ".")
    for name, why in data.get("missing", {}).items():
        lines.append(f"\n{name}: not measured, {why}.")
    return "\n".join(lines)


def ratio_text(v) -> str:
    return "—" if v is None else f"{v:.2f}x"


def spread_text(t: dict) -> str:
    spread = t.get("spread")
    return "—" if not spread else f"{spread[0]:.2f}–{spread[1]:.2f}x"


def met_text(t: dict) -> str:
    """yes / no / not decided; a file written before the spreads stored a bool."""
    met = t.get("met")
    if met is None:
        return "—"
    if isinstance(met, bool):
        return MET if met else MISSED
    return met


def rounds_text(data) -> str:
    """How many rounds each ratio line's scenario ran, and what the spread and the verdict mean."""
    counts = {}
    for scenario, label in (("decode_1", "decode alone"), ("prefill_512", "prefill 512"),
                            ("prefill_4096", "prefill 4,096"), ("serve_64", "64 requests"),
                            ("decode_1_contended", "beside a busy process")):
        runs = [len(e["runs"]) for e in data["results"].get(scenario, {}).values()]
        if runs:
            counts[label] = max(runs)
    return ("Each target is a ratio taken round by round: a round runs every system once on the same token ids, "
            "in an order that rotates from round to round; the table gives the median of the rounds' ratios and "
            "their spread. Rounds: " + ", ".join(f"{k} {v}" for k, v in counts.items())
            + "; the classroom, one run per format. A line whose spread crosses its goal is \"not decided\".")


def quantization_lines(data) -> list[str]:
    """The quantization table (bench/quality.py) of the same run, one column per format."""
    q = data.get("quantization") or {}
    table = q.get("formats")
    if not table:
        return []
    fmts = list(table)
    decode = [value(data, "decode_1", f"ours {f}") for f in fmts]
    rows = [("weights a decode step reads (MB)", [f"{table[f]['weight_bytes'] / 1e6:.0f}" for f in fmts]),
            ("decode, one request (tok/s)", [fmt_value(v) for v in decode]),
            ("top-5 agreement with fp32", [f"{table[f]['top5_agreement']:.3f}" for f in fmts]),
            ("KL(fp32 ‖ format), nats per token", [f"{table[f]['kl']:.2e}" for f in fmts]),
            ("held-out perplexity", [f"{table[f]['perplexity']:.3f}" for f in fmts])]
    out = ["", f"Quantization, the same run: our engine in each format on {q['positions']:,} held-out positions "
               f"({q['held_out']} of {q['text']}).", "",
           "| | " + " | ".join(fmts) + " |", "|---|" + "---|" * len(fmts)]
    return out + [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]


def write_readme(table: str, path: Path = README, begin: str = BEGIN, end: str = END) -> None:
    """Replace the README's section between `begin` and `end` (the benchmark's markers by default)
    with the table."""
    text = path.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{path} has no {begin} ... {end} section")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{table}\n{end}{tail}")
