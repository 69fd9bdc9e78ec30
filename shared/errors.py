"""The project's own error types. Transports map them to status codes in one place each."""

from __future__ import annotations

import secrets
from typing import Any


class SpecSplitError(Exception):
    """Base error: `code` is the machine-readable name, `http_status` the REST status."""

    code = "internal"
    http_status = 500
    # seconds a client should wait before sending again (REST `Retry-After`, gRPC trailing
    # metadata `retry-after`, `retry_after_s` in the body); None: retrying the same call is no use
    retry_after_s: int | None = None

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_body(self) -> dict[str, Any]:
        extra = {} if self.retry_after_s is None else {"retry_after_s": self.retry_after_s}
        return {"error": {"code": self.code, "message": self.message, **extra, **self.details}}


class InvalidArgument(SpecSplitError):
    """Malformed request: shapes, ranges, NaN, ids outside the vocabulary, sampling mismatch."""

    code, http_status = "invalid_argument", 422


class NotFound(SpecSplitError):
    """Unknown, expired or evicted session: the edge reopens with its full context."""

    code, http_status = "not_found", 404


class ContextMismatch(SpecSplitError):
    """`ctx_len` / `ctx_hash` disagree with the cloud; details carry `expected_ctx_len`."""

    code, http_status = "failed_precondition", 409


class Unauthenticated(SpecSplitError):
    code, http_status = "unauthenticated", 401


class PermissionDenied(SpecSplitError):
    code, http_status = "permission_denied", 403


class ResourceExhausted(SpecSplitError):
    """Over capacity (queue full, too many sessions): back off and retry."""

    code, http_status = "resource_exhausted", 429
    retry_after_s = 1


class PayloadTooLarge(SpecSplitError):
    code, http_status = "payload_too_large", 413


class Unavailable(SpecSplitError):
    """The process cannot take this call now (draining before exit, not ready): retry, possibly elsewhere."""

    code, http_status = "unavailable", 503
    retry_after_s = 1


class Internal(SpecSplitError):
    """A fault of the server itself (a bug, a device failure): not retried as if transient; `error_id`
    names the log line with the traceback."""

    code, http_status = "internal", 500

    @classmethod
    def of(cls, exc: BaseException) -> Internal:
        return cls(f"internal error: {type(exc).__name__}", error_id=secrets.token_hex(8))


ERRORS_BY_STATUS: dict[int, type[SpecSplitError]] = {
    cls.http_status: cls
    for cls in (InvalidArgument, NotFound, ContextMismatch, Unauthenticated, PermissionDenied,
                ResourceExhausted, PayloadTooLarge, Unavailable, Internal)
}
