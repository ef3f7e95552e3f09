"""toy_models/moe.py and train_router.py: the shipped router files of smollm2-135m-moe16, their
perplexity table (checked against transformers on the same held-out text), and the command that
remakes them, run in its quick mode."""

import math

import pytest
import torch

from bounds import U32, gamma
from toy_models.moe import DATA, WEIGHTS_FILE, derive, read_files
from toy_models.train_router import QUICK, Settings, main, text_pieces


U64 = 2.0 ** -53     # float64 unit roundoff
VOCAB = 49152        # SmolLM2's vocabulary: the cross-entropies' softmax width


def cross_entropy_error() -> float:
    """Bound on one token's fp32 cross-entropy (logsumexp - the target's logit) against the exact
    value of the same logits: the sum of VOCAB exps of x - max (each <= 1, the largest exactly 1, so
    the sum >= 1) within gamma_VOCAB + 2u relative (exp within 2 ulps), so its log within that
    absolutely; the subtractions and the final add a few u of the result. Doubled."""
    return 2 * (gamma(VOCAB) + 4 * U32)


def check_table(table: dict) -> None:
    ppl = table["perplexity"]
    assert set(ppl) == {"dense", "1", "2", "4", "8", "16"}
    for key, value in ppl.items():
        # the same float64 expression on the same floats (JSON keeps them exactly); exp within 1 ulp
        # on the machine that wrote the table and on this one: 2 ulps apart at most
        assert value == pytest.approx(math.exp(table["nll_sum"][key] / table["predicted_tokens"]), rel=2 * 2 * U64)
    # every expert: the dense MLP, its down-projection's sum split into 16 chains (tests/test_moe.py
    # checks those logits against dense with the float64-derived SPLIT_SUM_ERROR_RATIO bound). Each
    # token's cross-entropy moves by twice the logits' difference and by both computations' own
    # roundings (cross_entropy_error each); the logits' difference, fp32 rounding carried through the
    # network, is below cross_entropy_error's gamma_VOCAB (test_parity bounds our logits' error against
    # float64 on this model), so doubling covers it. The mean over tokens moves as much, and
    # perplexity by e^that - 1 relative.
    assert ppl["16"] == pytest.approx(ppl["dense"], rel=math.expm1(2 * 2 * cross_entropy_error()))
    assert table["predicted_tokens"] == table["text"]["eval_chunks"] * (table["text"]["chunk_tokens"] - 1)
    # the same positive floats summed in float64, perhaps in another way (Python's sum compensates
    # since 3.12): each within gamma_{n-1} of the exact sum
    pieces = table["dense_nll_per_piece"]
    assert sum(pieces) == pytest.approx(table["nll_sum"]["dense"], rel=2 * gamma(len(pieces) - 1, U64))
    assert "pydoc_data.topics" in table["text"]["source"]


def check_files(files, layers: int = 30) -> None:
    assert len(files.units) == len(files.routers) == layers
    for units, router in zip(files.units, files.routers):
        assert sorted(units.tolist()) == list(range(1536))             # every unit once
        assert router.shape == (16, 576) and torch.isfinite(router).all()


def test_the_shipped_files_are_small_and_complete():
    assert (DATA / WEIGHTS_FILE).stat().st_size < 1.5e6
    files = read_files()
    check_files(files)
    table = files.table
    check_table(table)
    assert table["made_by"] == "python -m toy_models.train_router"
    assert (table["model"], table["dense_model"], table["experts"], table["router_top_k"]) == \
        ("smollm2-135m-moe16", "smollm2-135m", 16, 2)
    assert table["text"]["eval_tokens"] >= 2000 and table["text"]["calibration_tokens"] >= 6000
    ppl = table["perplexity"]
    assert ppl["1"] > ppl["2"] > ppl["4"] > ppl["8"] > ppl["dense"]  # more experts, closer to dense


@pytest.mark.real_model
def test_the_held_out_topics_are_not_calibration_text(smollm_loaded):
    table = read_files().table
    s = Settings(**{**table["settings"], "top_ks": tuple(table["settings"]["top_ks"])})
    calib, held, about = text_pieces(smollm_loaded.tokenizer, s)
    assert about["held_out_topics"] == table["text"]["held_out_topics"]
    assert len(held) == table["text"]["eval_chunks"] and len(calib) * s.chunk_tokens == table["text"]["calibration_tokens"]
    import pydoc_data.topics as docs
    names = sorted(docs.topics)
    assert set(about["held_out_topics"]) == set(names[s.held_out_every - 1::s.held_out_every])


@pytest.mark.real_model
def test_the_dense_perplexity_matches_transformers(hf_reference, smollm_loaded, logit_bounds):
    """The table's dense column, piece by piece, recomputed by transformers on the same GGUF."""
    import torch.nn.functional as F
    table = read_files().table
    s = Settings(**{**table["settings"], "top_ks": tuple(table["settings"]["top_ks"])})
    _, held, _ = text_pieces(smollm_loaded.tokenizer, s)
    model, _ = hf_reference
    for ids, stored in list(zip(held, table["dense_nll_per_piece"]))[:2]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1]
        nll = F.cross_entropy(logits.float(), torch.tensor(ids[1:]), reduction="sum").item()
        # each of the n tokens' cross-entropies: ours (stored) and transformers' logits within
        # logit_bounds.fp32_pair of each other (test_parity's derived fp32 bound), which moves a
        # cross-entropy by at most twice that, plus both computations' own roundings; the fp32 sum
        # of n positive terms gamma_n of it, each side
        n = len(ids) - 1
        tol = n * 2 * (logit_bounds.fp32_pair + cross_entropy_error()) + 2 * gamma(n) * stored
        assert nll == pytest.approx(stored, abs=tol)


@pytest.mark.real_model
def test_the_command_remakes_the_files_in_quick_mode(tmp_path, capsys):
    assert main(["--quick", "--out", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    files = read_files(tmp_path)
    check_files(files)
    check_table(files.table)
    assert files.table["made_by"].endswith("--quick")
    assert files.table["text"]["eval_tokens"] == QUICK.eval_tokens
    from toy_models import load_model
    dense = load_model("smollm2-135m")
    cfg, sd = derive(dense.config, dense.state_dict, files)                 # the files make a model
    assert (cfg.num_experts, cfg.num_experts_per_token) == (16, 2)
    assert torch.equal(sd["layers.3.mlp.router.weight"], files.routers[3])
