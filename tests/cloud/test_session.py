"""Context: prefix hashes by length, cut-and-extend; Session: the bounded replay cache."""

from __future__ import annotations

from cloud.session import Context, Session
from shared.config import SamplingConfig
from shared.hashing import ctx_hash
from shared.protocol import VerifyResponse


def test_every_prefix_hash_matches_the_protocol_hash() -> None:
    ids = [5, 0, 4095, 17, 17, 2**31 - 1]
    ctx = Context.of(ids)
    assert [ctx.hash_at(n) for n in range(len(ids) + 1)] == [ctx_hash(ids[:n]) for n in range(len(ids) + 1)]


def test_hash_with_appended_ids_equals_hash_of_the_joined_list() -> None:
    ctx = Context.of([1, 2, 3, 4])
    assert ctx.hash_with(2, [9, 8]) == ctx_hash([1, 2, 9, 8])
    assert ctx.hash_with(4, []) == ctx_hash([1, 2, 3, 4])


def test_cut_and_extend_is_a_new_context_and_leaves_the_old_one() -> None:
    ctx = Context.of([1, 2, 3, 4])
    new = ctx.cut_and_extend(2, [7])
    assert new.ids == (1, 2, 7) and new.hash_at(3) == ctx_hash([1, 2, 7])
    assert ctx.ids == (1, 2, 3, 4) and ctx.hash_at(4) == ctx_hash([1, 2, 3, 4])


def _session() -> Session:
    return Session(ctx_id="x", owner="", sampling_cfg=SamplingConfig(), seed=0, correction="strict",
                   max_new_tokens=0, prompt_len=1, context=Context.of([1]), seq_id=None, kv_bytes_per_token=1,
                   last_used=0.0, created=0.0)


def test_replay_cache_keeps_the_newest_answers_only() -> None:
    s = _session()
    for i in range(5):
        s.remember(f"r{i}", "fp", VerifyResponse(i, None, "residual", None, 1, "h"), keep=3)
    assert list(s.replies) == ["r2", "r3", "r4"]
    s.remember("", "fp", VerifyResponse(0, None, "residual", None, 1, "h"), keep=3)  # no id: not kept
    assert list(s.replies) == ["r2", "r3", "r4"]
