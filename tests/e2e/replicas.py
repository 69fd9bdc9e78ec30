"""Helpers of the replica tests: a real cluster (bench.cluster: specsplit-cloud replicas behind a real
nginx on loopback), who holds a routing key, generations paused mid-way, edge clients through the balancer.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.cluster import Cluster, Replica
from bench.nginx_conf import is_session_call, last_upstream
from edge.client import EdgeClient, GenerationResult
from edge.drafters.base import Drafter
from edge.settings import EdgeSettings


def holder_of(cluster: Cluster, route_key: str, since: int) -> Replica:
    """The replica holding the session(s) of `route_key`, by nginx's access log."""
    return cluster.holder_of(route_key, since)


def opens_logged(replica: Replica, after: float = 0.0) -> list[dict[str, Any]]:
    """The replica's `open` log events (newer than the time `after`)."""
    return [e for e in replica.log_events() if e.get("event") == "open" and e.get("ts", 0) >= after]


def edge_client(cluster: Cluster, transport: str, tokenizer: Any, drafter: Drafter, **kw: Any) -> EdgeClient:
    """An edge client through the balancer; verified rounds only (no lossy timeout fallback)."""
    kw.setdefault("temperature", 0)
    s = EdgeSettings(cloud_url=cluster.nginx.http_url,
                     grpc_target=cluster.nginx.grpc_target if transport == "grpc" else None,
                     timeout_ms=20_000, timeout_fallback=False, backoff_ms=20, **kw)
    return EdgeClient(s, drafter=drafter, tokenizer=tokenizer)


@dataclass
class PausedRuns:
    """Generations in threads that all stop after `after` tokens until `resume()`; then run to the end."""

    after: int
    runs: dict[str, Callable[[], Any]]
    results: dict[str, GenerationResult] = field(default_factory=dict)
    errors: dict[str, BaseException] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._paused = threading.Barrier(len(self.runs) + 1)
        self._resume = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(name, start), daemon=True)
                         for name, start in self.runs.items()]
        for t in self._threads:
            t.start()

    def _run(self, name: str, start: Callable[[], Any]) -> None:
        try:
            gen = start()
            for n, _ in enumerate(gen, 1):
                if n == self.after:
                    self._paused.wait(120)
                    self._resume.wait(120)
            self.results[name] = gen.result()
        except BaseException as e:  # reported by finish()
            self.errors[name] = e
            self._paused.abort()

    def wait_paused(self) -> None:
        """Every generation has committed `after` tokens and waits (its session open, no call in flight)."""
        self._paused.wait(120)

    def resume(self) -> None:
        self._resume.set()

    def finish(self) -> dict[str, GenerationResult]:
        self.resume()
        for t in self._threads:
            t.join(120)
        assert not self.errors, self.errors
        return self.results


def keep_two_alive(cluster: Cluster) -> None:
    """Start stopped replicas again (without waiting) until two are running: enough for a failover,
    and no more start-ups than needed competing for the cores."""
    for r in cluster.replicas:
        if sum(x.alive() for x in cluster.replicas) >= 2:
            return
        if not r.alive():
            r.launch()


def wait_ready(cluster: Cluster, at_least: int) -> None:
    """Until `at_least` replicas answer ready (restarting ones may still be loading)."""
    deadline = time.monotonic() + 180
    while sum(r.ready() for r in cluster.replicas) < at_least:
        assert time.monotonic() < deadline, "replicas did not come back"
        time.sleep(0.2)


def settle(cluster: Cluster, fail_timeout_s: float) -> None:
    """Every running replica ready and back in nginx's good books: no replica joins or leaves the ring
    during the next case, so a key keeps its replica.

    Waiting out the failure marks is not enough. A replica nginx marked failed (killed in an earlier case,
    then restarted) is, once `fail_timeout` has passed, given one request as a probe, and until that probe
    has answered, nginx sends every other request that hashes to it to the next replica on the ring: two
    generations opening together with one key can land on two replicas. So each running replica answers
    a call through nginx (REST and gRPC, random routing keys) before the case starts."""
    for r in cluster.replicas:
        if r.alive():
            r.wait_ready()
    time.sleep(fail_timeout_s)
    since = cluster.nginx.access_log_size()
    want = {a for r in cluster.replicas if r.alive() for a in r.addresses}
    with grpc.insecure_channel(cluster.nginx.grpc_target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for _ in range(400):
            seen = {last_upstream(e) for e in cluster.nginx.access_log(since) if e["upstream"]}
            if want <= seen:
                return
            key = uuid.uuid4().hex
            httpx.get(cluster.nginx.http_url + "/healthz", headers={"X-Specsplit-Route": key}, timeout=10)
            health.Check(health_pb2.HealthCheckRequest(service=""), metadata=(("x-specsplit-route", key),), timeout=10)
    raise AssertionError(f"replicas {sorted(want - seen)} never answered through nginx")


__all__ = ["PausedRuns", "edge_client", "holder_of", "is_session_call", "keep_two_alive", "last_upstream",
           "opens_logged", "settle", "wait_ready"]
