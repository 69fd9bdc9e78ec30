"""The adaptive verify deadline: exact by default over slow links, a dead cloud still detected.

A wrapper around the in-process fake cloud plays a link with a fixed round trip on the injected
clock: a request whose deadline is shorter than the round trip is applied by the cloud but its
answer arrives too late (CloudTimeout), as over a real slow link.
"""

from __future__ import annotations

from typing import Any

import pytest

from edge.policy.deadline import DeadlineConfig, VerifyDeadline, percentile
from edge.transport.errors import CloudTimeout
from shared.config import SamplingConfig
from shared.protocol import VerifyRequest, VerifyResponse
from tests.edge.conftest import FakeClock
from tests.edge.fake_cloud import FakeCloud

PROMPT = "for i in range(10):\n    print(i)\nfor i in range("
N = 16


class SlowLink:
    """The fake cloud behind a link of `rtt_s` (None: the cloud never answers)."""

    def __init__(self, cloud: FakeCloud, clock: FakeClock, rtt_s: float | None, cloud_ms: float = 0.0) -> None:
        self.cloud, self.clock, self.rtt_s, self.cloud_ms = cloud, clock, rtt_s, cloud_ms
        self.deadlines: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cloud, name)

    def routed(self, route_key: str) -> SlowLink:
        return self

    def verify(self, req: VerifyRequest, timeout: float, sampling: SamplingConfig | None = None) -> VerifyResponse:
        self.deadlines.append(timeout)
        if self.rtt_s is None or timeout < self.rtt_s:
            self.clock.now += timeout
            if self.rtt_s is not None:
                self.cloud.verify(req, timeout, sampling)  # applied; the answer is lost to the deadline
            raise CloudTimeout("late")
        self.clock.now += self.rtt_s
        resp = self.cloud.verify(req, timeout, sampling)
        resp.metrics.queue_ms = self.cloud_ms
        return resp


def slow_client(make_client, fake_cloud: FakeCloud, rtt_s: float | None, **kw: Any):  # type: ignore[no-untyped-def]
    client, clock = make_client(temperature=0, max_new_tokens=N, **kw)
    link = SlowLink(fake_cloud, clock, rtt_s)
    client._transport = link
    return client, link


def test_a_slow_healthy_link_completes_with_every_token_verified(make_client, fake_cloud: FakeCloud) -> None:
    ref, _ = make_client(temperature=0, max_new_tokens=N)
    expected = ref.generate(PROMPT).token_ids
    client, link = slow_client(make_client, fake_cloud, rtt_s=0.6)
    r = client.generate(PROMPT)
    assert r.token_ids == expected
    assert r.metrics.local_commits == 0 and r.metrics.timeouts == 0
    assert all(d >= 0.6 for d in link.deadlines)


def test_the_default_never_commits_unverified_tokens_even_when_late(make_client, fake_cloud: FakeCloud) -> None:
    """The old default (a fixed 400 ms, fallback on) committed draft tokens unverified on this link."""
    ref, _ = make_client(temperature=0, max_new_tokens=N)
    expected = ref.generate(PROMPT).token_ids
    client, link = slow_client(make_client, fake_cloud, rtt_s=0.6, timeout_ms=400)
    r = client.generate(PROMPT)
    assert r.token_ids == expected and r.metrics.local_commits == 0 and r.metrics.timeout_fallbacks == 0
    # every late round was resent with a longer deadline (400 ms, then 800 ms), never the same one again
    assert r.metrics.timeouts > 0 and 0.8 in link.deadlines


def test_the_opt_in_fallback_is_counted(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = slow_client(make_client, fake_cloud, rtt_s=0.6, timeout_ms=400, timeout_fallback=True)
    r = client.generate(PROMPT)
    assert r.metrics.timeout_fallbacks > 0 and r.metrics.timeout_fallbacks == r.metrics.by_origin["local"]


def test_a_dead_cloud_fails_the_round_with_growing_deadlines(make_client, fake_cloud: FakeCloud) -> None:
    client, link = slow_client(make_client, fake_cloud, rtt_s=None, max_retries=3)
    with pytest.raises(CloudTimeout):
        client.generate(PROMPT)
    assert link.deadlines == [10.0, 20.0, 30.0, 30.0]  # first deadline, doubled per resend, capped


def test_k_zero_rounds_resend_with_backoff_instead_of_falling_back(make_client, fake_cloud: FakeCloud) -> None:
    client, link = slow_client(make_client, fake_cloud, rtt_s=None, max_retries=2, fixed_k=0, timeout_ms=400,
                               timeout_fallback=True)
    with pytest.raises(CloudTimeout):
        client.generate(PROMPT)
    assert link.deadlines == [0.4, 0.8, 1.6]


def test_deadline_follows_the_link_and_the_cloud_within_bounds() -> None:
    d = VerifyDeadline(DeadlineConfig(first_s=10, floor_s=0.5, ceiling_s=30, multiplier=4))
    assert d.base_s() == 10
    for _ in range(20):
        d.observe(0.6, 0.0)  # a slow link, an idle cloud
    assert d.base_s() == pytest.approx(2.4)
    for _ in range(64):
        d.observe(0.05, 0.01)  # fast again: the window forgets, the floor holds
    assert d.base_s() == 0.5
    for _ in range(64):
        d.observe(5.0, 4.9)  # a busy cloud: its reported queue time raises the deadline up to the ceiling
    assert d.base_s() == 20.0 and d.for_attempt(1) == 30.0
    assert percentile([1, 2, 3, 4], 0.5) == 2 and percentile([], 0.9) == 0
