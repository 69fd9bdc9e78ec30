"""Recovery on an in-process cloud: timeouts, retries with backoff, reopen on 404, resync on 409, gating.

Greedy runs with a fault must give exactly the no-fault text: nothing lost, nothing duplicated.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from edge.drafters.base import DraftBlock
from edge.transport.errors import CloudTimeout, CloudUnavailable
from shared.config import SamplingConfig
from shared.errors import ContextMismatch, InvalidArgument, NotFound, ResourceExhausted, Unauthenticated
from shared.hashing import ctx_hash
from tests.edge.fake_cloud import FakeCloud

PROMPT = "for i in range(10):\n    print(i)\nfor i in range("
N = 24


def reference(make_client, **kw) -> list[int]:  # type: ignore[no-untyped-def]
    client, _ = make_client(temperature=0, max_new_tokens=N, **kw)
    return client.generate(PROMPT).token_ids


def requests_are_consistent(cloud: FakeCloud, prompt_ids: list[int], out: list[int]) -> None:
    S = prompt_ids + out
    for req in cloud.requests:
        assert req.ctx_len <= len(S) and req.ctx_hash == ctx_hash(S[:req.ctx_len])
        assert req.append_ids == S[req.ctx_len - len(req.append_ids):req.ctx_len]


def test_late_answer_commits_the_first_draft_token_locally_and_realigns(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=N, timeout_fallback=True)
    fake_cloud.fail("verify", CloudTimeout("late"), times=1, apply_first=True)  # applied, answer dropped
    r = client.generate(PROMPT)
    m = r.metrics
    assert m.timeouts == 1 and m.local_commits == 1 and m.timeout_fallbacks == 1
    assert m.reopens == 0 and m.resyncs == 0
    assert r.tokens[0].origin == "local" and r.rounds[0].decided_by == "timeout"
    assert r.tokens[0].token_id == fake_cloud.requests[0].draft.draft_tokens[0]
    second = fake_cloud.requests[1]  # realigns: crops back to the prompt and appends the local token
    assert second.ctx_len - len(second.append_ids) == len(r.prompt_ids)
    assert second.append_ids == [r.tokens[0].token_id]
    assert len(r.token_ids) == N
    requests_are_consistent(fake_cloud, r.prompt_ids, r.token_ids)


def test_timeout_without_fallback_resends_and_loses_nothing(make_client, fake_cloud: FakeCloud) -> None:
    ref = reference(make_client)
    client, clock = make_client(temperature=0, max_new_tokens=N, timeout_fallback=False)
    fake_cloud.fail("verify", CloudTimeout("late"), times=2, apply_first=True)
    r = client.generate(PROMPT)
    assert r.token_ids == ref
    assert r.metrics.timeouts == 2 and r.metrics.retries == 2 and r.metrics.local_commits == 0
    assert clock.sleeps == [0.05, 0.1]


@pytest.mark.parametrize("error", [ResourceExhausted("busy"), CloudUnavailable("reset"), CloudUnavailable("500")])
def test_retryable_errors_back_off_exponentially(make_client, fake_cloud: FakeCloud, error) -> None:  # type: ignore[no-untyped-def]
    ref = reference(make_client)
    client, clock = make_client(temperature=0, max_new_tokens=N, backoff_ms=10, backoff_max_ms=30)
    fake_cloud.fail("verify", error, times=4)
    r = client.generate(PROMPT)
    assert r.token_ids == ref and r.metrics.retries == 4
    assert clock.sleeps == pytest.approx([0.01, 0.02, 0.03, 0.03])


def test_answer_lost_after_the_cloud_applied_it_is_resent_idempotently(make_client, fake_cloud: FakeCloud) -> None:
    ref = reference(make_client)
    client, _ = make_client(temperature=0, max_new_tokens=N)
    fake_cloud.fail("verify", CloudUnavailable("connection reset"), times=1, apply_first=True)
    assert client.generate(PROMPT).token_ids == ref


def test_retries_are_bounded(make_client, fake_cloud: FakeCloud) -> None:
    client, clock = make_client(temperature=0, max_new_tokens=N, max_retries=2, capacity_wait_s=0)
    fake_cloud.fail("verify", ResourceExhausted("busy"), times=3)
    with pytest.raises(ResourceExhausted):
        client.generate(PROMPT)
    assert len(clock.sleeps) == 2


def test_a_generation_waits_out_capacity_answers_past_its_retries(make_client, fake_cloud: FakeCloud) -> None:
    """A tight KV budget answers 429 for as long as another session holds the blocks: the generation waits
    its turn (Retry-After honoured) within capacity_wait_s and ends with the text it would have had."""
    ref = reference(make_client)
    client, clock = make_client(temperature=0, max_new_tokens=N, max_retries=2, capacity_wait_s=60)
    fake_cloud.fail("verify", ResourceExhausted("the KV cache is full", retry_after_s=1.0), times=20)
    r = client.generate(PROMPT)
    assert r.token_ids == ref and r.metrics.retries == 20
    assert sum(clock.sleeps) <= 60 + 2


def test_capacity_waits_are_bounded_by_capacity_wait_s(make_client, fake_cloud: FakeCloud) -> None:
    client, clock = make_client(temperature=0, max_new_tokens=N, max_retries=2, capacity_wait_s=5)
    fake_cloud.fail("verify", ResourceExhausted("the KV cache is full", retry_after_s=1.0), times=50)
    with pytest.raises(ResourceExhausted):
        client.generate(PROMPT)
    assert 5 <= sum(clock.sleeps) <= 7


@pytest.mark.parametrize("error", [Unauthenticated("no key"), InvalidArgument("bad")])
def test_auth_and_invalid_argument_errors_stop_at_once(make_client, fake_cloud: FakeCloud, error) -> None:  # type: ignore[no-untyped-def]
    client, clock = make_client(temperature=0, max_new_tokens=N)
    fake_cloud.fail("verify", error)
    with pytest.raises(type(error)):
        client.generate(PROMPT)
    assert clock.sleeps == [] and fake_cloud.calls.count("verify") == 1


def test_evicted_session_is_reopened_with_the_full_context(make_client, fake_cloud: FakeCloud) -> None:
    ref = reference(make_client)
    fake_cloud.calls.clear()
    client, _ = make_client(temperature=0, max_new_tokens=N)
    gen = client.stream(PROMPT)
    seen = []
    for tok in gen:
        seen.append(tok.token_id)
        if len(seen) == 5:
            fake_cloud.evict_all()
    r = gen.result()
    assert r.token_ids == ref and r.metrics.reopens == 1
    assert fake_cloud.calls.count("open") == 2
    reopened = [req for req in fake_cloud.requests if req.ctx_len - len(req.append_ids) > len(r.prompt_ids)]
    assert reopened  # rounds after the reopen start from the long context


def test_a_reopen_on_a_cloud_of_other_numerics_keeps_the_text_and_is_counted(make_client,
                                                                            fake_cloud: FakeCloud) -> None:
    """A failover to a replica of other numerics (here: the fake cloud's numerics string changes while the
    session is evicted) reopens from the committed text: every token is kept and the generation ends whole,
    and `numerics_changes` counts the change once; a reopen on the same numerics counts none."""
    ref = reference(make_client)
    client, _ = make_client(temperature=0, max_new_tokens=N)
    gen = client.stream(PROMPT)
    seen = []
    for tok in gen:
        seen.append(tok.token_id)
        if len(seen) == 3:
            fake_cloud.evict_all()  # the same cloud: no change
        if len(seen) == 6:
            fake_cloud.numerics = "pytorch bfloat16 invariant tp1 avx512_bf16 weights:fake"
            fake_cloud.evict_all()
    r = gen.result()
    assert r.token_ids == ref  # the fake target's numerics are one: the text is the reference, nothing lost
    assert r.metrics.reopens == 2 and r.metrics.numerics_changes == 1


def test_a_reopen_on_a_cloud_of_another_tokenizer_stops_the_generation_and_pairs_anew(make_client,
                                                                                    fake_cloud: FakeCloud) -> None:
    """The cloud behind the address restarts with another model (here: its tokenizer fingerprint changes while
    the session is evicted): the reopen's answer names the new tokenizer, the generation stops with
    TokenizerChanged (503, nothing sent under the wrong ids: no verify after that open), the session it opened
    is closed, and the client forgets the model info, so the next generation asks again and the pairing check
    refuses the pair with its fix. A reopen on the same tokenizer goes on as before."""
    from edge.exchange import TokenizerChanged
    from shared.tokenizer_id import tokenizer_fingerprint

    client, _ = make_client(temperature=0, max_new_tokens=N)
    fake_cloud.tokenizer_fingerprint = mine = tokenizer_fingerprint(client.tokenizer)
    ref = client.generate(PROMPT).token_ids
    gen = client.stream(PROMPT)
    seen: list[int] = []
    with pytest.raises(TokenizerChanged, match="another tokenizer") as err:
        for tok in gen:
            seen.append(tok.token_id)
            if len(seen) == 3:
                fake_cloud.evict_all()  # the same cloud: it goes on
            if len(seen) == 6:
                fake_cloud.tokenizer_fingerprint = "f" * 16
                fake_cloud.evict_all()
    assert err.value.http_status == 503 and err.value.paired == mine and err.value.now == "f" * 16
    assert seen == ref[:len(seen)] and len(seen) >= 6
    assert fake_cloud.calls[-2:] == ["open", "close"] and not fake_cloud.sessions
    asked = fake_cloud.calls.count("model")
    with pytest.raises(InvalidArgument, match="differs from the target's"):
        client.generate(PROMPT)
    assert fake_cloud.calls.count("model") == asked + 1


def test_404_from_a_verify_reopens(make_client, fake_cloud: FakeCloud) -> None:
    ref = reference(make_client)
    client, _ = make_client(temperature=0, max_new_tokens=N)
    fake_cloud.fail("verify", NotFound("expired"), times=1)
    r = client.generate(PROMPT)
    assert r.token_ids == ref and r.metrics.reopens == 1


def test_a_session_evicted_again_after_each_reopen_waits_and_goes_on(make_client, fake_cloud: FakeCloud) -> None:
    """An overloaded cloud evicts the session right after each of 5 reopens (404 on the next verify, more
    than max_recoveries = 4): the edge backs off before each further reopen instead of failing, and the
    text is the target's."""
    ref = reference(make_client)
    client, clock = make_client(temperature=0, max_new_tokens=N)
    fake_cloud.fail("verify", NotFound("evicted"), times=6)
    r = client.generate(PROMPT)
    assert r.token_ids == ref and r.metrics.reopens == 6
    assert len(clock.sleeps) == 5 and clock.sleeps == sorted(clock.sleeps)


