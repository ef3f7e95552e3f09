"""The benchmark's table, its ratios to each peer and the issue's targets, and the README section."""

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


def throughput(entry, stat: str = "median") -> float:
    value = entry[stat]
    return value["output_tok_s"] if isinstance(value, dict) else value


def value(data, scenario: str, system: str, stat: str = "median") -> float | None:
    entry = data["results"].get(scenario, {}).get(system)
    return throughput(entry, stat) if entry else None


def best(data, scenario: str, systems) -> tuple[str | None, float | None]:
    found = [(value(data, scenario, s), s) for s in systems if value(data, scenario, s) is not None]
    if not found:
        return None, None
    v, s = max(found)
    return s, v


def target(name: str, measured: float | None, goal: float, how: str) -> dict:
    return {"target": name, "measured": measured, "goal": goal, "how": how,
            "met": None if measured is None else measured >= goal}


# The weights each system reads a decode step: a peer's are the same tensors in the same format as
# one of ours (transformers' fp32 and bf16 models, llama.cpp's Q4_1 file with its Q8_0 head).
SAME_BYTES = {"ours fp32": "ours fp32", "ours bf16": "ours bf16", "ours q8_0": "ours q8_0", "ours q4_1": "ours q4_1",
              "transformers fp32": "ours fp32", "transformers bf16": "ours bf16",
              "llama.cpp Q4_1": "ours q4_1"}


def bandwidth_shares(data) -> dict[str, float]:
    """Every system's decode alone as a share of the memory-bandwidth limit for the bytes it reads
    a step (tokens/s x bytes / bandwidth): the target line holds the best format to it, this
    says how near each one comes, ours and the peers, in the same run."""
    bandwidth = data["limits"]["memory_bandwidth_gb_s"] * 1e9
    out = {}
    for system in OURS + PEERS:
        v, step_bytes = value(data, "decode_1", system), data["weight_bytes_per_token"].get(SAME_BYTES[system])
        if v and step_bytes:
            out[system] = v * step_bytes / bandwidth
    return out


def targets(data) -> list[dict]:
    """The issue's target lines, each as a ratio from this run's medians."""
    out = []
    fmt, ours = best(data, "decode_1", OURS)
    llama = value(data, "decode_1", "llama.cpp Q4_1")
    out.append(target("decode alone: best format vs llama.cpp Q4_1", ours / llama if ours and llama else None,
                      1.0, f"{fmt} / llama.cpp Q4_1"))
    fp32, hf = value(data, "decode_1", "ours fp32"), value(data, "decode_1", "transformers fp32")
    out.append(target("decode alone: fp32 vs transformers fp32", fp32 / hf if fp32 and hf else None, 3.0,
                      "ours fp32 / transformers fp32"))
    fmt64, ours64 = best(data, "serve_64", OURS)
    peer64, hf64 = best(data, "serve_64", PEERS[:2])
    out.append(target("64 concurrent: best format vs transformers' best static batch",
                      ours64 / hf64 if ours64 and hf64 else None, 2.0, f"{fmt64} / {peer64}"))
    for scenario, goal in (("prefill_512", 1.5), ("prefill_4096", 1.0)):
        f, v = best(data, scenario, OURS)
        hfb = value(data, scenario, "transformers bf16")
        out.append(target(f"{scenario.replace('_', ' ')}: best format vs transformers bf16",
                          v / hfb if v and hfb else None, goal, f"{f} / transformers bf16"))
        peer, hf_best = best(data, scenario, PEERS[:2])
        if v and hf_best and peer != "transformers bf16":   # a CPU without fast bfloat16: the fair peer
            out.append(target(f"{scenario.replace('_', ' ')}: best format vs transformers' best here",
                              v / hf_best, goal, f"{f} / {peer}"))
    threads = data["machine"]["threads"]
    share = threads / (threads + 1)  # one busy competitor: a fair scheduler gives each thread alike
    for fmt in ("ours q4_1", "ours bf16"):
        quiet, busy = value(data, "decode_1", fmt), value(data, "decode_1_contended", fmt)
        if quiet and busy:
            out.append(target(f"beside a busy process: {fmt} keeps its CPU share",
                              (busy / quiet) / share, 1.0,
                              f"(contended / quiet = {busy / quiet:.2f}) / share given {share:.2f}"))
    bandwidth = data["limits"]["memory_bandwidth_gb_s"] * 1e9
    fmt, v = best(data, "decode_1", OURS)
    if v:
        step_bytes = data["weight_bytes_per_token"][fmt]
        limit = bandwidth / step_bytes
        out.append(target("decode alone vs the memory-bandwidth limit", bandwidth_shares(data)[fmt], 0.6,
                          f"{fmt}: {v:.0f} tok/s x {step_bytes / 1e6:.0f} MB a step / "
                          f"{bandwidth / 1e9:.0f} GB/s (limit {limit:.0f} tok/s)"))
    return out


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
             f"Medians of interleaved rounds (min in the JSON).", "",
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
    lines += ["", f"Limits measured in the same run: memory read {lim['memory_bandwidth_gb_s']:.0f} GB/s; "
              f"matmul fp32 {lim['matmul_fp32_gflop_s']:.0f} GFLOP/s, bf16 {lim['matmul_bf16_gflop_s']:.0f} GFLOP/s. "
              "Weights a decode step reads: " + ", ".join(
                  f"{k} {v / 1e6:.0f} MB" for k, v in data["weight_bytes_per_token"].items()) + ".", "",
              "| target | measured | goal | met | from |", "|---|---|---|---|---|"]
    for t in data["targets"]:
        measured = "—" if t["measured"] is None else f"{t['measured']:.2f}x"
        met = "—" if t["met"] is None else ("yes" if t["met"] else "no")
        lines.append(f"| {t['target']} | {measured} | {t['goal']}x | {met} | {t['how']} |")
    lines += quantization_lines(data)
    shares = bandwidth_shares(data)
    if shares:
        lines.append("\nDecode alone as a share of the bandwidth limit for the bytes each system reads a step: "
                     + ", ".join(f"{s} {v:.2f}x" for s, v in shares.items()) + ".")
    for name, why in data.get("missing", {}).items():
        lines.append(f"\n{name}: not measured, {why}.")
    return "\n".join(lines)


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
