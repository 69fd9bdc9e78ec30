"""Error statuses back to the project's error types: the one place for REST and gRPC alike."""

from __future__ import annotations

import json
import re
from typing import Any

import grpc

from shared.errors import (
    ERRORS_BY_STATUS,
    ContextMismatch,
    Internal,
    InvalidArgument,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    ResourceExhausted,
    SpecSplitError,
    Unauthenticated,
)


class CloudTimeout(SpecSplitError):
    """No answer within the deadline; the request may still have been applied by the cloud."""

    code, http_status = "deadline_exceeded", 504


class CloudUnavailable(SpecSplitError):
    """Connection refused / reset, 5xx, or an unreadable answer: back off and retry."""

    code, http_status = "unavailable", 503


_BY_GRPC: dict[grpc.StatusCode, type[SpecSplitError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.FAILED_PRECONDITION: ContextMismatch,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: CloudTimeout,
    grpc.StatusCode.UNAVAILABLE: CloudUnavailable,
    grpc.StatusCode.INTERNAL: Internal,
    grpc.StatusCode.UNKNOWN: CloudUnavailable,
    grpc.StatusCode.ABORTED: CloudUnavailable,
}
_EXPECTED = re.compile(r"expected_ctx_len\D{0,4}(\d+)")


def _build(cls: type[SpecSplitError], message: str, details: dict[str, Any]) -> SpecSplitError:
    details = {k: v for k, v in details.items() if k not in ("code", "message")}
    if cls is ContextMismatch and "expected_ctx_len" not in details:
        m = _EXPECTED.search(message)
        if m:
            details["expected_ctx_len"] = int(m.group(1))
    return cls(message, **details)


# the longest wait a Retry-After may impose on the edge (seconds)
MAX_RETRY_AFTER_S = 30.0


def _retry_after(value: object) -> float | None:
    """Seconds of a Retry-After value (delay-seconds; an HTTP date or garbage reads as none)."""
    try:
        seconds = float(str(value))
    except ValueError:
        return None
    return seconds if seconds >= 0 and seconds == seconds else None


def retry_delay(err: SpecSplitError, backoff_s: float) -> float:
    """How long to wait before resending after `err`: the own backoff, or longer when the cloud asked
    for it (Retry-After / `retry_after_s`), at most MAX_RETRY_AFTER_S."""
    asked = _retry_after(err.details.get("retry_after_s")) or 0.0
    return max(backoff_s, min(asked, MAX_RETRY_AFTER_S))


def error_from_http(status: int, body: bytes, retry_after: str | None = None) -> SpecSplitError:
    """A REST error answer -> the project's exception; the body is `{"error": {...}}` when well formed.
    `retry_after`: the Retry-After header, kept as details["retry_after_s"] when the body has none."""
    err: dict[str, Any] = {}
    try:
        parsed = json.loads(body)
        if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
            err = parsed["error"]
        elif isinstance(parsed, dict) and "detail" in parsed:  # framework-level validation errors
            err = {"message": json.dumps(parsed["detail"])[:500]}
    except ValueError:
        err = {"message": body[:200].decode("utf-8", "replace")}
    message = str(err.get("message") or f"HTTP {status}")
    # every 5xx (the cloud's 503 `unavailable` included) is the edge's CloudUnavailable: back off, retry
    cls = CloudUnavailable if status >= 500 else ERRORS_BY_STATUS.get(status, SpecSplitError)
    if status == 500 and err.get("code") == Internal.code:  # the cloud's own fault: surfaced, not retried
        cls = Internal
    if status == 422 or status == 400:
        cls = InvalidArgument
    seconds = _retry_after(retry_after) if retry_after is not None else None
    if seconds is not None and "retry_after_s" not in err:
        err = {**err, "retry_after_s": seconds}
    return _build(cls, message, err)


def error_from_grpc(code: grpc.StatusCode, message: str,
                    trailing: tuple[tuple[str, str | bytes], ...] = ()) -> SpecSplitError:
    """A gRPC status -> the project's exception. Details come as the JSON error body in the trailing
    metadata `specsplit-error` (or in the message), or as a bare `expected_ctx_len` entry."""
    details: dict[str, Any] = {}
    text = message or ""
    try:
        parsed = json.loads(text)
        if isinstance(parsed, dict):
            err = parsed.get("error", parsed)
            if isinstance(err, dict):
                details = dict(err)
                text = str(err.get("message", text))
    except ValueError:
        pass
    for key, value in trailing or ():
        if key == "specsplit-error":  # the REST error body, as the cloud sends it
            try:
                body = json.loads(value)
                details.update(body.get("error", {}) if isinstance(body, dict) else {})
            except ValueError:
                pass
        elif key == "expected_ctx_len":
            details["expected_ctx_len"] = int(value)
        elif key == "retry-after" and _retry_after(value) is not None:
            details.setdefault("retry_after_s", _retry_after(value))
    cls = _BY_GRPC.get(code, CloudUnavailable)
    if code == grpc.StatusCode.INTERNAL and "code" not in details:
        # not the verifier's (it sends its error body): the connection under the call broke, e.g. a proxy's
        # RST_STREAM when the replica behind it died mid-stream
        cls = CloudUnavailable
    if cls is ResourceExhausted and (details.get("code") == PayloadTooLarge.code or "too large" in text):
        cls = PayloadTooLarge
    return _build(cls, text or code.name, details)


def error_from_body(body: dict[str, Any]) -> SpecSplitError:
    """An error body `{"error": {"code", "message", ...}}` without a status (e.g. mid-stream) -> its type."""
    err = body.get("error") if isinstance(body.get("error"), dict) else {}
    assert isinstance(err, dict)
    by_code = {cls.code: cls for cls in ERRORS_BY_STATUS.values()}
    cls = by_code.get(str(err.get("code")), CloudUnavailable)
    return _build(cls, str(err.get("message") or "error event"), err)


def with_key_hint(err: SpecSplitError) -> SpecSplitError:
    """A 401 from the cloud names the edge's setting that sends the key."""
    if isinstance(err, Unauthenticated) and "--api-key" not in err.message:
        err.message = (f"the cloud refused the edge's API key ({err.message}): pass --api-key KEY or set "
                       "SPECSPLIT_EDGE_API_KEY")
        err.args = (err.message,)
    return err


def is_retryable(err: SpecSplitError) -> bool:
    """Back off and send again: capacity, size limits (per PROTOCOL.md), 5xx and connection errors; not
    the cloud's own fault (500 internal, surfaced with its error_id)."""
    if isinstance(err, Internal):
        return False
    return isinstance(err, (ResourceExhausted, PayloadTooLarge, CloudUnavailable)) or (
        err.http_status >= 500 and not isinstance(err, CloudTimeout))
