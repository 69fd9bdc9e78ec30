"""Speculate or stream (edge/policy/stream.py): the controller's choices from injected costs, and switches at
random rounds on the fake cloud giving the target's own text, counted."""

from __future__ import annotations

import random
from typing import Any

import pytest

from edge.policy.stream import WayControl
from shared.errors import NotFound, Unavailable
from tests.edge.fake_cloud import FakeCloud

PROMPT = [5, 6, 7, 8, 9, 10]


def run_rounds(w: WayControl, n: int, tokens: int, wall_ms: float, cloud_ms: float, one_step_ms: float) -> list[int]:
    """n decisions, each followed by what it chose costing as given; returns the decisions."""
    seen = []
    for _ in range(n):
        chunk = w.next()
        seen.append(chunk)
        if chunk:
            w.observe_stream(chunk, chunk * one_step_ms * 1.05, chunk * one_step_ms)
        else:
            w.observe_round(tokens, wall_ms, cloud_ms, one_step_ms)
    return seen


def test_it_streams_when_streaming_is_cheaper_and_probes_with_growing_chunks() -> None:
    """A 50 ms link, 2 tokens a round of 180 ms (90 ms a token) against 66 ms a streamed token."""
    w = WayControl()
    seen = run_rounds(w, 8, tokens=2, wall_ms=180.0, cloud_ms=110.0, one_step_ms=66.0)
    assert seen[:2] == [0, 0]  # min_rounds measured first
    assert seen[2:] == [16, 0, 32, 0, 64, 0] and w.switches == 1 and w.streaming


def test_it_speculates_again_when_a_probe_shows_acceptance_rose() -> None:
    w = WayControl(weight=0.5)
    run_rounds(w, 4, tokens=2, wall_ms=180.0, cloud_ms=110.0, one_step_ms=66.0)
    assert w.streaming
    for _ in range(6):  # every probe now commits 6 tokens in 180 ms (30 ms a token)
        chunk = w.next()
        if chunk:
            w.observe_stream(chunk, chunk * 70.0, chunk * 66.0)
        else:
            w.observe_round(6, 180.0, 110.0, 66.0)
        if not w.streaming:
            break
    assert not w.streaming and w.switches == 2 and w.next() == 0


def test_a_near_tie_keeps_speculating() -> None:
    """At 0 ms the rounds cost about what streaming does: within the margin nothing switches."""
    w = WayControl()
    assert run_rounds(w, 10, tokens=2, wall_ms=140.0, cloud_ms=130.0, one_step_ms=66.0) == [0] * 10
    assert w.switches == 0


def test_the_cloud_objective_weighs_the_clouds_forward_time_not_the_link() -> None:
    """Slow link (wall 400 ms a round) but 2 tokens for 110 ms of forward: the cloud saves by speculating;
    the latency objective streams."""
    cloud, latency = WayControl(objective="cloud"), WayControl(objective="latency")
    assert set(run_rounds(cloud, 8, 2, 400.0, 110.0, 66.0)) == {0}
    assert 16 in run_rounds(latency, 8, 2, 400.0, 110.0, 66.0)
    with pytest.raises(ValueError, match="objective"):
        WayControl(objective="speed")


class RandomWays(WayControl):
    """Streams or speculates at random (fixed seed), whatever the costs."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.rng = random.Random(seed)
        self.chosen: list[int] = []

    def next(self) -> int:
        chunk = self.rng.choice([0, 0, 1, 2, 5])
        self.chosen.append(chunk)
        if chunk and not self.streaming:
            self.switches += 1
        self.streaming = bool(chunk)
        return chunk


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_switches_at_random_rounds_give_the_targets_greedy_text(make_client: Any, fake_cloud: FakeCloud,
                                                                 seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy: every committed token is the target's argmax whichever way decided it. 40 tokens, switches at
    random rounds (seeded), the same text as the cloud's own generation, tokens by way counted."""
    client, _ = make_client(temperature=0, max_new_tokens=40, tree="off", stop_at_eos=False)
    ways = RandomWays(seed)
    monkeypatch.setattr(client, "_way_control", lambda info, transport: ways)
    got = client.generate(PROMPT)
    want = fake_cloud.generate(PROMPT, client.settings.sampling(), 0, 40, 1.0).token_ids
    assert got.token_ids == want
    m = got.metrics
    assert 0 < m.streamed < 40 and m.stream_calls == sum(1 for c in ways.chosen if c) and m.switches == ways.switches
    assert m.by_origin["target"] >= m.streamed and "stream" in fake_cloud.calls


