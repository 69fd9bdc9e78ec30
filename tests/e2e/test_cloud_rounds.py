"""The real server process with the demo target: verify exchanges over REST and gRPC, each
round checked against a cache-free reference computed here; retries, timeouts, resync,
16 concurrent sessions."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from shared.config import SamplingConfig
from shared.hashing import ctx_hash
from tests.cloud.reference import CausalLM, Drafter, assert_matches, run_rounds
from tests.cloud.wire import GrpcClient, RestClient, WireError
from tests.server import CloudProcess

MODES = {
    # name: (sampling config, edge mode, correction, the next_kind the exchange must reach)
    "strict-scalar-residual": (SamplingConfig(1.0, 0.9, 0, 1.1), "scalar", "strict", "residual"),
    "strict-q_dists": (SamplingConfig(0.8, 1.0, 40, 1.0), "q_dists", "strict", "correction"),
    "deterministic": (SamplingConfig(1.0, 0.95, 0, 1.0), "deterministic", "strict", "correction"),
    "shortcut": (SamplingConfig(1.0, 0.9, 0, 1.1), "scalar", "shortcut", "correction"),
    "greedy": (SamplingConfig(0.0, 1.0, 0, 1.0), "scalar", "strict", None),
}


@pytest.fixture(scope="module")
def tokenizer(demo_target_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(demo_target_dir)


@pytest.fixture(scope="module")
def drafter(demo_draft_dir: Path) -> Drafter:
    torch.set_num_threads(1)
    return Drafter(demo_draft_dir)


@pytest.fixture(scope="module")
def target(demo_target_dir: Path) -> CausalLM:
    return CausalLM(demo_target_dir)


@pytest.fixture(scope="module", params=["rest", "grpc"])
def client(request: pytest.FixtureRequest, cloud_server: CloudProcess) -> Iterator[RestClient | GrpcClient]:
    c = RestClient(cloud_server.http_url) if request.param == "rest" else GrpcClient(cloud_server.grpc_target)
    yield c
    c.shutdown()


def metric(cloud: CloudProcess, name: str) -> float:
    for line in httpx.get(cloud.http_url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def wait_for(cond: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def encode(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return list(tokenizer.encode(text))


@pytest.mark.parametrize("mode", list(MODES))
def test_verify_exchange_matches_the_reference(mode: str, client: RestClient | GrpcClient, drafter: Drafter,
                                               target: CausalLM, tokenizer) -> None:  # type: ignore[no-untyped-def]
    cfg, edge_mode, correction, must_see = MODES[mode]
    prompt = encode(tokenizer, "def add(a, b):\n    return")
    ctx_id, edge, answers = run_rounds(client, drafter, target, prompt, cfg, seed=17, mode=edge_mode,
                                       correction=correction, rounds=4, k=5, until_kind=must_see)
    if must_see is not None:
        assert must_see in {a["next_kind"] for a in answers}
    info = client.get(ctx_id)
    assert info["ctx_len"] == len(edge.ids) - len(edge.pending)
    assert info["counters"]["rounds"] == len(answers)
    client.close(ctx_id)
    with pytest.raises(WireError) as e:
        client.get(ctx_id)
    assert e.value.code == "not_found"


def test_retried_round_is_idempotent(client: RestClient | GrpcClient, drafter: Drafter, target: CausalLM,
                                     tokenizer) -> None:  # type: ignore[no-untyped-def]
    cfg = SamplingConfig(1.0, 0.9, 0, 1.1)
    prompt = encode(tokenizer, "for i in range(10):")
    ctx_id, edge, _ = run_rounds(client, drafter, target, prompt, cfg, seed=3, rounds=1)
    for request_id in ("retry-1", ""):  # from the replay cache, and recomputed by crop-then-append
        body, draft = edge.request(ctx_id, 4)
        body["request_id"] = request_id
        first = client.verify(body)
        state = client.get(ctx_id)
        again = client.verify(body)
        for r in (first, again):
            r.pop("metrics")
            if not request_id:  # recomputed: the budget is the cloud's advice as of the new round
                r.pop("node_budget")
        assert again == first
        after = client.get(ctx_id)
        assert (after["ctx_len"], after["ctx_hash"]) == (state["ctx_len"], state["ctx_hash"])
        edge.apply(first, draft)
    assert client.get(ctx_id)["counters"]["replayed"] == 1


@pytest.fixture(scope="module")
def heavy_forward_cloud(demo_target_dir: Path) -> Iterator[CloudProcess]:
    """The demo target with rounds riding in forwards that carry up to 1,024 prefill tokens. Under a burst
    of long opens a round then waits for the forward in flight and rides in a whole prefill forward, so
    it takes longer than 50 ms whenever it arrives. (With the default 64 it rides in a small forward and
    may be answered within 50 ms, if it arrives as a prefill forward ends; so may it with the default share of
    its forward's cost, `--prefill-share-with-rounds` 0.5, which this cloud lifts.)"""
    with CloudProcess(demo_target_dir, extra_args=("--max-prefill-tokens-with-rounds", "1024",
                                                   "--prefill-share-with-rounds", "1000")) as c:
        yield c


@pytest.fixture(params=["rest", "grpc"])
def heavy_client(request: pytest.FixtureRequest, heavy_forward_cloud: CloudProcess,
                 ) -> Iterator[RestClient | GrpcClient]:
    c = RestClient(heavy_forward_cloud.http_url) if request.param == "rest" \
        else GrpcClient(heavy_forward_cloud.grpc_target)
    yield c
    c.shutdown()


def test_round_replayed_after_the_edge_timed_out(heavy_client: RestClient | GrpcClient,
                                                 heavy_forward_cloud: CloudProcess, drafter: Drafter,
                                                 target: CausalLM, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """The model is kept busy (~0.6 s of long prefills queued first), the edge gives up on its round
    after 50 ms; the server still applies it; the edge's retry (same request_id) gets the same answer
    without a second application, and the session goes on exactly like the reference."""
    client, cloud_server = heavy_client, heavy_forward_cloud
    cfg = SamplingConfig(1.0, 0.9, 0, 1.1)
    prompt = encode(tokenizer, "class Stack:\n    def push(self, x):")
    ctx_id, edge, _ = run_rounds(client, drafter, target, prompt, cfg, seed=5, rounds=1)
    body, draft = edge.request(ctx_id, 4)
    ref = edge.reference(target, draft, "strict")
    rounds_before = client.get(ctx_id)["counters"]["rounds"]
    impatient = RestClient(cloud_server.http_url, timeout=0.05) if client.name == "rest" \
        else GrpcClient(cloud_server.grpc_target, timeout=0.05)
    long_prompt = (prompt * 200)[:500]
    opened: list[str] = []
    counter = iter(range(1, 10**6))

    def long_open() -> float:
        t0 = time.monotonic()
        # distinct first tokens: no prefix shared through the cache, so every open is real model work
        ids = [next(counter)] + long_prompt[1:]
        r = httpx.post(cloud_server.http_url + "/v1/sessions", json={"prompt_ids": ids}, timeout=60)
        opened.append(r.json()["ctx_id"])
        return time.monotonic() - t0

    n = min(40, max(3, math.ceil(0.6 / long_open())))  # enough prefills for ~0.6 s of model work
    busy = [threading.Thread(target=long_open) for _ in range(n)]
    for t in busy:
        t.start()
    wait_for(lambda: metric(cloud_server, "specsplit_cloud_queue_depth") >= 2)  # they hold the model
    with pytest.raises((httpx.TimeoutException, WireError)) as e:
        impatient.verify(body)
    if isinstance(e.value, WireError):
        assert e.value.status == "DEADLINE_EXCEEDED"
    impatient.shutdown()
    for t in busy:
        t.join()
    for other in opened:
        httpx.delete(f"{cloud_server.http_url}/v1/sessions/{other}")
    deadline = time.monotonic() + 10
    while client.get(ctx_id)["counters"]["rounds"] == rounds_before and time.monotonic() < deadline:
        time.sleep(0.05)  # the abandoned round is applied once the model gets to it
    assert client.get(ctx_id)["counters"]["rounds"] == rounds_before + 1
    retried = client.verify(body)
    assert_matches(retried, ref, len(edge.ids))
    counters = client.get(ctx_id)["counters"]
    assert counters["rounds"] == rounds_before + 1 and counters["replayed"] == 1  # applied once, answered twice
    edge.apply(retried, draft)
    body, draft = edge.request(ctx_id, 4)
    assert_matches(client.verify(body), edge.reference(target, draft, "strict"), len(edge.ids))


def test_hash_mismatch_is_409_and_the_edge_resyncs_from_the_clouds_length(
        client: RestClient | GrpcClient, drafter: Drafter, target: CausalLM, tokenizer) -> None:  # type: ignore[no-untyped-def]
    cfg = SamplingConfig(1.0, 0.9, 0, 1.1)
    prompt = encode(tokenizer, "import os\nimport sys\n")
    ctx_id, edge, _ = run_rounds(client, drafter, target, prompt, cfg, seed=9, rounds=2)
    cloud = client.get(ctx_id)
    body, draft = edge.request(ctx_id, 3)
    with pytest.raises(WireError) as e:
        client.verify({**body, "ctx_hash": ctx_hash(edge.ids[:-1] + [edge.ids[-1] ^ 1])})
    assert e.value.status in (409, "FAILED_PRECONDITION")
    assert e.value.body["error"]["expected_ctx_len"] == cloud["ctx_len"]
    assert client.get(ctx_id)["ctx_hash"] == cloud["ctx_hash"]
    # the edge holds more than the cloud knows (two tokens the cloud never saw): 409, then resend them
    extra = encode(tokenizer, " x")[:1] * 2
    edge.ids += extra
    edge.pending = edge.pending + extra
    body, draft = edge.request(ctx_id, 3)
    with pytest.raises(WireError) as e:
        client.verify({**body, "append_ids": body["append_ids"][-1:]})
    expected = e.value.body["error"]["expected_ctx_len"]
    assert expected == cloud["ctx_len"]
    resynced = client.verify({**body, "append_ids": edge.ids[expected:]})
    assert_matches(resynced, edge.reference(target, draft, "strict"), len(edge.ids))


def test_sixteen_concurrent_sessions_get_their_own_correct_results(
        cloud_server: CloudProcess, drafter: Drafter, target: CausalLM, tokenizer) -> None:  # type: ignore[no-untyped-def]
    """16 sessions at once (half REST, half gRPC), different prompts, seeds, modes; every round of
    every session equals the reference computed for that session alone."""
    texts = ["def f(x):", "while True:", "# compute the mean", "return [", "if __name__ ==", "print(",
             "x = {", "try:\n    "]
    modes = [("scalar", SamplingConfig(1.0, 0.9, 0, 1.1)), ("q_dists", SamplingConfig(0.7, 1.0, 20, 1.0)),
             ("deterministic", SamplingConfig(1.0, 1.0, 0, 1.0)), ("scalar", SamplingConfig(0.0))]
    start = threading.Barrier(16)

    def one(i: int) -> int:
        client = RestClient(cloud_server.http_url) if i % 2 == 0 else GrpcClient(cloud_server.grpc_target)
        mode, cfg = modes[i % 4]
        start.wait()
        try:
            _, edge, answers = run_rounds(client, drafter, target, encode(tokenizer, texts[i % 8]), cfg,
                                          seed=100 + i, mode=mode, rounds=3, k=4)
            return len(answers)
        finally:
            client.shutdown()

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(one, range(16))) == [3] * 16
