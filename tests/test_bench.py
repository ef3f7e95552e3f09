"""bench/: the serving metrics, the target ratios, the table and the README section, on results
made up for the test (the benchmark itself is run by `python -m bench`, never timed in a test)."""

import json

import pytest

from bench import classroom, limits, load, report
from bench.__main__ import main, plan, prompt, repetitive, summarize, turns
from bench.systems import serving_metrics
from conftest import assert_writes_its_section

# A float64 formula (u = 2^-53) of at most 16 operations on the made-up results, evaluated here and
# in bench/ in another order or form (a percentile's interpolation, a ratio of ratios): within
# gamma_16 of each other, relative (Higham 3.1; no cancellation: every term positive)
F64 = 16 * 2.0 ** -53 / (1 - 16 * 2.0 ** -53)


def test_serving_metrics_follow_vllm():
    start = 10.0
    times = [[11.0, 11.5, 12.0], [12.0, 13.0]]     # two requests: 3 and 2 tokens
    m = serving_metrics(start, times)
    assert m["output_tok_s"] == pytest.approx(5 / 3.0, rel=F64)
    assert m["ttft_p50_s"] == pytest.approx(1.5, rel=F64)           # TTFTs 1.0 and 2.0
    assert m["tpot_p50_s"] == pytest.approx(0.75, rel=F64)          # TPOTs 0.5 and 1.0
    assert m["ttft_p99_s"] == pytest.approx(1.99, rel=F64)


def test_prompts_are_the_same_for_every_system_and_differ_by_seed():
    assert prompt(512, 2) == prompt(512, 2)
    assert len(prompt(4096, 3)) == 4096 and prompt(32, 1)[0] == 1
    assert prompt(32, 1) != prompt(32, 2)


def test_the_repetitive_prompt_repeats_a_walk():
    ids = repetitive(64, 5)
    assert len(ids) == 64 and ids[0] == 1
    assert ids[1:13] == ids[13:25] == prompt(13, 5)[1:]     # the same 12 tokens again and again
    assert len(set(ids[1:])) == 12


def test_the_speculative_rows_run_on_ours_only():
    from bench import systems
    kinds = {s["kind"] for s in plan(type("Args", (), {"quick": True, "rounds": 1}))}
    assert {"decode_ngram", "decode_self"} <= kinds
    for kind in ("decode_ngram", "decode_self"):
        assert hasattr(systems.Ours, kind)
        assert not hasattr(systems.Transformers, kind) and not hasattr(systems.LlamaCpp, kind)


def test_plan_quick_and_full():
    class Args:
        quick, rounds = True, 3
    quick = {s["name"] for s in plan(Args)}
    assert quick == {"decode_1", "prefill_512", "decode_1_contended", "serve_8", "serve_64",
                     "decode_1_ngram", "decode_1_self", "decode_repeat", "decode_repeat_ngram", "decode_repeat_self"}
    Args.quick = False
    full = {s["name"]: s for s in plan(Args)}
    assert {"prefill_4096", "serve_32"} <= set(full)
    assert full["decode_1"]["args"][1] == 128 and full["decode_1"]["rounds"] == 7     # 2 x 3 + 1: the cheap one
    assert full["prefill_512"]["rounds"] == 5 and full["prefill_4096"]["rounds"] == 3
    assert full["serve_64"]["rounds"] == 3 and full["serve_8"]["rounds"] == 2
    assert max(s["rounds"] for s in full.values()) == full["decode_1"]["rounds"]
    assert len(full["serve_64"]["args"][0]) == 64
    Args.quick = True
    quick = {s["name"]: s for s in plan(Args)}
    assert quick["decode_1"]["rounds"] == 3 and quick["serve_64"]["rounds"] == 2   # a spread even in a quick run


