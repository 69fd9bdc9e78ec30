"""Prometheus metrics of the verifier (GET /metrics), one documented field per series.

Names follow Prometheus' conventions: base units (`_seconds`, `_bytes`), `_total` on counters
(prometheus_client appends it), help text saying what is measured. The process's own
`process_*` series (CPU, resident memory, open file descriptors, start time) come with them.
Each server builds its own registry, so several servers (or tests) in one process never share
counts. Acceptance per position i = position_accepted{position=i} / position_checked{position=i}:
the rate at which y_i is kept once the check reaches it (for a token tree, depth i: reached when the
accepted path did not end at a leaf before it). docs/PROTOCOL.md ("Metrics") lists every
series and the names they had before.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from shared.tree import TreeOutcome
from shared.verify import VerifyOutcome

PREFIX = "specsplit_cloud_"
# seconds: 0.5 ms .. 10 s
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, float("inf"))


class SecondsHistogram:
    """A `_seconds` histogram that its callers feed in milliseconds (the unit of the wire metrics)."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram

    def observe(self, ms: float) -> None:
        self.histogram.observe(ms / 1000.0)


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
    # per draft position i (1-based; a tree's depth i): rounds whose check reached y_i (a chain: i <= la + 1
    # and i <= k; a tree: i <= la, or i = la + 1 when the accepted path's last node has children)
    position_checked: Counter
    # per draft position i: rounds that kept y_i
    position_accepted: Counter
    # fed in ms: the target forward time of one verify round (its forwards, a resync's chunks included);
    # exported in seconds
    prefill_ms: SecondsHistogram
    # fed in ms: the prompt prefill of a session's open or of a generation (all its chunks); exported in seconds
    prompt_prefill_ms: SecondsHistogram
    # fed in ms: time a request waited for the model (its session and the queue); exported in seconds
    queue_ms: SecondsHistogram
    # fed in ms by record_round: queue wait + forward of each verify round; exported in seconds
    verify_round_ms: SecondsHistogram
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
    # fed in ms: wall time of each batched forward; exported in seconds
    forward_ms: SecondsHistogram
    # sessions open now
    open_sessions: Gauge
    # KV cache bytes held by open sessions (their lengths x bytes per position)
    kv_bytes: Gauge
    # the KV budget (kv_budget_bytes): sessions are evicted beyond it
    kv_budget_bytes: Gauge
    # bytes the KV pool has allocated (blocks that exist x block bytes; never above kv_budget_bytes)
    kv_pool_bytes: Gauge
    # bytes the graph executor's CUDA graphs hold (never above graph_memory_bytes)
    graph_bytes: Gauge
    # the graph executor's forwards, by path: "replayed" (a captured CUDA graph) or "eager" (outside every bucket)
    executor_forwards: Counter
    # model-bound requests admitted and not finished
    queue_depth: Gauge
    # 1, labelled with the dtype the target runs in, why (what --dtype auto saw) and whether forwards are
    # batch-invariant
    model_dtype: Gauge
    # sessions removed other than by DELETE, by reason ("ttl", "kv_budget": evicted for KV blocks)
    evictions: Counter
    # error answers by code (invalid_argument, not_found, ...)
    errors: Counter
    # answers of /v1/ routes and Verifier methods, by transport ("rest" | "grpc") and HTTP status
    # (gRPC: the status of the REST twin of its code, 200 for OK)
    responses: Counter
    # tokens produced by POST /v1/generate
    generated: Counter
    # tokens sent by session streams (POST /v1/sessions/{ctx_id}/stream, StreamSession): each a k = 0 round
    streamed: Counter
    # pauses of the interpreter's garbage collections, by generation (cloud/gc_pauses.py)
    gc_pause: Histogram
    # the node budget given with each verify answer (cloud/node_budget.py)
    node_budget: Histogram
    # the fitted forward cost by term: base (a forward's fixed part), row (per verify or decode token),
    # prefill_token; seconds
    forward_cost: Gauge
    # committed tokens per second of forwards, recently, and b x that rate: the least a further node must add
    tokens_per_forward_second: Gauge
    node_value: Gauge

    @classmethod
    def create(cls, max_k: int, kv_budget_bytes: int = 0) -> CloudMetrics:
        r = CollectorRegistry()
        ProcessCollector(registry=r)
        p = PREFIX

        def seconds(name: str, doc: str) -> SecondsHistogram:
            return SecondsHistogram(Histogram(p + name, doc, buckets=SECONDS_BUCKETS, registry=r))

        m = cls(
            registry=r,
            rounds=Counter(p + "rounds", "Verify rounds run on the target model (replays excluded).", registry=r),
            drafted=Counter(p + "drafted_tokens", "Draft tokens received for verification (sum of k).", registry=r),
            accepted=Counter(p + "accepted_tokens", "Draft tokens the verifier accepted (sum of accepted_len).",
                             registry=r),
            emitted=Counter(p + "emitted_tokens", "Tokens committed by the cloud: accepted plus correction or bonus.",
                            registry=r),
            replayed=Counter(p + "replayed_rounds", "Verify rounds answered from a session's replay cache.",
                             registry=r),
            accepted_len=Histogram(p + "accepted_length", "Draft tokens accepted per verify round (accepted_len).",
                                   buckets=[*range(0, max_k + 1), float("inf")], registry=r),
            position_checked=Counter(p + "position_checked", "Verify rounds whose check reached draft position i "
                                     "(a token tree's depth i: not once its accepted path ended at a leaf).",
                                     ["position"], registry=r),
            position_accepted=Counter(p + "position_accepted", "Verify rounds that kept the draft token at "
                                      "position i.", ["position"], registry=r),
            prefill_ms=seconds("target_forward_seconds", "Target forward time of one verify round (prompt prefills "
                               "are in prompt_prefill_seconds)."),
            prompt_prefill_ms=seconds("prompt_prefill_seconds", "Target forward time of one prompt prefill (all "
                                      "chunks): a session's open or a generation's prompt."),
            queue_ms=seconds("request_wait_seconds", "Time a request waited for the model (its session's earlier "
                             "rounds and the queue) before its forward started."),
            verify_round_ms=seconds("verify_round_seconds", "Queue wait plus target forward of each verify round "
                                    "(the verifier's share of a round trip)."),
            batch_size=Histogram(p + "batch_size", "Rows (sessions, prefills, generate streams) per batched forward.",
                                 buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, float("inf")), registry=r),
            batch_tokens=Histogram(p + "batch_tokens", "Real tokens per forward (one flattened row, no padding).",
                                   buckets=(1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, float("inf")),
                                   registry=r),
            padded_tokens=Counter(p + "padded_equivalent_tokens", "Tokens a right-padded batch of the same rows "
                                  "would have run (rows x longest row).", registry=r),
            queue_wait=Histogram(p + "queue_wait_seconds", "Time from admission to a job's first forward, by job "
                                 "kind (round, decode, prefill).", ["kind"], buckets=SECONDS_BUCKETS, registry=r),
            kv_blocks=Gauge(p + "kv_blocks", "KV blocks by state: used (in block tables), cached (prefix cache, "
                            "unreferenced), free.", ["state"], registry=r),
            prefix_hit_tokens=Counter(p + "prefix_cache_hit_tokens", "Positions served from the prefix cache "
                                      "instead of a forward.", registry=r),
            cached_block_evictions=Counter(p + "kv_cached_block_evictions", "Cached prefix blocks taken back for "
                                           "reuse.", registry=r),
            forward_ms=seconds("batch_forward_seconds", "Wall time of each batched target forward."),
            open_sessions=Gauge(p + "open_sessions", "Sessions open now.", registry=r),
            kv_bytes=Gauge(p + "kv_bytes", "KV cache bytes held by open sessions (their lengths x bytes per "
                           "position).", registry=r),
            kv_budget_bytes=Gauge(p + "kv_budget_bytes", "The KV budget (kv_budget_bytes): idle sessions are "
                                  "evicted beyond it.", registry=r),
            kv_pool_bytes=Gauge(p + "kv_pool_bytes", "Bytes the KV pool has allocated (never above the budget).",
                                registry=r),
            graph_bytes=Gauge(p + "graph_bytes", "Bytes the CUDA graphs hold (never above graph_memory_bytes).",
                              registry=r),
            executor_forwards=Counter(p + "executor_forwards", "The graph executor's forwards by path: replayed "
                                      "from a CUDA graph, or eager (outside every captured bucket).", ["path"],
                                      registry=r),
            queue_depth=Gauge(p + "queue_depth", "Model-bound requests admitted and not finished.", registry=r),
            model_dtype=Gauge(p + "model_dtype", "1, labelled with the target's dtype, why it was chosen and whether "
                              "its forwards are batch-invariant.", ["dtype", "reason", "batch_invariant"], registry=r),
            evictions=Counter(p + "evictions", "Sessions removed other than by close, by reason (ttl, kv_budget).",
                              ["reason"], registry=r),
            errors=Counter(p + "errors", "Error answers by error code (invalid_argument, not_found, ...).", ["code"],
                           registry=r),
            responses=Counter(p + "responses", "Answers of /v1/ routes and Verifier methods by transport and "
                              "HTTP status (gRPC: its REST twin's).", ["transport", "status"], registry=r),
            generated=Counter(p + "generated_tokens", "Tokens produced by POST /v1/generate.", registry=r),
            streamed=Counter(p + "streamed_tokens", "Tokens sent by session streams, each one k = 0 verify round "
                             "(also counted in rounds).", registry=r),
            gc_pause=Histogram(p + "gc_pause_seconds", "Pauses of the interpreter's garbage collections (every thread "
                               "waits), by generation.", ["generation"], buckets=SECONDS_BUCKETS, registry=r),
            node_budget=Histogram(p + "node_budget", "The node budget given with each verify answer: the most draft "
                                  "nodes the next round should send.", buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48,
                                                                                64, 128, 256, float("inf")), registry=r),
            forward_cost=Gauge(p + "forward_cost_seconds", "The forward cost fitted online (the process's CPU seconds "
                               "per forward, its rows' processing and the requests served with it included; wall "
                               "seconds on a GPU), by term: base, row (each verify or decode token), prefill_token.", ["term"], registry=r),
            tokens_per_forward_second=Gauge(p + "tokens_per_forward_second", "Committed tokens per second of "
                                            "forward cost, recently.", registry=r),
            node_value=Gauge(p + "node_value", "Row cost x the recent rate: the fewest expected tokens a further "
                             "draft node must add to be given a row.", registry=r),
        )
        m.kv_budget_bytes.set(kv_budget_bytes)
        return m

    def record_round(self, out: VerifyOutcome | TreeOutcome, k: int, prefill_ms: float, queue_ms: float) -> None:
        la = out.accepted_len
        self.rounds.inc()
        self.drafted.inc(k)
        self.accepted.inc(la)
        self.emitted.inc(la + (out.next_token is not None))
        self.accepted_len.observe(la)
        # the deepest position checked: a chain's y_{la + 1} unless all k were kept; a tree's depth la + 1
        # only when the draw was tried against the children of the path's last node ("correction")
        reached = la + (out.next_kind == "correction") if isinstance(out, TreeOutcome) else min(la + 1, k)
        for i in range(1, reached + 1):
            self.position_checked.labels(position=str(i)).inc()
            if i <= la:
                self.position_accepted.labels(position=str(i)).inc()
        self.prefill_ms.observe(prefill_ms)
        self.queue_ms.observe(queue_ms)
        self.verify_round_ms.observe(prefill_ms + queue_ms)

    def render(self) -> bytes:
        return generate_latest(self.registry)
