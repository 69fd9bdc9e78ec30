"""REST boundary in-process: error bodies, body limit, auth on the open endpoints, metrics, SSE."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from cloud.rest import create_app
from cloud.service import VerifierService
from shared.hashing import ctx_hash


def samples(c: TestClient) -> dict[tuple[str, tuple], float]:
    text = c.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_validation_errors_use_the_project_error_body(client: Callable[..., TestClient]) -> None:
    c = client()
    for content in ('{"ctx_id": ', '{"ctx_id": "x"}', '{"ctx_id": "x", "ctx_len": "ten", "ctx_hash": "", '
                    '"draft_tokens": [], "q_token_probs": [], "k": 0}', '[1, 2]'):
        r = c.post("/v1/verify", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 422, content
        err = r.json()["error"]
        assert err["code"] == "invalid_argument" and err["message"].startswith("malformed body")
        assert err["problems"] and all({"loc", "msg", "type"} <= set(p) for p in err["problems"])


def test_unknown_sampling_field_is_rejected_not_ignored(client: Callable[..., TestClient]) -> None:
    r = client().post("/v1/sessions", json={"prompt_ids": [1], "sampling_cfg": {"temp": 0.5}})
    assert r.status_code == 422 and "temp" in json.dumps(r.json())


def test_body_over_the_limit_answers_413(client: Callable[..., TestClient]) -> None:
    c = client(max_body_bytes=2048)
    big = {"prompt_ids": list(range(1000))}
    r = c.post("/v1/sessions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"

    def chunks() -> Iterator[bytes]:  # no content-length: the streamed size counts
        data = json.dumps(big).encode()
        for i in range(0, len(data), 500):
            yield data[i: i + 500]

    r = c.post("/v1/sessions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert c.post("/v1/sessions", json={"prompt_ids": [1, 2, 3]}).status_code == 200


def test_unknown_route_uses_the_error_body(client: Callable[..., TestClient]) -> None:
    r = client().get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_docs_and_openapi_are_served(client: Callable[..., TestClient]) -> None:
    c = client()
    assert c.get("/docs").status_code == 200
    paths = c.get("/openapi.json").json()["paths"]
    assert {"/v1/sessions", "/v1/verify", "/v1/sessions/{ctx_id}", "/v1/model", "/v1/generate"} <= set(paths)


def test_auth_guards_the_api_but_not_health_or_metrics(client: Callable[..., TestClient]) -> None:
    c = client(api_keys=["k1"])
    for path in ("/healthz", "/readyz", "/metrics"):
        assert c.get(path).status_code == 200, path
    assert c.get("/v1/model").status_code == 401
    assert c.get("/v1/model", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert c.get("/v1/model", headers={"Authorization": "Basic k1"}).status_code == 401
    assert c.get("/v1/model", headers={"Authorization": "Bearer k1"}).status_code == 200
    body = c.post("/v1/sessions", json={"prompt_ids": [1]}).json()
    assert body["error"]["code"] == "unauthenticated"


def test_metrics_count_rounds_tokens_positions_and_errors(client: Callable[..., TestClient]) -> None:
    c = client()
    prompt = [3, 1, 4, 1, 5]
    info = c.post("/v1/sessions", json={"prompt_ids": prompt, "seed": 2}).json()
    ids, total_k, total_la = list(prompt), 0, 0
    checked: dict[int, int] = {}
    for k in (1, 3, 4):
        r = c.post("/v1/verify", json={"ctx_id": info["ctx_id"], "ctx_len": len(ids), "ctx_hash": ctx_hash(ids),
                                       "draft_tokens": [7] * k, "q_token_probs": [0.001] * k, "k": k,
                                       "draft_kind": "sampled", "q_dists": None}).json()
        la = r["accepted_len"]
        for i in range(1, min(la + 1, k) + 1):
            checked[i] = checked.get(i, 0) + 1
        total_k, total_la = total_k + k, total_la + la
        ids = ids + [7] * la + ([r["correction"]] if r["correction"] is not None else [])
        if r["next_kind"] == "residual":
            break
    c.post("/v1/verify", json={"ctx_id": "nope", "ctx_len": 1, "ctx_hash": "0" * 16, "draft_tokens": [],
                               "q_token_probs": [], "k": 0})
    c.post("/v1/verify", json={})
    m = samples(c)
    rounds = m[("specsplit_cloud_rounds_total", ())]
    assert rounds >= 1
    assert m[("specsplit_cloud_drafted_tokens_total", ())] == total_k
    assert m[("specsplit_cloud_accepted_tokens_total", ())] == total_la
    assert m[("specsplit_cloud_accepted_length_count", ())] == rounds
    for i, n in checked.items():
        assert m[("specsplit_cloud_position_checked_total", (("position", str(i)),))] == n
    assert m[("specsplit_cloud_errors_total", (("code", "not_found"),))] == 1
    assert m[("specsplit_cloud_errors_total", (("code", "invalid_argument"),))] == 1
    assert m[("specsplit_cloud_open_sessions", ())] == 1
    assert m[("specsplit_cloud_kv_bytes", ())] > 0
    assert m[("specsplit_cloud_target_forward_seconds_count", ())] == rounds  # the rounds only
    assert m[("specsplit_cloud_prompt_prefill_seconds_count", ())] == 1  # the open's prefill
    assert m[("specsplit_cloud_verify_round_seconds_count", ())] == rounds
    assert m[("specsplit_cloud_kv_budget_bytes", ())] == 2 * 1024**3
    rest = {k[1]: v for k, v in m.items() if k[0] == "specsplit_cloud_responses_total"}
    assert rest[(("status", "404"), ("transport", "rest"))] == 1
    assert rest[(("status", "422"), ("transport", "rest"))] == 1
    assert rest[(("status", "200"), ("transport", "rest"))] == rounds + 1  # the open and the rounds
    assert m[("process_resident_memory_bytes", ())] > 0


def test_generate_streams_server_sent_events(client: Callable[..., TestClient]) -> None:
    c = client()
    body = {"prompt_ids": [1, 2, 3], "seed": 4, "max_new_tokens": 5, "stop_at_eos": False}
    plain = c.post("/v1/generate", json=body).json()
    with c.stream("POST", "/v1/generate", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    events = [e for e in text.split("\n\n") if e]
    tokens = [json.loads(e.removeprefix("data: "))["token_id"] for e in events[:-1]]
    assert events[-1].startswith("event: done\n")
    done = json.loads(events[-1].split("data: ", 1)[1])
    assert tokens == done["token_ids"] == plain["token_ids"] and len(tokens) == 5
    assert done["metrics"]["stop_reason"] == "length"


def test_unexpected_failure_is_500_with_an_error_body(make_service: Callable[..., VerifierService],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    svc = make_service()

    async def broken(*a: Any, **kw: Any) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(svc, "verify", broken)
    with TestClient(create_app(svc), raise_server_exceptions=False) as c:
        r = c.post("/v1/verify", json={"ctx_id": "x", "ctx_len": 1, "ctx_hash": "0" * 16, "draft_tokens": [],
                                       "q_token_probs": [], "k": 0})
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal" and "RuntimeError" in r.json()["error"]["message"]


def test_a_failure_mid_stream_ends_with_an_error_event(make_service: Callable[..., VerifierService]) -> None:
    """The forward fails (a device error, not a SpecSplitError) after two tokens of a streamed generate:
    the stream ends with `event: error` and an internal error body naming its error_id, not a dropped
    connection."""
    svc = make_service()
    real = svc.forward
    calls = [0]

    def flaky(rows: Any) -> Any:
        calls[0] += 1
        if calls[0] > 2:
            raise RuntimeError("device lost")
        assert real is not None
        return real(rows)

    svc.forward = flaky
    with TestClient(create_app(svc)) as c:
        with c.stream("POST", "/v1/generate", json={"prompt_ids": [5, 6, 7], "max_new_tokens": 8,
                                                     "stream": True}) as r:
            text = "".join(r.iter_text())
    tokens = [line for line in text.splitlines() if line.startswith("data:") and "token_id" in line]
    assert len(tokens) == 2 and "event: error" in text
    body = json.loads(text.split("event: error\ndata: ", 1)[1].split("\n", 1)[0])
    assert body["error"]["code"] == "internal" and body["error"]["error_id"]