def test_the_systems_take_turns_round_by_round():
    systems = ["a", "b", "c", "d"]
    orders = [turns(systems, rnd) for rnd in range(len(systems))]
    for order in orders:
        assert sorted(order) == systems                        # every system once a round
    assert sorted(order[0] for order in orders) == systems      # each goes first once
    for s in systems:                                           # ... and sits in every place once
        assert sorted(order.index(s) for order in orders) == list(range(len(systems)))
    assert turns(systems, len(systems)) == systems and turns([], 3) == []


def fake_results():
    def entry(*runs):
        e = {"runs": list(runs), "load": [0.5] * len(runs)}
        summarize(e)
        return e

    def served(*rates):
        return entry(*[{"output_tok_s": r, "ttft_p50_s": 0.5, "ttft_p99_s": 0.9,
                        "tpot_p50_s": 0.1, "tpot_p99_s": 0.2} for r in rates])
    return {
        "date": "2026-11-30T15:00:00+00:00", "quick": False,
        "machine": {"cpu": "Test CPU", "cores": 2, "threads": 2, "torch": "2.13.0",
                    "load_before": (0.5, 0.5, 0.5), "load_after": (0.7, 0.5, 0.5)},
        "limits": {"memory_bandwidth_gb_s": 50.0, "matmul_fp32_gflop_s": 150.0, "matmul_bf16_gflop_s": 300.0},
        "weight_bytes_per_token": {"ours fp32": 538e6, "ours q4_1": 100e6},
        "missing": {},
        "results": {
            "decode_1": {"ours fp32": entry(30, 40, 50), "ours q4_1": entry(100, 120, 110),
                         "transformers fp32": entry(15, 16, 17), "llama.cpp Q4_1": entry(100, 110, 90)},
            "decode_1_contended": {"ours q4_1": entry(80, 90)},
            "prefill_512": {"ours q4_1": entry(900), "transformers bf16": entry(1000)},
            "serve_64": {"ours q4_1": served(400, 500), "transformers fp32": served(200),
                         "transformers bf16": served(250)},
        },
    }


def test_summarize_reports_min_and_median():
    data = fake_results()
    assert data["results"]["decode_1"]["ours fp32"]["median"] == 40
    assert data["results"]["decode_1"]["ours fp32"]["min"] == 30
    assert data["results"]["serve_64"]["ours q4_1"]["median"]["output_tok_s"] == 450


def test_targets_are_medians_of_ratios_per_round_with_their_spread():
    data = fake_results()
    found = {t["target"]: t for t in report.targets(data)}
    decode = found["decode alone: best format vs llama.cpp Q4_1"]
    # rounds: 100/100, 120/110, 110/90: the median of the rounds' ratios, not the ratio of the medians
    ratios = [100 / 100, 120 / 110, 110 / 90]
    assert decode["rounds"] == pytest.approx(ratios, rel=F64)
    assert decode["measured"] == pytest.approx(120 / 110, rel=F64)
    assert decode["spread"] == pytest.approx([1.0, 110 / 90], rel=F64)
    assert decode["goal"] == report.GOALS[decode["target"]] == 1.5 and decode["met"] == "no"   # all below 1.5
    assert "ours q4_1" in decode["how"]
    fp32 = found["decode alone: fp32 vs transformers fp32"]
    assert fp32["rounds"] == pytest.approx([30 / 15, 40 / 16, 50 / 17], rel=F64)
    assert fp32["met"] == "no"                                      # 2.0-2.9 against 3.0
    batch = found["64 concurrent: best format vs transformers' best static batch"]
    assert batch["how"] == "ours q4_1 / transformers bf16"          # transformers' best median
    assert batch["rounds"] == pytest.approx([400 / 250], rel=F64)   # the rounds both ran
    prefill = found["prefill 512: best format vs transformers' best format"]
    assert prefill["measured"] == pytest.approx(0.9, rel=F64) and prefill["how"] == "ours q4_1 / transformers bf16"
    assert found["prefill 4096: best format vs transformers' best format"]["measured"] is None
    assert found["prefill 4096: best format vs transformers' best format"]["met"] is None
    share = found["beside a busy process: ours q4_1 keeps its CPU share"]
    assert share["rounds"] == pytest.approx([(80 / 100) / (2 / 3), (90 / 120) / (2 / 3)], rel=F64)
    roof = found["decode alone vs the memory-bandwidth limit"]
    assert roof["rounds"] == pytest.approx([r * 100e6 / 50e9 for r in (100, 120, 110)], rel=F64)
    assert found["50 clients x 60 s (bench.load): best format vs the stored q4_1 row"]["measured"] is None


