"""Typed migration errors and the HTTP status each kind maps to.

Scheduler-side code raises `MigrationError`; the scheduler handlers turn it into an
output with ``success=False`` and ``error_kind`` so it can cross the process boundary,
and the HTTP layer maps ``error_kind`` to a status code in one place.
"""

from __future__ import annotations

from enum import StrEnum
from http import HTTPStatus
from typing import TypeVar


class ErrorKind(StrEnum):
    BAD_REQUEST = "bad_request"  # malformed input (400)
    TOO_LARGE = "too_large"  # request body over the size limit (413)
    FORBIDDEN = "forbidden"  # no valid grant / receipt for this write or commit (403)
    NOT_FOUND = "not_found"  # unknown migration id (404)
    CONFLICT = "conflict"  # layout mismatch, state conflict (409)
    GONE = "gone"  # migration expired by the watchdog (410)
    UNAVAILABLE = "unavailable"  # migration disabled, host pool full (503)
    TRANSFER_FAILED = "transfer_failed"  # transport error talking to a peer (502)
    INTERNAL = "internal"  # a bug: logged with its traceback (500)

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]


_HTTP_STATUS: dict[ErrorKind, int] = {
    ErrorKind.BAD_REQUEST: HTTPStatus.BAD_REQUEST,
    ErrorKind.TOO_LARGE: HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
    ErrorKind.FORBIDDEN: HTTPStatus.FORBIDDEN,
    ErrorKind.NOT_FOUND: HTTPStatus.NOT_FOUND,
    ErrorKind.CONFLICT: HTTPStatus.CONFLICT,
    ErrorKind.GONE: HTTPStatus.GONE,
    ErrorKind.UNAVAILABLE: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorKind.TRANSFER_FAILED: HTTPStatus.BAD_GATEWAY,
    ErrorKind.INTERNAL: HTTPStatus.INTERNAL_SERVER_ERROR,
}


class MigrationError(Exception):
    """A migration step failed; `kind` says how the caller should react."""

    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message

    def __reduce__(self):
        return (MigrationError, (self.kind, self.message))


_E = TypeVar("_E", bound=BaseException)


def detached(error: _E) -> _E:
    """`error` without its traceback and the exceptions it was raised from, to be kept.

    A caught exception's traceback holds the frames it passed through, and their locals
    hold whatever kept the error (a transfer's record, its request): a cycle that
    only CPython's full garbage collection frees, so every refused request's body would
    stay in memory until then."""
    error.__traceback__ = None
    error.__context__ = None
    error.__cause__ = None
    return error
