"""The outside probe's cases against the real process (tiny target, keys alpha and beta), over REST
and gRPC where both apply: each answers its clear error, or behaves as docs/PROTOCOL.md says,
and leaves the service usable for everyone else. Timings here are sanity bounds with wide margins
(the old behaviour took 4 s to 3 minutes), never measurements."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from edge.client import EdgeClient
from edge.drafters import ModelDrafter
from edge.settings import EdgeSettings
from edge.transport.errors import retry_delay
from edge.transport.rest import RestTransport
from shared.errors import ResourceExhausted
from shared.hashing import ctx_hash
from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc
from shared.protocol import OpenSessionRequest
from tests.cloud.wire import GrpcClient, RestClient, WireError
from tests.server import CloudProcess

ALPHA, BETA = "alpha", "beta"
MAX_CONTEXT = 256  # n_positions of the tiny target (tests/conftest.py)


@pytest.fixture(scope="module")
def cloud(tiny_pair: tuple[Path, Path]) -> Iterator[CloudProcess]:
    """Defaults except the keys: 64 sessions, so 32 per key (two keys configured)."""
    with CloudProcess(tiny_pair[0], api_keys=(ALPHA, BETA)) as c:
        yield c


@pytest.fixture(scope="module")
def prompt(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode("def fibonacci(n):\n    if n < 2:"))


def client(transport: str, cloud: CloudProcess, key: str | None = ALPHA) -> RestClient | GrpcClient:
    return RestClient(cloud.http_url, key) if transport == "rest" else GrpcClient(cloud.grpc_target, key)


def metric(cloud: CloudProcess, name: str) -> float:
    for line in httpx.get(cloud.http_url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def post(cloud: CloudProcess, path: str, content: bytes, key: str | None = ALPHA) -> httpx.Response:
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(cloud.http_url + path, content=content, headers=headers, timeout=30)


def wait_queue_empty(cloud: CloudProcess, within_s: float) -> float:
    """Seconds until queue_depth reads 0 (AssertionError after `within_s`)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        if metric(cloud, "specsplit_cloud_queue_depth") == 0:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"the model queue is still busy after {within_s} s")


# --- abandoned generations --------------------------------------------------------------------
def test_generate_whose_clients_gave_up_leaves_the_queue(cloud: CloudProcess, prompt: list[int]) -> None:
    """64 non-streaming generations of 150 tokens whose clients hang up after 0.2 s stop at their next
    step (or, past the key's share of the queue, are refused with 429 before any compute): the queue
    empties, few tokens are made, and another key opens a session at once."""
    body = json.dumps({"prompt_ids": prompt, "max_new_tokens": 150, "stop_at_eos": False}).encode()
    made_before = metric(cloud, "specsplit_cloud_generated_tokens_total")

    def give_up() -> None:
        try:
            r = httpx.post(cloud.http_url + "/v1/generate", content=body, timeout=0.2,
                           headers={"content-type": "application/json", **cloud.auth_headers(ALPHA)})
        except httpx.TimeoutException:
            return
        assert r.status_code == 429, r.text  # refused up front: the key's share of the queue is full

    with ThreadPoolExecutor(64) as pool:
        for f in [pool.submit(give_up) for _ in range(64)]:
            f.result()
    wait_queue_empty(cloud, within_s=20)
    opened = RestClient(cloud.http_url, BETA).open({"prompt_ids": prompt})
    assert opened["ctx_len"] == len(prompt)
    RestClient(cloud.http_url, BETA).close(opened["ctx_id"])
    made = metric(cloud, "specsplit_cloud_generated_tokens_total") - made_before
    assert made < 64 * 150 / 2, f"{made} tokens were generated for clients that had gone"