def test_a_session_evicted_without_end_fails_with_the_clouds_404(make_client, fake_cloud: FakeCloud) -> None:
    """Evicted after every reopen, always: after max_retries waits and capacity_wait_s of backoff the edge gives
    up with the cloud's own status (404 not_found), not an internal error."""
    client, _ = make_client(temperature=0, max_new_tokens=N, capacity_wait_s=10)
    fake_cloud.fail("verify", NotFound("evicted"), times=100)
    with pytest.raises(NotFound) as e:
        client.generate(PROMPT)
    assert e.value.http_status == 404


def _tamper_after(fake_cloud: FakeCloud, gen, n: int, how) -> list[int]:  # type: ignore[no-untyped-def]
    out = []
    for tok in gen:
        out.append(tok.token_id)
        if len(out) == n:
            (session,) = fake_cloud.sessions.values()
            how(session)
    return out


def test_cloud_behind_resends_from_its_expected_length(make_client, fake_cloud: FakeCloud) -> None:
    ref = reference(make_client)
    client, _ = make_client(temperature=0, max_new_tokens=N)
    gen = client.stream(PROMPT)

    def shorten(s) -> None:  # type: ignore[no-untyped-def]  # as after a duplicated older request
        del s.ids[-3:]

    _tamper_after(fake_cloud, gen, 6, shorten)
    r = gen.result()
    assert r.token_ids == ref and r.metrics.resyncs == 1 and r.metrics.reopens == 0
    requests_are_consistent(fake_cloud, r.prompt_ids, r.token_ids)


