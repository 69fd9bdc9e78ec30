"""The verifier's operator surface in-process: /metrics passes `promtool check metrics`, an
X-Request-Id is echoed and logged with the ctx_id (REST and gRPC), a malformed one is refused, and
/metrics takes a key when metrics_auth is on."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient

from cloud.grpc_server import start_grpc
from cloud.logs import JsonFormatter
from cloud.service import VerifierService
from shared.hashing import ctx_hash
from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc
from shared.request_id import RequestIdFilter
from tests.ops.tools import promtool


@pytest.fixture
def json_lines(caplog: pytest.LogCaptureFixture) -> Callable[[], list[dict[str, Any]]]:
    """The captured records as the process writes them (the request id filter, then the JSON formatter)."""
    caplog.set_level(logging.INFO)
    caplog.handler.addFilter(RequestIdFilter())

    def lines() -> list[dict[str, Any]]:
        return [json.loads(JsonFormatter().format(r)) for r in caplog.records]

    return lines


def one_round(c: TestClient, headers: dict[str, str]) -> tuple[str, Any]:
    ids = [1, 2, 3]
    opened = c.post("/v1/sessions", json={"prompt_ids": ids, "seed": 1}, headers=headers)
    assert opened.status_code == 200
    ctx = opened.json()["ctx_id"]
    r = c.post("/v1/verify", headers=headers, json={
        "ctx_id": ctx, "ctx_len": len(ids), "ctx_hash": ctx_hash(ids), "draft_tokens": [5, 6],
        "q_token_probs": [0.5, 0.5], "k": 2, "request_id": "round-1"})
    assert r.status_code == 200
    return ctx, r


def test_cloud_metrics_pass_promtool_check_metrics(client: Callable[..., TestClient]) -> None:
    """The real /metrics text, after a session, a round and an error, has no lint problem; the names the
    cloud had before (milliseconds, abbreviated) do not pass the same check."""
    c = client()
    one_round(c, {})
    c.get("/v1/sessions/nope")
    text = c.get("/metrics").content
    assert b"specsplit_cloud_verify_round_seconds_bucket" in text and b"process_resident_memory_bytes" in text
    for paged in (b"specsplit_cloud_kv_blocks{", b"specsplit_cloud_queue_wait_seconds_bucket{",
                  b"specsplit_cloud_padded_equivalent_tokens_total", b"specsplit_cloud_prefix_cache_hit_tokens_total"):
        assert paged in text, paged
    out = promtool("check", "metrics", stdin=text)
    assert out.returncode == 0, out.stdout + out.stderr
    old = b"# HELP specsplit_cloud_queue_ms wait for the model, ms\n# TYPE specsplit_cloud_queue_ms histogram\n" \
          b'specsplit_cloud_queue_ms_bucket{le="+Inf"} 1\nspecsplit_cloud_queue_ms_sum 2\nspecsplit_cloud_queue_ms_count 1\n'
    bad = promtool("check", "metrics", stdin=old)
    assert bad.returncode != 0 and "abbreviated units" in bad.stdout + bad.stderr


def test_rest_echoes_the_request_id_and_logs_it_with_the_ctx_id(client: Callable[..., TestClient],
                                                                 json_lines: Callable[[], list[dict[str, Any]]]
                                                                 ) -> None:
    c = client()
    ctx, r = one_round(c, {"X-Request-Id": "cmpl-abc123"})
    assert r.headers["x-request-id"] == "cmpl-abc123"
    rounds = [ln for ln in json_lines() if ln.get("event") == "verify_round"]
    opens = [ln for ln in json_lines() if ln.get("event") == "open"]
    assert rounds and all(ln["x_request_id"] == "cmpl-abc123" and ln["ctx_id"] == ctx for ln in rounds)
    assert rounds[0]["request_id"] == "round-1"  # the round's own idempotency key stays as it was
    assert opens and opens[-1]["x_request_id"] == "cmpl-abc123" and opens[-1]["ctx_id"] == ctx
    plain = c.get("/v1/model")
    assert "x-request-id" not in plain.headers  # none sent, none made up


def test_a_malformed_request_id_is_refused_and_nothing_runs(client: Callable[..., TestClient]) -> None:
    c = client()
    r = c.post("/v1/sessions", json={"prompt_ids": [1, 2]}, headers={"X-Request-Id": "has space"})
    assert r.status_code == 422 and "X-Request-Id" in r.json()["error"]["message"]
    assert "x-request-id" not in r.headers
    assert c.get("/metrics").text.count("specsplit_cloud_open_sessions 0.0") == 1


def test_metrics_take_a_key_only_when_metrics_auth_is_on(client: Callable[..., TestClient]) -> None:
    open_ = client(api_keys=["k1"])
    assert open_.get("/metrics").status_code == 200
    closed = client(api_keys=["k1"], metrics_auth=True)
    assert closed.get("/metrics").status_code == 401
    assert closed.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert closed.get("/metrics", headers={"Authorization": "Bearer k1"}).status_code == 200
    assert closed.get("/healthz").status_code == 200 and closed.get("/readyz").status_code == 200


def test_grpc_echoes_the_request_id_in_initial_metadata_and_counts_answers(
        make_service: Callable[..., VerifierService], json_lines: Callable[[], list[dict[str, Any]]]) -> None:
    svc = make_service()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server, port, _ = asyncio.run_coroutine_threadsafe(start_grpc(svc, "127.0.0.1", 0), loop).result(10)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        stub = pb_grpc.VerifierStub(channel)
        md = (("x-request-id", "chatcmpl-42"),)
        info, call = stub.OpenSession.with_call(pb.OpenSessionRequest(prompt_ids=[1, 2, 3]), metadata=md, timeout=10)
        assert dict(call.initial_metadata())["x-request-id"] == "chatcmpl-42"
        opens = [ln for ln in json_lines() if ln.get("event") == "open"]
        assert opens[-1]["x_request_id"] == "chatcmpl-42" and opens[-1]["ctx_id"] == info.ctx_id
        with pytest.raises(grpc.RpcError) as e:
            stub.GetSession(pb.GetSessionRequest(ctx_id="nope"), metadata=md, timeout=10)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as bad:
            stub.GetModel(pb.GetModelRequest(), metadata=(("x-request-id", "a b"),), timeout=10)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        text = svc.render_metrics().decode()
        assert 'specsplit_cloud_responses_total{status="200",transport="grpc"} 1.0' in text
        assert 'specsplit_cloud_responses_total{status="404",transport="grpc"} 1.0' in text
        assert 'specsplit_cloud_responses_total{status="422",transport="grpc"} 1.0' in text
    finally:
        channel.close()
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
