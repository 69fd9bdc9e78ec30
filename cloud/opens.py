"""Idempotent opens: an open that carries a request id (REST `X-Request-Id`, gRPC `x-request-id`) joins
the open of the same API key, id and body that is still in flight, or was answered within `keep_s`,
instead of prefilling the prompt again. An edge that timed out resends its open with the same id; the
retry gets the first attempt's session. Such an open is not cancelled when its caller goes away (its
retry is expected); an open without a request id is (cloud/service.py). Runs on the event loop only.
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
class OpenJoiner:
    # seconds an answered open stays joinable (an edge's retry comes after its timeout and backoff)
    keep_s: float
    # (owner, request id) -> (body fingerprint, the open)
    _opens: dict[tuple[str, str], tuple[str, asyncio.Task[SessionInfo]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._opens)

    async def join(self, owner: str, request_id: str, req: OpenSessionRequest,
                   start: Callable[[], Awaitable[SessionInfo]], alive: Callable[[str], bool]) -> SessionInfo:
        """The session of the open (`owner`, `request_id`, this body): the one in flight or just answered
        while its session is still held (`alive(ctx_id)`), else a new one (`start()`). A different body
        under the same id starts a new open."""
        key, fp = (owner, request_id), open_fingerprint(req)
        got = self._opens.get(key)
        if got is None or got[0] != fp or _failed(got[1]) or (got[1].done() and not alive(got[1].result().ctx_id)):
            task = asyncio.ensure_future(start())
            got = self._opens[key] = (fp, task)
            task.add_done_callback(lambda t: self._answered(key, t))
        return await asyncio.shield(got[1])

    def _answered(self, key: tuple[str, str], task: asyncio.Task[SessionInfo]) -> None:
        if not task.cancelled():
            task.exception()  # each caller had it through its shield; nobody may be left to read it
        asyncio.get_running_loop().call_later(self.keep_s, self._forget, key, task)

    def _forget(self, key: tuple[str, str], task: asyncio.Task[SessionInfo]) -> None:
        got = self._opens.get(key)
        if got is not None and got[1] is task:
            del self._opens[key]


def _failed(task: asyncio.Task[SessionInfo]) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)
