"""A client that goes away while its session is being opened leaves no session behind (REST and gRPC)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import AutoTokenizer

from cloud.grpc_server import start_grpc
from cloud.rest import create_app
from cloud.service import VerifierService
from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc


@pytest.fixture(scope="module")
def prompt(tiny_pair: tuple[Path, Path]) -> list[int]:
    return list(AutoTokenizer.from_pretrained(tiny_pair[0]).encode("import numpy as np\n" * 8))


def test_rest_open_whose_client_disconnected_is_closed(make_service: Callable[..., VerifierService],
                                                       prompt: list[int]) -> None:
    svc = make_service()
    body = json.dumps({"prompt_ids": prompt}).encode()
    inbox: list[dict[str, Any]] = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}  # the client is gone once it has sent

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": "/v1/sessions", "raw_path": b"/v1/sessions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000), "scheme": "http"}
    asyncio.run(create_app(svc)(scope, receive, send))
    assert len(svc.store) == 0


def test_grpc_open_whose_caller_gave_up_is_not_kept(make_service: Callable[..., VerifierService],
                                                    prompt: list[int]) -> None:
    svc = make_service()

    async def main() -> None:
        server, port, _ = await start_grpc(svc, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.VerifierStub(channel)
                call = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt))
                await asyncio.sleep(0)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                for _ in range(200):  # until the server has seen the cancellation and the model is idle
                    if svc.admission.depth == 0:
                        break
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.1)
        finally:
            await server.stop(None)
        assert len(svc.store) == 0

    asyncio.run(main())
