"""SessionStore policy: TTL, the session cap, LRU order for evictions under the KV budget, ownership."""

from __future__ import annotations

import pytest

from cloud.session import Context, Session
from cloud.store import SessionStore
from shared.config import SamplingConfig
from shared.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from tests.cloud.conftest import FakeClock


def session(ctx_id: str, kv_len: int, clock: FakeClock, owner: str = "") -> Session:
    return Session(ctx_id=ctx_id, owner=owner, sampling_cfg=SamplingConfig(), seed=0, correction="strict",
                   max_new_tokens=0, prompt_len=kv_len + 1, context=Context.of([1] * (kv_len + 1)),
                   seq_id=0, kv_len=kv_len, kv_bytes_per_token=10, last_used=clock(), created=clock())


def store(clock: FakeClock, **kw: int | float) -> tuple[SessionStore, list[tuple[str, str]]]:
    removed: list[tuple[str, str]] = []
    args = {"max_sessions": 4, "ttl_s": 60.0, "kv_budget_bytes": 1000, **kw}
    st = SessionStore(clock=clock, on_remove=lambda s, why: removed.append((s.ctx_id, why)), **args)  # type: ignore[arg-type]
    return st, removed


def test_idle_session_expires_after_ttl_and_then_is_not_found() -> None:
    clock = FakeClock()
    st, removed = store(clock, ttl_s=10)
    st.add(session("a", 5, clock))
    clock.advance(9)
    st.get("a", "")  # a use resets the idle time
    clock.advance(9.5)
    assert st.get("a", "").ctx_id == "a"
    clock.advance(10.5)
    with pytest.raises(NotFound):
        st.get("a", "")
    assert removed == [("a", "ttl")]


def test_session_with_a_request_in_flight_does_not_expire() -> None:
    clock = FakeClock()
    st, _ = store(clock, ttl_s=10)
    s = session("a", 5, clock)
    st.add(s)
    s.inflight = 1
    clock.advance(100)
    assert st.expire() == 0


def test_full_store_refuses_a_new_session_unless_one_has_expired() -> None:
    clock = FakeClock()
    st, removed = store(clock, max_sessions=2, ttl_s=10)
    st.add(session("a", 1, clock))
    st.add(session("b", 1, clock))
    with pytest.raises(ResourceExhausted) as e:
        st.check_room(10)
    assert e.value.http_status == 429 and e.value.details["limit"] == "max_sessions"
    assert removed == []  # working sessions are not evicted for a newcomer
    clock.advance(11)
    st.check_room(10)
    assert {r[1] for r in removed} == {"ttl"}


def test_lru_order_and_drop_of_an_evicted_session() -> None:
    """The model thread evicts for KV blocks in `lru()` order and hands the session to `drop`."""
    clock = FakeClock()
    st, removed = store(clock, kv_budget_bytes=1000)
    for name in "abc":
        st.add(session(name, 30, clock))
        clock.advance(1)
    st.get("a", "")  # a becomes the most recently used: b is now the oldest
    assert [s.ctx_id for s in st.lru()] == ["b", "c", "a"]
    b = st.lru()[0]
    st.drop(b, "kv_budget")
    st.drop(b, "kv_budget")  # twice: once removed, nothing more happens
    assert removed == [("b", "kv_budget")] and b.closed
    with pytest.raises(NotFound):
        st.get("b", "")


def test_a_context_larger_than_the_whole_budget_is_refused_as_never_fitting() -> None:
    """422, not a retryable 429: no wait frees more than the whole budget."""
    clock = FakeClock()
    st, removed = store(clock, kv_budget_bytes=1000)
    st.add(session("a", 10, clock))
    with pytest.raises(InvalidArgument) as e:
        st.make_room(1001)
    assert e.value.details["limit"] == "kv_budget_bytes" and e.value.details["reason"] == "exceeds_kv_budget"
    assert removed == []


def test_session_is_visible_only_to_its_owner() -> None:
    clock = FakeClock()
    st, _ = store(clock)
    st.add(session("a", 1, clock, owner="alice"))
    with pytest.raises(PermissionDenied):
        st.get("a", "bob")
    with pytest.raises(PermissionDenied):
        st.close("a", "bob")
    assert st.get("a", "alice").ctx_id == "a"


def test_removed_session_is_closed_and_handed_to_on_remove() -> None:
    clock = FakeClock()
    st, removed = store(clock)
    s = session("a", 3, clock)
    st.add(s)
    st.close("a", "")
    assert s.closed and removed == [("a", "closed")]
    with pytest.raises(NotFound):
        st.get("a", "")
