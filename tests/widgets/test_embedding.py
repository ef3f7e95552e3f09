"""Widget `embedding`: a token's real row and its nearest rows, checked against transformers."""

import pytest
import torch

from bounds import U32, U64, gamma
from conftest import figure_value, on_a_phone, shoot_widget, wait_ready

EMB = '[data-widget="embedding"]'


def test_embedding_registers_one_job():
    from app.widgets import BY_NAME
    types = {m.type: m for m in BY_NAME["embedding"].messages}
    assert set(types) == {"embedding"}
    assert types["embedding"].job


def half_unit(decimals: int, scale: float = 1.0) -> float:
    """How far a float of magnitude at most `scale` rounded to `decimals` places (Python's round)
    lies from it: half a unit of the last place (all of it at a tie: a value d q of a Q8_0 group,
    a few binary digits long, can end on one), plus the rounding of that decimal to the nearest
    double (u of the value), doubled."""
    return 0.5 * 10.0 ** -decimals + 2 * U64 * scale


def norm_tolerance(norm: float, C: int) -> float:
    """The reply's row_norm: an fp32 norm of C fp32 values (a sum of C squares, gamma_C relative,
    and a sqrt, half of that plus u: within gamma_{C+2}), doubled, rounded to 6 places."""
    return 2 * gamma(C + 2) * norm + half_unit(6, norm)


def cosine_tolerance(C: int) -> float:
    """The reply's cosine: an fp32 dot product (gamma_C sum |a b| <= gamma_C |a| |b|), two fp32
    norms (gamma_{C+2} each), their product and the divide (2u), all relative to |a| |b|, so
    absolute on the cosine; doubled for second order; rounded to 7 places."""
    return 2 * (gamma(C) + 2 * gamma(C + 2) + 2 * U32) + half_unit(7)


def reference_neighbours(table: torch.Tensor, token_id: int, k: int):
    """Cosine of row token_id with every row, computed here in float64; the token left out."""
    table = table.double()
    cos = torch.nn.functional.cosine_similarity(table, table[token_id].unsqueeze(0), dim=1)
    cos[token_id] = float("-inf")
    values, ids = cos.topk(k)
    return ids.tolist(), values.tolist()


@pytest.mark.real_model
@pytest.mark.parametrize("token_id, k", [(2368, 10), (504, 20), (1, 5), (17097, 10)])
def test_row_and_neighbours_equal_transformers(real_ws, hf_reference, token_id, k):
    model, _ = hf_reference
    table = model.get_input_embeddings().weight.detach()                      # (V, C)
    reply = real_ws.call("embedding", token_id=token_id, k=k)
    assert reply["type"] == "embedding", reply
    assert reply["token_id"] == token_id and reply["num_rows"] == table.shape[0]
    row = torch.tensor(reply["row"], dtype=torch.float64)
    assert row.shape == (table.shape[1],) == (576,)
    C = table.shape[1]
    # transformers' dequantized table is ours bit for bit (both d q of the file's Q8_0 groups, exact in
    # fp32), and the reply rounds each value to 7 places: half a unit, plus u of the value for the
    # rounded decimal's double, doubled (half_unit, elementwise: allclose's rtol is that u term)
    assert torch.allclose(row, table[token_id].double(), rtol=2 * U64, atol=half_unit(7, 0.0))
    norm = float(table[token_id].double().norm())
    assert reply["row_norm"] == pytest.approx(norm, abs=norm_tolerance(norm, C))
    ids, cosines = reference_neighbours(table, token_id, k)
    assert [n["id"] for n in reply["neighbours"]] == ids
    assert [n["cosine"] for n in reply["neighbours"]] == pytest.approx(cosines, abs=cosine_tolerance(C))
    assert token_id not in [n["id"] for n in reply["neighbours"]] and reply["self_excluded"]
    nearest = torch.tensor(reply["nearest_row"], dtype=torch.float64)
    assert torch.allclose(nearest, table[ids[0]].double(), rtol=2 * U64, atol=half_unit(7, 0.0))   # as the row above


@pytest.mark.real_model
def test_text_picks_its_first_token(real_ws, hf_reference):
    _, hf_tok = hf_reference
    ids = hf_tok.encode(" unbelievably", add_special_tokens=False)
    assert len(ids) > 1
    reply = real_ws.call("embedding", text=" unbelievably", k=5)
    assert reply["token_id"] == ids[0]
    assert [t["id"] for t in reply["text_tokens"]] == ids
    assert "".join(t["text"] for t in reply["text_tokens"]) == " unbelievably"
    assert reply["token"]["text"] == hf_tok.decode([ids[0]])
    assert len(reply["neighbours"]) == 5


