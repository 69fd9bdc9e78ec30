"""The bad-input battery against the real process, auth on, over REST and gRPC: every case of the
PROTOCOL.md error table gets its status / code and a clear error body, and leaves the session as
it was (length, hash, counters)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoTokenizer

from shared.hashing import ctx_hash
from tests.cloud.wire import GrpcClient, RestClient, WireError
from tests.server import CloudProcess

KEY, OTHER_KEY = "key-a", "key-b"
MAX_K, MAX_PROMPT, MAX_BODY = 8, 64, 64 * 1024


@pytest.fixture(scope="module")
def cloud(demo_target_dir: Path) -> Iterator[CloudProcess]:
    args = ("--max-k", str(MAX_K), "--max-prompt-len", str(MAX_PROMPT), "--max-body-bytes", str(MAX_BODY),
            "--max-queue-depth", "1")
    with CloudProcess(demo_target_dir, api_keys=(KEY, OTHER_KEY), extra_args=args) as c:
        yield c


@pytest.fixture(scope="module")
def vocab(cloud: CloudProcess) -> int:
    return int(httpx.get(cloud.http_url + "/v1/model", headers=cloud.auth_headers()).json()["vocab_size"])


@pytest.fixture(scope="module")
def prompt(demo_target_dir: Path) -> list[int]:
    return list(AutoTokenizer.from_pretrained(demo_target_dir).encode("def main():\n    args ="))


def make_client(transport: str, cloud: CloudProcess, key: str | None = KEY) -> RestClient | GrpcClient:
    return RestClient(cloud.http_url, key) if transport == "rest" else GrpcClient(cloud.grpc_target, key)


@pytest.fixture(scope="module", params=["rest", "grpc"])
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def session(transport: str, cloud: CloudProcess, prompt: list[int]) -> dict[str, Any]:
    """A session after one good round, and the good next request (`good`) for it."""
    c = make_client(transport, cloud)
    info = c.open({"prompt_ids": prompt, "sampling_cfg": {"temperature": 1.0, "top_p": 0.9, "top_k": 0,
                                                          "repetition_penalty": 1.1}, "seed": 4})
    ids = list(prompt)
    r = c.verify({"ctx_id": info["ctx_id"], "ctx_len": len(ids), "ctx_hash": ctx_hash(ids), "append_ids": [],
                  "draft_tokens": [prompt[0]], "q_token_probs": [1.0], "draft_kind": "deterministic", "k": 1})
    ids += [prompt[0]] * r["accepted_len"] + [r["correction"]]
    good = {"ctx_id": info["ctx_id"], "ctx_len": len(ids), "ctx_hash": ctx_hash(ids), "append_ids": [],
            "draft_tokens": [prompt[1], prompt[2]], "q_token_probs": [0.5, 0.25], "draft_kind": "sampled", "k": 2,
            "request_id": "good"}
    return {"ctx_id": info["ctx_id"], "good": good, "client": c}


def snapshot(s: dict[str, Any]) -> tuple:
    info = s["client"].get(s["ctx_id"])
    return info["ctx_len"], info["ctx_hash"], info["counters"]["rounds"], info["counters"]["replayed"]


# case name -> (change to the good request, REST status, gRPC code, words in the message)
Patch = Callable[[dict[str, Any], int], dict[str, Any]]
VERIFY_CASES: dict[str, tuple[Patch, int, str, str]] = {
    "k_differs_from_len": (lambda g, v: {**g, "k": 3}, 422, "INVALID_ARGUMENT", "k = 3"),
    "len_q_differs_from_k": (lambda g, v: {**g, "q_token_probs": [0.5]}, 422, "INVALID_ARGUMENT", "len(q_token_probs)"),
    "q_zero": (lambda g, v: {**g, "q_token_probs": [0.0, 0.5]}, 422, "INVALID_ARGUMENT", "not in (0, 1]"),
    "q_above_one": (lambda g, v: {**g, "q_token_probs": [1.5, 0.5]}, 422, "INVALID_ARGUMENT", "not in (0, 1]"),
    "q_nan": (lambda g, v: {**g, "q_token_probs": [math.nan, 0.5]}, 422, "INVALID_ARGUMENT", "nan"),
    "draft_id_not_in_vocab": (lambda g, v: {**g, "draft_tokens": [v, 1]}, 422, "INVALID_ARGUMENT", "token id"),
    "append_id_not_in_vocab": (lambda g, v: {**g, "append_ids": [v + 5], "ctx_len": g["ctx_len"] + 1}, 422,
                               "INVALID_ARGUMENT", "append_ids[0]"),
    "k_over_limit": (lambda g, v: {**g, "draft_tokens": [1] * (MAX_K + 1), "q_token_probs": [0.5] * (MAX_K + 1),
                                   "k": MAX_K + 1}, 422, "INVALID_ARGUMENT", "max_k"),
    "sampling_differs": (lambda g, v: {**g, "sampling_cfg": {"temperature": 0.5, "top_p": 0.9, "top_k": 0,
                                                             "repetition_penalty": 1.1}}, 422, "INVALID_ARGUMENT",
                         "sampling_cfg differs"),
    "unknown_draft_kind": (lambda g, v: {**g, "draft_kind": "guessed"}, 422, "INVALID_ARGUMENT", "draft_kind"),
    "q_dists_wrong_length": (lambda g, v: {**g, "q_dists": [{"ids": [1], "probs": [1.0]}]}, 422,
                             "INVALID_ARGUMENT", "len(q_dists)"),
    "unknown_ctx_id": (lambda g, v: {**g, "ctx_id": "no-such-session"}, 404, "NOT_FOUND", "reopen"),
    "ctx_hash_mismatch": (lambda g, v: {**g, "ctx_hash": "0123456789abcdef"}, 409, "FAILED_PRECONDITION",
                          "ctx_hash disagrees"),
    "ctx_len_ahead": (lambda g, v: {**g, "ctx_len": g["ctx_len"] + 3}, 409, "FAILED_PRECONDITION", "resend from"),
    "body_too_large": (lambda g, v: {**g, "request_id": "x" * (MAX_BODY + 10)}, 413, "RESOURCE_EXHAUSTED", ""),
}


@pytest.mark.parametrize("case", list(VERIFY_CASES))
def test_bad_verify_request_gets_its_code_and_changes_nothing(case: str, transport: str, session: dict[str, Any],
                                                              vocab: int) -> None:
    patch, status, code, words = VERIFY_CASES[case]
    before = snapshot(session)
    with pytest.raises(WireError) as e:
        session["client"].verify(patch(session["good"], vocab))
    assert e.value.status == (status if transport == "rest" else code)
    if transport == "rest" or status != 413:  # gRPC refuses an oversized message before our code sees it
        err = e.value.body["error"]
        assert err["code"] and words in err["message"]
        if status == 409:
            assert err["expected_ctx_len"] == before[0]
    assert snapshot(session) == before


def test_malformed_body_is_invalid_argument(transport: str, session: dict[str, Any]) -> None:
    before = snapshot(session)
    with pytest.raises(WireError) as e:
        session["client"].verify_raw(b'{"ctx_id": [' if transport == "rest" else b"\x0a\xff\xff\xff")
    assert e.value.status == (422 if transport == "rest" else "INVALID_ARGUMENT")
    assert e.value.code == "invalid_argument" and "malformed" in e.value.body["error"]["message"]
    assert snapshot(session) == before


@pytest.mark.parametrize("key, status, code", [(None, 401, "UNAUTHENTICATED"), ("wrong", 401, "UNAUTHENTICATED"),
                                               (OTHER_KEY, 403, "PERMISSION_DENIED")])
def test_auth_is_required_and_sessions_belong_to_their_key(key: str | None, status: int, code: str, transport: str,
                                                           cloud: CloudProcess, session: dict[str, Any]) -> None:
    before = snapshot(session)
    stranger = make_client(transport, cloud, key)
    for call in (lambda: stranger.verify(session["good"]), lambda: stranger.get(session["ctx_id"]),
                 lambda: stranger.close(session["ctx_id"])):
        with pytest.raises(WireError) as e:
            call()
        assert e.value.status == (status if transport == "rest" else code)
    if key != OTHER_KEY:
        with pytest.raises(WireError):
            stranger.model()
    stranger.shutdown()
    assert snapshot(session) == before


def test_health_readiness_and_metrics_need_no_key(cloud: CloudProcess) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert httpx.get(cloud.http_url + path).status_code == 200
    with grpc.insecure_channel(cloud.grpc_target) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="specsplit.v1.Verifier"))
        assert status.status == health_pb2.HealthCheckResponse.SERVING


OPEN_CASES: dict[str, tuple[Callable[[list[int], int], dict[str, Any]], str]] = {
    "prompt_longer_than_the_limit": (lambda p, v: {"prompt_ids": (p * 20)[: MAX_PROMPT + 1]}, "more than the limit"),
    "prompt_id_not_in_vocab": (lambda p, v: {"prompt_ids": p + [v]}, "prompt_ids"),
    "bad_sampling": (lambda p, v: {"prompt_ids": p, "sampling_cfg": {"temperature": -1.0, "top_p": 1.0,
                                                                     "top_k": 0, "repetition_penalty": 1.0}},
                     "temperature"),
    "bad_correction": (lambda p, v: {"prompt_ids": p, "correction": "approximate"}, "correction"),
}


@pytest.mark.parametrize("case", list(OPEN_CASES))
def test_bad_open_request_is_invalid_argument(case: str, transport: str, cloud: CloudProcess, prompt: list[int],
                                              vocab: int) -> None:
    make, words = OPEN_CASES[case]
    c = make_client(transport, cloud)
    open_before = _open_sessions(cloud)
    with pytest.raises(WireError) as e:
        c.open(make(prompt, vocab))
    assert e.value.status == (422 if transport == "rest" else "INVALID_ARGUMENT")
    assert words in e.value.body["error"]["message"]
    assert _open_sessions(cloud) == open_before
    c.shutdown()


def _open_sessions(cloud: CloudProcess) -> float:
    for line in httpx.get(cloud.http_url + "/metrics").text.splitlines():
        if line.startswith("specsplit_cloud_open_sessions "):
            return float(line.split()[1])
    raise AssertionError("no open_sessions gauge")


def test_full_queue_is_resource_exhausted(transport: str, cloud: CloudProcess, session: dict[str, Any],
                                          prompt: list[int]) -> None:
    """max_queue_depth = 1: while a streamed generation holds the queue, an open is refused at once (429
    naming max_queue_depth) and a round of an open session is still served."""
    first_token = threading.Event()
    stop = threading.Event()

    def generate() -> None:
        body = {"prompt_ids": prompt, "max_new_tokens": 400, "stream": True, "stop_at_eos": False}
        with httpx.stream("POST", cloud.http_url + "/v1/generate", json=body, headers=cloud.auth_headers(),
                          timeout=60) as r:
            for _ in r.iter_lines():
                first_token.set()
                if stop.is_set():
                    break

    t = threading.Thread(target=generate)
    t.start()
    try:
        assert first_token.wait(30)
        session["client"].verify(session["good"])  # new work never refuses a round
        before = snapshot(session)
        with pytest.raises(WireError) as e:
            session["client"].open({"prompt_ids": prompt})
        assert e.value.status == (429 if transport == "rest" else "RESOURCE_EXHAUSTED")
        assert e.value.body["error"]["limit"] == "max_queue_depth"
    finally:
        stop.set()
        t.join()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # the abandoned generation gives its place back
        text = httpx.get(cloud.http_url + "/metrics").text
        if "specsplit_cloud_queue_depth 0.0" in text:
            break
        time.sleep(0.05)
    assert snapshot(session) == before
    assert session["client"].verify(session["good"])["ctx_len"] >= before[0]


def test_error_answers_are_counted_by_code(cloud: CloudProcess) -> None:
    text = httpx.get(cloud.http_url + "/metrics").text
    counted = {line.split('"')[1]: float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("specsplit_cloud_errors_total{")}
    for code in ("invalid_argument", "not_found", "failed_precondition", "unauthenticated", "permission_denied",
                 "resource_exhausted"):
        assert counted.get(code, 0) >= 1, code
    assert json.loads(json.dumps(counted))  # plain numbers