def test_streamed_generate_stops_when_the_client_goes(cloud: CloudProcess, prompt: list[int]) -> None:
    body = {"prompt_ids": prompt, "max_new_tokens": 200, "stop_at_eos": False, "stream": True}
    with httpx.stream("POST", cloud.http_url + "/v1/generate", json=body, headers=cloud.auth_headers(),
                      timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # one token, then hang up
    wait_queue_empty(cloud, within_s=10)
    made = metric(cloud, "specsplit_cloud_generated_tokens_total")
    time.sleep(0.5)
    assert metric(cloud, "specsplit_cloud_generated_tokens_total") == made


# --- huge counts: refused by their length, before any conversion ------------------------------
def _healthz_worst_latency(cloud: CloudProcess, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(timeout=30) as http:
        while not stop.is_set():
            t0 = time.monotonic()
            http.get(cloud.http_url + "/healthz")
            out.append(time.monotonic() - t0)
            time.sleep(0.01)


def test_grpc_verify_with_a_million_q_dists_is_refused_by_its_count(cloud: CloudProcess) -> None:
    msg = pb.VerifyRequest(ctx_id="x", ctx_len=19, ctx_hash="0" * 16, draft_tokens=[1, 2, 3, 4],
                           q_token_probs=[0.5] * 4, k=4, q_dists=[pb.SparseDist()] * 1_000_000)
    stop, latencies = threading.Event(), []  # type: ignore[var-annotated]
    watcher = threading.Thread(target=_healthz_worst_latency, args=(cloud, stop, latencies))
    watcher.start()
    try:
        with grpc.insecure_channel(cloud.grpc_target) as ch:
            stub = pb_grpc.VerifierStub(ch)
            for metadata, code in [((("authorization", "Bearer alpha"),), grpc.StatusCode.INVALID_ARGUMENT),
                                   ((), grpc.StatusCode.UNAUTHENTICATED)]:
                t0 = time.monotonic()
                with pytest.raises(grpc.RpcError) as e:
                    stub.Verify(msg, metadata=metadata, timeout=30)
                took = time.monotonic() - t0
                assert e.value.code() == code
                assert took < 2.0, f"{took:.2f} s to refuse"
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    assert "len(q_dists) = 1000000 but k = 4" in e.value.details()
    finally:
        stop.set()
        watcher.join()
    assert latencies and max(latencies) < 1.0, f"/healthz waited {max(latencies):.2f} s"


def _big_verify_body() -> bytes:
    return json.dumps({"ctx_id": "x", "ctx_len": 19, "ctx_hash": "0" * 16, "draft_tokens": [1, 2, 3, 4],
                       "q_token_probs": [0.5] * 4, "k": 4, "q_dists": [{"ids": [], "probs": []}] * 150_000}).encode()


def test_rest_answers_401_before_reading_the_body(cloud: CloudProcess) -> None:
    """Headers announcing 3.9 MB and no body at all: the 401 comes without waiting for it."""
    size = len(_big_verify_body())
    with socket.create_connection((cloud.host, cloud.http_port), timeout=10) as s:
        s.sendall(f"POST /v1/verify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {size}\r\n\r\n".encode())
        head = s.recv(4096).decode("latin-1")
    assert head.startswith("HTTP/1.1 401"), head[:80]


def test_rest_verify_with_150k_q_dists_is_refused_by_its_count(cloud: CloudProcess) -> None:
    big = _big_verify_body()
    assert post(cloud, "/v1/verify", big, key=None).status_code == 401
    t0 = time.monotonic()
    r = post(cloud, "/v1/verify", big)
    assert time.monotonic() - t0 < 2.0
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_argument"
    assert "JSON objects" in r.json()["error"]["message"]


# --- per-key session cap ------------------------------------------------------------------------
@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_one_key_cannot_take_every_session(transport: str, cloud: CloudProcess, prompt: list[int]) -> None:
    """Two keys and max_sessions 64: each key holds at most 32; the other key still opens."""
    a, b = client(transport, cloud, ALPHA), client(transport, cloud, BETA)
    mine = [a.open({"prompt_ids": prompt})["ctx_id"] for _ in range(32)]
    try:
        with pytest.raises(WireError) as e:
            a.open({"prompt_ids": prompt})
        assert e.value.status == (429 if transport == "rest" else "RESOURCE_EXHAUSTED")
        err = e.value.body["error"]
        assert err["limit"] == "max_sessions_per_key" and "max_sessions_per_key = 32" in err["message"]
        assert err["retry_after_s"] == 1
        theirs = b.open({"prompt_ids": prompt})["ctx_id"]
        b.close(theirs)
    finally:
        for ctx_id in mine:
            a.close(ctx_id)


def test_retry_after_is_sent_on_429_and_honoured_by_the_edge(cloud: CloudProcess, prompt: list[int],
                                                             drafter: ModelDrafter, tokenizer: Any) -> None:
    a = RestClient(cloud.http_url, ALPHA)
    mine = [a.open({"prompt_ids": prompt})["ctx_id"] for _ in range(32)]
    try:
        r = post(cloud, "/v1/sessions", json.dumps({"prompt_ids": prompt}).encode())
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        with grpc.insecure_channel(cloud.grpc_target) as ch, pytest.raises(grpc.RpcError) as e:
            pb_grpc.VerifierStub(ch).OpenSession(pb.OpenSessionRequest(prompt_ids=prompt),
                                                 metadata=cloud.grpc_metadata(), timeout=10)
        assert dict(e.value.trailing_metadata())["retry-after"] == "1"
        transport = RestTransport(cloud.http_url, ALPHA)
        with pytest.raises(ResourceExhausted) as err:
            transport.open_session(OpenSessionRequest(prompt), 10)
        assert retry_delay(err.value, 0.05) == 1.0
        slept: list[float] = []
        edge = EdgeClient(EdgeSettings(cloud_url=cloud.http_url, api_key=ALPHA, max_retries=2),
                          transport=transport, drafter=drafter, tokenizer=tokenizer, sleep=slept.append)
        with pytest.raises(ResourceExhausted):
            edge.generate(prompt, max_new_tokens=4)
        assert slept and all(s >= 1.0 for s in slept), slept  # its own backoff would be 0.05 s, 0.1 s
    finally:
        for ctx_id in mine:
            a.close(ctx_id)


# --- sampling configs that would make p non-finite --------------------------------------------
EXTREME = [("temperature", 1e-40), ("top_p", 1e-300), ("repetition_penalty", 1e-300), ("temperature", 1e300)]


@pytest.mark.parametrize("field, value", EXTREME)
@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_sampling_that_would_make_p_non_finite_is_refused_at_open(transport: str, field: str, value: float,
                                                                   cloud: CloudProcess, prompt: list[int]) -> None:
    cfg = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, field: value}
    with pytest.raises(WireError) as e:
        client(transport, cloud).open({"prompt_ids": prompt, "sampling_cfg": cfg})
    assert e.value.status == (422 if transport == "rest" else "INVALID_ARGUMENT")
    assert e.value.body["error"]["message"].startswith(field)


@pytest.mark.parametrize("field, value", EXTREME)
def test_sampling_that_would_make_p_non_finite_is_refused_at_generate(field: str, value: float,
                                                                      cloud: CloudProcess, prompt: list[int]) -> None:
    cfg = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0, field: value}
    r = post(cloud, "/v1/generate", json.dumps({"prompt_ids": prompt, "sampling_cfg": cfg}).encode())
    assert r.status_code == 422 and r.json()["error"]["message"].startswith(field)


