"""Students' display names: checked once, at the door, so every view can trust their shape.

A name is NFC-normalized and stripped, then must be 1 to MAX_LENGTH characters of letters,
digits (with their combining marks), spaces and - _ . ' (no markup, no control or format characters), and unique in its room
case-insensitively (casefold). Every failure is an InvalidParameter naming `display_name`.
Views still insert names as text (textContent, Jinja's autoescape): the check is the first
defence, not the only one.
"""

import unicodedata

from core.errors import InvalidParameter

PARAM = "display_name"
MAX_LENGTH = 24
PUNCTUATION = set(" -_.'")


def validate_name(text, taken=()) -> str:
    """-> the name as it will be shown; taken: names already in the room."""
    if not isinstance(text, str):
        raise InvalidParameter(PARAM, "is required")
    name = unicodedata.normalize("NFC", text).strip()
    if not name:
        raise InvalidParameter(PARAM, "must not be empty")
    if len(name) > MAX_LENGTH:
        raise InvalidParameter(PARAM, f"must be at most {MAX_LENGTH} characters, got {len(name)}")
    for ch in name:
        if ch in PUNCTUATION:
            continue
        category = unicodedata.category(ch)
        if category[0] == "C":
            raise InvalidParameter(PARAM, "must not contain control or invisible characters")
        if category[0] not in "LMN" or (category[0] == "M" and ch == name[0]):
            raise InvalidParameter(PARAM, f"may hold letters, digits, spaces and - _ . ' only, not {ch!r}")
    if "  " in name:
        raise InvalidParameter(PARAM, "must not contain two spaces in a row")
    key = name.casefold()
    if any(key == other.casefold() for other in taken):
        raise InvalidParameter(PARAM, f"{name!r} is already taken in this room; choose another")
    return name
