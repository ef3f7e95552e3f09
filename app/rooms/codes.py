"""Room codes, presenter keys and student tokens, drawn from `secrets` (never `random`).

A room code is what a class types or scans: 8 characters from an alphabet without look-alikes
(no 0/O, 1/I/L), about 40 bits, so trying codes at the join rate limit finds nothing. The
presenter key and the student tokens are cookie values nobody types: 32 URL-safe bytes.
Comparisons of secrets take constant time (hmac.compare_digest).
"""

import hmac
import secrets

ALPHABET = "23456789ABCDEFGHJKMNPQRSTUVWXYZ"  # 31 symbols: 8 of them are ~39.6 bits
CODE_LENGTH = 8
SECRET_BYTES = 32


def new_code(first: str = "") -> str:
    """A fresh code; first: its first symbol (a replica's, app/replicas.py), else random too."""
    return first + "".join(secrets.choice(ALPHABET) for _ in range(CODE_LENGTH - len(first)))


def new_secret() -> str:
    """A presenter key or a student token."""
    return secrets.token_urlsafe(SECRET_BYTES)


def normalize_code(text) -> str | None:
    """A code as typed (any case, surrounding spaces) -> its canonical form, or None if it
    cannot be a code at all (so a malformed one is answered like an unknown one)."""
    if not isinstance(text, str):
        return None
    code = text.strip().upper()
    if len(code) != CODE_LENGTH or any(c not in ALPHABET for c in code):
        return None
    return code


def same_secret(given, expected: str) -> bool:
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())