def test_the_bandwidth_takes_a_turn_in_decode_alone_and_each_round_is_held_to_its_own():
    """A machine whose bandwidth moves between rounds: each round's decode is divided by the bandwidth
    measured in that round, not by the one measured before the rounds."""
    data = fake_results()
    data["results"]["decode_1"]["memory bandwidth"] = {"runs": [40.0, 60.0, 50.0], "load": [0.5] * 3}
    summarize(data["results"]["decode_1"]["memory bandwidth"])
    roof = {t["target"]: t for t in report.targets(data)}["decode alone vs the memory-bandwidth limit"]
    assert roof["rounds"] == pytest.approx([100 * 100e6 / 40e9, 120 * 100e6 / 60e9, 110 * 100e6 / 50e9], rel=F64)
    assert "50 GB/s (40–60" in roof["how"]
    assert report.bandwidth_shares(data)["ours q4_1"] == pytest.approx(110 * 100e6 / 50e9, rel=F64)   # the median
    table = report.markdown({**data, "targets": report.targets(data)})
    assert "memory read 50 GB/s before the rounds, 40–60 GB/s in the rounds of decode alone" in table
    assert "| memory bandwidth" not in table and "memory bandwidth |" not in table   # a limit, not a system


def test_the_bandwidth_turn_measures_memory_and_only_in_decode_alone():
    class Args:
        quick, rounds = False, 3
    turn = limits.MemoryBandwidth()
    assert turn.unit == "GB/s" and turn.decode() > 0
    for scenario in plan(Args):
        takes_it = "only" not in scenario and scenario["kind"] == "decode"
        assert takes_it == (scenario["name"] == "decode_1")


def test_a_spread_that_crosses_its_goal_is_not_decided():
    assert report.verdict((1.6, 2.0), 1.5) == "yes"
    assert report.verdict((1.5, 1.5), 1.5) == "yes"           # reaching the goal is meeting it
    assert report.verdict((1.0, 1.4), 1.5) == "no"
    assert report.verdict((1.2, 1.7), 1.5) == "not decided"
    assert report.verdict((1.2, 1.5), 1.5) == "not decided"
    assert report.verdict(None, 1.5) is None
    line = report.target("decode alone: best format vs llama.cpp Q4_1", [1.7, 1.4, 1.6], "x / y")
    assert line["met"] == "not decided" and line["spread"] == [1.4, 1.7] and line["measured"] == 1.6
    assert report.target("decode alone: best format vs llama.cpp Q4_1", [], "x")["spread"] is None


def test_every_target_line_of_the_issue_with_its_goal_from_one_place():
    data = fake_results()
    data["classroom"] = classroom_result({"q4_1": 300.0, "bf16": 450.0})
    lines = report.targets(data)
    issue = {"decode alone: best format vs llama.cpp Q4_1": 1.5,
             "64 concurrent: best format vs transformers' best static batch": 2.0,
             "prefill 512: best format vs transformers' best format": 1.5,
             "prefill 4096: best format vs transformers' best format": 1.5,
             "decode alone vs the memory-bandwidth limit": 0.6,
             "50 clients x 60 s (bench.load): best format vs the stored q4_1 row": 2.0}
    names = [t["target"] for t in lines]
    assert len(names) == len(set(names))
    for name, goal in issue.items():
        assert name in names and report.GOALS[name] == goal
    for t in lines:                                    # every goal is GOALS' own (the busy lines share one)
        assert t["goal"] in report.GOALS.values()
    room = lines[names.index("50 clients x 60 s (bench.load): best format vs the stored q4_1 row")]
    assert room["rounds"] == pytest.approx([450 / 196.5], rel=F64) and room["met"] == "yes"
    assert "ours bf16" in room["how"] and "2026-11-30" in room["how"] and "a5e1101" in room["how"]


