"""bench/: the serving metrics, the target ratios, the table and the README section, on results
made up for the test (the benchmark itself is run by `python -m bench`, never timed in a test)."""

import json

import pytest

from bench import report
from bench.__main__ import plan, prompt, repetitive, summarize
from bench.systems import serving_metrics

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
    assert full["decode_1"]["args"][1] == 128 and full["decode_1"]["rounds"] == 3
    assert len(full["serve_64"]["args"][0]) == 64


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


def test_targets_are_ratios_of_medians():
    data = fake_results()
    found = {t["target"]: t for t in report.targets(data)}
    decode = found["decode alone: best format vs llama.cpp Q4_1"]
    assert decode["measured"] == pytest.approx(110 / 100, rel=F64) and decode["met"] is True
    assert "ours q4_1" in decode["how"]
    fp32 = found["decode alone: fp32 vs transformers fp32"]
    assert fp32["measured"] == pytest.approx(40 / 16, rel=F64) and fp32["met"] is False
    batch = found["64 concurrent: best format vs transformers' best static batch"]
    assert batch["measured"] == pytest.approx(450 / 250, rel=F64) and batch["met"] is False
    assert found["prefill 512: best format vs transformers bf16"]["measured"] == pytest.approx(0.9, rel=F64)
    assert found["prefill 4096: best format vs transformers bf16"]["measured"] is None
    assert "prefill 512: best format vs transformers' best here" not in found   # bf16 is its best here
    share = found["beside a busy process: ours q4_1 keeps its CPU share"]
    assert share["measured"] == pytest.approx((85 / 110) / (2 / 3), rel=F64)
    roof = found["decode alone vs the memory-bandwidth limit"]
    assert roof["measured"] == pytest.approx(110 / (50e9 / 100e6), rel=F64)


def test_prefill_is_also_held_against_transformers_best_where_bf16_is_slow():
    """On a CPU without fast bfloat16, transformers fp32 beats its bf16: the target line against
    bf16 stays (the issue's), and one against transformers' best sits beside it."""
    data = fake_results()
    data["results"]["prefill_512"]["transformers fp32"] = {"runs": [2000], "load": [0.5]}
    summarize(data["results"]["prefill_512"]["transformers fp32"])
    found = {t["target"]: t for t in report.targets(data)}
    assert found["prefill 512: best format vs transformers bf16"]["measured"] == pytest.approx(0.9, rel=F64)
    fair = found["prefill 512: best format vs transformers' best here"]
    assert fair["measured"] == pytest.approx(900 / 2000, rel=F64) and fair["how"] == "ours q4_1 / transformers fp32"


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
    assert "| decode alone: best format vs llama.cpp Q4_1 | 1.10x | 1.0x | yes |" in table
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