def test_a_second_ask_comes_from_the_cache(ws, live_server):
    first = ws.call("embedding", token_id=42, k=3)
    hits = live_server.runtime.jobs.stats()["cache_hits"]
    again = ws.call("embedding", token_id=42, k=3)
    assert again["neighbours"] == first["neighbours"] and again["row"] == first["row"]
    assert live_server.runtime.jobs.stats()["cache_hits"] == hits + 1


@pytest.mark.parametrize("fields, param", [
    ({}, "token_id"),
    ({"token_id": 1, "text": "a"}, "token_id"),
    ({"token_id": -1}, "token_id"),
    ({"token_id": 49152}, "token_id"),
    ({"token_id": True}, "token_id"),
    ({"token_id": 1.5}, "token_id"),
    ({"text": ""}, "text"),
    ({"text": 7}, "text"),
    ({"text": "word " * 80}, "text"),          # over the server's max_inspect_tokens (64)
    ({"token_id": 1, "k": 0}, "k"),
    ({"token_id": 1, "k": 51}, "k"),
    ({"token_id": 1, "k": "5"}, "k"),
    ({"token_id": 1, "top": 5}, "top"),
])
def test_bad_input_names_the_field_and_the_connection_stays_usable(ws, fields, param):
    err = ws.error({"type": "embedding", "id": "e1", **fields}, "e1")
    assert err["code"] == "invalid_request" and err["param"] == param, err
    assert len(ws.call("embedding", token_id=3, k=2)["neighbours"]) == 2


@pytest.mark.browser
@pytest.mark.real_model
def test_embedding_page_from_the_url_and_a_click_on_a_neighbour(pg, artifacts_dir, hf_reference):
    model, hf_tok = hf_reference
    table = model.get_input_embeddings().weight.detach()
    shoot_widget(pg, "embedding", artifacts_dir, "?token=+dog&k=10")
    page = pg.page
    pg.goto("/embed/embedding?token=+dog&k=5")
    wait_ready(page, EMB)
    dog = hf_tok.encode(" dog", add_special_tokens=False)[0]
    assert figure_value(page, "token_id") == dog
    ids, cosines = reference_neighbours(table, dog, 5)
    C = table.shape[1]
    assert figure_value(page, "top_cosine") == pytest.approx(cosines[0], abs=cosine_tolerance(C))
    norm = float(table[dog].double().norm())
    assert figure_value(page, "row_norm") == pytest.approx(norm, abs=norm_tolerance(norm, C))
    shown = page.locator(f"{EMB} .neighbours .tok").evaluate_all("els => els.map(e => Number(e.dataset.id))")
    assert shown == ids
    page.locator(f"{EMB} .neighbours .tok").nth(1).click()          # look up the second neighbour
    page.wait_for_function(f"""() => document.querySelector('{EMB} [data-figure="token_id"]')
                               ?.dataset.value === '{ids[1]}'""")
    wait_ready(page, EMB)
    assert page.input_value(f'{EMB} input[name="token_id"]') == str(ids[1])
    assert figure_value(page, "top_cosine") == pytest.approx(reference_neighbours(table, ids[1], 5)[1][0],
                                                            abs=cosine_tolerance(C))
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_embedding_by_id_on_the_walkthrough_at_phone_width(pg, artifacts_dir):
    snippet = on_a_phone(pg, "embedding", "?embedding.token_id=504&embedding.k=5", artifacts_dir)
    assert figure_value(pg.page, "token_id") == 504
    assert "token_id=504" in snippet
    pg.assert_clean()


@pytest.mark.browser
@pytest.mark.real_model
def test_a_word_typed_alone_offers_its_spaced_token(pg, hf_reference):
    _, hf_tok = hf_reference
    alone = hf_tok.encode("dog", add_special_tokens=False)
    spaced = hf_tok.encode(" dog", add_special_tokens=False)
    assert alone[0] != spaced[0]
    page = pg.page
    pg.goto("/embed/embedding?token=dog&k=5")
    wait_ready(page, EMB)
    assert figure_value(page, "token_id") == alone[0]
    offer = page.locator(f'{EMB} .picked button.tok[data-id="{spaced[0]}"]')
    offer.click()
    page.wait_for_function(f"""() => document.querySelector('{EMB} [data-figure="token_id"]')
                               ?.dataset.value === '{spaced[0]}'""")
    assert page.input_value(f'{EMB} input[name="token"]') == " dog"
    pg.assert_clean()