def test_a_stream_that_fails_midway_keeps_what_it_streamed_and_the_rounds_go_on(
        make_client: Any, fake_cloud: FakeCloud, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream fails after 3 tokens (503), then the session is evicted before the next stream: the edge
    keeps the 3 tokens, reopens, and the text is still the target's."""
    client, _ = make_client(temperature=0, max_new_tokens=30, tree="off", stop_at_eos=False)

    class Ways(WayControl):
        def next(self) -> int:
            return 8

    monkeypatch.setattr(client, "_way_control", lambda info, transport: Ways())
    fake_cloud.stream_fail_after = 3
    fake_cloud.fail("stream", Unavailable("going away"))
    got = client.generate(PROMPT)
    want = fake_cloud.generate(PROMPT, client.settings.sampling(), 0, 30, 1.0).token_ids
    assert got.token_ids == want and got.metrics.streamed > 3

    client2, _ = make_client(temperature=0, max_new_tokens=30, tree="off", stop_at_eos=False)
    monkeypatch.setattr(client2, "_way_control", lambda info, transport: Ways())
    fake_cloud.stream_fail_after = None
    fake_cloud.fail("stream", NotFound("evicted"))
    got2 = client2.generate(PROMPT)
    assert got2.token_ids == want and got2.metrics.reopens == 1


def test_no_switch_where_the_text_would_depend_on_it(make_client: Any, fake_cloud: FakeCloud,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampled chain session (its rounds use min(1, p/q), not the target's own draw) never streams, nor
    does a cloud without session streams, nor --no-stream-switch."""
    client, _ = make_client(temperature=1.0, max_new_tokens=12, tree="off")
    monkeypatch.setattr(client, "_way_control", lambda info, transport: RandomWays(0))
    assert client.generate(PROMPT).metrics.streamed == 0
    off, _ = make_client(temperature=0, max_new_tokens=12, stream_switch=False)
    assert off._way_control(off.model_info(), fake_cloud) is None
    fake_cloud.supports_session_stream = False
    on, _ = make_client(temperature=0, max_new_tokens=12)
    assert on._way_control(on.model_info(), fake_cloud) is None


def test_a_new_session_starts_from_the_last_ones_costs() -> None:
    """Over a slow link the second session streams from its first decision; a session that measured too
    little passes nothing on, nor does one of another objective."""
    first = WayControl()
    run_rounds(first, 6, tokens=2, wall_ms=250.0, cloud_ms=110.0, one_step_ms=66.0)
    assert first.streaming
    second = WayControl().carry(first)
    assert second.next() == first.chunk > second.chunk_min and second.streaming
    assert WayControl().carry(WayControl()).next() == 0
    assert WayControl(objective="cloud").carry(first).spec_cost() is None


def test_the_client_carries_the_costs_from_one_generation_to_the_next(make_client: Any, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=8, tree="off")
    a = client._way_control(client.model_info(), fake_cloud)
    assert a is not None
    a.rounds, a._spec = 5, [300.0, 2.0]
    b = client._way_control(client.model_info(), fake_cloud)
    assert b is not None and b is not a and b.rounds == 5 and b.spec_cost() == 150.0


def test_a_failed_stream_ends_streaming_for_the_session_only() -> None:
    w = WayControl()
    run_rounds(w, 3, tokens=2, wall_ms=250.0, cloud_ms=110.0, one_step_ms=66.0)
    assert w.streaming
    w.stream_failed()
    assert not w.streaming and w.stream_broken and w.next() == 0
    run_rounds(w, 4, tokens=2, wall_ms=250.0, cloud_ms=110.0, one_step_ms=66.0)
    assert not w.streaming
    assert WayControl().carry(w).next() > 0  # the next session tries again


def test_a_stream_that_never_answers_falls_back_to_rounds(make_client: Any, fake_cloud: FakeCloud,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stream fails (as through a proxy that cannot stream): one attempt, then rounds to the end, the
    target's text."""
    client, _ = make_client(temperature=0, max_new_tokens=20, tree="off", stop_at_eos=False)
    ways = WayControl(min_rounds=0)
    ways.one_step_ms, ways._spec = 1.0, [500.0, 1.0]  # streaming looks far cheaper
    monkeypatch.setattr(client, "_way_control", lambda info, transport: ways)
    fake_cloud.fail("stream", Unavailable("no event stream through here"), times=100)
    got = client.generate(PROMPT)
    want = fake_cloud.generate(PROMPT, client.settings.sampling(), 0, 20, 1.0).token_ids
    assert got.token_ids == want and got.metrics.stream_calls == 1 and got.metrics.streamed == 0


def test_stream_chunks_stay_within_the_clouds_max_generate_tokens(make_client: Any, fake_cloud: FakeCloud,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A cloud announcing max_generate_tokens 5: chunks start at 5 (not 16) and never double past it, so no
    stream is refused and the text is the target's."""
    fake_cloud.max_generate_tokens = 5
    client, _ = make_client(temperature=0, max_new_tokens=40, tree="off", stop_at_eos=False)
    real = client._way_control

    def cheap_streams(info: Any, transport: Any) -> WayControl | None:
        ways = real(info, transport)
        assert ways is not None
        ways.min_rounds, ways.one_step_ms, ways._spec = 0, 1.0, [500.0, 1.0]  # streaming looks far cheaper
        return ways

    monkeypatch.setattr(client, "_way_control", cheap_streams)
    got = client.generate(PROMPT)
    want = fake_cloud.generate(PROMPT, client.settings.sampling(), 0, 40, 1.0).token_ids
    assert got.token_ids == want and got.metrics.streamed > 5
    assert fake_cloud.stream_sizes and max(fake_cloud.stream_sizes) <= 5
    assert WayControl().limit(0).chunk_max == 256 and WayControl().limit(300).chunk_max == 256


def test_a_refused_stream_ends_streaming_and_the_generation_goes_on(make_client: Any, fake_cloud: FakeCloud,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk the cloud refuses (422: over a --max-generate-tokens it did not announce) is not the user's
    error: the session speculates from then on and the text is the target's."""
    fake_cloud.max_generate_tokens = 8
    client, _ = make_client(temperature=0, max_new_tokens=30, tree="off", stop_at_eos=False)
    ways = WayControl(min_rounds=0)  # not limited: as with an older cloud that does not announce its limit
    ways.one_step_ms, ways._spec = 1.0, [500.0, 1.0]
    monkeypatch.setattr(client, "_way_control", lambda info, transport: ways)
    got = client.generate(PROMPT)
    want = fake_cloud.generate(PROMPT, client.settings.sampling(), 0, 30, 1.0).token_ids
    assert got.token_ids == want and got.metrics.stream_calls == 1 and got.metrics.streamed == 0
    assert ways.stream_broken and fake_cloud.stream_sizes == [16]



def test_a_stream_the_cloud_ended_for_rounds_speculates_for_a_while_then_weighs_again() -> None:
    """The cloud under load ended a stream with stop_reason "speculate": the session speculates for
    declined_rounds rounds even though streaming still looks cheaper, then streams again if it still is."""
    w = WayControl(declined_rounds=5)
    assert run_rounds(w, 3, tokens=2, wall_ms=180.0, cloud_ms=110.0, one_step_ms=66.0)[2] == 16
    w.declined()
    assert not w.streaming and w.switches == 2
    seen = run_rounds(w, 6, tokens=2, wall_ms=180.0, cloud_ms=110.0, one_step_ms=66.0)
    assert seen[:5] == [0] * 5 and seen[5] > 0
