"""The REST app's OpenAPI schema says what the routes do, in process: the statuses and error bodies they answer,
the static bounds the bodies are held to, the media types, the key; a 405 names every method of its path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from shared.hashing import ctx_hash


def operations(c: TestClient) -> dict[tuple[str, str], dict[str, Any]]:
    schema = c.get("/openapi.json").json()
    return {(m.upper(), p): op for p, item in schema["paths"].items() for m, op in item.items()}


def test_every_refusal_a_route_answers_is_declared_with_its_error_body(client: Callable[..., TestClient]) -> None:
    c = client(api_keys=["k1"])
    ops = operations(c)
    key = {"Authorization": "Bearer k1"}
    ctx_id = c.post("/v1/sessions", json={"prompt_ids": [1, 2, 3]}, headers=key).json()["ctx_id"]
    good = {"ctx_id": ctx_id, "ctx_len": 3, "ctx_hash": ctx_hash([1, 2, 3]), "draft_tokens": [], "q_token_probs": [],
            "k": 0}
    refusals = [
        ("POST", "/v1/verify", None, good, 401),
        ("POST", "/v1/verify", key, {**good, "ctx_id": "gone"}, 404),
        ("POST", "/v1/verify", key, {**good, "ctx_hash": "0" * 16}, 409),
        ("POST", "/v1/verify", key, {**good, "ctx_hash": "not-hex"}, 422),
        ("GET", "/v1/sessions/gone", key, None, 404),
        ("DELETE", "/v1/sessions/gone", key, None, 404),
        ("POST", "/v1/sessions/gone/stream", key, {"ctx_len": 3, "ctx_hash": ctx_hash([1, 2, 3])}, 404),
        ("POST", "/v1/sessions", key, {"prompt_ids": []}, 422),
        ("POST", "/v1/generate", key, {"prompt_ids": [1], "seed": -1}, 422),
    ]
    for method, path, headers, body, status in refusals:
        r = c.request(method, path, json=body, headers=headers)
        assert r.status_code == status, (method, path, r.text)
        route = path.replace("/gone", "/{ctx_id}")
        declared = ops[method, route]["responses"][str(status)]["content"]["application/json"]["schema"]
        assert r.json()["error"]["code"] == declared["properties"]["error"]["properties"]["code"]["const"]


def test_the_static_bounds_are_in_the_schema_and_hold(client: Callable[..., TestClient]) -> None:
    c = client()
    schemas = c.get("/openapi.json").json()["components"]["schemas"]
    verify = schemas["VerifyBody"]["properties"]
    assert verify["ctx_hash"]["pattern"] == "^[0-9a-f]{16}$"
    assert verify["ctx_len"]["minimum"] == 1 and verify["k"]["maximum"] == 256
    assert verify["draft_tokens"]["items"]["minimum"] == 0
    assert verify["q_token_probs"]["items"] == {"type": "number", "exclusiveMinimum": 0, "maximum": 1}
    assert verify["draft_kind"]["enum"] == ["sampled", "deterministic"]
    assert verify["request_id"]["maxLength"] == 128
    assert schemas["OpenSessionBody"]["properties"]["prompt_ids"]["minItems"] == 1
    assert schemas["OpenSessionBody"]["properties"]["seed"]["exclusiveMaximum"] == 2**64
    assert "tokenizer_size" in schemas["OpenSessionBody"]["properties"]["prompt_ids"]["description"]
    assert schemas["SamplingBody"]["properties"]["top_p"]["minimum"] == 1e-6
    # what the schema refuses the cloud refuses, with the error body of the schema
    for body in ({"prompt_ids": [-1]}, {"prompt_ids": [1], "correction": "approximate"},
                 {"prompt_ids": [1], "seed": 2**64}, {"prompt_ids": [1], "feature_encoding": "bfloat16"}):
        r = c.post("/v1/sessions", json=body)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_argument", body


def test_json_types_are_not_coerced(client: Callable[..., TestClient]) -> None:
    """A boolean field takes only true/false and an integer field only integers, as the schema says: a lax parser
    would read 0 as false or "3" as 3, an answer to a body the schema declares invalid (found by the long fuzz)."""
    c = client()
    for body in ({"prompt_ids": [1], "stop_at_eos": 0}, {"prompt_ids": [1], "stream": "true"},
                 {"prompt_ids": [1], "max_new_tokens": "3"}, {"prompt_ids": [1], "seed": 1.0}):
        r = c.post("/v1/generate", json=body)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_argument", body
    schemas = c.get("/openapi.json").json()["components"]["schemas"]
    for model, field in (("GenerateBody", "stop_at_eos"), ("GenerateBody", "stream"), ("VerifyBody", "check_last"),
                         ("StreamSessionBody", "stop_at_eos")):
        assert schemas[model]["properties"][field]["type"] == "boolean"


@pytest.mark.parametrize("field, value", [("temperature", 1e-9), ("top_p", 0.0), ("repetition_penalty", 1e3)])
def test_sampling_refusals_keep_the_message_that_starts_with_the_field(client: Callable[..., TestClient], field: str,
                                                                       value: float) -> None:
    r = client().post("/v1/sessions", json={"prompt_ids": [1], "sampling_cfg": {field: value}})
    assert r.status_code == 422 and r.json()["error"]["message"].startswith(field)


def test_media_types_and_the_key_are_declared(client: Callable[..., TestClient]) -> None:
    ops = operations(client(api_keys=["k1"]))
    assert ops["GET", "/metrics"]["responses"]["200"]["content"].keys() == {"text/plain"}
    assert "security" not in ops["GET", "/metrics"]
    assert ops["POST", "/v1/sessions/{ctx_id}/stream"]["responses"]["200"]["content"].keys() == {"text/event-stream"}
    assert ops["POST", "/v1/verify"]["security"] == [{"bearer": []}]
    assert ops["POST", "/v1/sessions"]["responses"]["429"]["headers"]["Retry-After"]["required"]
    assert "security" not in operations(client())["POST", "/v1/verify"]  # no keys, no scheme


def test_a_405_lists_every_method_of_its_path(client: Callable[..., TestClient]) -> None:
    r = client().request("PUT", "/v1/sessions/anything")
    assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
    assert r.json()["error"]["code"] == "http_error"
