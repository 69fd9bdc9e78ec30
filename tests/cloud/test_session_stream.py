"""Session streams on the service: each streamed token is the k = 0 round's draw, so a session's text is the one
/v1/generate gives whichever positions were streamed; a ctx_len below the cloud's crops; a refused stream leaves
the session as it was; a caller that goes away stops the stream after its round in progress (REST, gRPC)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from cloud.grpc_server import start_grpc
from cloud.rest import create_app
from cloud.service import GenerateRequest, VerifierService
from shared.config import SamplingConfig
from shared.errors import ContextMismatch, InvalidArgument, NotFound, PermissionDenied
from shared.hashing import ctx_hash
from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc
from shared.protocol import OpenSessionRequest, StreamDone, StreamedToken, StreamSessionRequest
from tests.cloud.test_abandoned import prefill_tokens
from tests.cloud.test_service import draft_request, k0_request

GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(1.0, 0.9, 0, 1.1)


@pytest.fixture(scope="module")
def prompt(tiny_pair: tuple[Path, Path]) -> list[int]:
    return list(AutoTokenizer.from_pretrained(tiny_pair[0]).encode("import numpy as np\n"))


async def generated(svc: VerifierService, prompt: list[int], cfg: SamplingConfig, seed: int, n: int) -> list[int]:
    """/v1/generate's text (no stop at eos)."""
    req = GenerateRequest(prompt, cfg, seed, max_new_tokens=n, stop_at_eos=False)
    return [e.token_id async for e in svc.start_generate(req, "") if e.token_id is not None]


async def streamed(svc: VerifierService, ctx_id: str, ids: list[int], n: int, owner: str = ""
                   ) -> tuple[list[StreamedToken], StreamDone]:
    events = [e async for e in svc.stream_session(StreamSessionRequest(ctx_id, len(ids), ctx_hash(ids), n, False),
                                                  owner)]
    done = events[-1]
    assert isinstance(done, StreamDone) and all(isinstance(e, StreamedToken) for e in events[:-1])
    return events[:-1], done  # type: ignore[return-value]


async def open_(svc: VerifierService, prompt: list[int], cfg: SamplingConfig, seed: int = 0, owner: str = "") -> str:
    return (await svc.open_session(OpenSessionRequest(prompt, cfg, seed), owner)).ctx_id


