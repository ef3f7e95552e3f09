"""Display names: length, characters, uniqueness; each refusal names display_name."""

import pytest

from app.rooms.names import MAX_LENGTH, validate_name
from core.errors import InvalidParameter


@pytest.mark.parametrize("text, shown", [
    ("Ada", "Ada"), ("  Ada Lovelace ", "Ada Lovelace"), ("O'Brien-Smith_2.0", "O'Brien-Smith_2.0"),
    ("Zoë", "Zoë"), ("Zoe\u0308", "Zoë"), ("李雷", "李雷"), ("x" * MAX_LENGTH, "x" * MAX_LENGTH),
])
def test_good_names_are_kept_nfc_and_stripped(text, shown):
    assert validate_name(text) == shown


@pytest.mark.parametrize("text, words", [
    ("", "empty"), ("   ", "empty"), ("x" * (MAX_LENGTH + 1), "at most"),
    ("<b>bold</b>", "letters"), ("a&b", "letters"), ('say "hi"', "letters"),
    ("tab\there", "control"), ("bell\x07", "control"), ("zero\u200bwidth", "control"),
    ("rtl\u202eevil", "control"), ("two  spaces", "two spaces"), ("\u0301accent", "letters"),
    (None, "required"), (42, "required"),
])
def test_bad_names_are_refused_naming_display_name(text, words):
    with pytest.raises(InvalidParameter) as err:
        validate_name(text)
    assert err.value.param == "display_name"
    assert words in str(err.value)


def test_a_name_is_unique_in_its_room_whatever_its_case():
    taken = ["Ada", "Grace"]
    for text in ("ada", "ADA", " Grace "):
        with pytest.raises(InvalidParameter) as err:
            validate_name(text, taken)
        assert err.value.param == "display_name" and "taken" in str(err.value)
    assert validate_name("Adam", taken) == "Adam"
