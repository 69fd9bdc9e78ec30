"""The OpenAI server's Prometheus metrics (GET /metrics).

Counters are fed from one generation's EdgeMetrics when it ends (finished, stopped, cancelled or
failed), so the words are those of edge/metrics.py. The acceptance rate over all traffic is
specsplit_edge_accepted_tokens_total / specsplit_edge_drafted_tokens_total. Histograms, in base
units: time to first token and between tokens (`TokenClock`, as tokens are committed), the verify
round trip and the tokens committed per round (one observation per round, at the end), a
generation's acceptance rate and its duration. With them the process's own `process_*` series.
Names follow Prometheus' conventions (`_seconds`, `_total` appended to counters by
prometheus_client); docs/OPENAI.md lists them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from .metrics import ORIGINS, EdgeMetrics, RoundRecord

PREFIX = "specsplit_edge_"
# seconds: 1 ms .. 60 s
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   float("inf"))
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, float("inf"))
TOKENS_PER_ROUND_BUCKETS = (*range(0, 17), 20, 24, 32, float("inf"))


@dataclass
class EdgePrometheus:
    registry: CollectorRegistry
    # generations ended, by endpoint ("completions" | "chat") and finish ("stop" | "length" | "cancelled" | "error")
    generations: Counter
    # generations running now
    active: Gauge
    # emitted tokens by origin (accepted, correction, bonus, residual, local, target)
    tokens: Counter
    # rounds run (verified + local)
    rounds: Counter
    # draft tokens sent for verification, and of those accepted
    drafted: Counter
    accepted: Counter
    # requests to the cloud, every attempt counted (open, verify, close)
    cloud_calls: Counter
    # tokens committed without the cloud's check (gate, timeout fallback)
    local_commits: Counter
    # of those, tokens committed unverified after a missed verify deadline (--timeout-fallback only)
    timeout_fallbacks: Counter
    # recovery: resends after retryable errors, reopened sessions, resyncs after 409, late answers
    retries: Counter
    reopens: Counter
    numerics_changes: Counter
    resyncs: Counter
    timeouts: Counter
    # seconds spent drafting (forwards of the draft model / n-gram lookups), waiting for the shared
    # draft model while other generations drafted, and waiting for verify answers (retries included)
    drafting_seconds: Counter
    draft_wait_seconds: Counter
    cloud_wait_seconds: Counter
    # token trees: verified rounds that sent one, and the nodes they sent
    tree_rounds: Counter
    tree_nodes: Counter
    # copy branches: tree nodes only a copy branch proposed, sent and accepted
    copy_nodes: Counter
    copy_accepted: Counter
    # bytes exchanged with the cloud by direction ("up" | "down"), and received with open answers (also in
    # "down"); the target's state bytes (before framing) received, by answer ("verify" | "open")
    wire_bytes: Counter
    open_bytes: Counter
    state_bytes: Counter
    # generated tokens by way (speculated in rounds, streamed by the cloud on the session), stream calls, and
    # switches between the two (edge/policy/stream.py)
    way_tokens: Counter
    stream_calls: Counter
    switches: Counter
    # error answers of the OpenAI routes by OpenAI error type
    errors: Counter
    # answers of the /v1/ routes by HTTP status
    responses: Counter
    # from a request's arrival to its first generated token
    ttft: Histogram
    # between consecutive generated tokens of one generation (a round's tokens come together)
    inter_token: Histogram
    # one verify exchange of a round (retries included), for rounds the cloud verified
    verify_round_trip: Histogram
    # the target's forwards that ran a row of a generation (verified rounds, streamed tokens), and their rows
    target_forwards: Counter
    target_rows: Counter
    # tokens committed per round (accepted + the next token; local rounds count too)
    tokens_per_round: Histogram
    # a generation's accepted / drafted (generations that sent drafts)
    acceptance: Histogram
    # from a request's arrival to its generation's end (finished generations)
    duration: Histogram

    @classmethod
    def create(cls) -> EdgePrometheus:
        r = CollectorRegistry()
        ProcessCollector(registry=r)
        p = PREFIX
        return cls(
            registry=r,
            generations=Counter(p + "generations", "Generations ended, by endpoint and finish reason.",
                                ["endpoint", "finish"], registry=r),
            active=Gauge(p + "active_generations", "Generations running now.", registry=r),
            tokens=Counter(p + "tokens", "Generated tokens by origin (accepted, correction, bonus, residual, "
                           "local, target).", ["origin"], registry=r),
            rounds=Counter(p + "rounds", "Rounds run (verified by the cloud and committed locally).", registry=r),
            drafted=Counter(p + "drafted_tokens", "Draft tokens sent to the cloud for verification.", registry=r),
            accepted=Counter(p + "accepted_tokens", "Draft tokens the cloud accepted.", registry=r),
            cloud_calls=Counter(p + "cloud_calls", "Requests to the cloud, every attempt counted.", registry=r),
            target_forwards=Counter(p + "target_forwards", "The target's forwards that ran a row of a generation: "
                                    "verified rounds and streamed tokens.", registry=r),
            target_rows=Counter(p + "target_rows", "Rows of the target's forwards the generations took (the context "
                                "fed and the drafts per round, one per streamed token); over committed tokens, "
                                "the cloud's work per token.", registry=r),
            local_commits=Counter(p + "local_commits", "Tokens committed without the cloud's check (lossy).",
                                  registry=r),
            timeout_fallbacks=Counter(p + "timeout_fallbacks", "Of those, tokens committed unverified after a "
                                      "missed verify deadline (--timeout-fallback only).", registry=r),
            retries=Counter(p + "retries", "Cloud requests resent after retryable errors.", registry=r),
            reopens=Counter(p + "reopens", "Cloud sessions reopened after 404.", registry=r),
            numerics_changes=Counter(p + "numerics_changes", "Reopens answered by a cloud of other numerics than "
                                     "the session's (a failover to another dtype, runner, group size, CPU or "
                                     "checkpoint); the committed text is kept.", registry=r),
            resyncs=Counter(p + "resyncs", "Rounds resent from the cloud's length after 409.", registry=r),
            timeouts=Counter(p + "verify_timeouts", "Verify answers later than the timeout.", registry=r),
            drafting_seconds=Counter(p + "drafting_seconds", "Time spent drafting.", registry=r),
            draft_wait_seconds=Counter(p + "draft_wait_seconds", "Time waiting for the shared draft model.",
                                       registry=r),
            cloud_wait_seconds=Counter(p + "cloud_wait_seconds", "Time waiting for verify answers (retries "
                                       "included).", registry=r),
            tree_rounds=Counter(p + "tree_rounds", "Verified rounds that sent a token tree.", registry=r),
            tree_nodes=Counter(p + "tree_nodes", "Token-tree nodes sent to the cloud (also in drafted_tokens).",
                               registry=r),
            copy_nodes=Counter(p + "copy_nodes", "Tree nodes only a copy branch proposed (also in tree_nodes).",
                               registry=r),
            copy_accepted=Counter(p + "copy_accepted", "Copy-branch nodes the target accepted.", registry=r),
            wire_bytes=Counter(p + "wire_bytes", "Bytes exchanged with the cloud, framing included, by direction.",
                               ["direction"], registry=r),
            open_bytes=Counter(p + "open_bytes", "Bytes received with open answers, reopens included (also in "
                               "wire_bytes down).", registry=r),
            state_bytes=Counter(p + "state_bytes", "The target's state bytes received (before framing), with "
                                "verify answers or opens.", ["answer"], registry=r),
            way_tokens=Counter(p + "way_tokens", "Generated tokens by way: speculated (rounds) or streamed (the "
                               "cloud streaming on the session).", ["way"], registry=r),
            stream_calls=Counter(p + "stream_calls", "Streams of target-only tokens on a session.", registry=r),
            switches=Counter(p + "way_switches", "Switches between speculating and streaming.", registry=r),
            errors=Counter(p + "errors", "Error answers of the OpenAI routes by OpenAI error type.", ["type"],
                           registry=r),
            responses=Counter(p + "responses", "Answers of the /v1/ routes by HTTP status.", ["status"],
                              registry=r),
            ttft=Histogram(p + "time_to_first_token_seconds", "Time from a request's arrival to its first "
                           "generated token.", buckets=LATENCY_BUCKETS, registry=r),
            inter_token=Histogram(p + "inter_token_latency_seconds", "Time between consecutive generated tokens "
                                  "of one generation.", buckets=LATENCY_BUCKETS, registry=r),
            verify_round_trip=Histogram(p + "verify_round_trip_seconds", "Wall time of one round's verify "
                                        "exchange with the cloud, retries included.", buckets=LATENCY_BUCKETS,
                                        registry=r),
            tokens_per_round=Histogram(p + "tokens_per_round", "Tokens committed per round (accepted plus the "
                                       "next token).", buckets=TOKENS_PER_ROUND_BUCKETS, registry=r),
            acceptance=Histogram(p + "acceptance_ratio", "A generation's accepted / drafted tokens.",
                                 buckets=RATIO_BUCKETS, registry=r),
            duration=Histogram(p + "request_duration_seconds", "Time from a request's arrival to the end of its "
                               "generation (finished generations).", buckets=LATENCY_BUCKETS, registry=r),
        )

    def record(self, m: EdgeMetrics, draft_wait_s: float = 0.0, rounds: Iterable[RoundRecord] = ()) -> None:
        """Add one ended generation's work; `draft_wait_s` of its drafting time was spent queueing."""
        for origin in ORIGINS:
            if m.by_origin.get(origin):
                self.tokens.labels(origin).inc(m.by_origin[origin])
        self.rounds.inc(m.rounds)
        self.drafted.inc(m.drafted)
        self.accepted.inc(m.accepted)
        self.cloud_calls.inc(m.cloud_calls)
        self.target_forwards.inc(m.target_forwards)
        self.target_rows.inc(m.target_rows)
        self.local_commits.inc(m.local_commits)
        self.timeout_fallbacks.inc(m.timeout_fallbacks)
        self.retries.inc(m.retries)
        self.reopens.inc(m.reopens)
        self.numerics_changes.inc(m.numerics_changes)
        self.resyncs.inc(m.resyncs)
        self.timeouts.inc(m.timeouts)
        self.tree_rounds.inc(m.tree_rounds)
        self.tree_nodes.inc(m.tree_nodes)
        self.copy_nodes.inc(m.copy_nodes)
        self.copy_accepted.inc(m.copy_accepted)
        self.wire_bytes.labels("up").inc(m.bytes_up)
        self.wire_bytes.labels("down").inc(m.bytes_down)
        self.open_bytes.inc(m.open_bytes_down)
        self.state_bytes.labels("verify").inc(m.feature_bytes)
        self.state_bytes.labels("open").inc(m.open_feature_bytes)
        if m.rounds or m.streamed:  # a speculative generation
            self.way_tokens.labels("speculated").inc(max(0, m.emitted - m.streamed))
            self.way_tokens.labels("streamed").inc(m.streamed)
        self.stream_calls.inc(m.stream_calls)
        self.switches.inc(m.switches)
        self.drafting_seconds.inc(max(0.0, m.edge_time_ms / 1000 - draft_wait_s))
        self.draft_wait_seconds.inc(draft_wait_s)
        self.cloud_wait_seconds.inc(m.rtt_ms / 1000)
        if m.drafted:
            self.acceptance.observe(m.acceptance_rate)
        for rec in rounds:
            self.tokens_per_round.observe(rec.committed)
            if rec.decided_by == "cloud":
                self.verify_round_trip.observe(rec.rtt_ms / 1000)

    def token_clock(self, start: float, clock: Callable[[], float] = time.monotonic) -> TokenClock:
        """Times one generation's tokens from `start` (a `clock()` reading at the request's arrival)."""
        return TokenClock(self, start, clock)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class TokenClock:
    """`tick()` at each generated token: the first observes time to first token, the rest inter-token latency."""

    def __init__(self, prom: EdgePrometheus, start: float, clock: Callable[[], float]) -> None:
        self.prom, self.start, self.clock = prom, start, clock
        self.last: float | None = None
        # seconds from the start to the first token (None before it)
        self.ttft_s: float | None = None

    def tick(self) -> None:
        now = self.clock()
        if self.last is None:
            self.ttft_s = now - self.start
            self.prom.ttft.observe(self.ttft_s)
        else:
            self.prom.inter_token.observe(now - self.last)
        self.last = now

    def finished(self) -> None:
        """The generation ended normally: observe its duration."""
        self.prom.duration.observe(self.clock() - self.start)
