"""The OpenAI server's Prometheus metrics (GET /metrics), summed over finished generations.

Every counter is fed from one generation's EdgeMetrics when it ends (finished, stopped, cancelled
or failed), so the words are those of edge/metrics.py. The acceptance rate over all traffic is
specsplit_edge_accepted_tokens_total / specsplit_edge_drafted_tokens_total.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from .metrics import ORIGINS, EdgeMetrics

PREFIX = "specsplit_edge_"


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
    resyncs: Counter
    timeouts: Counter
    # seconds spent drafting (forwards of the draft model / n-gram lookups), waiting for the shared
    # draft model while other generations drafted, and waiting for verify answers (retries included)
    drafting_seconds: Counter
    draft_wait_seconds: Counter
    cloud_wait_seconds: Counter
    # error answers of the OpenAI routes by OpenAI error type
    errors: Counter

    @classmethod
    def create(cls) -> EdgePrometheus:
        r = CollectorRegistry()
        p = PREFIX
        return cls(
            registry=r,
            generations=Counter(p + "generations", "generations ended", ["endpoint", "finish"], registry=r),
            active=Gauge(p + "active_generations", "generations running", registry=r),
            tokens=Counter(p + "tokens", "emitted tokens by origin", ["origin"], registry=r),
            rounds=Counter(p + "rounds", "rounds run (verified + local)", registry=r),
            drafted=Counter(p + "drafted_tokens", "draft tokens sent for verification", registry=r),
            accepted=Counter(p + "accepted_tokens", "draft tokens the cloud accepted", registry=r),
            cloud_calls=Counter(p + "cloud_calls", "requests to the cloud, every attempt", registry=r),
            local_commits=Counter(p + "local_commits", "tokens committed unverified", registry=r),
            timeout_fallbacks=Counter(p + "timeout_fallbacks", "tokens committed unverified after a missed "
                                      "verify deadline (--timeout-fallback)", registry=r),
            retries=Counter(p + "retries", "resends after retryable errors", registry=r),
            reopens=Counter(p + "reopens", "sessions reopened after 404", registry=r),
            resyncs=Counter(p + "resyncs", "resends from the cloud's length after 409", registry=r),
            timeouts=Counter(p + "verify_timeouts", "verify answers later than the timeout", registry=r),
            drafting_seconds=Counter(p + "drafting_seconds", "time spent drafting", registry=r),
            draft_wait_seconds=Counter(p + "draft_wait_seconds", "time waiting for the shared draft model",
                                       registry=r),
            cloud_wait_seconds=Counter(p + "cloud_wait_seconds", "time waiting for verify answers", registry=r),
            errors=Counter(p + "errors", "error answers by type", ["type"], registry=r),
        )

    def record(self, m: EdgeMetrics, draft_wait_s: float = 0.0) -> None:
        """Add one ended generation's work; `draft_wait_s` of its drafting time was spent queueing."""
        for origin in ORIGINS:
            if m.by_origin.get(origin):
                self.tokens.labels(origin).inc(m.by_origin[origin])
        self.rounds.inc(m.rounds)
        self.drafted.inc(m.drafted)
        self.accepted.inc(m.accepted)
        self.cloud_calls.inc(m.cloud_calls)
        self.local_commits.inc(m.local_commits)
        self.timeout_fallbacks.inc(m.timeout_fallbacks)
        self.retries.inc(m.retries)
        self.reopens.inc(m.reopens)
        self.resyncs.inc(m.resyncs)
        self.timeouts.inc(m.timeouts)
        self.drafting_seconds.inc(max(0.0, m.edge_time_ms / 1000 - draft_wait_s))
        self.draft_wait_seconds.inc(draft_wait_s)
        self.cloud_wait_seconds.inc(m.rtt_ms / 1000)

    def render(self) -> bytes:
        return generate_latest(self.registry)
