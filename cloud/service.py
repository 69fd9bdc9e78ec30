"""The verifier service: what REST and gRPC both call. Transport-free, async, on the event loop.

`VerifierService` is the service's parts and shared checks (cloud/core.py) with one method a call; each
call's work lives in the module of its job: opening sessions (cloud/opening.py), verify rounds
(cloud/rounds.py), session streams (cloud/streaming.py), target-only generation (cloud/generate.py); the
eviction policy is cloud/eviction.py. Order of checks for every call: see cloud/core.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from cloud import generate, opening, rounds, streaming
from cloud.core import ServiceCore, key_owner
from cloud.generate import GenerateEvent, GenerateRequest
from cloud.runners import load_target
from cloud.settings import CloudSettings
from shared.config import SamplingConfig
from shared.protocol import (
    OpenSessionRequest,
    SessionInfo,
    StreamDone,
    StreamedToken,
    StreamSessionRequest,
    VerifyRequest,
    VerifyResponse,
)

__all__ = ["GenerateEvent", "GenerateRequest", "VerifierService", "key_owner"]


class VerifierService(ServiceCore):
    @classmethod
    def load(cls, settings: CloudSettings, **kw) -> VerifierService:  # type: ignore[no-untyped-def]
        # the service sizes its pool
        return cls(settings, load_target(settings), **kw)

    # --- sessions -----------------------------------------------------------------------------
    async def open_session(self, req: OpenSessionRequest, owner: str, request_id: str = "") -> SessionInfo:
        """A new session. With a `request_id` (the call's X-Request-Id) a retry joins the first attempt
        (cloud/idempotent_opens.py); without, an open whose caller goes away leaves the queue (or stops after its
        chunk in progress) and leaves nothing behind."""
        return await opening.open_session(self, req, owner, request_id)

    def get_session(self, ctx_id: str, owner: str) -> SessionInfo:
        return self.session_info(self.lookup(ctx_id, owner), counters=True)

    def close_session(self, ctx_id: str, owner: str) -> None:
        self.lookup(ctx_id, owner)
        self.store.close(ctx_id, owner)

    # --- verify -------------------------------------------------------------------------------
    async def verify(self, req: VerifyRequest, owner: str, declared_k: int,
                     sampling_cfg: SamplingConfig | None = None) -> VerifyResponse:
        return await rounds.verify(self, req, owner, declared_k, sampling_cfg)

    # --- session streams ------------------------------------------------------------------------
    def stream_session(self, req: StreamSessionRequest, owner: str) -> AsyncIterator[StreamedToken | StreamDone]:
        """Check the request now (errors before any compute leave the session as it was), then stream the
        target's own tokens on the session, one k = 0 verify round each (cloud/streaming.py)."""
        return streaming.stream_session(self, req, owner)

    # --- target-only generation -----------------------------------------------------------------
    def start_generate(self, req: GenerateRequest, owner: str) -> AsyncIterator[GenerateEvent]:
        """Check the request now (errors before any output), then stream tokens as they come."""
        return generate.start_generate(self, req, owner)

    # --- housekeeping -------------------------------------------------------------------------
    def render_metrics(self) -> bytes:
        self.metrics.open_sessions.set(len(self.store))
        self.metrics.kv_bytes.set(self.store.kv_bytes)
        self.metrics.kv_pool_bytes.set(self.model.pool.allocated_bytes)
        paged = getattr(self.model, "paged", None)
        if paged is not None:
            self.metrics.graph_bytes.set(paged.graph_bytes)
            for path, seen in (("replayed", paged.replayed), ("eager", paged.eager)):
                self.metrics.executor_forwards.labels(path=path).inc(seen - self._paths_seen.get(path, 0))
                self._paths_seen[path] = seen
        m = self.model.pool.manager
        self.metrics.kv_blocks.labels(state="used").set(m.used)
        self.metrics.kv_blocks.labels(state="cached").set(len(m.cached))
        self.metrics.kv_blocks.labels(state="free").set(m.available() - len(m.cached)
                                                        if m.max_blocks is not None else len(m.free))
        self.metrics.prefix_hit_tokens.inc(m.hit_tokens - self._hits_seen)
        self.metrics.cached_block_evictions.inc(m.evicted_blocks - self._evicted_seen)
        self._hits_seen, self._evicted_seen = m.hit_tokens, m.evicted_blocks
        self.metrics.queue_depth.set(self.admission.depth)
        cost = self.budget.cost
        for term, value in (("base", cost.base_s), ("row", cost.row_s), ("prefill_token", cost.prefill_token_s)):
            self.metrics.forward_cost.labels(term=term).set(value)
        self.metrics.tokens_per_forward_second.set(self.budget.rate)
        self.metrics.node_value.set(self.budget.node_value)
        return self.metrics.render()

    def count_error(self, code: str) -> None:
        self.metrics.errors.labels(code=code).inc()

    def count_response(self, transport: str, status: int) -> None:
        self.metrics.responses.labels(transport=transport, status=str(status)).inc()

    async def sweep_forever(self) -> None:
        """Expire idle sessions in the background (lookups also expire them lazily)."""
        period = min(self.settings.session_ttl_s / 2, 5.0)
        while True:
            await asyncio.sleep(period)
            self.store.expire()

    def close(self) -> None:
        self.ready = False
        self.store.clear()
        self.scheduler.shutdown()
