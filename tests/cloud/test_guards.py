"""The transport-free guards: the bearer rule, verify counts, the context rule, the per-key cap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cloud.guards import CONTEXT_FULL, bearer_key, check_context_room, check_verify_counts
from cloud.settings import CloudSettings
from cloud.store import SessionStore
from shared.errors import InvalidArgument, ResourceExhausted


@pytest.mark.parametrize("header, key", [("Bearer k1", "k1"), ("bearer  k1 ", "k1"), ("k1", None), ("", None),
                                         (None, None), ("Basic k1", None), ("Bearer ", None)])
def test_only_the_bearer_scheme_carries_a_key(header: str | None, key: str | None) -> None:
    assert bearer_key(header) == key


COUNTS: dict[str, Any] = dict(declared_k=4, n_draft=4, n_q=4, n_dists=None, n_hard=0, n_append=3, max_k=8,
                              max_context=100)


@pytest.mark.parametrize("change, words", [
    ({"declared_k": 5}, "k = 5 but len(draft_tokens) = 4"),
    ({"declared_k": 9, "n_draft": 9, "n_q": 9}, "max_k = 8"),
    ({"n_q": 1}, "len(q_token_probs) = 1"),
    ({"n_dists": 10**6}, "len(q_dists) = 1000000 but k = 4"),
    ({"n_hard": 2}, "hard_mask"),
    ({"n_append": 101}, "len(append_ids) = 101"),
])
def test_verify_counts_are_checked_by_length(change: dict[str, int], words: str) -> None:
    check_verify_counts(**COUNTS)
    with pytest.raises(InvalidArgument) as e:
        check_verify_counts(**{**COUNTS, **change})
    assert words in e.value.message


def test_a_round_may_fill_the_context_but_not_pass_it() -> None:
    check_context_room(ctx_len=95, k=4, max_context=100)  # 95 + 4 + 1 = 100
    check_context_room(ctx_len=99, k=0, max_context=100)
    with pytest.raises(InvalidArgument) as e:
        check_context_room(ctx_len=95, k=5, max_context=100)
    assert e.value.details["max_k_here"] == 4
    with pytest.raises(InvalidArgument) as e:
        check_context_room(ctx_len=100, k=0, max_context=100)
    assert e.value.details["reason"] == CONTEXT_FULL and "full" in e.value.message


@pytest.mark.parametrize("keys, explicit, expected", [((), 0, 64), (("a",), 0, 64), (("a", "b"), 0, 32),
                                                      (("a", "b", "c"), 5, 5), (("a", "b"), 100, 64)])
def test_sessions_per_key_default(tiny_pair: tuple[Path, Path], keys: tuple[str, ...], explicit: int,
                                  expected: int) -> None:
    st = CloudSettings(model=tiny_pair[0], api_keys=list(keys), max_sessions=64, max_sessions_per_key=explicit)
    assert st.sessions_per_key_limit() == expected


class _S:
    def __init__(self, ctx_id: str, owner: str) -> None:
        self.ctx_id, self.owner, self.inflight, self.last_used, self.kv_bytes = ctx_id, owner, 0, 0.0, 0


def test_store_caps_sessions_per_owner_and_leaves_others_room() -> None:
    store = SessionStore(max_sessions=10, ttl_s=60, kv_budget_bytes=1, clock=lambda: 0.0, max_sessions_per_owner=2)
    for i in range(2):
        store.check_room(0, "a")
        store.add(_S(f"a{i}", "a"))  # type: ignore[arg-type]
    with pytest.raises(ResourceExhausted) as e:
        store.check_room(0, "a")
    assert e.value.details["limit"] == "max_sessions_per_key" and e.value.retry_after_s == 1
    store.check_room(0, "b")
