"""Recordings (app/recordings): the schema check names the field at fault, and keys are canonical."""

import copy

import pytest

from app.recordings import FORMAT, RecordingError, canonical_key, validate
from app.recordings.keys import js_number


def good() -> dict:
    message = {"type": "tokenize", "text": "The cat", "id": "tokenize-1"}
    return {
        "format": FORMAT, "widget": "tokenizer", "options": {},
        "machine": {"cpu": "AMD EPYC", "threads": 2}, "date": "2026-12-04T10:19:33Z",
        "engine": {"version": "0.1.0", "commit": None}, "model": "tiny",
        "hello": {"type": "hello", "num_layers": 2},
        "exchanges": [{"key": canonical_key(message), "message": message,
                       "replies": [{"type": "tokenize", "id": "tokenize-1", "ids": [1, 2]}]}],
    }


def test_a_good_recording_passes():
    assert validate(good())["widget"] == "tokenizer"


@pytest.mark.parametrize("change, field, words", [
    (lambda r: r.pop("machine"), "recording.machine", "is missing"),
    (lambda r: r["machine"].update(threads=0), "recording.machine.threads", "at least 1"),
    (lambda r: r.update(date="4 December"), "recording.date", "must match"),
    (lambda r: r.update(format="sendlens-recording/0"), "recording.format", "must be"),
    (lambda r: r["options"].update(layer=3), "recording.options.layer", "type string"),
    (lambda r: r.update(extra=1), "recording.extra", "not a field"),
    (lambda r: r["exchanges"][0].update(replies=[]), "recording.exchanges[0].replies", "at least 1"),
    (lambda r: r["exchanges"][0]["replies"][0].pop("type"), "recording.exchanges[0].replies[0].type", "is missing"),
    (lambda r: r["exchanges"][0].update(key='{"text":"The dog","type":"tokenize"}'), "recording.exchanges[0].key",
     "not the canonical key"),
    (lambda r: r["exchanges"][0]["replies"].__setitem__(0, {"type": "progress"}), "recording.exchanges[0].replies",
     "does not end"),
])
def test_a_bad_recording_is_refused_naming_its_field(change, field, words):
    r = copy.deepcopy(good())
    change(r)
    with pytest.raises(RecordingError) as err:
        validate(r)
    assert err.value.param == field
    assert str(err.value).startswith(field + ": ") and words in str(err.value)


def test_keys_leave_out_the_id_and_sort_every_level():
    a = {"id": "a-1", "type": "attention", "options": {"layer": 3, "head": 0}, "text": "x"}
    b = {"text": "x", "options": {"head": 0, "layer": 3}, "type": "attention", "id": "a-99"}
    assert canonical_key(a) == canonical_key(b) == '{"options":{"head":0,"layer":3},"text":"x","type":"attention"}'
    # a nested "id" is part of the question: only the top-level one is the client's tag
    assert canonical_key({"type": "t", "pick": {"id": 5}}) == '{"pick":{"id":5},"type":"t"}'


def test_keys_write_numbers_and_text_as_javascript_does():
    # JSON.stringify: integral floats as integers, shortest round-trip digits, exponents from 1e21
    # and below 1e-6, non-ASCII text as itself
    assert canonical_key({"type": "t", "temperature": 1.0, "top_p": 0.9, "eps": 1e-7, "small": 1e-5,
                          "big": 1e21, "text": "café 😀"}) == \
        '{"big":1e+21,"eps":1e-7,"small":0.00001,"temperature":1,"text":"café 😀","top_p":0.9,"type":"t"}'
    assert [js_number(x) for x in (0.1 + 0.2, -2.5e-7, 123456789012345680000.0, 1.5e300)] == \
        ["0.30000000000000004", "-2.5e-7", "123456789012345680000", "1.5e+300"]


def test_keys_refuse_what_json_cannot_hold():
    with pytest.raises(ValueError, match="message"):
        canonical_key({"type": "t", "when": object()})
    with pytest.raises(ValueError, match="message"):
        canonical_key(["not", "an", "object"])


def test_presets_come_from_the_widget_docs():
    from app.export import presets
    docs = "## `kv-memory`\n\ntext\n\nRecorded for the export: `?preset=llama-3.1-8b`, `?preset=deepseek-v3&context=8192`\n\n## `paging`\n"
    assert presets("kv-memory", docs) == [{"preset": "llama-3.1-8b"}, {"preset": "deepseek-v3", "context": "8192"}]
    assert presets("paging", docs) == []
    assert presets("nothing", docs) == []


@pytest.mark.parametrize("argv, param", [
    (["--server", "ftp://example.org"], "server"),
    (["--server", "example.org"], "server"),
    (["--widgets", "tokenizer,nothing"], "widgets"),
])
def test_export_refuses_bad_arguments_before_starting_an_engine(tmp_path, argv, param):
    from app.export import main
    with pytest.raises(ValueError) as err:
        main(["--out", str(tmp_path), *argv])
    assert err.value.param == param
    assert list(tmp_path.iterdir()) == []