def test_cloud_with_other_content_is_reopened(make_client, fake_cloud: FakeCloud) -> None:
    ref = reference(make_client)
    client, _ = make_client(temperature=0, max_new_tokens=N)
    gen = client.stream(PROMPT)

    def corrupt(s) -> None:  # type: ignore[no-untyped-def]
        s.ids[-1] = (s.ids[-1] + 1) % fake_cloud.vocab

    _tamper_after(fake_cloud, gen, 6, corrupt)
    r = gen.result()
    assert r.token_ids == ref and r.metrics.reopens == 1


def test_409_storm_gives_up(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(temperature=0, max_new_tokens=N)
    fake_cloud.fail("verify", ContextMismatch("no", expected_ctx_len=0), times=50)
    with pytest.raises(ContextMismatch, match="resynchronise") as e:
        client.generate(PROMPT)
    assert e.value.http_status == 409  # the cloud's status, not an internal error


class ScriptedDrafter:
    """Proposes fixed tokens with scripted gating signals: easy blocks on even calls, hard on odd ones."""

    kind = "sampled"
    wants_top_k = 0
    max_context = None

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.calls = 0

    def reset(self) -> None:
        self.calls = 0

    def propose(self, context: Sequence[int], k: int, cfg: SamplingConfig, seed: int) -> DraftBlock:
        import torch

        easy = self.calls % 2 == 0
        self.calls += 1
        toks = [(len(context) * 7 + i) % self.vocab for i in range(k)]
        q_full = []
        for t in toks:
            q = torch.full((self.vocab,), 0.5 / (self.vocab - 1), dtype=torch.float64)
            q[t] = 0.5
            q_full.append(q)
        return DraftBlock(tokens=toks, q_probs=[0.5] * k, kind="sampled", q_full=q_full,
                          nll=[0.1 if easy else 5.0] * k, entropy_bits=[1.0] * k, margin=[0.9] * k)

    def observe(self, context: Sequence[int], draft: Sequence[int], top_k_ids: Sequence[Sequence[int]]) -> None:
        return None


def test_gate_commits_easy_blocks_locally_and_sends_them_as_append_ids(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(ScriptedDrafter(fake_cloud.vocab), temperature=1.0, max_new_tokens=30, gating=True,
                            rule_triggers=False, fixed_k=4, check_last=False)
    r = client.generate(PROMPT)
    local = [x for x in r.rounds if x.decided_by == "gate"]
    verified = [x for x in r.rounds if x.decided_by == "cloud"]
    assert local and verified and r.metrics.gated_rounds == len(local)
    assert r.metrics.local_commits == sum(x.committed for x in local) == r.metrics.by_origin["local"]
    assert all(x.hard_ratio == 0.0 for x in local) and all(x.hard_ratio == 1.0 for x in verified if x.k)
    first_local = [t.token_id for t in r.tokens if t.round_index == local[0].index]
    assert fake_cloud.requests[0].append_ids == first_local  # the next verify carries them
    assert fake_cloud.requests[0].draft.hard_mask == [1, 1, 1, 1]
    requests_are_consistent(fake_cloud, r.prompt_ids, r.token_ids)


def test_target_rows_count_the_locally_committed_tail_the_next_verify_feeds(make_client,
                                                                           fake_cloud: FakeCloud) -> None:
    """A gated block of 4 tokens committed locally goes to the cloud as the next verify's append_ids: that round's
    target rows are those 4 plus its drafts, not one row for the whole tail."""
    client, _ = make_client(ScriptedDrafter(fake_cloud.vocab), temperature=1.0, max_new_tokens=30, gating=True,
                            rule_triggers=False, fixed_k=4, check_last=False)
    r = client.generate(PROMPT)
    assert r.metrics.gated_rounds > 0 and len(fake_cloud.requests) == r.metrics.verify_calls  # no resends here
    assert any(len(req.append_ids) == 4 for req in fake_cloud.requests)
    fed = sum(max(len(req.append_ids), 1) + len(req.draft.draft_tokens) for req in fake_cloud.requests)
    assert r.metrics.target_rows == fed


def test_gating_is_off_by_default(make_client, fake_cloud: FakeCloud) -> None:
    client, _ = make_client(ScriptedDrafter(fake_cloud.vocab), temperature=1.0, max_new_tokens=10, fixed_k=3)
    r = client.generate(PROMPT)
    assert r.metrics.local_commits == 0 and all(x.decided_by == "cloud" for x in r.rounds)
    assert all(req.draft.hard_mask is None for req in fake_cloud.requests)
