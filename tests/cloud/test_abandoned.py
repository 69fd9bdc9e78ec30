"""A client that goes away while its session is being opened leaves no session behind (REST and gRPC)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import AutoTokenizer

from cloud.grpc_server import start_grpc
from cloud.rest import create_app
from cloud.service import GenerateRequest, VerifierService
from shared.errors import Unavailable
from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc
from shared.protocol import OpenSessionRequest


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


def prefill_tokens(svc: VerifierService) -> list[int]:
    """Tokens of every forward the service runs from now on (filled as they run)."""
    seen: list[int] = []
    inner = svc.on_batch

    def hook(b: Any) -> None:
        seen.append(b.tokens)
        inner(b)

    svc.on_batch = hook
    return seen


def test_an_open_cancelled_while_queued_leaves_the_queue_unprefilled(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    """The model thread is held while an open queues; its caller goes away: once the model is free no
    forward runs for it, no session is stored and its KV sequence is gone."""
    svc = make_service()
    forwards = prefill_tokens(svc)

    async def main() -> None:
        gate = threading.Event()
        blocker = asyncio.ensure_future(svc.scheduler.run(gate.wait))
        task = asyncio.ensure_future(svc.open_session(OpenSessionRequest(prompt), ""))
        await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.sleep(0.01)
        gate.set()
        await blocker
        with pytest.raises(asyncio.CancelledError):
            await task
        await svc.scheduler.run(lambda: None)  # the sequence release ran (between batches)
        assert svc.model.pool.manager.seqs == {}

    asyncio.run(main())
    assert forwards == [] and len(svc.store) == 0 and svc.admission.depth == 0


def test_an_open_cancelled_mid_prefill_stops_at_its_next_chunk(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    """A long prompt prefilled in 16-token chunks: cancelled after its second chunk (the model thread held
    there until the cancel has been taken, so the count does not depend on the machine's speed), at most the
    chunk in progress runs after it, far from the whole prompt."""
    svc = make_service(max_batch_tokens=16, batch_wait_ms=0)
    long_prompt = (prompt * 4)[:200]
    forwards = prefill_tokens(svc)
    gate = threading.Event()
    counted = svc.on_batch

    def held(b: Any) -> None:
        counted(b)
        if len(forwards) == 2:
            gate.wait(10)

    svc.on_batch = held

    async def main() -> None:
        task = asyncio.ensure_future(svc.open_session(OpenSessionRequest(long_prompt), ""))
        while len(forwards) < 2:
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.sleep(0.05)  # the cancel reaches the scheduler while the model thread is held
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await svc.scheduler.run(lambda: None)
        assert svc.model.pool.manager.seqs == {}

    asyncio.run(main())
    assert 2 <= len(forwards) <= 4 and len(svc.store) == 0


def test_a_generation_cancelled_while_queued_runs_no_forward(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    svc = make_service()
    forwards = prefill_tokens(svc)

    async def consume() -> None:
        async for _ in svc.start_generate(GenerateRequest(prompt, max_new_tokens=8), ""):
            pass

    async def main() -> None:
        gate = threading.Event()
        blocker = asyncio.ensure_future(svc.scheduler.run(gate.wait))
        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.sleep(0.01)
        gate.set()
        await blocker
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert forwards == [] and svc.admission.depth == 0


def test_a_rest_open_whose_client_left_first_runs_no_prefill(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    svc = make_service()
    forwards = prefill_tokens(svc)
    sent = rest_open_then_leave(svc, prompt)
    assert forwards == [] and len(svc.store) == 0
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]


def rest_open_then_leave(svc: VerifierService, prompt: list[int], request_id: str = "") -> list[dict[str, Any]]:
    """POST /v1/sessions over raw ASGI; the client disconnects as soon as it has sent its body."""
    body = json.dumps({"prompt_ids": prompt}).encode()
    inbox: list[dict[str, Any]] = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if request_id:
        headers.append((b"x-request-id", request_id.encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": "/v1/sessions", "raw_path": b"/v1/sessions", "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000), "scheme": "http"}

    async def main() -> None:
        gate = threading.Event()
        blocker = asyncio.ensure_future(svc.scheduler.run(gate.wait))  # the model is busy: the open queues
        call = asyncio.ensure_future(create_app(svc)(scope, receive, send))
        await asyncio.sleep(0.05)
        gate.set()
        await blocker
        await call

    asyncio.run(main())
    return sent


def test_an_open_retried_with_its_request_id_joins_the_first_attempt(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    """The first attempt's caller gives up (the edge's timeout) and the retry, with the same request id and
    body, gets the same session from one prefill; another body under that id is a new open."""
    svc = make_service()
    forwards = prefill_tokens(svc)

    async def main() -> None:
        gate = threading.Event()
        blocker = asyncio.ensure_future(svc.scheduler.run(gate.wait))
        first = asyncio.ensure_future(svc.open_session(OpenSessionRequest(prompt), "a", "req-1"))
        await asyncio.sleep(0.02)
        first.cancel()  # the edge timed out
        retry = asyncio.ensure_future(svc.open_session(OpenSessionRequest(prompt), "a", "req-1"))
        await asyncio.sleep(0.02)
        gate.set()
        await blocker
        info = await retry
        again = await svc.open_session(OpenSessionRequest(prompt), "a", "req-1")  # a late duplicate
        assert again.ctx_id == info.ctx_id and len(svc.store) == 1 and len(forwards) == 1
        other = await svc.open_session(OpenSessionRequest(prompt, seed=5), "a", "req-1")
        assert other.ctx_id != info.ctx_id and len(svc.store) == 2
        svc.close_session(other.ctx_id, "a")  # a session gone (closed, evicted) is not handed out again
        reopened = await svc.open_session(OpenSessionRequest(prompt, seed=5), "a", "req-1")
        assert reopened.ctx_id != other.ctx_id and len(svc.store) == 2

    asyncio.run(main())


def test_an_open_with_a_request_id_nobody_comes_back_for_is_cancelled_after_the_grace(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    """Its caller gives up and no retry joins within the grace: the open leaves the queue unprefilled and
    leaves no session; a retry inside the grace (the edge's backoff) would have joined it."""
    svc = make_service()
    svc.opens.grace_s = 0.05
    forwards = prefill_tokens(svc)

    async def main() -> None:
        gate = threading.Event()
        blocker = asyncio.ensure_future(svc.scheduler.run(gate.wait))  # the model is busy: the open queues
        first = asyncio.ensure_future(svc.open_session(OpenSessionRequest(prompt), "a", "req-9"))
        await asyncio.sleep(0.02)
        first.cancel()  # the caller is gone for good
        await asyncio.sleep(0.2)  # past the grace
        gate.set()
        await blocker
        await asyncio.sleep(0.05)
        assert forwards == [] and len(svc.store) == 0 and svc.admission.depth == 0
        info = await svc.open_session(OpenSessionRequest(prompt), "a", "req-9")  # a late retry: a new open
        assert len(svc.store) == 1 and svc.store.holds(info.ctx_id) and len(forwards) == 1

    asyncio.run(main())


def test_stopping_with_opens_in_flight_answers_them_503_without_error_logs(
        make_service: Callable[..., VerifierService], prompt: list[int], caplog: pytest.LogCaptureFixture) -> None:
    svc = make_service()

    async def main() -> None:
        gate = threading.Event()
        blocker = asyncio.ensure_future(svc.scheduler.run(gate.wait))
        opens = [asyncio.ensure_future(svc.open_session(OpenSessionRequest(prompt, seed=i), "")) for i in range(3)]
        await asyncio.sleep(0.02)
        stopping = asyncio.ensure_future(asyncio.to_thread(svc.scheduler.shutdown))
        await asyncio.sleep(0.02)
        gate.set()
        await blocker
        await stopping
        got = await asyncio.gather(*opens, return_exceptions=True)
        assert all(isinstance(g, Unavailable) and g.http_status == 503 for g in got), got

    with caplog.at_level(logging.INFO):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
