"""gRPC boundary in-process: proto3 defaults, the error mapping, unexpected failures."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from cloud.grpc_server import GRPC_CODES, open_from_pb, sampling_from_pb, start_grpc
from cloud.service import VerifierService
from shared.config import SamplingConfig
from shared.errors import ERRORS_BY_STATUS
from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc


@pytest.fixture
def grpc_stub(make_service: Callable[..., VerifierService]) -> Iterator[tuple[VerifierService, Any]]:
    """(service, stub) with the gRPC server on its own event loop in a thread."""
    svc = make_service()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server, port, _ = asyncio.run_coroutine_threadsafe(start_grpc(svc, "127.0.0.1", 0), loop).result(10)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield svc, pb_grpc.VerifierStub(channel)
    channel.close()
    asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


def test_every_error_type_has_a_grpc_code() -> None:
    assert {cls.code for cls in ERRORS_BY_STATUS.values()} <= set(GRPC_CODES)
    assert GRPC_CODES["payload_too_large"] == GRPC_CODES["resource_exhausted"] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert GRPC_CODES["failed_precondition"] == grpc.StatusCode.FAILED_PRECONDITION


def test_unset_proto_fields_read_as_the_rest_defaults() -> None:
    assert sampling_from_pb(pb.SamplingConfig(temperature=0.7)) == SamplingConfig(0.7, 1.0, 0, 1.0)
    req = open_from_pb(pb.OpenSessionRequest(prompt_ids=[1, 2]))
    assert req.sampling_cfg == SamplingConfig() and req.correction == "strict" and req.seed == 0
    greedy = open_from_pb(pb.OpenSessionRequest(prompt_ids=[1], sampling_cfg=pb.SamplingConfig(temperature=0.0)))
    assert greedy.sampling_cfg.greedy


def test_unexpected_failure_is_internal_with_an_error_body(grpc_stub: tuple[VerifierService, Any],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    svc, stub = grpc_stub

    async def broken(*a: Any, **kw: Any) -> None:
        raise RuntimeError("device lost")

    monkeypatch.setattr(svc, "verify", broken)
    with pytest.raises(grpc.RpcError) as e:
        stub.Verify(pb.VerifyRequest(ctx_id="x"), timeout=10)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    body = json.loads(dict(e.value.trailing_metadata())["specsplit-error"])
    assert body["error"]["code"] == "internal" and "RuntimeError" in body["error"]["message"]


def test_project_errors_carry_their_body(grpc_stub: tuple[VerifierService, Any]) -> None:
    _, stub = grpc_stub
    with pytest.raises(grpc.RpcError) as e:
        stub.GetSession(pb.GetSessionRequest(ctx_id="nope"), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert json.loads(dict(e.value.trailing_metadata())["specsplit-error"])["error"]["ctx_id"] == "nope"