def test_a_greedy_stream_is_the_targets_text_and_a_verify_round_continues_it(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    svc = make_service()

    async def main() -> None:
        ref = await generated(svc, prompt, GREEDY, 0, 12)
        ctx_id = await open_(svc, prompt, GREEDY)
        tokens, done = await streamed(svc, ctx_id, prompt, 8)
        assert [t.token_id for t in tokens] == ref[:8]
        assert [t.ctx_len for t in tokens] == list(range(len(prompt) + 1, len(prompt) + 9))
        assert (done.tokens, done.ctx_len, done.ctx_hash) == (8, len(prompt) + 8, ctx_hash(prompt + ref[:8]))
        assert done.metrics["stop_reason"] == "length" and done.metrics["decode_ms"] > 0
        r = await svc.verify(draft_request(ctx_id, prompt + ref[:8], ref[8:11]), "", 3)  # the right guesses
        assert (r.accepted_len, r.correction) == (3, ref[11])
        counters = svc.get_session(ctx_id, "").counters
        assert (counters["streamed"], counters["rounds"]) == (8, 9)
        assert b"specsplit_cloud_streamed_tokens_total 8.0" in svc.render_metrics()

    asyncio.run(main())


def test_k0_rounds_and_streams_mixed_give_generates_sampled_text_for_the_seed(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    """Sampling at temperature 1 (top-p, repetition penalty): positions taken by k = 0 rounds and by streams, in
    turns, draw exactly /v1/generate's tokens at seed 11; another seed gives other text."""
    svc = make_service()

    async def main() -> None:
        ref = await generated(svc, prompt, SAMPLED, 11, 20)
        assert ref != await generated(svc, prompt, SAMPLED, 12, 20)
        ctx_id = await open_(svc, prompt, SAMPLED, seed=11)
        ids = list(prompt)
        for k0_rounds, stream_n in ((2, 5), (3, 4), (1, 5)):
            for _ in range(k0_rounds):
                r = await svc.verify(k0_request(ctx_id, ids), "", 0)
                assert r.correction is not None
                ids.append(r.correction)
            tokens, done = await streamed(svc, ctx_id, ids, stream_n)
            ids += [t.token_id for t in tokens]
            assert done.ctx_hash == ctx_hash(ids)
        assert ids[len(prompt):] == ref

    asyncio.run(main())


def test_a_ctx_len_below_the_clouds_crops_to_it(make_service: Callable[..., VerifierService],
                                                prompt: list[int]) -> None:
    """A stream of 5 whose last 2 tokens the client never got: streaming again from ctx_len - 2 draws those 2
    again and goes on, the session's text still generate's; a ctx_len past the cloud's is 409."""
    svc = make_service()

    async def main() -> None:
        ref = await generated(svc, prompt, SAMPLED, 3, 9)
        ctx_id = await open_(svc, prompt, SAMPLED, seed=3)
        first, _ = await streamed(svc, ctx_id, prompt, 5)
        assert [t.token_id for t in first] == ref[:5]
        again, done = await streamed(svc, ctx_id, prompt + ref[:3], 6)
        assert [t.token_id for t in again] == ref[3:9]
        info = svc.get_session(ctx_id, "")
        assert (info.ctx_len, info.ctx_hash) == (done.ctx_len, done.ctx_hash) == (len(prompt) + 9,
                                                                                 ctx_hash(prompt + ref))
        with pytest.raises(ContextMismatch) as e:
            svc.stream_session(StreamSessionRequest(ctx_id, len(prompt) + 10, ctx_hash(prompt + ref + [1]), 2), "")
        assert e.value.details["expected_ctx_len"] == len(prompt) + 9

    asyncio.run(main())


def test_a_refused_stream_runs_nothing_and_leaves_the_session_as_it_was(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    svc = make_service(max_generate_tokens=16)

    async def main() -> None:
        ctx_id = await open_(svc, prompt, GREEDY, owner="a")
        tokens, _ = await streamed(svc, ctx_id, prompt, 3, owner="a")
        ids = prompt + [t.token_id for t in tokens]
        before = svc.get_session(ctx_id, "a")
        forwards = prefill_tokens(svc)
        bad = [  # (request, owner, error): each raised by the call itself, before any event
            (StreamSessionRequest(ctx_id, len(ids), ctx_hash(ids[:-1] + [ids[-1] + 1]), 2), "a", ContextMismatch),
            (StreamSessionRequest(ctx_id, len(ids) + 1, ctx_hash(ids + [5]), 2), "a", ContextMismatch),
            (StreamSessionRequest(ctx_id, len(ids), ctx_hash(ids), 0), "a", InvalidArgument),
            (StreamSessionRequest(ctx_id, len(ids), ctx_hash(ids), 17), "a", InvalidArgument),
            (StreamSessionRequest(ctx_id, len(ids), "not-a-hash", 2), "a", InvalidArgument),
            (StreamSessionRequest(ctx_id, 0, ctx_hash([]), 2), "a", InvalidArgument),
            (StreamSessionRequest("no-such-session", len(ids), ctx_hash(ids), 2), "a", NotFound),
            (StreamSessionRequest(ctx_id, len(ids), ctx_hash(ids), 2), "b", PermissionDenied),
        ]
        for req, owner, error in bad:
            with pytest.raises(error):
                svc.stream_session(req, owner)
        await asyncio.sleep(0.05)
        after = svc.get_session(ctx_id, "a")
        assert forwards == [] and svc.admission.depth == 0
        assert (after.ctx_len, after.ctx_hash) == (before.ctx_len, before.ctx_hash) == (len(ids), ctx_hash(ids))
        for key in ("rounds", "streamed", "kv_len", "emitted"):
            assert after.counters[key] == before.counters[key], key

    asyncio.run(main())


def held_at(svc: VerifierService, n: int, gate: threading.Event) -> list[int]:
    """Forwards from now on (their token counts); the model thread waits on `gate` after the n-th, before the
    rounds in it are applied."""
    forwards = prefill_tokens(svc)
    counted = svc.on_batch

    def held(b: Any) -> None:
        counted(b)
        if len(forwards) == n:
            gate.wait(10)

    svc.on_batch = held
    return forwards


def test_a_stream_cancelled_mid_round_stops_after_that_round(make_service: Callable[..., VerifierService],
                                                              prompt: list[int]) -> None:
    """The caller goes away while the 3rd round runs (the model thread held there until the cancel has been
    taken): that round is applied, no 4th runs, of the 40 asked for."""
    svc = make_service(batch_wait_ms=0)
    got: list[int] = []

    async def consume(ctx_id: str) -> None:
        async for e in svc.stream_session(StreamSessionRequest(ctx_id, len(prompt), ctx_hash(prompt), 40, False), ""):
            if isinstance(e, StreamedToken):
                got.append(e.token_id)

    async def main() -> None:
        ctx_id = await open_(svc, prompt, GREEDY)
        gate = threading.Event()
        forwards = held_at(svc, 3, gate)
        task = asyncio.ensure_future(consume(ctx_id))
        while len(forwards) < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        await asyncio.sleep(0.05)
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.1)
        info = svc.get_session(ctx_id, "")
        assert len(forwards) == 3 and len(got) == 2 and info.ctx_len == len(prompt) + 3
        assert info.counters["streamed"] == 2 and svc.admission.depth == 0

    asyncio.run(main())


def test_a_rest_stream_whose_client_disconnects_stops_after_its_round(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    """Over raw ASGI: the client disconnects while the 3rd round runs; no 4th runs, of the 40 asked for."""
    svc = make_service(batch_wait_ms=0)
    ctx_id = asyncio.run(open_(svc, prompt, GREEDY))
    gate = threading.Event()
    forwards = held_at(svc, 3, gate)
    body = json.dumps({"ctx_len": len(prompt), "ctx_hash": ctx_hash(prompt), "max_new_tokens": 40,
                       "stop_at_eos": False}).encode()
    sent: list[dict[str, Any]] = []
    read = [False]

    async def receive() -> dict[str, Any]:
        if not read[0]:
            read[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        while len(forwards) < 3:  # the client is there until the 3rd round runs
            await asyncio.sleep(0.001)
        asyncio.get_running_loop().call_later(0.05, gate.set)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    path = f"/v1/sessions/{ctx_id}/stream"
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": path,
             "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000), "scheme": "http"}

    async def main() -> None:
        await create_app(svc)(scope, receive, send)
        await asyncio.sleep(0.1)

    asyncio.run(main())
    chunks = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    assert chunks.count("data: {\"token_id\"") == 2 and "event: done" not in chunks
    assert len(forwards) == 3 and svc.get_session(ctx_id, "").ctx_len == len(prompt) + 3


def test_a_grpc_stream_whose_caller_cancels_stops_after_its_round(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    svc = make_service(batch_wait_ms=0)

    async def main() -> None:
        ctx_id = await open_(svc, prompt, GREEDY)
        gate = threading.Event()
        forwards = held_at(svc, 3, gate)
        server, port, _ = await start_grpc(svc, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                call = pb_grpc.VerifierStub(channel).StreamSession(pb.StreamSessionRequest(
                    ctx_id=ctx_id, ctx_len=len(prompt), ctx_hash=ctx_hash(prompt), max_new_tokens=40,
                    stop_at_eos=False))
                events = [await call.read(), await call.read()]
                assert [e.WhichOneof("event") for e in events] == ["token", "token"]
                while len(forwards) < 3:
                    await asyncio.sleep(0.001)
                call.cancel()
                await asyncio.sleep(0.05)
                gate.set()
                await asyncio.sleep(0.2)
        finally:
            await server.stop(None)
        assert len(forwards) == 3 and svc.get_session(ctx_id, "").ctx_len == len(prompt) + 3

    asyncio.run(main())


def test_rest_answers_events_and_refuses_with_status_codes(client: Callable[..., TestClient],
                                                           prompt: list[int]) -> None:
    c = client(max_generate_tokens=16)
    assert c.get("/v1/model").json()["session_stream"] is True
    ctx_id = c.post("/v1/sessions", json={"prompt_ids": prompt, "sampling_cfg": {"temperature": 0}}).json()["ctx_id"]
    path = f"/v1/sessions/{ctx_id}/stream"
    ok = {"ctx_len": len(prompt), "ctx_hash": ctx_hash(prompt), "max_new_tokens": 3, "stop_at_eos": False}
    r = c.post(path, json=ok)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = [f for f in r.text.split("\n\n") if f]
    tokens = [json.loads(f[len("data: "):]) for f in frames[:3]]
    assert [t["ctx_len"] for t in tokens] == [len(prompt) + 1, len(prompt) + 2, len(prompt) + 3]
    assert set(tokens[0]) == {"token_id", "ctx_len", "node_budget"}  # no feature asked for: none sent
    event, data = frames[3].split("\n")
    done = json.loads(data[len("data: "):])
    ids = prompt + [t["token_id"] for t in tokens]
    assert event == "event: done" and (done["tokens"], done["ctx_len"], done["ctx_hash"]) == (3, len(ids), ctx_hash(ids))
    assert set(done["metrics"]) == {"decode_ms", "queue_ms", "total_ms", "stop_reason"}
    for body, status in (({**ok, "ctx_len": len(ids), "ctx_hash": ctx_hash(prompt)}, 409),
                         ({**ok, "ctx_len": len(ids), "ctx_hash": ctx_hash(ids), "max_new_tokens": 0}, 422),
                         ({**ok, "max_new_tokens": 17}, 422), ({**ok, "ctx_len": "3"}, 422)):
        assert c.post(path, json=body).status_code == status, body
    assert c.post("/v1/sessions/nope/stream", json=ok).status_code == 404
    assert c.get(f"/v1/sessions/{ctx_id}").json()["counters"]["streamed"] == 3


def test_a_stream_stops_at_the_context_end_and_at_eos(make_service: Callable[..., VerifierService],
                                                      prompt: list[int]) -> None:
    svc = make_service()
    room = svc.info.max_context - len(prompt)

    async def main() -> None:
        ctx_id = await open_(svc, prompt, GREEDY)
        tokens, done = await streamed(svc, ctx_id, prompt, room + 5)
        assert len(tokens) == room and done.metrics["stop_reason"] == "context"
        assert done.ctx_len == svc.info.max_context
        ref = await generated(svc, prompt, GREEDY, 0, 4)
        svc.info.eos_ids = [ref[2]]  # the 3rd token (or an earlier equal one) ends the stream, and is sent
        ctx_id = await open_(svc, prompt, GREEDY)
        events = [e async for e in svc.stream_session(StreamSessionRequest(ctx_id, len(prompt), ctx_hash(prompt),
                                                                           4), "")]
        assert [e.token_id for e in events[:-1]] == ref[:ref.index(ref[2]) + 1]  # type: ignore[union-attr]
        assert events[-1].metrics["stop_reason"] == "eos"  # type: ignore[union-attr]

    asyncio.run(main())


def test_a_loaded_cloud_ends_a_stream_for_speculative_rounds_and_an_idle_one_does_not(
        make_service: Callable[..., VerifierService], prompt: list[int]) -> None:
    """Streams decided by both sides (cloud/node_budget.py): while forwards carry several jobs and the session's
    first draft node is worth its row, the stream ends after a token with stop_reason "speculate"; the same stream
    on an idle cloud runs its length. Either way the tokens are the target's own (generate's text)."""
    svc = make_service()

    async def main() -> None:
        ref = await generated(svc, prompt, GREEDY, 0, 8)
        idle = await open_(svc, prompt, GREEDY)
        tokens, done = await streamed(svc, idle, prompt, 6)
        assert done.metrics["stop_reason"] == "length" and [t.token_id for t in tokens] == ref[:6]
        assert all(t.node_budget >= 1 for t in tokens)
        svc.budget.jobs_per_forward = 4.0  # as if every forward carried four sessions' work,
        svc.budget._tokens = svc.budget._seconds = 1.0  # at a rate where a row buys little (fixed, not timed)
        loaded = await open_(svc, prompt, GREEDY)
        tokens, done = await streamed(svc, loaded, prompt, 6)
        assert done.metrics["stop_reason"] == "speculate" and [t.token_id for t in tokens] == ref[:1]
        svc.settings.node_budget = False  # budgets off: the edge alone decides
        tokens, done = await streamed(svc, loaded, prompt + ref[:1], 5)
        assert done.metrics["stop_reason"] == "length" and [t.token_id for t in tokens] == ref[1:6]

    asyncio.run(main())
