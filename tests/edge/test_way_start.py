"""The session's first speculate-or-stream decision (edge/policy/stream.py `start`): made before the first round from
the cloud's fitted forward cost and the draft's acceptance (the key's pooled one, else the draft's prior), named in
the metrics, and today's rounds-first start where the cloud does not say its cost."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from edge.drafters import ModelDrafter
from edge.policy.stream import ForwardFit, WayControl, chain_tokens, pooled_accept
from shared.protocol import NodeAcceptance
from tests.edge.fake_cloud import FakeCloud

PROMPT = [5, 6, 7, 8, 9, 10]
N = 40
# a verify of k costs about k + 1 steps (one CPU core running the target in llama.cpp): 4 drafts, 4.9 steps
ROW_BOUND = {"base_ms": 1.0, "row_ms": 50.0, "forwards": 200}
# a verify of k costs about one step (a GPU): 4 drafts, 1.04 steps
FLAT = {"base_ms": 50.0, "row_ms": 0.5, "forwards": 200}
# between the two: a verify of 4 costs 2.3 steps, so only well accepted drafts pay
BETWEEN = {"base_ms": 20.0, "row_ms": 10.0, "forwards": 200}
# the key's pooled acceptance by tenth of q: 5 % and 95 % of the tried nodes kept
LOW = NodeAcceptance(kept=[0.5] * 10, tried=[10.0] * 10)
HIGH = NodeAcceptance(kept=[9.5] * 10, tried=[10.0] * 10)


def greedy_text(fake_cloud: FakeCloud, client: Any) -> list[int]:
    return fake_cloud.generate(PROMPT, client.settings.sampling(), 0, N, 1.0).token_ids


def after_open(fake_cloud: FakeCloud) -> list[str]:
    return fake_cloud.calls[fake_cloud.calls.index("open") + 1:]


# -- the rule -----------------------------------------------------------------------------------------------------

def test_the_fit_is_read_from_a_mapping_or_an_object_once_it_has_seen_enough_forwards() -> None:
    assert ForwardFit.of(ROW_BOUND) == ForwardFit(1.0, 50.0)
    assert ForwardFit.of(SimpleNamespace(base_ms=1.0, row_ms=50.0, forwards=200)) == ForwardFit(1.0, 50.0)
    assert ForwardFit.of({**ROW_BOUND, "forwards": 3}) is None  # not fitted yet: no reading
    assert ForwardFit.of(None) is None and ForwardFit.of({"forwards": 50}) is None
    assert round(ForwardFit(1.0, 50.0).steps(4), 2) == 4.92
    assert chain_tokens(0.5, 2) == 1.75 and chain_tokens(1.0, 4) == 5.0
    assert pooled_accept([0.0] * 10, [0.0] * 10, 0.6) is None  # an empty pool: the draft's prior stands
    assert pooled_accept(HIGH.kept, HIGH.tried, 0.6) == (95 + 3 * 0.6) / 103


def test_a_cloud_where_a_verify_costs_its_rows_streams_from_the_first_decision_without_probes() -> None:
    """A verify of k costing ~k + 1 steps: not even a round whose every draft is accepted beats streaming by the
    margin, so the session streams whatever the acceptance, no probe round is due, and chunks grow by themselves."""
    for accept in (0.05, 0.95):
        w = WayControl().know_costs(ROW_BOUND)
        assert w.start(accept, "pooled", range(1, 13)) == "stream" and w.streaming and not w.probes
        assert w.start_reason == "cloud_costs" and "no probe rounds" in w.start_note and w.switches == 0
        assert w.next() == 16
        w.observe_stream(16, 16 * 53.0, 16 * 51.0)
        assert w.next() == 32  # no probe round between chunks


def test_a_cloud_where_a_verify_costs_one_step_speculates_first() -> None:
    w = WayControl().know_costs(FLAT)
    assert w.start(0.9, "pooled", range(1, 13)) == "speculate" and not w.streaming and w.next() == 0
    assert w.start_reason == "cloud_costs" and "speculating" in w.start_note


def test_a_tie_without_the_drafts_cost_streams_first_with_probes() -> None:
    """The reading leaves the drafting out (speculation's best case), so speculation must win by the margin to go
    first: at the acceptance where the BETWEEN cloud prices speculating within 1 % of streaming (found by
    bisection) the session streams from the first token, probes kept; at one where speculating is cheaper by more
    than the margin it speculates."""
    def ratio(accept: float) -> float:
        w = WayControl().know_costs(BETWEEN)
        spec, stream, _ = w.priced(accept, range(1, 13))
        return spec / stream

    lo, hi = 0.0, 1.0  # ratio falls as acceptance rises
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) > 1.0 else (lo, mid)
    assert abs(ratio(hi) - 1.0) < 0.01
    tie = WayControl().know_costs(BETWEEN)
    assert tie.start(hi, "pooled", range(1, 13)) == "stream" and tie.probes
    better = next(a for a in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95) if ratio(a) * 1.1 < 1.0)
    assert WayControl().know_costs(BETWEEN).start(better, "pooled", range(1, 13)) == "speculate"


def test_low_acceptance_streams_where_good_drafts_would_pay_and_probes_stay() -> None:
    """Between the two clouds the acceptance decides: 5 % streams (with probe rounds after its chunks, since
    better drafts could pay), 95 % speculates."""
    low = WayControl().know_costs(BETWEEN)
    assert low.start(0.05, "pooled", range(1, 13)) == "stream" and low.probes
    low.observe_stream(16, 16 * 33.0, 16 * 30.0)
    assert low.next() == 0  # the probe round
    assert WayControl().know_costs(BETWEEN).start(0.95, "pooled", range(1, 13)) == "speculate"


def test_a_measured_slow_link_tips_the_latency_objective_only() -> None:
    """A one-step cloud over a link of 500 ms beyond it, drafts accepted at 30 %: a round commits 1.4 tokens for
    the link's 500 ms, streaming pays it once. The cloud objective counts the cloud's forwards alone."""
    assert WayControl().know_costs(FLAT).start(0.3, "pooled", range(1, 13)) == "speculate"
    assert WayControl().know_costs(FLAT).start(0.3, "pooled", range(1, 13), link_ms=500.0) == "stream"
    cloud = WayControl(objective="cloud").know_costs(FLAT)
    assert cloud.start(0.3, "pooled", range(1, 13), link_ms=500.0) == "speculate"


def test_without_the_figures_the_session_speculates_first_and_measured_costs_come_before_them() -> None:
    w = WayControl()
    assert w.start(0.05, "prior", range(1, 13)) == "speculate" and w.start_reason == "no_cost_figures"
    assert w.next() == 0 and w.probes
    carried = WayControl(min_rounds=0).know_costs(FLAT)  # the last session measured streaming far cheaper
    carried.one_step_ms, carried._spec = 1.0, [500.0, 1.0]
    assert carried.start(0.95, "pooled", range(1, 13)) == "stream" and carried.start_reason == "carried_costs"
    assert carried.switches == 0 and carried.next() == 16
    close = WayControl(min_rounds=0).know_costs(FLAT)  # speculation measured dearer, though within the margin
    close.one_step_ms, close._spec = 172.3, [186.0, 1.0]
    assert close.start(0.95, "pooled", range(1, 13)) == "stream" and close.start_reason == "carried_costs"
    cheap = WayControl(min_rounds=0).know_costs(FLAT)  # cheaper, though not by the margin: a tie streams
    cheap.one_step_ms, cheap._spec = 172.3, [165.0, 1.0]
    assert cheap.start(0.95, "pooled", range(1, 13)) == "stream"
    cheaper = WayControl(min_rounds=0).know_costs(FLAT)  # cheaper by more than the margin
    cheaper.one_step_ms, cheaper._spec = 172.3, [120.0, 1.0]
    assert cheaper.start(0.95, "pooled", range(1, 13)) == "speculate"


# -- sessions on the fake cloud ----------------------------------------------------------------------------------

def test_a_row_bound_cloud_with_low_pooled_acceptance_streams_from_the_first_token(
        make_client: Any, fake_cloud: FakeCloud, model_drafter: ModelDrafter) -> None:
    """The open answer says a verify of k costs ~k + 1 steps and the key's drafts are rarely kept: no verify round
    and no switch, every token streamed, the cloud's own greedy text; the draft reads none of the streamed tokens
    (no probe round will need them; the prompt it read while the cloud opened, before the open answer said the
    cost); the metrics name the reason. --no-stream-switch still speculates."""
    fake_cloud.open_forward_cost, fake_cloud.open_acceptance = ROW_BOUND, LOW
    client, _ = make_client(temperature=0, max_new_tokens=N, stop_at_eos=False)
    got = client.generate(PROMPT)
    m = got.metrics
    assert got.token_ids == greedy_text(fake_cloud, client)
    assert m.verify_calls == 0 and m.rounds == 0 and m.switches == 0 and m.streamed == N
    assert after_open(fake_cloud)[0] == "stream" and "verify" not in fake_cloud.calls
    assert (m.start_way, m.start_reason) == ("stream", "cloud_costs") and "pooled" in m.start_note
    assert model_drafter.kv_len <= len(PROMPT) + 1  # the prompt, and the one step timed after it
    assert got.to_json()["metrics"]["start_reason"] == "cloud_costs"

    fake_cloud.calls.clear()
    off, _ = make_client(temperature=0, max_new_tokens=N, stop_at_eos=False, stream_switch=False)
    forced = off.generate(PROMPT)
    assert forced.token_ids == got.token_ids and forced.metrics.verify_calls > 0 and forced.metrics.streamed == 0
    assert forced.metrics.start_way == ""


def test_a_one_step_cloud_with_high_pooled_acceptance_speculates_from_the_first_round(
        make_client: Any, fake_cloud: FakeCloud) -> None:
    fake_cloud.open_forward_cost, fake_cloud.open_acceptance = FLAT, HIGH
    client, _ = make_client(temperature=0, max_new_tokens=N, stop_at_eos=False)
    got = client.generate(PROMPT)
    assert got.token_ids == greedy_text(fake_cloud, client)
    assert after_open(fake_cloud)[0] == "verify" and got.rounds[0].decided_by == "cloud"
    assert (got.metrics.start_way, got.metrics.start_reason) == ("speculate", "cloud_costs")


def test_a_draft_step_dearer_than_what_speculation_saves_streams_from_the_first_token(
        make_client: Any, fake_cloud: FakeCloud, model_drafter: ModelDrafter, monkeypatch: Any) -> None:
    """The one-step cloud and well accepted drafts of the test above, but a draft whose step (timed once after it
    read the prompt, edge/prefetch.py; tests/edge/test_prefetch.py checks the timing, here it reads 200 ms, four of
    the cloud's 50 ms steps) costs more than any round saves: the session streams from the first token, the cloud's
    own greedy text. (The catch-up is joined before the decision here, as a cloud's prefill longer than the draft's
    prompt read leaves it done.)"""
    from edge.prefetch import DraftAhead

    fake_cloud.open_forward_cost, fake_cloud.open_acceptance = FLAT, HIGH
    catch_up = DraftAhead.catch_up

    def joined(self: DraftAhead, context: Any) -> bool:
        started = catch_up(self, context)
        if self._thread is not None:
            self._thread.join()
        assert self.step_ms is not None
        self.step_ms = 200.0
        return started

    monkeypatch.setattr(DraftAhead, "catch_up", joined)
    client, _ = make_client(temperature=0, max_new_tokens=N, stop_at_eos=False)
    got = client.generate(PROMPT)
    assert got.token_ids == greedy_text(fake_cloud, client)
    assert (got.metrics.start_way, got.metrics.start_reason) == ("stream", "cloud_costs")
    assert got.metrics.verify_calls == 0 and "verify" not in fake_cloud.calls


def test_a_cloud_without_the_figures_keeps_the_rounds_first_start(make_client: Any, fake_cloud: FakeCloud,
                                                                 model_drafter: ModelDrafter) -> None:
    """An older cloud (no forward cost), or one whose fit has seen too few forwards: rounds first, as before, with
    the draft reading the prompt while the cloud opens."""
    for cost in (None, {**ROW_BOUND, "forwards": 3}):
        fake_cloud.calls.clear()
        fake_cloud.open_forward_cost, fake_cloud.open_acceptance = cost, LOW
        client, _ = make_client(temperature=0, max_new_tokens=N, stop_at_eos=False)
        got = client.generate(PROMPT)
        assert got.token_ids == greedy_text(fake_cloud, client)
        assert after_open(fake_cloud)[0] == "verify" and got.metrics.verify_calls >= 2
        assert (got.metrics.start_way, got.metrics.start_reason) == ("speculate", "no_cost_figures")


def test_streaming_first_with_probes_keeps_the_targets_text(make_client: Any, fake_cloud: FakeCloud) -> None:
    """A cloud where good drafts could pay, drafts rarely kept: the first token is streamed, probe rounds follow
    the chunks (the draft reads the prompt after the first token), and the text is the target's."""
    fake_cloud.open_forward_cost, fake_cloud.open_acceptance = BETWEEN, LOW
    client, _ = make_client(temperature=0, max_new_tokens=N, stop_at_eos=False)
    got = client.generate(PROMPT)
    assert got.token_ids == greedy_text(fake_cloud, client)
    assert after_open(fake_cloud)[:2] == ["stream", "verify"] and got.metrics.streamed >= 16
    assert got.metrics.start_way == "stream" and "no probe rounds" not in got.metrics.start_note


def test_the_model_infos_figures_decide_before_the_open(make_client: Any, fake_cloud: FakeCloud,
                                                        model_drafter: ModelDrafter) -> None:
    """A cloud that says its cost in its model info only (the open answer says none) and no pooled acceptance (the
    draft's prior): the session streams from the first token, and the draft never reads the prompt."""
    fake_cloud.model_forward_cost = ROW_BOUND
    client, _ = make_client(temperature=0, max_new_tokens=N, stop_at_eos=False)
    got = client.generate(PROMPT)
    assert got.token_ids == greedy_text(fake_cloud, client) and got.metrics.verify_calls == 0
    assert got.metrics.start_reason == "cloud_costs" and "prior" in got.metrics.start_note
    assert model_drafter.kv_len == 0
