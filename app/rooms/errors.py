"""The rooms' named errors: each an InvalidParameter (so the websocket answers it in the usual
error shape, `code` + `param`) with a code of its own (docs/protocol.md, "Rooms")."""

from core.errors import InvalidParameter


class RoomError(InvalidParameter):
    code = "invalid_request"

    def __init__(self, code: str, param: str, message: str):
        super().__init__(param, message)
        self.code = code


def not_found(param: str = "room") -> RoomError:
    """The same answer whether a code never existed or its room is closed: nothing leaks which."""
    return RoomError("room_not_found", param, "no open room has this code")
