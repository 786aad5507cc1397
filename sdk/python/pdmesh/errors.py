"""Typed exceptions of the pdmesh client.

Errors the router reports carry its ErrorCode (proto/pdmesh.proto); errors detected on the
client side (timeout, unreachable router, malformed reply) have their own classes.
"""


class PdmeshError(Exception):
    """Base class. `code` is the router's ErrorCode name ("ERR_OVERLOADED", ...) or a
    client-side name ("TIMEOUT", "UNREACHABLE", "PROTOCOL", "CLOSED")."""

    code = "ERR_INTERNAL"

    def __init__(self, message, code=None, request_id=0):
        super().__init__(message)
        if code is not None:
            self.code = code
        self.request_id = request_id


class TimeoutError_(PdmeshError):
    code = "TIMEOUT"


class UnreachableError(PdmeshError):
    code = "UNREACHABLE"


class ProtocolError(PdmeshError):
    code = "PROTOCOL"


class ClosedError(PdmeshError):
    code = "CLOSED"


class InvalidArgumentError(PdmeshError):
    code = "ERR_INVALID_ARGUMENT"


class UnauthorizedError(PdmeshError):
    code = "ERR_UNAUTHORIZED"


class OverloadedError(PdmeshError):
    code = "ERR_OVERLOADED"


class DeadlineExceededError(PdmeshError):
    code = "ERR_DEADLINE_EXCEEDED"


class CancelledError(PdmeshError):
    code = "ERR_CANCELLED"


class UnavailableError(PdmeshError):
    code = "ERR_UNAVAILABLE"


class NotFoundError(PdmeshError):
    code = "ERR_NOT_FOUND"


class RouterError(PdmeshError):
    """Any other error the router reports (ERR_BAD_MESSAGE, ERR_INTERNAL, ERR_KV_TRANSFER...)."""


# Public name: shadowing the builtin inside the package would surprise users.
PdmeshTimeout = TimeoutError_

_BY_CODE = {
    "ERR_INVALID_ARGUMENT": InvalidArgumentError,
    "ERR_UNAUTHORIZED": UnauthorizedError,
    "ERR_OVERLOADED": OverloadedError,
    "ERR_DEADLINE_EXCEEDED": DeadlineExceededError,
    "ERR_CANCELLED": CancelledError,
    "ERR_UNAVAILABLE": UnavailableError,
    "ERR_NOT_FOUND": NotFoundError,
}


def from_router(code_name, message, request_id=0):
    """The exception for an Error message from the router."""
    cls = _BY_CODE.get(code_name, RouterError)
    return cls(f"router: {message or code_name}", code=code_name, request_id=request_id)
