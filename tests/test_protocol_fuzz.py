"""Property-based fuzzing of the protocol (hypothesis): no input makes the server answer anything
but a named error or a proper reply, and the connection stays usable.

Two layers: the envelope parser alone (fast, many examples), then every registered message type
over a real websocket on the tiny model, with fields drawn from its own field names and any JSON.
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.config import ServerConfig
from app.protocol import ProtocolError, parse
from app.widgets import MESSAGE_TYPES
from conftest import WS

# Every code a refusal may carry (docs/protocol.md's table). `timeout` is a valid job on a machine
# so busy that its worker processes ran past worker_timeout_s: named, not a crash.
NAMED = {"invalid_request", "context_length_exceeded", "overloaded", "aborted", "timeout"}
CONFIG = ServerConfig(model="tiny", max_message_bytes=4096)

scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
           | st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.text(max_size=300), st.binary(max_size=100),
                 json_values.map(json.dumps),
                 st.dictionaries(st.sampled_from(["type", "id", "prompt", "messages", "text", "x"]),
                                 json_values, max_size=4).map(json.dumps)))
def test_the_parser_answers_only_with_named_errors(raw):
    try:
        msg = parse(raw, CONFIG, MESSAGE_TYPES)
    except ProtocolError as exc:
        assert exc.code == "invalid_request" and exc.param
        return
    assert msg["type"] in set(MESSAGE_TYPES) | {"abort"}


def message_for(kind: str):
    fields = sorted(MESSAGE_TYPES[kind].fields)
    return st.dictionaries(st.sampled_from(fields), json_values, max_size=len(fields)) if fields else st.just({})


@pytest.fixture(scope="module")
def fuzz_ws(live_server):
    client = WS(live_server.ws)
    yield client
    client.close()


# Message types whose valid messages start worker processes (app/processes.py): slow, as
# conftest.py's SLOW_MODULES, so `make fast` leaves them to `make test`.
WORKER_KINDS = {"moe_parallel", "moe-parallel", "pipeline", "tensor_parallel", "tensor-parallel"}


def test_the_worker_kinds_are_message_types():
    assert WORKER_KINDS <= set(MESSAGE_TYPES)


@pytest.mark.parametrize("kind", [pytest.param(kind, marks=pytest.mark.slow) if kind in WORKER_KINDS else kind
                                  for kind in sorted(MESSAGE_TYPES)])
def test_every_message_type_refuses_bad_fields_by_name(live_server, fuzz_ws, kind):
    counter = [0]

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(message_for(kind))
    def check(fields):
        counter[0] += 1
        mid = f"{kind}-{counter[0]}"
        fuzz_ws.send({**fields, "type": kind, "id": mid})
        while True:
            reply = fuzz_ws.recv_for(mid, timeout=60)
            if reply["type"] == "error":
                assert reply["code"] in NAMED, reply
                if reply["code"] not in ("overloaded", "timeout"):   # refusals of load, not of a field
                    assert reply["param"], reply
                return
            if reply["type"] in ("accepted", "token", "progress"):
                continue
            assert reply["type"] in (kind, "done"), reply
            return

    check()
    assert fuzz_ws.call_within_rate("template", messages=[{"role": "user", "content": "still here"}])["type"] == "template"
