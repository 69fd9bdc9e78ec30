"""The client's rounds on an in-process cloud: exactness in greedy mode, origins, bookkeeping, modes."""

from __future__ import annotations

import pytest

from edge.client import EdgeClient
from edge.drafters import ModelDrafter
from shared.config import SamplingConfig
from shared.errors import InvalidArgument
from shared.hashing import ctx_hash
from tests.edge.fake_cloud import FakeCloud

PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "The cat sat on the mat. The cat", "import os\nimport"]


def target_greedy(cloud: FakeCloud, client: EdgeClient, prompt: str, n: int) -> list[int]:
    return cloud.generate(client.encode(prompt), client.settings.sampling(), 0, n, 1.0).token_ids


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_greedy_speculative_output_equals_target_greedy(make_client, fake_cloud: FakeCloud, drafter: str) -> None:
    client, _ = make_client(drafter, temperature=0, max_new_tokens=24)
    for prompt in PROMPTS:
        result = client.generate(prompt)
        assert result.token_ids == target_greedy(fake_cloud, client, prompt, 24), prompt
        assert result.metrics.local_commits == 0


def test_tokens_carry_origins_and_metrics_add_up(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(temperature=1.0, top_p=0.9, max_new_tokens=40, seed=5)
    r = client.generate(PROMPTS[1])
    m = r.metrics
    assert len(r.token_ids) == m.emitted == 40
    assert sum(m.by_origin.values()) == 40
    assert m.by_origin["accepted"] == m.accepted
    verified = [x for x in r.rounds if x.decided_by == "cloud"]
    assert m.drafted == sum(x.k for x in verified) and m.accepted == sum(x.accepted_len for x in verified)
    assert m.verify_calls == len(verified) == m.rounds
    assert m.position_drafted[0] == sum(1 for x in verified if x.k > 0)
    assert sum(m.position_accepted) == m.accepted
    # every round contributes its accepted tokens, then exactly one correction / bonus / residual
    for x in r.rounds:
        kinds = [t.origin for t in r.tokens if t.round_index == x.index]
        assert kinds[:x.accepted_len] == ["accepted"] * x.accepted_len
        assert kinds[x.accepted_len:] in ([], [x.next_kind])  # the last round may be cut by the budget
    assert r.rounds[-1].A_cum == pytest.approx(m.acceptance_rate)
    assert r.text == client.decode(r.token_ids)


def test_residual_is_drawn_on_the_edge_and_sent_as_append_ids(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(temperature=1.0, top_p=0.5, max_new_tokens=30, seed=2, k_start=6, k_min=6)
    r = client.generate(PROMPTS[0])
    residual_rounds = [x for x in r.rounds if x.next_kind == "residual"]
    assert residual_rounds, "no rejection in 30 tokens: pick another seed"
    i = residual_rounds[0].index
    token = [t.token_id for t in r.tokens if t.round_index == i][-1]
    nxt = fake_cloud.requests[i + 1]
    assert nxt.append_ids == [token]
    S = r.prompt_ids + r.token_ids
    assert nxt.ctx_hash == ctx_hash(S[:nxt.ctx_len])


def test_q_dists_are_sent_sparse_only_when_asked(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(temperature=1.0, top_k=20, max_new_tokens=20, seed=3, send_q_dists=True)
    r = client.generate(PROMPTS[2])
    sent = [q for req in fake_cloud.requests for q in (req.draft.q_dists or [])]
    assert sent and all(len(q.ids) <= 20 and abs(sum(q.probs) - 1) < 1e-5 for q in sent)
    assert all(x.next_kind != "residual" for x in r.rounds)  # the cloud draws corrections itself
    fake_cloud.requests.clear()
    client2, _ = make_client(temperature=1.0, top_k=20, max_new_tokens=5, seed=3)
    client2.generate(PROMPTS[2])
    assert all(req.draft.q_dists is None for req in fake_cloud.requests)


def test_k_is_dynamic_and_capped_by_the_budget(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client("ngram", temperature=0, max_new_tokens=30, k_start=4, k_min=3, k_max=8)
    r = client.generate("a b c d a b c d a b c d a b c d a b")
    assert r.rounds[0].k <= 4
    emitted = 0
    for x in r.rounds:
        assert x.k <= 30 - emitted - 1
        emitted += x.committed
    assert len(r.token_ids) == 30
    fixed, _ = make_client(temperature=0, max_new_tokens=12, fixed_k=2)
    assert {x.k for x in fixed.generate(PROMPTS[0]).rounds[:-1]} == {2}


def test_the_first_round_obeys_the_open_answers_budget(make_client, fake_cloud: FakeCloud) -> None:
    """The open answer's node budget caps the first round (a chain's k, a tree's nodes) as a verify answer's caps
    the next; without one the first round is the edge's own size."""
    fake_cloud.open_budget = 2
    chain, _ = make_client(temperature=0, max_new_tokens=20, fixed_k=6, tree="off")
    tree, _ = make_client(temperature=0, max_new_tokens=20, tree="auto")
    assert chain.generate(PROMPTS[0]).rounds[0].k == 2
    assert tree.generate(PROMPTS[0]).rounds[0].k == 2
    fake_cloud.open_budget = 0
    assert chain.generate(PROMPTS[0]).rounds[0].k == 6
    assert tree.generate(PROMPTS[0]).rounds[0].k > 2


def test_a_new_tree_controller_values_its_nodes_from_the_open_answers_acceptance(
        model_drafter: ModelDrafter, fake_cloud: FakeCloud) -> None:
    """The open answer's pooled node acceptance seeds a tree controller that has seen nothing of its own: a q-0.55
    node then reads the pool's share (never kept: 2 x 0.55 / 10 with the prior's two nodes), not the calibrated
    0.55; a controller with rounds of its own (carried from the client's last session) keeps its own; an open
    answer without one, or an edge with --no-node-budget, leaves a new controller calibrated."""
    from edge.exchange import RecoveryPolicy, SessionParams
    from edge.metrics import EdgeMetrics
    from edge.policy.k import KController
    from edge.policy.tree import TreeControl
    from edge.speculative import SpeculativeRun
    from shared.config import SamplingConfig
    from shared.protocol import NodeAcceptance

    def opened(tree: TreeControl, budget: bool = True) -> TreeControl:
        run = SpeculativeRun(fake_cloud, model_drafter, SessionParams(SamplingConfig(temperature=0.0), 1),
                             KController(), EdgeMetrics(), RecoveryPolicy(), tree=tree, node_budget=budget)
        run.open([5, 6, 7], 8)
        return tree

    fake_cloud.open_acceptance = NodeAcceptance([0.0] * 10, [10.0] * 10)
    assert opened(TreeControl()).nodes.conditional(0.55) == pytest.approx(2 * 0.55 / 10)
    assert opened(TreeControl(), budget=False).nodes.conditional(0.55) == pytest.approx(0.55)  # --no-node-budget
    own = TreeControl()
    own.nodes.observe([-1, 0], [0.55, 0.55], [True, True])
    assert opened(own).nodes.conditional(0.55) == pytest.approx((2 + 2 * 0.55) / 4)
    fake_cloud.open_acceptance = None
    assert opened(TreeControl()).nodes.conditional(0.55) == pytest.approx(0.55)


def test_a_clients_next_generation_starts_from_the_last_ones_tree_controller(make_client, fake_cloud: FakeCloud,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One client's sessions share a draft, a link and a cloud: each new tree controller is carried from the last
    session's (TreeControl.carry), the first from nothing."""
    from dataclasses import replace

    from edge.policy.tree import TreeControl

    seen: list[TreeControl | None] = []
    carry = TreeControl.carry

    def recording(self: TreeControl, last: TreeControl | None) -> TreeControl:
        seen.append(last)
        return carry(self, last)

    monkeypatch.setattr(TreeControl, "carry", recording)
    client, _ = make_client(temperature=0, max_new_tokens=20, tree="auto")
    info = replace(fake_cloud.get_model(1.0), max_tree_nodes=32)  # a cloud that takes trees
    first = client._tree_control(info)
    second = client._tree_control(info)
    assert first is not None and second is not None and second is not first
    assert seen == [None, first] and client._last_tree is second


def test_generation_stops_after_eos(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=20)
    full = client.generate(PROMPTS[0]).token_ids
    fake_cloud.eos_ids = [full[6]]
    client._model_info = None
    stop = full.index(full[6])
    assert client.generate(PROMPTS[0]).token_ids == full[: stop + 1]


def test_stream_yields_tokens_as_rounds_commit(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=30)
    gen = client.stream(PROMPTS[1])
    first = next(iter(gen))
    assert fake_cloud.calls.count("verify") == 1 and first.round_index == 0
    result = gen.result()
    assert result.tokens[0] == first and len(result.token_ids) == 30
    assert fake_cloud.calls[-1] == "close" and not fake_cloud.sessions


def test_edge_only_uses_the_draft_alone(make_client, fake_cloud: FakeCloud, model_drafter: ModelDrafter) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=15, mode="edge_only", stop_at_eos=False)
    r = client.generate(PROMPTS[0])
    assert fake_cloud.calls == [] and len(r.token_ids) == 15
    assert {t.origin for t in r.tokens} == {"local"} and r.metrics.local_commits == 15
    model_drafter.reset()
    ref = model_drafter.propose(r.prompt_ids, 15, client.settings.sampling(), 0).tokens
    assert r.token_ids == ref


def test_cloud_only_with_and_without_a_generate_call(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=10, mode="cloud_only")
    r = client.generate(PROMPTS[2])
    assert r.token_ids == target_greedy(fake_cloud, client, PROMPTS[2], 10)
    assert {t.origin for t in r.tokens} == {"target"} and "generate" in fake_cloud.calls
    fake_cloud.supports_generate = False  # as over gRPC: k = 0 verify rounds
    r2 = client.generate(PROMPTS[2])
    assert r2.token_ids == r.token_ids and {x.k for x in r2.rounds} == {0}
    assert {t.origin for t in r2.tokens} == {"target"}


def test_vocab_mismatch_is_an_error(make_client, fake_cloud: FakeCloud, model_drafter: ModelDrafter,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A cloud without a tokenizer fingerprint: the logit rows are all there is to compare."""
    monkeypatch.setattr(model_drafter, "logit_rows", fake_cloud.vocab + 1)
    client, _ = make_client(temperature=0, max_new_tokens=3)
    with pytest.raises(InvalidArgument, match="logits"):
        client.generate(PROMPTS[0])
    assert not fake_cloud.sessions


def test_sampling_mismatch_with_the_session_is_an_error(make_client, fake_cloud: FakeCloud,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = make_client(temperature=0.8, max_new_tokens=5)
    real_open = fake_cloud.open_session

    def open_with_other_settings(req, timeout):  # type: ignore[no-untyped-def]
        info = real_open(req, timeout)
        fake_cloud.sessions[info.ctx_id].cfg = SamplingConfig(temperature=0.9)
        return info

    monkeypatch.setattr(fake_cloud, "open_session", open_with_other_settings)
    with pytest.raises(InvalidArgument, match="sampling"):
        client.generate(PROMPTS[0])


def test_cloud_only_resumes_an_interrupted_stream_with_the_same_tokens(make_client, fake_cloud: FakeCloud) -> None:
    from edge.transport.errors import CloudUnavailable

    client, clock = make_client(temperature=0.8, max_new_tokens=12, mode="cloud_only", seed=4)
    ref = client.generate(PROMPTS[1]).token_ids
    real = fake_cloud.generate_stream
    calls = []

    def flaky(prompt_ids, cfg, seed, n, timeout, stop_at_eos=True):  # type: ignore[no-untyped-def]
        calls.append(len(prompt_ids))
        for i, item in enumerate(real(prompt_ids, cfg, seed, n, timeout, stop_at_eos)):
            if len(calls) == 1 and i == 5:
                raise CloudUnavailable("connection reset mid-stream")
            yield item

    fake_cloud.generate_stream = flaky  # type: ignore[method-assign]
    r = client.generate(PROMPTS[1])
    assert r.token_ids == ref and r.metrics.retries == 1 and len(clock.sleeps) == 1
    assert calls[1] == calls[0] + 5  # resumed after the five tokens received


def test_model_info_is_retried(make_client, fake_cloud: FakeCloud) -> None:
    from edge.transport.errors import CloudUnavailable

    fake_cloud.fail("model", CloudUnavailable("starting"), times=2)
    client, clock = make_client(temperature=0, max_new_tokens=3)
    assert len(client.generate(PROMPTS[0]).token_ids) == 3 and len(clock.sleeps) == 2


def test_a_prompt_longer_than_the_draft_model_is_refused(make_client, fake_cloud: FakeCloud,
                                                         model_drafter: ModelDrafter) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=3)
    assert model_drafter.max_context is not None
    with pytest.raises(InvalidArgument, match="positions"):
        client.generate(list(range(model_drafter.max_context)))
    assert "open" not in fake_cloud.calls


def test_cloud_only_goes_past_an_end_of_sequence_token_like_speculation_when_told_not_to_stop(
        make_client, fake_cloud: FakeCloud) -> None:  # type: ignore[no-untyped-def]
    """With stop_at_eos false, cloud_only's /v1/generate goes on past an eos token (the cloud is told so), and its
    greedy text equals the speculative one; with it true, both stop at the eos."""
    client, _ = make_client(temperature=0, max_new_tokens=12, mode="cloud_only", stop_at_eos=False)
    text = client.generate(PROMPTS[2]).token_ids
    fake_cloud.eos_ids = [text[3]]  # the target's 4th token now ends a sequence
    past = client.generate(PROMPTS[2])
    assert past.token_ids == text and len(past.token_ids) == 12 and "generate" in fake_cloud.calls
    spec, _ = make_client(temperature=0, max_new_tokens=12, mode="speculative", stop_at_eos=False)
    assert spec.generate(PROMPTS[2]).token_ids == text
    stopping, _ = make_client(temperature=0, max_new_tokens=12, mode="cloud_only")
    assert stopping.generate(PROMPTS[2]).token_ids == text[: text.index(text[3]) + 1]
