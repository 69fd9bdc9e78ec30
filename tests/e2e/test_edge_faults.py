"""Fault paths against the real cloud process: the generation completes, nothing is lost or duplicated.

REST faults go through tests/e2e/fault_proxy.py (dropped, late, duplicated, stale-replayed and
refused requests); the cloud is also killed and restarted mid-generation (REST and gRPC) and a
session is evicted by its idle timeout. Every run is greedy, and its text must equal the no-fault
run's text token for token. The one lossy path, the timeout fallback, commits the first draft
token unverified; it is checked with the target model itself as the drafter, so the unverified
token is still the target's greedy choice and the text must still be equal.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge.client import EdgeClient, GenerationResult
from edge.drafters import ModelDrafter
from edge.settings import EdgeSettings
from tests.e2e.fault_proxy import FaultProxy
from tests.server import CloudProcess

N_NEW = 24
PROMPT = "def area(width, height):\n    return width * height\n\n\ndef volume("
TTL_S = 2.0


@pytest.fixture(scope="module")
def cloud(tiny_pair: tuple[Path, Path]) -> Iterator[CloudProcess]:
    """The tiny-target cloud with a short session TTL, so idle sessions expire within a test."""
    with CloudProcess(tiny_pair[0], extra_args=("--session-ttl-s", str(TTL_S))) as c:
        yield c


@pytest.fixture
def proxy(cloud: CloudProcess):  # type: ignore[no-untyped-def]
    with FaultProxy("127.0.0.1", cloud.http_port) as p:
        yield p


def client(url: str | None, tokenizer: Any, drafter: ModelDrafter, grpc: str | None = None, **kw: Any) -> EdgeClient:
    kw.setdefault("timeout_ms", 10_000)
    kw.setdefault("timeout_fallback", False)
    kw.setdefault("stream_switch", False)  # the fault proxy frames Content-Length bodies only, not event streams
    s = EdgeSettings(cloud_url=url or "http://unused", grpc_target=grpc, temperature=0, max_new_tokens=N_NEW,
                     backoff_ms=20, **kw)
    return EdgeClient(s, drafter=drafter, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def reference(cloud: CloudProcess, tokenizer: Any, drafter: ModelDrafter) -> list[int]:
    out = client(cloud.http_url, tokenizer, drafter).generate(PROMPT)
    assert out.metrics.retries == out.metrics.reopens == out.metrics.timeouts == 0
    return out.token_ids


def verify_count(proxy: FaultProxy) -> int:
    return sum(1 for _, path in proxy.log.requests if path == "/v1/verify")


@pytest.mark.parametrize("action", ["drop", "duplicate", "replay", "refuse"])
def test_lost_duplicated_or_refused_requests_change_nothing(proxy: FaultProxy, tokenizer: Any,
                                                            drafter: ModelDrafter, reference: list[int],
                                                            action: str) -> None:
    proxy.plan("/v1/verify", 2, action)
    proxy.plan("/v1/verify", 4, action)
    r = client(proxy.url, tokenizer, drafter).generate(PROMPT)
    assert [a for a, _, _ in proxy.log.applied] == [action, action]
    assert r.token_ids == reference
    assert r.metrics.local_commits == 0 and r.metrics.reopens == 0
    if action in ("drop", "refuse"):
        assert r.metrics.retries == 2


def test_late_answer_is_discarded_and_resent(proxy: FaultProxy, tokenizer: Any, drafter: ModelDrafter,
                                            reference: list[int]) -> None:
    proxy.plan("/v1/verify", 2, "delay", delay_s=3.0)
    r = client(proxy.url, tokenizer, drafter, timeout_ms=1500).generate(PROMPT)
    assert r.token_ids == reference
    assert r.metrics.timeouts == 1 and r.metrics.retries == 1 and r.metrics.local_commits == 0


def test_timeout_fallback_commits_one_token_and_realigns(proxy: FaultProxy, tokenizer: Any,
                                                        tiny_pair: tuple[Path, Path]) -> None:
    as_target = ModelDrafter(tiny_pair[0])  # local commits are then the target's own greedy tokens
    ref = client(proxy.url, tokenizer, as_target).generate(PROMPT).token_ids
    proxy.plan("/v1/verify", 2, "delay", delay_s=3.0)
    r = client(proxy.url, tokenizer, as_target, timeout_ms=1500, timeout_fallback=True).generate(PROMPT)
    assert r.token_ids == ref
    assert r.metrics.timeouts == 1 and r.metrics.local_commits == 1 and r.metrics.by_origin["local"] == 1
    assert r.metrics.reopens == 0 and r.metrics.resyncs == 0  # append_ids realigned both sides


def test_timeout_fallback_with_a_different_drafter_completes_consistently(
        proxy: FaultProxy, tokenizer: Any, drafter: ModelDrafter, reference: list[int]) -> None:
    proxy.plan("/v1/verify", 2, "delay", delay_s=3.0)
    r = client(proxy.url, tokenizer, drafter, timeout_ms=1500, timeout_fallback=True).generate(PROMPT)
    assert len(r.token_ids) == N_NEW and r.metrics.local_commits == 1
    assert r.metrics.reopens == 0 and r.metrics.resyncs == 0
    local = next(i for i, t in enumerate(r.tokens) if t.origin == "local")
    assert r.token_ids[:local] == reference[:local]  # exact up to the unverified token


def _run_and_interrupt(c: EdgeClient, after: int, interrupt: Any) -> GenerationResult:
    gen = c.stream(PROMPT)
    n = 0
    for _ in gen:
        n += 1
        if n == after:
            interrupt()
    return gen.result()


def test_cloud_killed_and_restarted_mid_generation(cloud: CloudProcess, tokenizer: Any, drafter: ModelDrafter,
                                                   reference: list[int]) -> None:
    """A REST and a gRPC generation are both mid-way when the cloud is killed; both complete exactly."""
    paused = threading.Barrier(3)
    resume = threading.Event()
    results: dict[str, GenerationResult] = {}

    def run(name: str, c: EdgeClient) -> None:
        def pause() -> None:
            paused.wait()
            resume.wait()

        results[name] = _run_and_interrupt(c, 6, pause)

    clients = {"rest": client(cloud.http_url, tokenizer, drafter.fork(), max_retries=40, backoff_max_ms=1000),
               "grpc": client(None, tokenizer, drafter.fork(), grpc=cloud.grpc_target, max_retries=40,
                              backoff_max_ms=1000)}
    threads = [threading.Thread(target=run, args=item) for item in clients.items()]
    for t in threads:
        t.start()
    paused.wait()
    cloud.kill()
    resume.set()
    cloud.start()  # same ports; every session is gone
    for t in threads:
        t.join()
    for name, r in results.items():
        assert r.token_ids == reference, name
        assert r.metrics.retries >= 1 and r.metrics.reopens == 1, name


def test_evicted_session_is_reopened(cloud: CloudProcess, tokenizer: Any, drafter: ModelDrafter,
                                     reference: list[int]) -> None:
    c = client(cloud.http_url, tokenizer, drafter)
    r = _run_and_interrupt(c, 6, lambda: time.sleep(TTL_S + 1.5))  # idle past the session TTL
    assert r.token_ids == reference
    assert r.metrics.reopens == 1 and r.metrics.local_commits == 0
