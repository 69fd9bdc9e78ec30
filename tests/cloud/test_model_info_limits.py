"""The model info advertises --max-generate-tokens (`max_generate_tokens`), on REST and gRPC alike, so an
edge can keep its stream chunks and generations within it instead of learning it from a 422."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import grpc
from fastapi.testclient import TestClient

from cloud.grpc_server import start_grpc
from cloud.service import VerifierService
from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc


def test_model_info_advertises_max_generate_tokens_on_rest(client: Callable[..., TestClient]) -> None:
    assert client(max_generate_tokens=77).get("/v1/model").json()["max_generate_tokens"] == 77
    assert client().get("/v1/model").json()["max_generate_tokens"] == 1024  # the default


def test_model_info_advertises_max_generate_tokens_on_grpc(make_service: Callable[..., VerifierService]) -> None:
    svc = make_service(max_generate_tokens=77)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server, port, _ = asyncio.run_coroutine_threadsafe(start_grpc(svc, "127.0.0.1", 0), loop).result(10)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            info = pb_grpc.VerifierStub(channel).GetModel(pb.GetModelRequest(), timeout=10)
        assert info.max_generate_tokens == 77
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
