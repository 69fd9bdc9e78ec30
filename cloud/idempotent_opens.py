"""Idempotent opens: an open that carries a request id (REST `X-Request-Id`, gRPC `x-request-id`) joins
the open of the same API key, id and body that is still in flight, or was answered within `keep_s`,
instead of prefilling the prompt again. An edge that timed out resends its open with the same id; the
retry gets the first attempt's session. When every caller of such an open has gone, it waits `grace_s`
for a retry (an edge's backoff is at most 2 s) and is then cancelled: it leaves the queue or stops after
its chunk in progress, as an open without a request id does at once (cloud/opening.py). An open that
failed or was cancelled is forgotten at once (a retry starts anew; no exception, traceback or request is
kept), and each owner (API key) has at most `max_per_owner` entries: a new one first drops that owner's
answered opens whose session is gone, then its oldest. Runs on the event loop only.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from shared.protocol import OpenSessionRequest, SessionInfo


def open_fingerprint(req: OpenSessionRequest) -> str:
    """What a retry must share with the first attempt to join it: every field of the open."""
    body = (req.prompt_ids, sorted(req.sampling_cfg.to_dict().items()), req.seed, req.correction,
            req.max_new_tokens, req.feature_encoding, req.feature_window)
    return hashlib.sha256(repr(body).encode()).hexdigest()


@dataclass
class _Open:
    # the body's fingerprint (open_fingerprint)
    fp: str
    task: asyncio.Task[SessionInfo]
    # callers waiting for it now
    waiters: int = 0
    # the cancellation due when nobody has come back within the grace
    orphaned: asyncio.TimerHandle | None = None


@dataclass
class OpenJoiner:
    # seconds an answered open stays joinable (an edge's retry comes after its timeout and backoff)
    keep_s: float
    # seconds an open nobody waits for any more stays in flight for a retry to join
    grace_s: float = 5.0
    # entries one owner may have (in flight or answered); the service sizes it to what the owner can hold at
    # once, its sessions plus its opens in flight, past which an entry could only name a session gone
    max_per_owner: int = 256
    # (owner, request id) -> the open
    _opens: dict[tuple[str, str], _Open] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._opens)

    async def join(self, owner: str, request_id: str, req: OpenSessionRequest,
                   start: Callable[[], Awaitable[SessionInfo]], alive: Callable[[str], bool]) -> SessionInfo:
        """The session of the open (`owner`, `request_id`, this body): the one in flight or just answered
        while its session is still held (`alive(ctx_id)`), else a new one (`start()`). A different body
        under the same id starts a new open."""
        key, fp = (owner, request_id), open_fingerprint(req)
        got = self._opens.get(key)
        if got is None or got.fp != fp or _failed(got.task) or (got.task.done() and not alive(got.task.result().ctx_id)):
            self._make_room(owner, key, alive)
            task = asyncio.ensure_future(start())
            got = self._opens[key] = _Open(fp, task)
            task.add_done_callback(lambda t: self._answered(key, t))
        if got.orphaned is not None:
            got.orphaned.cancel()
            got.orphaned = None
        got.waiters += 1
        try:
            return await asyncio.shield(got.task)
        finally:
            got.waiters -= 1
            if not got.waiters and not got.task.done():
                got.orphaned = asyncio.get_running_loop().call_later(self.grace_s, self._cancel_orphan, got)

    @staticmethod
    def _cancel_orphan(got: _Open) -> None:
        if not got.waiters:
            got.task.cancel()

    def _make_room(self, owner: str, key: tuple[str, str], alive: Callable[[str], bool]) -> None:
        """Below `max_per_owner` entries of `owner` once `key`'s is replaced: its answered opens whose
        session is gone go first, then its oldest (forgotten, not cancelled: their callers still get them)."""
        self._opens.pop(key, None)
        mine = [k for k in self._opens if k[0] == owner]
        if len(mine) < self.max_per_owner:
            return
        for k in mine:
            task = self._opens[k].task
            if _failed(task) or (task.done() and not alive(task.result().ctx_id)):
                del self._opens[k]
        mine = [k for k in self._opens if k[0] == owner]
        for k in mine[:max(len(mine) - self.max_per_owner + 1, 0)]:
            del self._opens[k]

    def _answered(self, key: tuple[str, str], task: asyncio.Task[SessionInfo]) -> None:
        if task.cancelled() or task.exception() is not None:  # each caller had it through its shield
            self._forget(key, task)  # now: its exception's traceback holds the request's frames
            return
        asyncio.get_running_loop().call_later(self.keep_s, self._forget, key, task)

    def _forget(self, key: tuple[str, str], task: asyncio.Task[SessionInfo]) -> None:
        got = self._opens.get(key)
        if got is not None and got.task is task:
            del self._opens[key]


def _failed(task: asyncio.Task[SessionInfo]) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)
