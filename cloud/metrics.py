"""Prometheus metrics of the verifier (GET /metrics), one documented field per series.

Each server builds its own registry, so several servers (or tests) in one process never share
counts. Acceptance per position i = position_accepted{position=i} / position_checked{position=i}:
the rate at which y_i is kept once the check reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.verify import VerifyOutcome

_MS_BUCKETS = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, float("inf"))


@dataclass
class CloudMetrics:
    registry: CollectorRegistry
    # verify rounds run on the model (replays from the cache not included)
    rounds: Counter
    # draft tokens received: sum of k
    drafted: Counter
    # draft tokens accepted: sum of accepted_len
    accepted: Counter
    # tokens the cloud committed: accepted + correction/bonus (a residual token is drawn by the edge)
    emitted: Counter
    # rounds answered from a session's replay cache (late duplicates)
    replayed: Counter
    # accepted_len per round
    accepted_len: Histogram
    # per draft position i (1-based): rounds whose check reached y_i
    position_checked: Counter
    # per draft position i: rounds that kept y_i
    position_accepted: Counter
    # wall time of each target forward (verify rounds, session prefills, generate steps), ms
    prefill_ms: Histogram
    # time a request waited for the model (its session and the queue), ms
    queue_ms: Histogram
    # rows (sessions, prefills, generate streams) in each batched forward
    batch_size: Histogram
    # real tokens in each forward (one flattened row, no padding)
    batch_tokens: Histogram
    # tokens a right-padded batch of the same rows would have run (rows x longest row), summed
    padded_tokens: Counter
    # time from admission to a job's first forward, seconds, by kind (round, decode, prefill)
    queue_wait: Histogram
    # KV blocks by state: used (in a session's block table), cached (prefix cache, unreferenced), free
    kv_blocks: Gauge
    # prompt/context positions served from the prefix cache instead of a forward
    prefix_hit_tokens: Counter
    # unreferenced cached prefix blocks taken back for reuse (least recently used first)
    cached_block_evictions: Counter
    # wall time of each batched forward, ms
    forward_ms: Histogram
    # sessions open now
    open_sessions: Gauge
    # KV cache bytes held by open sessions (their lengths x bytes per position)
    kv_bytes: Gauge
    # bytes the KV pool has allocated (blocks that exist x block bytes; never above kv_budget_bytes)
    kv_pool_bytes: Gauge
    # model-bound requests admitted and not finished
    queue_depth: Gauge
    # sessions removed other than by DELETE, by reason ("ttl", "kv_budget": evicted for KV blocks)
    evictions: Counter
    # error answers by code (invalid_argument, not_found, ...)
    errors: Counter
    # tokens produced by POST /v1/generate
    generated: Counter

    @classmethod
    def create(cls, max_k: int) -> CloudMetrics:
        r = CollectorRegistry()
        p = "specsplit_cloud_"
        return cls(
            registry=r,
            rounds=Counter(p + "rounds", "verify rounds run on the model", registry=r),
            drafted=Counter(p + "drafted_tokens", "draft tokens received", registry=r),
            accepted=Counter(p + "accepted_tokens", "draft tokens accepted", registry=r),
            emitted=Counter(p + "emitted_tokens", "tokens committed by the cloud", registry=r),
            replayed=Counter(p + "replayed_rounds", "rounds answered from the replay cache", registry=r),
            accepted_len=Histogram(p + "accepted_length", "accepted_len per round",
                                   buckets=[*range(0, max_k + 1), float("inf")], registry=r),
            position_checked=Counter(p + "position_checked", "rounds whose check reached draft position i",
                                     ["position"], registry=r),
            position_accepted=Counter(p + "position_accepted", "rounds that kept draft position i",
                                      ["position"], registry=r),
            prefill_ms=Histogram(p + "prefill_ms", "target forward wall time, ms", buckets=_MS_BUCKETS,
                                 registry=r),
            queue_ms=Histogram(p + "queue_ms", "wait for the model, ms", buckets=_MS_BUCKETS, registry=r),
            batch_size=Histogram(p + "batch_size", "rows per batched forward",
                                 buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, float("inf")), registry=r),
            batch_tokens=Histogram(p + "batch_tokens", "real tokens per forward (no padding)",
                                   buckets=(1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, float("inf")),
                                   registry=r),
            padded_tokens=Counter(p + "padded_equivalent_tokens", "tokens a right-padded batch of the same rows "
                                  "would have run (rows x longest row)", registry=r),
            queue_wait=Histogram(p + "queue_wait_seconds", "admission to first forward, seconds, by job kind",
                                 ["kind"], buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5,
                                                    10, float("inf")), registry=r),
            kv_blocks=Gauge(p + "kv_blocks", "KV blocks by state (used, cached, free)", ["state"], registry=r),
            prefix_hit_tokens=Counter(p + "prefix_cache_hit_tokens", "positions served from the prefix cache",
                                      registry=r),
            cached_block_evictions=Counter(p + "kv_cached_block_evictions", "cached prefix blocks taken back",
                                           registry=r),
            forward_ms=Histogram(p + "forward_ms", "batched forward wall time, ms", buckets=_MS_BUCKETS, registry=r),
            open_sessions=Gauge(p + "open_sessions", "sessions open", registry=r),
            kv_bytes=Gauge(p + "kv_bytes", "KV cache bytes held by sessions", registry=r),
            kv_pool_bytes=Gauge(p + "kv_pool_bytes", "KV pool bytes allocated", registry=r),
            queue_depth=Gauge(p + "queue_depth", "model-bound requests admitted", registry=r),
            evictions=Counter(p + "evictions", "sessions evicted or expired", ["reason"], registry=r),
            errors=Counter(p + "errors", "error answers by code", ["code"], registry=r),
            generated=Counter(p + "generated_tokens", "tokens of POST /v1/generate", registry=r),
        )

    def record_round(self, out: VerifyOutcome, k: int, prefill_ms: float, queue_ms: float) -> None:
        la = out.accepted_len
        self.rounds.inc()
        self.drafted.inc(k)
        self.accepted.inc(la)
        self.emitted.inc(la + (out.next_token is not None))
        self.accepted_len.observe(la)
        for i in range(1, min(la + 1, k) + 1):
            self.position_checked.labels(position=str(i)).inc()
            if i <= la:
                self.position_accepted.labels(position=str(i)).inc()
        self.prefill_ms.observe(prefill_ms)
        self.queue_ms.observe(queue_ms)

    def render(self) -> bytes:
        return generate_latest(self.registry)
