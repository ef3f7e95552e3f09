"""The canonical key of a request message: what a recording is looked up by.

The message's JSON with object keys sorted at every level, no spaces, and its top-level "id" left
out (the id is the client's own correlation tag, not part of the question). The text is the one
JavaScript's JSON.stringify writes for the same value (static/js/recorded.js canonicalKey), so a
key computed on either side matches: integral floats are written as integers, and numbers use
JavaScript's shortest round-trip form (ECMA-262 Number::toString).
"""

import json
import math

from core.errors import InvalidParameter


def canonical_key(message: dict) -> str:
    if not isinstance(message, dict):
        raise InvalidParameter("message", f"must be a JSON object, got {type(message).__name__}")
    return _dump({k: v for k, v in message.items() if k != "id"})


def _dump(value) -> str:
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(str(k), ensure_ascii=False) + ":" + _dump(value[k])
                              for k in sorted(value, key=_js_order)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_dump(v) for v in value) + "]"
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return js_number(value)
    raise InvalidParameter("message", f"holds a {type(value).__name__}, which JSON has no form for")


def _js_order(key: str):
    """JavaScript sorts strings by UTF-16 code units, Python by code points: sort as JS does."""
    return str(key).encode("utf-16-be")


def js_number(x: float) -> str:
    """A float as JavaScript's Number::toString writes it (JSON.stringify uses it)."""
    if not math.isfinite(x):
        return "null"                         # JSON.stringify(NaN) is null
    if x == 0:
        return "0"
    if x.is_integer() and abs(x) < 2 ** 53:   # exact integers: their digits are the shortest form
        return str(int(x))
    digits, exponent = _shortest(x)           # x = 0.d1d2...dk * 10**exponent
    sign = "-" if x < 0 else ""
    k, n = len(digits), exponent
    if k <= n <= 21:
        return sign + digits + "0" * (n - k)
    if 0 < n <= 21:
        return sign + digits[:n] + "." + digits[n:]
    if -6 < n <= 0:
        return sign + "0." + "0" * (-n) + digits
    e = n - 1
    mantissa = digits[0] + ("." + digits[1:] if k > 1 else "")
    return f"{sign}{mantissa}e{'+' if e >= 0 else '-'}{abs(e)}"


def _shortest(x: float) -> tuple[str, int]:
    """The shortest round-trip decimal digits of |x| and its exponent n (|x| = 0.digits * 10**n)."""
    text = repr(abs(x))                       # Python's repr is the shortest round-trip form too
    mantissa, _, exp = text.partition("e")
    whole, _, frac = mantissa.partition(".")
    digits = (whole + frac).lstrip("0")
    lead_zeros = len(whole + frac) - len((whole + frac).lstrip("0"))
    n = len(whole) - lead_zeros + (int(exp) if exp else 0)
    return digits.rstrip("0") or "0", n
