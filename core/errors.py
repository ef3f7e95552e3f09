"""Errors the engine raises on bad input, each naming the parameter at fault.

The web layer turns these into protocol errors (`invalid_request`, `context_length_exceeded`,
`overloaded`) without guessing: the parameter name travels with the exception.
"""


def is_int(value) -> bool:
    """An int that is not a bool (JSON true would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


class InvalidParameter(ValueError):
    """A request or setting has a value the engine cannot use."""

    code = "invalid_request"

    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(f"{param}: {message}")


class ContextLengthExceeded(InvalidParameter):
    """The prompt does not fit in the model's context window."""

    code = "context_length_exceeded"


class EngineOverloaded(RuntimeError):
    """The engine's waiting queue is full; try again later."""

    code = "overloaded"

    def __init__(self, message: str, param: str = "queue"):
        self.param = param
        super().__init__(message)
