"""Recordings: a widget's exchanges with the server for given options, kept as JSON so that a
static export (app/export.py) or a refused embed can show them without the engine.

keys.py: the canonical key of a request message; schema.json + schema.py: the format and its
check; meta.py: the machine, engine and model a recording names; store.py: reading and writing
the files, and serving a folder of them at /recordings/<widget>.json; recorder.py: recording
each widget through the real engine in Chromium. docs/export.md describes the format.
"""

from .keys import canonical_key
from .schema import RecordingError, validate

FORMAT = "sendlens-recording/1"

__all__ = ["FORMAT", "RecordingError", "canonical_key", "validate"]
