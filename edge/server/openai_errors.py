"""Errors of the OpenAI-compatible routes, in OpenAI's body: {"error": {"message", "type", "param", "code"}}.

The project's own errors map to an HTTP status and an OpenAI error type here, in one place: a bad
request (ours or one the cloud refused as invalid) is 400 `invalid_request_error`; a cloud that
is over capacity is 429, and so is this server running --max-generations already (`ServerBusy`, code
`server_busy`, with Retry-After); a cloud that refuses this server's key is 502 (naming --api-key); a cloud that
cannot be reached or answers too late is 503; the rest 500.
"""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError

from shared.errors import (
    InvalidArgument,
    PayloadTooLarge,
    PermissionDenied,
    ResourceExhausted,
    SpecSplitError,
    Unauthenticated,
    Unavailable,
)

from ..transport.errors import CloudTimeout, CloudUnavailable

# seconds a client told `server_busy` waits before its retry (a generation of a few hundred tokens takes seconds)
BUSY_RETRY_AFTER_S = 1


class ServerBusy(SpecSplitError):
    """This server runs its --max-generations already: each holds a draft state of its own, so one more waits."""

    code, http_status = "server_busy", 429


class OpenAIError(Exception):
    """status: the HTTP status; type: "invalid_request_error", "not_found_error", "rate_limit_error",
    "service_unavailable" or "server_error"; param: the request field at fault, or None; code: a
    machine-readable detail ("unsupported_parameter", "model_not_found", ...), or None."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        # seconds for a Retry-After header (None: none)
        self.retry_after = retry_after

    def to_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 invalid_request_error."""
    return OpenAIError(400, message, "invalid_request_error", param, code)


def from_specsplit(err: SpecSplitError) -> OpenAIError:
    """The OpenAI answer for one of the project's errors."""
    if isinstance(err, (InvalidArgument, PayloadTooLarge)):
        return OpenAIError(400, err.message, "invalid_request_error", None, err.code)
    if isinstance(err, ServerBusy):
        return OpenAIError(429, err.message, "rate_limit_error", None, err.code, retry_after=BUSY_RETRY_AFTER_S)
    if isinstance(err, ResourceExhausted):
        return OpenAIError(429, f"the cloud verifier is over capacity: {err.message}", "rate_limit_error",
                           None, err.code)
    if isinstance(err, (Unauthenticated, PermissionDenied)):  # this server's configuration, not the request
        return OpenAIError(502, f"the cloud verifier refused this server: {err.message}", "server_error",
                           None, "cloud_refused_key")
    if isinstance(err, (CloudUnavailable, CloudTimeout, Unavailable)):
        return OpenAIError(503, f"the cloud verifier is unavailable: {err.message}", "service_unavailable",
                           None, err.code)
    return OpenAIError(500, f"generation failed: {err.code}: {err.message}", "server_error", None, err.code)


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """pydantic's first complaint as a 400 naming the field (OpenAI's wording for unknown fields)."""
    errors = exc.errors()
    if not errors:
        return invalid("malformed request body")
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return invalid(f"Unrecognized request argument supplied: {param}", param, "unrecognized_argument")
    if first.get("type") == "json_invalid":
        return invalid(f"the body is not valid JSON: {first.get('msg', '')}", None, "invalid_json")
    return invalid(f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg")), param)
