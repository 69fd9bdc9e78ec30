"""The verifier's parts and the checks every call shares: transport-free, async, on the event loop.

`ServiceCore` builds one model's pool, session store, admission, scheduler, eviction policy (cloud/eviction.py)
and metrics from the settings, and is the scheduler's model runner (cloud/scheduler.py `ModelRunner`: the
forward, the KV its rows take, the cost fit). The calls on top of it live one job a module: opening (cloud/opening.py),
verify rounds (cloud/rounds.py), session streams (cloud/streaming.py), target-only generation
(cloud/generate.py); `VerifierService` (cloud/service.py) is what REST and gRPC call.

Order of checks for every call: auth (401) -> session lookup (404) and owner (403) -> request
checks (422) -> admission (429) -> per-session lock -> context check (409) and the round on the
model thread (cloud/scheduler.py). Every rejection happens before anything is written, so a rejected request never
changes a session.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from cloud.admission import Admission
from cloud.engine import RoundLimits, check_ids
from cloud.eviction import Eviction
from cloud.idempotent_opens import OpenJoiner
from cloud.jobs import BatchStats, Job
from cloud.metrics import CloudMetrics
from cloud.node_budget import NodeBudget
from cloud.numerics import matrix_units, numerics, weights_fingerprint
from cloud.runners import Runner, TreeSeqPool
from cloud.scheduler import Scheduler
from cloud.session import Session
from cloud.settings import CloudSettings
from cloud.store import CLOSED, SessionStore
from shared.blocks import OutOfBlocks
from shared.errors import InvalidArgument, NotFound, Unauthenticated, Unavailable
from shared.features import ENCODINGS
from shared.protocol import ModelInfo, NodeAcceptance, SessionInfo
from shared.rows import Row

# the service's log lines keep the logger name they have always had
log = logging.getLogger("cloud.service")
# seconds an answered open stays joinable by a retry with the same request id (cloud/idempotent_opens.py)
OPEN_JOIN_S = 60.0


def key_owner(key: str) -> str:
    """What a session stores about its API key: a fingerprint, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class ServiceCore:
    def __init__(self, settings: CloudSettings, model: Runner, *, clock: Callable[[], float] = time.monotonic,
                 new_id: Callable[[], str] = lambda: secrets.token_urlsafe(24)) -> None:
        self.settings, self.model, self.clock, self.new_id = settings, model, clock, new_id
        model.use_pool(settings.kv_budget_bytes, settings.kv_block_size, settings.prefix_cache,
                       settings.kv_preallocate)
        offer = settings.features and model.feature_size > 0
        self.info: ModelInfo = replace(model.info, max_k=settings.max_k, max_tree_nodes=settings.max_tree_nodes,
                                       feature_size=model.feature_size if offer else 0,
                                       feature_encodings=list(ENCODINGS) if offer else [],
                                       max_feature_window=settings.max_feature_window if offer else 0,
                                       session_stream=True, max_generate_tokens=settings.max_generate_tokens)
        self.prompt_limit = settings.prompt_limit(model.info.max_context)
        self.limits = RoundLimits(max_k=settings.max_k, max_return_top_k=settings.max_return_top_k,
                                  max_context=model.info.max_context, vocab_size=model.support,
                                  max_tree_nodes=settings.max_tree_nodes)
        self.metrics = CloudMetrics.create(max(settings.max_k, settings.max_tree_nodes), settings.kv_budget_bytes)
        # the forward cost fitted online and the node budget of each answer (cloud/node_budget.py)
        self.budget = NodeBudget(max_nodes=max(settings.max_k, settings.max_tree_nodes, 1))
        # a GPU's forward cost is a step function of its size: the budget reads the marginal cost per bucket
        self.budget.cost.steps = str(getattr(model, "device", "cpu")).startswith("cuda")
        self.store = SessionStore(max_sessions=settings.max_sessions, ttl_s=settings.session_ttl_s,
                                  kv_budget_bytes=settings.kv_budget_bytes, clock=clock, on_remove=self._removed,
                                  max_sessions_per_owner=settings.sessions_per_key_limit())
        self.admission = Admission(max_new=settings.max_queue_depth,
                                   max_new_per_key=settings.queue_depth_per_key_limit(),
                                   max_total=settings.max_queue_depth + settings.max_sessions)
        self.eviction = Eviction(settings, model, self.store, clock)
        # only llama.cpp's pool gives a tree's leaves sequence ids of their own (cloud/runners/__init__.py)
        self._tree_pool = model.pool if isinstance(model.pool, TreeSeqPool) else None
        # the model thread: it builds each forward and runs it through this core (`ModelRunner`, below)
        self.scheduler = Scheduler(clock, self, max_batch_size=settings.max_batch_size,
                                   max_batch_tokens=settings.max_batch_tokens, batch_wait_ms=settings.batch_wait_ms,
                                   max_prefill_tokens_with_rounds=settings.max_prefill_tokens_with_rounds,
                                   active_s=settings.session_active_ms / 1000.0,
                                   torch_threads=settings.torch_threads,
                                   # a GPU's forward is not the host's CPU time: there the cost is wall time
                                   cost_clock=time.monotonic if str(getattr(model, "device", "cpu")).startswith("cuda")
                                   else time.process_time)
        # batch invariance measured on the model thread at its thread count, up to the largest forward, before
        # /v1/model and /metrics report it (cloud/runners/torch_runner.py `calibrate`)
        # CUDA graphs of the deployment's buckets, captured on the model thread before anything is served or probed
        capture = getattr(model, "capture_graphs", None)
        if capture is not None:
            self.scheduler.call_sync(lambda: capture(*settings.graph_lists(), settings.graph_memory_bytes))
        self.info.batch_invariant = self.scheduler.call_sync(lambda: model.calibrate(settings.max_batch_tokens))
        # the forward's cost measured before anything is served, so the first open answer already carries a fit
        # (the edge decides speculate or stream from it before its first round)
        self.scheduler.call_sync(self._measure_forward_cost)
        weights = getattr(model, "weights_path", None)
        self.info.numerics = numerics(self.info, weights_fingerprint(weights) if weights is not None else "unknown",
                                      matrix_units(str(getattr(model, "device", "cpu"))),
                                      tiled=getattr(model, "row_tile", 0) > 0)
        self.metrics.model_dtype.labels(self.info.dtype, self.info.dtype_reason,
                                        str(self.info.batch_invariant).lower()).set(1)
        self.opens = OpenJoiner(OPEN_JOIN_S, max_per_owner=settings.sessions_per_key_limit()
                                + settings.queue_depth_per_key_limit())
        self._hits_seen = self._evicted_seen = 0
        self._paths_seen: dict[str, int] = {}
        self._keys = settings.api_key_values()
        self._ready = True
        # set at SIGTERM (cloud.app.drain): new sessions and generations are refused, verify is still served
        self.draining = False

    @property
    def ready(self) -> bool:
        """Serving (/readyz 200): not draining, and no tensor-parallel rank lost."""
        return self._ready and self.model.healthy()

    @ready.setter
    def ready(self, value: bool) -> None:
        self._ready = value

    # --- auth ---------------------------------------------------------------------------------
    def authenticate(self, key: str | None) -> str:
        """The caller's owner id; Unauthenticated when keys are configured and `key` is not one."""
        if not self._keys:
            return ""
        if not key:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer KEY'")
        if not any(hmac.compare_digest(key.encode(), k.encode()) for k in self._keys):
            raise Unauthenticated("wrong API key")
        return key_owner(key)

    # --- checks every call shares -------------------------------------------------------------
    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidArgument("prompt_ids is empty: a session needs at least one token")
        if len(ids) > self.prompt_limit:
            raise InvalidArgument(f"the prompt has {len(ids)} tokens, more than the limit of {self.prompt_limit} "
                                  f"(model context {self.info.max_context})", limit=self.prompt_limit)
        check_ids(ids, self.model.support, "prompt_ids")

    def refuse_when_draining(self, what: str) -> None:
        if self.draining:
            raise Unavailable(f"this replica is shutting down and takes no new {what}: retry (elsewhere)")
        self.refuse_when_unhealthy()

    def refuse_when_unhealthy(self) -> None:
        if not self.model.healthy():
            raise Unavailable("this verifier lost a tensor-parallel rank and is restarting: retry (elsewhere)")

    def lookup(self, ctx_id: str, owner: str) -> Session:
        """The session; while draining, one this replica does not hold is Unavailable (503), not NotFound:
        it may live on another replica, where a load balancer sends the call next."""
        try:
            return self.store.get(ctx_id, owner)
        except NotFound:
            if self.draining:
                raise Unavailable(f"this replica is shutting down and holds no session {ctx_id!r}: retry "
                                  "(elsewhere)") from None
            raise

    def session_info(self, s: Session, counters: bool = False) -> SessionInfo:
        ctx = s.context
        return SessionInfo(ctx_id=s.ctx_id, ctx_len=len(ctx), ctx_hash=ctx.hash_at(len(ctx)),
                           vocab_size=self.model.support, numerics=self.info.numerics,
                           tokenizer_fingerprint=self.info.tokenizer_fingerprint,
                           counters=s.describe(self.clock()) if counters else {})

    # --- KV and the model thread --------------------------------------------------------------
    def kv_bytes(self, positions: int) -> int:
        """The KV bytes a sequence of `positions` takes in whole blocks, with one block more for a
        copy-on-write: what the never-fits check compares with the budget (the pool holds whole blocks)."""
        size = self.model.pool.block_size
        return (-(-positions // size) + 1) * size * self.model.kv_bytes_per_token

    def salt(self, owner: str) -> bytes:
        """The prefix-cache salt of an owner's sequences: blocks are shared within one API key only,
        unless the operator shares them across keys."""
        return b"" if self.settings.share_prefix_across_keys else owner.encode()

    async def abandon(self, job: Job[Any], task: asyncio.Future[Any]) -> None:
        """Nobody waits for `job` (its caller left, or it failed): it runs no further forward; returns once the
        model thread has let go of it."""
        self.scheduler.cancel(job)
        await asyncio.wait({task})
        if not task.cancelled():
            task.exception()  # retrieved: the caller has its own error

    def release(self, seq_id: int | None) -> None:
        if seq_id is not None:
            self.scheduler.between_batches(lambda: self.model.pool.release(seq_id))

    def _removed(self, s: Session, reason: str) -> None:
        seq_id, s.seq_id = s.seq_id, None
        self.release(seq_id)  # on the model thread, after any batch that still uses it
        self.scheduler.forget(s.ctx_id)
        if reason != CLOSED:
            self.metrics.evictions.labels(reason=reason).inc()
        log.info("session removed", extra={"fields": {"event": "remove", "ctx_id": s.ctx_id, "reason": reason}})

    def forward_cost(self) -> dict[str, float | int]:
        """The fitted forward cost, the recent rate and the node value (/v1/model, /metrics, the log)."""
        return {**self.budget.cost.describe(), "tokens_per_second": round(self.budget.rate, 3),
                "node_value": round(self.budget.node_value, 4)}

    def _measure_forward_cost(self, context: int = 32, rows: tuple[int, ...] = (1, 2, 4, 8, 1, 2, 4, 8, 16)) -> None:
        """Seed the cost fit (model thread, at start-up): forwards of one scratch sequence's row of n new tokens
        after `context` cached ones, each timed on the clock the serving fit reads (CPU seconds of this process on a
        CPU, wall seconds on a GPU). Skipped, with a line, where the pool has no room for the scratch sequence."""
        pool, model = self.model.pool, self.model
        clock = time.monotonic if self.budget.cost.steps else time.process_time
        g = torch.Generator().manual_seed(0)
        n_ids = max(1, min(model.support, 1000))
        seq_id = None
        try:
            seq_id = pool.allocate()
            model.forward([Row(seq_id, 0, torch.randint(0, n_ids, (context,), generator=g).tolist(), 0)])
            pool.set_length(seq_id, context)
            for n in rows:
                t0 = clock()
                model.forward([Row(seq_id, context, torch.randint(0, n_ids, (n,), generator=g).tolist(), n)])
                self.budget.forward(n, 0, clock() - t0, 1)
                pool.crop(seq_id, context)
        except OutOfBlocks:
            log.warning("forward cost not measured at start-up: the KV budget holds too few blocks; the first sessions "
                        "open without a fitted cost")
        finally:
            if seq_id is not None:
                pool.release(seq_id)

    def open_budget(self, s: Session) -> int:
        """The open answer's budget for the first round: what its owner's recent rounds were given, or before
        those the new session's prior acceptance read as a chain's at the present load (cloud/node_budget.py;
        0 with --node-budget false)."""
        return self.budget.first_budget(s.owner, s.acceptance.alpha) if self.settings.node_budget else 0

    def open_acceptance(self, s: Session) -> NodeAcceptance | None:
        """The open answer's node acceptance: the owner's pooled one (cloud/node_budget.py), which the new session's
        own starts from as the edge's does (None before the owner's first round, or with --node-budget false)."""
        pooled = self.budget.pooled(s.owner) if self.settings.node_budget else None
        if pooled is None:
            return None
        s.acceptance.nodes.seed(*pooled)
        return NodeAcceptance(*pooled)

    def node_budget(self, s: Session, accepted: int, depth: int, committed: int, parents: list[int],
                    q: list[float], kept: list[bool]) -> int:
        """A verified round's committed tokens counted, the session's acceptance updated, and its next budget
        (0 with --node-budget false); the round's nodes as `parents` (-1: the root) and `q`, and whether the
        target accepted each (`kept`)."""
        self.budget.committed(committed)
        s.acceptance.observe(accepted, depth)
        s.acceptance.nodes.observe(parents, q, kept)
        if not self.settings.node_budget:
            return 0
        self.budget.pool(s.owner, parents, q, kept)
        n = self.budget.budget(s.acceptance.alpha, s.acceptance.nodes.expected(parents, q))
        self.budget.given(s.owner, n)
        self.metrics.node_budget.observe(n)
        return n

    def row_ms(self) -> float:
        """What a further row costs a forward at the present load (ms), for the edge's count; 0 before the fit has
        seen 8 forwards, or with --node-budget false."""
        cost = self.budget.cost
        return round(cost.row_s * 1000, 4) if self.settings.node_budget and cost.forwards >= 8 else 0.0

    def speculate_instead(self, s: Session) -> bool:
        """Whether a session's stream should end for speculative rounds (stop_reason "speculate"): the cloud
        carries others' work (two or more jobs a forward, recently) and the session's first draft node is
        expected to add more than a row buys at the present rate. An idle cloud leaves it to the edge."""
        b = self.budget
        return (self.settings.node_budget and b.jobs_per_forward >= 2.0 and b.cost.forwards >= 8
                and s.acceptance.alpha > b.node_value)

    # --- the scheduler's model runner (cloud/scheduler.py `ModelRunner`): model thread only -----------
    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        return self.model.forward(rows)

    def blocks_needed(self, row: Row) -> int:
        return self.model.pool.blocks_needed(row)

    def blocks_available(self) -> int:
        return self.model.pool.manager.available()

    def tree_seqs(self, row: Row) -> int:
        return self._tree_pool.tree_seqs(row) if self._tree_pool is not None else 0

    def tree_seqs_available(self) -> int:
        return self._tree_pool.tree_seqs_free if self._tree_pool is not None else 1 << 30

    def make_room(self, blocks: int, progressing: bool) -> None:
        self.eviction.make_room(blocks, progressing)

    def prefill_slice(self, running: int) -> int:
        """Prefill tokens a forward carrying `running` round and decode tokens may add (model thread): what keeps
        it within `prefill_share_with_rounds` of the rounds' own forward by the fitted cost, at least one KV
        block so prefills go on; the token cap alone until the fit has seen prefills."""
        cap, cost = self.settings.max_prefill_tokens_with_rounds, self.budget.cost
        if cost.forwards < 8 or cost.prefill_token_s <= 0:
            return cap
        room = self.settings.prefill_share_with_rounds * cost.predict(max(running, 1)) / cost.prefill_token_s
        return max(self.settings.kv_block_size, min(cap, int(room)))

    def on_batch(self, b: BatchStats) -> None:
        """A forward's figures: the metrics and the cost fit."""
        self.metrics.batch_size.observe(b.rows)
        self.metrics.batch_tokens.observe(b.tokens)
        self.metrics.padded_tokens.inc(b.padded_tokens)
        self.metrics.forward_ms.observe(b.ms)
        cost = b.cpu_s if b.cpu_s is not None else b.ms / 1000.0
        paged = getattr(self.model, "paged", None)
        if paged is not None and paged.captured_last:  # a CUDA graph's capture: no forward's cost
            cost = -1.0
        if cost >= 0:
            self.budget.forward(b.running_tokens, b.tokens - b.running_tokens, cost, b.rows)
        if self.budget.cost.forwards % 500 == 0:
            log.info("forward cost", extra={"fields": {"event": "forward_cost", **self.forward_cost()}})
        for kind, waited in b.waits:
            self.metrics.queue_wait.labels(kind=kind).observe(waited)