def classroom_result(rates: dict) -> dict:
    """bench/classroom.py's measure() on made-up rows, with the stored baseline."""
    def row(rate):
        return {"sent": 10, "completed": 10, "lost": 0, "output_tokens_per_s": rate,
                "ttft_ms": {"p50": 500.0, "p99": 900.0, "mean": 550.0}, "tpot_ms": {"p50": 200.0, "p99": 260.0}}
    return {"model": "smollm2-135m", "clients": 50, "seconds": 60, "max_tokens": 32,
            "formats": {f: row(r) for f, r in rates.items()}, "baseline": classroom.load_baseline()}


def test_the_stored_baseline_is_the_readmes_q4_1_row():
    base = classroom.load_baseline()
    assert base["date"] == "2026-11-30" and len(base["commit"]) == 40
    assert base["formats"]["q4_1"]["output_tokens_per_s"] == 196.5
    assert (base["clients"], base["seconds"]) == (50, 60)


@pytest.mark.parametrize("text, formats", [
    ("fp32,bf16,q8_0,q4_1", ["fp32", "bf16", "q8_0", "q4_1"]),
    ("q4_1", ["q4_1"]),
    (" bf16 , q4_1 ,", ["bf16", "q4_1"]),
])
def test_the_formats_list_parses_in_its_order(text, formats):
    assert classroom.parse_formats(text) == formats


@pytest.mark.parametrize("text", ["", ",", "fp16", "q4_1,q4_1", "fp32 bf16"])
def test_a_bad_formats_list_is_refused_by_name(text):
    with pytest.raises(ValueError, match="--formats"):
        classroom.parse_formats(text)


@pytest.mark.parametrize("argv", [["--formats", "fp16"], ["--formats", "q4_1", "--clients", "0"]])
def test_the_load_command_refuses_a_bad_formats_run(argv):
    with pytest.raises(SystemExit) as exit_:
        load.main(argv)
    assert exit_.value.code == 2


def test_the_bench_command_refuses_a_bad_classroom_list():
    with pytest.raises(SystemExit) as exit_:
        main(["--classroom-formats", "int3"])
    assert exit_.value.code == 2


def test_the_classroom_table_puts_each_format_beside_the_stored_rows(tmp_path):
    room = classroom_result({"fp32": 160.0, "bf16": 270.5, "q8_0": 200.0, "q4_1": 210.0})
    text = classroom.table(room, "2026-12-04")
    lines = text.splitlines()
    assert "--formats fp32,bf16,q8_0,q4_1 --clients 50 --seconds 60" in lines[0]
    assert "load average" not in lines[0]                    # bench.load alone stores none
    room["load_before"], room["load_after"] = (3.25, 1, 1), (1.5, 1, 1)
    assert "load average 3.2 before and 1.5 after" in classroom.table(room, "2026-12-04").splitlines()[0]
    rows = [line for line in lines if line.startswith("| 2026-")]
    assert [r.split("|")[2].strip() for r in rows] == ["fp32", "bf16", "q8_0", "q4_1", "fp32", "q4_1", "bf16"]
    assert "| 2026-12-04 | bf16 | 10 | 10 | 0 | 270.5 | 500 / 900 ms | 200 / 260 ms |" in rows
    assert "| 2026-11-30 (stored) | q4_1 | 446 | 446 | 0 | 196.5 | 495 / 705 ms | 239 / 322 ms |" in rows
    assert_writes_its_section(classroom.write_readme, classroom.BEGIN, classroom.END, text, tmp_path)