# --- malformed text and JSON ------------------------------------------------------------------
BAD_BODIES = {
    "lone_surrogate_ctx_id": b'{"ctx_id": "\\ud800", "ctx_len": 3, "ctx_hash": "0000000000000000", '
                             b'"draft_tokens": [], "q_token_probs": [], "k": 0}',
    "nested_100k_deep": b"[" * 100_000 + b"]" * 100_000,
    "not_utf8": b'{"ctx_id": "\xff\xfe", "ctx_len": 3}',
    "string_probability": b'{"ctx_id": "x", "ctx_len": 3, "ctx_hash": "0000000000000000", '
                          b'"draft_tokens": [1], "q_token_probs": ["0.5"], "k": 1}',
    "boolean_probability": b'{"ctx_id": "x", "ctx_len": 3, "ctx_hash": "0000000000000000", '
                           b'"draft_tokens": [1], "q_token_probs": [true], "k": 1}',
    "string_temperature": b'{"prompt_ids": [1, 2], "sampling_cfg": {"temperature": "0.5"}}',
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_malformed_rest_body_is_422_invalid_argument(case: str, cloud: CloudProcess) -> None:
    path = "/v1/sessions" if "temperature" in case else "/v1/verify"
    r = post(cloud, path, BAD_BODIES[case])
    assert r.status_code == 422, r.text[:200]
    assert r.json()["error"]["code"] == "invalid_argument"


def _field(number: int, wire_type: int) -> bytes:
    return bytes([(number << 3) | wire_type])


GRPC_BAD_BYTES = {
    # ctx_id (field 1) holding the UTF-8-style encoding of the surrogate U+D800: not valid UTF-8
    "surrogate_ctx_id": _field(1, 2) + b"\x03\xed\xa0\x80",
    "not_utf8_ctx_id": _field(1, 2) + b"\x02\xff\xfe",
    # an unknown group (field 15) opened 100k times: deeper than the parser allows
    "nested_100k_deep": _field(15, 3) * 100_000,
}


@pytest.mark.parametrize("case", list(GRPC_BAD_BYTES))
def test_malformed_grpc_message_is_invalid_argument(case: str, cloud: CloudProcess) -> None:
    with pytest.raises(WireError) as e:
        GrpcClient(cloud.grpc_target, ALPHA).verify_raw(GRPC_BAD_BYTES[case])
    assert e.value.status == "INVALID_ARGUMENT" and e.value.code == "invalid_argument"


# --- the bearer rule, alike on both transports --------------------------------------------------
def test_key_without_bearer_scheme_is_unauthenticated_on_both(cloud: CloudProcess) -> None:
    r = httpx.get(cloud.http_url + "/v1/model", headers={"Authorization": ALPHA})
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthenticated"
    with grpc.insecure_channel(cloud.grpc_target) as ch:
        stub = pb_grpc.VerifierStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModel(pb.GetModelRequest(), metadata=(("authorization", ALPHA),), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.GetModel(pb.GetModelRequest(), metadata=(("authorization", f"Bearer {ALPHA}"),),
                             timeout=10).max_context == MAX_CONTEXT


# --- the context end: one rule for verify, generate and the edge --------------------------------
@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_rounds_stop_at_the_models_context(transport: str, cloud: CloudProcess, prompt: list[int]) -> None:
    """Greedy, deterministic drafts: ctx_len + k + 1 <= max_context is accepted, one more is refused
    naming the room left, and a full context answers reason "context_full" and changes nothing."""
    c = client(transport, cloud)
    start = (prompt * 40)[: MAX_CONTEXT - 6]
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
    ctx_id = c.open({"prompt_ids": start, "sampling_cfg": greedy})["ctx_id"]
    ids = list(start)

    def round_(k: int) -> dict[str, Any]:
        return c.verify({"ctx_id": ctx_id, "ctx_len": len(ids), "ctx_hash": ctx_hash(ids), "append_ids": [],
                         "draft_tokens": [ids[-1]] * k, "q_token_probs": [1.0] * k, "draft_kind": "deterministic",
                         "k": k})

    while len(ids) < MAX_CONTEXT:
        room = MAX_CONTEXT - len(ids) - 1
        with pytest.raises(WireError) as e:
            round_(room + 1)
        assert e.value.body["error"]["max_k_here"] == room
        r = round_(room)
        ids += [ids[-1]] * r["accepted_len"] + [r["correction"]]
        assert r["ctx_len"] == len(ids) <= MAX_CONTEXT
    with pytest.raises(WireError) as e:
        round_(0)
    assert e.value.status == (422 if transport == "rest" else "INVALID_ARGUMENT")
    assert e.value.body["error"]["reason"] == "context_full"
    assert c.get(ctx_id)["ctx_len"] == MAX_CONTEXT
    c.close(ctx_id)


def test_generate_stops_at_the_same_length(cloud: CloudProcess, prompt: list[int]) -> None:
    start = (prompt * 40)[: MAX_CONTEXT - 6]
    r = post(cloud, "/v1/generate", json.dumps({"prompt_ids": start, "max_new_tokens": 50,
                                                "stop_at_eos": False}).encode())
    assert r.status_code == 200
    assert len(start) + len(r.json()["token_ids"]) == MAX_CONTEXT
    assert r.json()["metrics"]["stop_reason"] == "context"


@pytest.mark.parametrize("grpc_too", [False, True])
def test_the_edge_ends_cleanly_at_the_context_end(grpc_too: bool, cloud: CloudProcess, prompt: list[int],
                                                  drafter: ModelDrafter, tokenizer: Any) -> None:
    start = (prompt * 40)[: MAX_CONTEXT - 9]
    settings = EdgeSettings(cloud_url=cloud.http_url, grpc_target=cloud.grpc_target if grpc_too else None,
                            api_key=ALPHA, temperature=0.0, fixed_k=4, stop_at_eos=False, timeout_ms=30_000)
    edge = EdgeClient(settings, drafter=drafter, tokenizer=tokenizer)
    try:
        out = edge.generate(start, max_new_tokens=100)
    finally:
        edge.close()
    assert out.stop_reason == "context"
    assert len(start) + len(out.token_ids) == MAX_CONTEXT
    assert all(t.origin != "local" for t in out.tokens)


# --- connection limit ---------------------------------------------------------------------------
def test_slow_header_connections_are_bounded(tiny_pair: tuple[Path, Path]) -> None:
    """--max-connections 4: four connections trickling headers hold no more than that; a fifth
    client is answered 503 at once instead of the server taking connections without bound, and
    the server serves again when they go."""
    with CloudProcess(tiny_pair[0], extra_args=("--max-connections", "4")) as c:
        slow = [socket.create_connection((c.host, c.http_port), timeout=10) for _ in range(4)]
        try:
            for s in slow:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            time.sleep(0.3)
            t0 = time.monotonic()
            r = httpx.get(c.http_url + "/healthz", timeout=10)
            assert r.status_code == 503 and time.monotonic() - t0 < 5
        finally:
            for s in slow:
                s.close()
        deadline = time.monotonic() + 10
        while httpx.get(c.http_url + "/healthz", timeout=10).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)


# --- soak ---------------------------------------------------------------------------------------
def test_64_greedy_sessions_give_the_target_only_text(cloud: CloudProcess, tokenizer: Any) -> None:
    """64 sessions at once (32 per key, the per-key cap), greedy, k = 4 drafts that are right except
    for their last token on odd rounds: every session's text equals /v1/generate's greedy text."""
    greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0}
    n_new = 24

    def one(i: int) -> None:
        key = ALPHA if i % 2 else BETA
        c = RestClient(cloud.http_url, key, timeout=120)
        start = list(tokenizer.encode(f"# task {i}: sum the list\ndef f{i}(xs):"))
        ref = c._call("POST", "/v1/generate", {"prompt_ids": start, "max_new_tokens": n_new,
                                               "sampling_cfg": greedy, "stop_at_eos": False})["token_ids"]
        ctx_id = c.open({"prompt_ids": start, "sampling_cfg": greedy})["ctx_id"]
        ids, r_i = list(start), 0
        while len(ids) - len(start) < n_new:
            done = len(ids) - len(start)
            draft = (ref[done: done + 4] + [0] * 4)[:4]
            if r_i % 2:
                draft[-1] = (draft[-1] + 1) % 100
            r = c.verify({"ctx_id": ctx_id, "ctx_len": len(ids), "ctx_hash": ctx_hash(ids), "append_ids": [],
                          "draft_tokens": draft, "q_token_probs": [1.0] * 4, "draft_kind": "deterministic", "k": 4,
                          "request_id": f"r{r_i}"})
            ids += draft[: r["accepted_len"]] + [r["correction"]]
            r_i += 1
        assert ids[len(start):][:n_new] == ref, i
        c.close(ctx_id)
        c.shutdown()

    with ThreadPoolExecutor(64) as pool:
        for f in [pool.submit(one, i) for i in range(64)]:
            f.result()
