"""Checking a recording against schema.json (a JSON Schema, draft 2020-12).

A small validator of our own for the keywords schema.json uses (type, const, enum, required,
properties, additionalProperties, items, minItems, minLength, minimum, pattern): the project adds
no dependency for it. The first error found is raised as RecordingError naming the field's path
(`exchanges[2].replies`), then the two checks JSON Schema cannot say: every exchange's key is the
canonical key of its message, and its last reply ends the request.
"""

import json
import re
from pathlib import Path

from core.errors import InvalidParameter

from .keys import canonical_key

SCHEMA_PATH = Path(__file__).with_name("schema.json")
SCHEMA = json.loads(SCHEMA_PATH.read_text())

TYPES = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


class RecordingError(InvalidParameter):
    """A recording that does not fit the format; .param is the path of the field at fault."""


def validate(recording, schema: dict = SCHEMA) -> dict:
    """Return `recording` when it fits; raise RecordingError naming the first field that does not."""
    _check(recording, schema, "recording")
    for i, ex in enumerate(recording["exchanges"]):
        want = canonical_key(ex["message"])
        if ex["key"] != want:
            raise RecordingError(f"recording.exchanges[{i}].key", f"is not the canonical key of its message: "
                                                                   f"got {ex['key'][:80]!r}, want {want[:80]!r}")
        last = ex["replies"][-1]["type"]
        kind = ex["message"]["type"]
        if not (last in ("done", "error") or (last == kind and kind != "generate")):
            raise RecordingError(f"recording.exchanges[{i}].replies", f"does not end the {kind!r} request: its "
                                                                       f"last message is a {last!r}")
    return recording


def _check(value, schema: dict, path: str) -> None:
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(TYPES[t](value) for t in types):
            raise RecordingError(path, f"must be of type {' or '.join(types)}, got {_name(value)}")
    if "const" in schema and value != schema["const"]:
        raise RecordingError(path, f"must be {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise RecordingError(path, f"must be one of {schema['enum']!r}, got {value!r}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            raise RecordingError(path, f"must have at least {schema['minLength']} characters")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            raise RecordingError(path, f"must match {schema['pattern']}, got {value[:80]!r}")
    if TYPES["number"](value) and "minimum" in schema and value < schema["minimum"]:
        raise RecordingError(path, f"must be at least {schema['minimum']}, got {value!r}")
    if isinstance(value, dict):
        for key in schema.get("required", []):
            if key not in value:
                raise RecordingError(f"{path}.{key}", "is missing")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                _check(item, props[key], f"{path}.{key}")
            elif extra is False:
                raise RecordingError(f"{path}.{key}", "is not a field of a recording here")
            elif isinstance(extra, dict):
                _check(item, extra, f"{path}.{key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            raise RecordingError(path, f"must hold at least {schema['minItems']} item(s)")
        if "items" in schema:
            for i, item in enumerate(value):
                _check(item, schema["items"], f"{path}[{i}]")


def _name(value) -> str:
    return next((t for t in ("null", "boolean", "integer", "number", "string", "array", "object")
                 if TYPES[t](value)), type(value).__name__)
