"""The OpenAPI schema of the OpenAI-compatible routes: each route's 200 content, the errors it answers in OpenAI's
error body, X-Request-Id, and the bearer scheme when keys guard the server (the routes build their JSON
themselves, so the schema is stated here rather than read from response models).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from shared.request_id import REQUEST_ID_PATTERN

# each error status: OpenAI's error type there, and what it means (openai_errors.py)
ERRORS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "a malformed or unsupported request (`param` names the field), or a malformed "
                                   "X-Request-Id"),
    401: ("invalid_request_error", "no key or a wrong key (--server-api-key); code invalid_api_key"),
    404: ("not_found_error", "not the model this server serves; code model_not_found"),
    413: ("invalid_request_error", "the body is larger than --max-body-bytes"),
    429: ("rate_limit_error", "this server runs --max-generations already (code server_busy, Retry-After), or the "
                              "cloud is over capacity"),
    500: ("server_error", "a fault of this server or of its generation"),
    502: ("server_error", "the cloud refused this server's key (--api-key); code cloud_refused_key"),
    503: ("service_unavailable", "the cloud cannot be reached or answers too late"),
}
# the statuses of a route that may ask the cloud (the model's name without --served-model-name, a generation)
CLOUD_ERRORS = (500, 502, 503)
TEXT_ROUTE_ERRORS = (404, 413, 429, *CLOUD_ERRORS)
_OBJECT: dict[str, Any] = {"type": "object"}
COMPLETION_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["id", "object", "created", "model", "choices"],
    "properties": {"id": {"type": "string"}, "object": {"type": "string", "enum": ["text_completion", "chat.completion"]},
                   "created": {"type": "integer"}, "model": {"type": "string"},
                   "choices": {"type": "array", "items": _OBJECT}, "usage": _OBJECT, "specsplit": _OBJECT}}
# one server-sent event: a chunk as JSON text, or "[DONE]" (an annotation: JSON Schema does not parse the text)
EVENTS_SCHEMA: dict[str, Any] = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": 'a chunk object as JSON text, then "[DONE]"'}}}
MODEL_CARD: dict[str, Any] = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
    "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}}}
READY: dict[str, Any] = {"type": "object", "required": ["ready"], "properties": {"ready": {"type": "boolean"},
                                                                              "reason": {"type": "string"}}}
REQUEST_ID_PARAMETER: dict[str, Any] = {
    "name": "X-Request-Id", "in": "header", "required": False,
    "description": "the caller's id: 400 when malformed; echoed (a fresh one when absent), sent on the cloud calls",
    "schema": {"type": "string", "pattern": f"^{REQUEST_ID_PATTERN.pattern}$"}}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, each with OpenAI's error body of its type."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        kind, meaning = ERRORS[status]
        body = {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"const": kind},
                           "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
        out[status] = {"description": meaning, "content": {"application/json": {"schema": body}}}
        if status == 429:
            out[status]["headers"] = {"Retry-After": {"required": False, "schema": {"type": "string"}}}
    return out


def doc(operation_id: str, ok: dict[str, Any], *errors: int, keyed: bool = False) -> dict[str, Any]:
    """A route's OpenAPI side: its id, its 200 answer's content, the errors it answers (400 for a malformed
    X-Request-Id and 500 everywhere, 401 where keys guard it), X-Request-Id, the bearer scheme when keyed."""
    statuses = sorted({*errors, 400, 500, *((401,) if keyed else ())})
    extra: dict[str, Any] = {"parameters": [REQUEST_ID_PARAMETER]}
    if keyed:
        extra["security"] = [{"bearer": []}]
    return {"operation_id": operation_id, "response_model": None, "openapi_extra": extra,
            "responses": {200: {"description": "OK", "content": ok}, **error_responses(*statuses)}}


def finish_schema(app: FastAPI, keyed: bool) -> None:
    """The schema as these routes answer: no 422 (a malformed body is OpenAI's 400), the bearer scheme when keyed."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            for item in schema["paths"].values():
                for op in item.values():
                    op["responses"].pop("422", None)
            components = schema.setdefault("components", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.get("schemas", {}).pop(name, None)
            if keyed:
                components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer",
                                                            "description": "one of --server-api-key"}}
        return build()

    app.openapi = openapi  # type: ignore[method-assign]