def test_bandwidth_shares_for_every_system_with_the_bytes_of_its_format():
    data = fake_results()
    shares = report.bandwidth_shares(data)
    assert shares["ours q4_1"] == pytest.approx(110 * 100e6 / 50e9, rel=F64)
    assert shares["llama.cpp Q4_1"] == pytest.approx(100 * 100e6 / 50e9, rel=F64)     # the same file's bytes
    assert shares["transformers fp32"] == pytest.approx(16 * 538e6 / 50e9, rel=F64)
    assert "ours bf16" not in shares                   # not measured in this run
    table = report.markdown({**data, "targets": report.targets(data)})
    assert "ours q4_1 0.22x" in table and "llama.cpp Q4_1 0.20x" in table


def test_markdown_table_and_readme_section(tmp_path):
    data = fake_results()
    data["targets"] = report.targets(data)
    table = report.markdown(data)
    assert "Test CPU" in table and "2026-11-30" in table
    assert "| decode, one request (tok/s) | 40.0 | 110 | 16.0 | — | 100 |" in table
    assert "| decode alone: best format vs llama.cpp Q4_1 | 1.09x | 1.00–1.22x | 3 | 1.5x | no |" in table
    assert "Rounds: decode alone 3, prefill 512 1, 64 requests 2, beside a busy process 2" in table
    data["targets"][0]["goal"] = 1.1                     # a goal inside the spread
    data["targets"][0]["met"] = report.verdict(data["targets"][0]["spread"], 1.1)
    assert "| 1.00–1.22x | 3 | 1.1x | not decided |" in report.markdown(data)
    json.dumps(data)  # the JSON the benchmark writes
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{report.BEGIN}\nold\n{report.END}\n\nafter\n")
    report.write_readme(table, readme)
    text = readme.read_text()
    assert "old" not in text and table in text and text.endswith("after\n")
    readme.write_text("no markers")
    with pytest.raises(ValueError):
        report.write_readme(table, readme)


def test_the_quantization_table_of_the_same_run():
    data = fake_results()
    data["quantization"] = {"text": "the docs", "held_out": "every 4th topic", "positions": 2048, "formats": {
        "fp32": {"weight_bytes": 538e6, "perplexity": 14.9466, "top5_agreement": 1.0, "kl": 0.0},
        "q4_1": {"weight_bytes": 96.4e6, "perplexity": 14.9444, "top5_agreement": 0.92, "kl": 1.9e-4}}}
    lines = report.quantization_lines(data)
    assert "| | fp32 | q4_1 |" in lines
    assert "| weights a decode step reads (MB) | 538 | 96 |" in lines
    assert "| decode, one request (tok/s) | 40.0 | 110 |" in lines       # the decode_1 row of the same run
    assert "| held-out perplexity | 14.947 | 14.944 |" in lines
    assert "\n".join(lines) in report.markdown({**data, "targets": report.targets(data)})
    assert report.quantization_lines(fake_results()) == []                # a run without the table


@pytest.mark.slow   # every weight format's held-out perplexity
def test_the_quantization_table_reads_each_engines_model(make_tiny_engine):
    """bench/quality.py on tiny engines standing in for the run's `ours <format>` systems."""
    from types import SimpleNamespace

    from bench.quality import quantization_table

    systems = [SimpleNamespace(weight_format=f, engine=make_tiny_engine(weight_format=f)) for f in ("fp32", "q8_0")]
    q = quantization_table(systems)
    fp32, q8 = q["formats"]["fp32"], q["formats"]["q8_0"]
    assert fp32["top5_agreement"] == 1.0 and fp32["kl"] == 0.0
    assert 0.0 <= q8["top5_agreement"] <= 1.0 and q8["kl"] >= 0.0
    assert fp32["weight_bytes"] > q8["weight_bytes"] and q["positions"] > 0
    assert quantization_table(systems[1:]) == {}                          # no fp32 to compare with
