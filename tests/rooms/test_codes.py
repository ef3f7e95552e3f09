"""Room codes and secrets: long enough that trying codes finds nothing, and no look-alikes."""

import math

from app.rooms import codes


def test_a_code_is_eight_unambiguous_characters_of_about_forty_bits():
    seen = {codes.new_code() for _ in range(2000)}
    assert len(seen) == 2000
    for code in seen:
        assert len(code) == codes.CODE_LENGTH == 8
        assert set(code) <= set(codes.ALPHABET)
    assert not set("01ILO") & set(codes.ALPHABET)
    assert codes.CODE_LENGTH * math.log2(len(codes.ALPHABET)) > 39


def test_codes_are_read_as_typed_and_anything_else_is_no_code():
    code = codes.new_code()
    assert codes.normalize_code(f"  {code.lower()} ") == code
    for bad in ("", "ABC", code + "2", "0" * 8, "<script>", None, 12345678, "ÀBCDEFGH"):
        assert codes.normalize_code(bad) is None


def test_secrets_are_long_and_compared_whole():
    key = codes.new_secret()
    assert len(key) >= 40 and key != codes.new_secret()
    assert codes.same_secret(key, key)
    assert not codes.same_secret(key[:-1], key)
    assert not codes.same_secret(None, key)
    assert not codes.same_secret(["x"], key)
