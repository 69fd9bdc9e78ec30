"""The session store: lookup with ownership, the session-count cap, idle TTL, and the KV byte budget.

Policy:
- `max_sessions`: opening one more first drops sessions idle past the TTL; if the store is
  still full it answers ResourceExhausted (429). Working sessions are never evicted to make
  room for a new one (that would only move the 404 to someone else).
- `max_sessions_per_owner`: the same, counted over one owner's (API key's) sessions, so one key
  cannot take every session (ResourceExhausted naming `max_sessions_per_key`).
- `session_ttl_s`: a session idle that long is gone (NotFound on its next call).
- `kv_budget_bytes`: the paged KV pool (shared/kvpool.py) is sized from it and never grows past
  it. A session whose own cache would exceed the whole budget can never fit: it is refused here with
  InvalidArgument (422, `reason` "exceeds_kv_budget"), which a client must not retry.
  When a forward needs blocks that are not left, the model thread evicts the least recently used
  sessions with no request in flight (cloud/eviction.py `make_room`) and hands them to `drop`.
Every removal frees the cache and marks the session closed. Runs on the event loop only.
"""

from __future__ import annotations

import hmac
from collections import OrderedDict
from collections.abc import Callable, Iterator

from cloud.session import Session
from shared.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted

# removal reasons, the `reason` label of the evictions metric
TTL, KV_BUDGET, CLOSED = "ttl", "kv_budget", "closed"


class SessionStore:
    def __init__(self, *, max_sessions: int, ttl_s: float, kv_budget_bytes: int,
                 clock: Callable[[], float], on_remove: Callable[[Session, str], None] | None = None,
                 max_sessions_per_owner: int | None = None) -> None:
        self.max_sessions = max_sessions
        self.max_sessions_per_owner = max_sessions_per_owner or max_sessions
        self.ttl_s = ttl_s
        self.kv_budget_bytes = kv_budget_bytes
        self.clock = clock
        self.on_remove = on_remove
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    @property
    def kv_bytes(self) -> int:
        return sum(s.kv_bytes for s in self._sessions.values())

    def get(self, ctx_id: str, owner: str) -> Session:
        """The session, touched (most recently used). NotFound / PermissionDenied otherwise."""
        s = self._sessions.get(ctx_id)
        if s is not None and self._expired(s):
            self._remove(s, TTL)
            s = None
        if s is None:
            raise NotFound(f"session {ctx_id!r} is unknown, closed, expired or evicted; reopen it with the "
                           "full context", ctx_id=ctx_id)
        if not hmac.compare_digest(s.owner, owner):
            raise PermissionDenied("this session belongs to another API key")
        s.last_used = self.clock()
        self._sessions.move_to_end(ctx_id)
        return s

    def holds(self, ctx_id: str) -> bool:
        """Whether the session is open (not closed, evicted or expired), without touching it."""
        s = self._sessions.get(ctx_id)
        return s is not None and not s.closed and not self._expired(s)

    def check_room(self, need_bytes: int, owner: str | None = None, opening: int = 0, opening_all: int = 0) -> None:
        """Raise ResourceExhausted unless one more session holding `need_bytes` of KV can be opened
        (by `owner`, when given: its own sessions count against max_sessions_per_owner). Opens already
        admitted count as the sessions they will be: `opening` of the owner's, `opening_all` in all."""
        self.expire()
        held = len(self._sessions) + opening_all
        if held >= self.max_sessions:
            raise ResourceExhausted(f"{len(self._sessions)} sessions are open and {opening_all} opening "
                                    f"(max_sessions = {self.max_sessions}); retry later", limit="max_sessions")
        if owner is not None:
            mine = sum(1 for s in self._sessions.values() if hmac.compare_digest(s.owner, owner)) + opening
            if mine >= self.max_sessions_per_owner:
                raise ResourceExhausted(f"this API key holds or is opening {mine} sessions (max_sessions_per_key = "
                                        f"{self.max_sessions_per_owner}); close one or retry later",
                                        limit="max_sessions_per_key")
        self.make_room(need_bytes)

    def add(self, s: Session) -> None:
        self._sessions[s.ctx_id] = s

    def close(self, ctx_id: str, owner: str) -> None:
        self._remove(self.get(ctx_id, owner), CLOSED)

    def make_room(self, need_bytes: int, session: Session | None = None) -> None:
        """Refuse a context that could not fit even alone (InvalidArgument: retrying cannot help); eviction
        for blocks is the model thread's (`drop`)."""
        if need_bytes > self.kv_budget_bytes:
            raise InvalidArgument(f"this context needs {need_bytes} bytes of KV cache, more than the whole budget "
                                  f"({self.kv_budget_bytes} bytes, --kv-budget-bytes): it can never fit; shorten it "
                                  "or raise the budget", limit="kv_budget_bytes", reason="exceeds_kv_budget")

    def lru(self) -> list[Session]:
        """Sessions, least recently used first."""
        return list(self._sessions.values())

    def drop(self, s: Session, reason: str) -> None:
        """Remove `s` if it is still held (evicted by the model thread for KV blocks)."""
        if self._sessions.get(s.ctx_id) is s:
            self._remove(s, reason)

    def expire(self) -> int:
        """Drop every session idle past the TTL; returns how many."""
        gone = [s for s in self._sessions.values() if self._expired(s)]
        for s in gone:
            self._remove(s, TTL)
        return len(gone)

    def clear(self) -> None:
        for s in list(self._sessions.values()):
            self._remove(s, CLOSED)

    def _expired(self, s: Session) -> bool:
        return s.inflight == 0 and self.clock() - s.last_used > self.ttl_s

    def _remove(self, s: Session, reason: str) -> None:
        self._sessions.pop(s.ctx_id, None)
        s.closed = True  # its sequence is released by on_remove, on the model thread
        s.replies.clear()
        if self.on_remove is not None:
            self.on_remove(s, reason)
