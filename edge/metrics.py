"""What the edge records: committed tokens with their origin, one record per round, and totals.

Words as in shared/verify.py. A *round* is one draft block and what became of it: verified by the
cloud (`origin` "cloud"), committed locally by the uncertainty gate ("gate"), or committed locally
after the cloud answered too late ("timeout"). Local commits are lossy by design: those tokens
were never checked against the target.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# where a committed token came from
Origin = Literal["accepted", "correction", "bonus", "residual", "local", "target"]
ORIGINS: tuple[Origin, ...] = ("accepted", "correction", "bonus", "residual", "local", "target")


@dataclass(frozen=True)
class CommittedToken:
    # the token id
    token_id: int
    # "accepted" draft, cloud "correction" / "bonus", edge-drawn "residual", "local" (unverified:
    # gate, timeout fallback, edge_only) or "target" (cloud_only)
    origin: Origin
    # index of the round that committed it (0-based)
    round_index: int


@dataclass
class RoundRecord:
    # 0-based round index
    index: int
    # number of draft tokens proposed
    k: int
    # draft tokens kept (cloud-verified: La; locally committed: how many went in unverified)
    accepted_len: int
    # "correction" | "bonus" | "residual" | "local" (gate or timeout fallback, no cloud answer used)
    next_kind: str
    # "cloud" (verified), "gate" (uncertainty gate kept it local), "timeout" (late answer dropped)
    decided_by: str
    # tokens committed by this round (accepted + the next token; local commits count here too)
    committed: int
    # accepted_len / k (0 when k = 0)
    la_over_k: float = 0.0
    # the cloud's mean of min(1, p_i / q_i) over the draft (0 when not verified)
    alpha_mean: float = 0.0
    # edge wall time drafting this block
    edge_time_ms: float = 0.0
    # the cloud's target-forward time, as it reports it
    cloud_prefill_ms: float = 0.0
    # wall time of the verify exchange(s) of this round, retries included
    rtt_ms: float = 0.0
    # cumulative acceptance rate after this round: accepted / drafted over verified rounds
    A_cum: float = 0.0
    # payload bytes sent / received in this round (all attempts)
    bytes_up: int = 0
    bytes_down: int = 0
    # gating: fraction of hard draft tokens (None when gating is off)
    hard_ratio: float | None = None
    # gating: a rule (digits, dates, amounts) sent the block to the cloud
    triggered: bool = False
    # cloud calls made by this round beyond the first (retries, reopen, resync)
    extra_calls: int = 0
    # drafting while the previous round was verified: "hit" (its guess held), "miss" (dropped), "" (none)
    ahead: str = ""
    # draft tokens of this round that were ready from drafting ahead
    ahead_used: int = 0
    # drafting time those tokens took off this round's critical path, ms
    ahead_saved_ms: float = 0.0
    # the cloud's reported queue time
    cloud_queue_ms: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EdgeMetrics:
    # draft tokens proposed in rounds that the cloud verified
    drafted: int = 0
    # of those, accepted by the cloud
    accepted: int = 0
    # tokens emitted to the caller (after the prompt, truncated at EOS / max_new_tokens)
    emitted: int = 0
    # rounds run (verified + local)
    rounds: int = 0
    # requests sent to the cloud, every attempt counted (open, verify, generate, close)
    cloud_calls: int = 0
    # verify requests answered in time and used
    verify_calls: int = 0
    # attempts repeated after 429 / 413 / 5xx / connection errors / timeouts without fallback
    retries: int = 0
    # sessions reopened with the full context after 404
    reopens: int = 0
    # of those, reopens answered by a cloud of other numerics than the session's (ModelInfo.numerics: a failover
    # to a replica of another dtype, runner, group size, CPU or checkpoint); the committed text is kept
    numerics_changes: int = 0
    # resends from the cloud's expected length after 409
    resyncs: int = 0
    # verify answers later than the timeout (discarded)
    timeouts: int = 0
    # tokens committed without the cloud's check (gate, timeout fallback, edge_only)
    local_commits: int = 0
    # of those, tokens committed unverified after a missed verify deadline (only with --timeout-fallback)
    timeout_fallbacks: int = 0
    # the verify deadline of the last attempt (ms; edge/policy/deadline.py)
    deadline_ms: float = 0.0
    # rounds the uncertainty gate kept local
    gated_rounds: int = 0
    # emitted tokens per origin
    by_origin: dict[str, int] = field(default_factory=lambda: {o: 0 for o in ORIGINS})
    # per draft position i (0-based): verified rounds with k > i ...
    position_drafted: list[int] = field(default_factory=list)
    # ... and of those, rounds where draft token i + 1 was accepted
    position_accepted: list[int] = field(default_factory=list)
    # payload bytes: JSON bodies (REST) or serialized protobuf messages (gRPC), headers excluded
    bytes_up: int = 0
    bytes_down: int = 0
    # summed drafting time, verify round-trip time, and the cloud's reported forward time
    edge_time_ms: float = 0.0
    rtt_ms: float = 0.0
    cloud_prefill_ms: float = 0.0
    # drafting while verifying: rounds that drafted ahead, of those whose guess held, draft tokens
    # taken from it, drafting time taken off the critical path, and time waited for the worker, ms
    ahead_rounds: int = 0
    ahead_hits: int = 0
    ahead_tokens: int = 0
    ahead_saved_ms: float = 0.0
    ahead_wait_ms: float = 0.0
    # feature-fed drafting (a drafter wrapped by EdgeClient's states_drafting, edge/states_hook.py): rounds drafted
    # from the cloud's states, rounds with k > 0 drafted by the tokens-only fallback, and feature bytes received
    # with verify answers and with opens (vector and scale, before the transport's framing)
    head_rounds: int = 0
    fallback_rounds: int = 0
    feature_bytes: int = 0
    open_feature_bytes: int = 0
    # bytes received with open answers (reopens included; also in bytes_down): the prompt's states, when asked
    open_bytes_down: int = 0
    # token trees: verified rounds that sent a tree, and the nodes they sent (also counted in `drafted`)
    tree_rounds: int = 0
    tree_nodes: int = 0
    # copy branches (edge/drafters/lookup.py): nodes sent that only a copy branch proposed, and those accepted
    copy_nodes: int = 0
    copy_accepted: int = 0
    # tokens the cloud streamed on the session instead of rounds (edge/policy/stream.py), the stream calls,
    # and the switches between speculating and streaming
    streamed: int = 0
    stream_calls: int = 0
    switches: int = 0
    # how the session began (edge/policy/stream.py): "stream" (from its first token, no round before it) or
    # "speculate" ("" without a way controller); why, by name: "cloud_costs" (the cloud's fitted forward cost and
    # the key's pooled acceptance, or the draft's prior, priced both ways), "carried_costs" (the client's last
    # session measured both ways), "no_cost_figures" (the cloud did not say its cost: rounds first); and the
    # figures behind it, in words
    start_way: str = ""
    start_reason: str = ""
    start_note: str = ""
    # rows of the target's forwards this generation took, as the edge counts them: per verified round the context
    # tokens it fed (at least one) and the drafts it ran through the target, one per streamed token (each is a row
    # of its own forward); the prompt's prefill is not counted
    target_rows: int = 0
    # wall time from start to the first emitted token, and to the end
    ttft_ms: float = 0.0
    wall_ms: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted over verified rounds."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Mean La per verified round."""
        return self.accepted / self.verify_calls if self.verify_calls else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens each verify round committed (its accepted drafts and the one token of the cloud's): streamed
        tokens and local commits are not in it."""
        return (self.accepted + self.verify_calls) / self.verify_calls if self.verify_calls else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after the first (the prompt's prefill left out)."""
        ms = self.wall_ms - self.ttft_ms
        return (self.emitted - 1) / ms * 1000 if self.emitted > 1 and ms > 0 else 0.0

    @property
    def tokens_per_call(self) -> float:
        """Emitted tokens per cloud call, every attempt counted and a stream counted as the forwards it ran (one
        per streamed token), not as one call."""
        calls = self.cloud_calls - self.stream_calls + self.streamed
        return self.emitted / calls if calls > 0 else 0.0

    @property
    def target_forwards(self) -> int:
        """The target's forwards that ran a row of this generation: verified rounds and streamed tokens."""
        return self.verify_calls + self.streamed

    @property
    def tokens_per_forward(self) -> float:
        """Tokens committed by the cloud's forwards (verified rounds' and streamed) per forward."""
        n = self.target_forwards
        return (self.accepted + self.verify_calls + self.streamed) / n if n else 0.0

    @property
    def rows_per_token(self) -> float:
        """Rows of the target's forwards per token they committed: the cloud's work per token (1 for cloud_only)."""
        tokens = self.accepted + self.verify_calls + self.streamed
        return self.target_rows / tokens if tokens else 0.0

    def record_positions(self, k: int, accepted_len: int) -> None:
        """Per-position acceptance histogram of one verified round."""
        while len(self.position_drafted) < k:
            self.position_drafted.append(0)
            self.position_accepted.append(0)
        for i in range(k):
            self.position_drafted[i] += 1
            self.position_accepted[i] += int(i < accepted_len)

    @property
    def feature_bytes_per_round(self) -> float:
        """Feature bytes received with verify answers, per verified round."""
        return self.feature_bytes / self.verify_calls if self.verify_calls else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted_len=self.mean_accepted_len,
                 tokens_per_call=self.tokens_per_call, feature_bytes_per_round=self.feature_bytes_per_round,
                 tokens_per_verify=self.tokens_per_verify, tokens_per_forward=self.tokens_per_forward,
                 rows_per_token=self.rows_per_token, target_forwards=self.target_forwards)
        return d
