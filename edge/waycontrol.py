"""Speculate or stream, per session, by the numbers.

A speculative round pays the edge's drafting, the round trip and one verify forward, and commits the
accepted drafts plus one token. A stream on the same session (PROTOCOL.md "Streaming on a session") pays
the round trip once and one target forward per token. Which is faster depends on acceptance, the link and
the cloud's forward costs, all of which the edge sees, so it keeps one running cost per token for each way:

    speculate: EWMA of the rounds' cost / EWMA of the tokens they committed
    stream:    the same over stream chunks; before the first one, the cloud's reported time of a
               one-position forward (the k controller's verify fit at k = 0) plus `stream_overhead_ms`

A client's generations share a link and a cloud, so a new session starts from the last one's costs and
chunk size (`carry`): over a slow link it streams from its first token, in chunks as long as the last
session's, instead of paying `min_rounds` rounds and short chunks first.
The cost is the wall time seen by the edge (`objective="latency"`) or the cloud's reported forward time
(`objective="cloud"`: an operator who pays for the cloud speculates whenever that saves cloud forwards).
The session starts speculating; after `min_rounds` rounds it streams when streaming is cheaper by
`margin`. It streams `chunk` tokens (from `chunk_min`, doubling after each chunk while streaming stays
cheaper, up to `chunk_max`); after every chunk one speculative round (the probe) measures speculation
again, and the session speculates once more when that has become cheaper by `margin` (acceptance rose,
the link improved). Chunks never exceed the cloud's `max_generate_tokens` (GET /v1/model; `limit`). A stream
that fails (a proxy that cannot pass server-sent events, a cloud in trouble, a cloud refusing the chunk) ends
streaming for the session; the next session tries again. A draft model reads the streamed tokens while the
stream goes on (edge/prefetch.py `catch_up`), so the probe pays only the last few of them; other drafters
catch up within the probe, which leans the choice towards streaming, the way the cloud alone would go.

Either way every committed token is the target's own draw at its position when the session's rounds are
greedy or draw-and-match trees (shared/tree.py) of a "strict" session (whose rounds without a tree are k = 0
rounds), so the text does not depend on the switches; the edge switches only for such sessions
(edge/speculative.py). Clocks stay outside: the caller feeds `observe_*`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OBJECTIVES = ("latency", "cloud")


def _ewma(old: float | None, new: float, w: float) -> float:
    return new if old is None else (1 - w) * old + w * new


@dataclass
class WayControl:
    # "latency": wall time per token; "cloud": the cloud's forward time per token
    objective: str = "latency"
    # the other way must be this much cheaper to switch to it
    margin: float = 0.1
    # speculative rounds measured before the first switch
    min_rounds: int = 2
    # tokens of the first stream chunk, and the cap of the doubling
    chunk_min: int = 16
    chunk_max: int = 256
    # weight of a new round or chunk in the running costs
    weight: float = 0.3
    # the stream's wall cost per token beyond one forward, before any stream is measured (ms)
    stream_overhead_ms: float = 2.0
    # running [cost ms, tokens] of each way (None until measured)
    _spec: list[float | None] = field(default_factory=lambda: [None, None])
    _stream: list[float | None] = field(default_factory=lambda: [None, None])
    # the cloud's time of a one-position forward (ms), from the k or tree controller's fit
    one_step_ms: float | None = None
    # the session streams now; a probe round is due after the last chunk
    streaming: bool = False
    _probe_due: bool = False
    chunk: int = 0
    rounds: int = 0
    switches: int = 0
    # rounds speculated after the cloud ended a stream asking for them, before streaming is weighed again
    declined_rounds: int = 16
    # a stream failed in this session (a proxy that cannot stream, a cloud under trouble): speculate from now on
    stream_broken: bool = False

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be 'latency' or 'cloud', not {self.objective!r}")

    def carry(self, last: WayControl | None) -> WayControl:
        """Start from `last`'s costs (the same client's previous session) when it measured both ways or enough
        rounds; returns self."""
        if last is not None and last.objective == self.objective and last.rounds >= self.min_rounds:
            self._spec, self._stream = list(last._spec), list(last._stream)
            self.one_step_ms, self.rounds = last.one_step_ms, last.rounds
            self.chunk = last.chunk if last.streaming else 0  # a streaming link goes on with its chunk size
        return self

    def limit(self, most: int) -> WayControl:
        """Chunks of at most `most` tokens (the cloud's --max-generate-tokens; 0 = unknown); returns self."""
        if most > 0:
            self.chunk_min, self.chunk_max = min(self.chunk_min, most), min(self.chunk_max, most)
            self.chunk = min(self.chunk, self.chunk_max)
        return self

    # -- costs per token ------------------------------------------------------------------------

    def spec_cost(self) -> float | None:
        ms, tokens = self._spec
        return None if ms is None or not tokens else ms / tokens

    def stream_cost(self) -> float | None:
        ms, tokens = self._stream
        if ms is not None and tokens:
            return ms / tokens
        if self.one_step_ms is None or self.one_step_ms <= 0:
            return None
        return self.one_step_ms + (self.stream_overhead_ms if self.objective == "latency" else 0.0)

    def _cheaper(self, a: float | None, b: float | None) -> bool:
        """Cost a is below cost b by the margin."""
        return a is not None and b is not None and a * (1 + self.margin) < b

    # -- decisions ------------------------------------------------------------------------------

    def next(self) -> int:
        """Tokens to stream next, or 0 for a speculative round."""
        if self.stream_broken:
            return 0
        if not self.streaming:
            if self.rounds >= self.min_rounds and self._cheaper(self.stream_cost(), self.spec_cost()):
                self.streaming, self.chunk, self._probe_due = True, max(self.chunk, self.chunk_min), False
                self.switches += 1
                return self.chunk
            return 0
        return 0 if self._probe_due else self.chunk

    def observe_round(self, tokens: int, wall_ms: float, cloud_ms: float, one_step_ms: float | None = None) -> None:
        """One speculative round: tokens committed, its wall time and the cloud's forward time (ms)."""
        self.rounds += 1
        if one_step_ms is not None and one_step_ms > 0:
            self.one_step_ms = one_step_ms
        cost = wall_ms if self.objective == "latency" else cloud_ms
        self._spec = [_ewma(self._spec[0], max(0.0, cost), self.weight), _ewma(self._spec[1], tokens, self.weight)]
        if self.streaming and self._probe_due:
            self._probe_due = False
            if self._cheaper(self.spec_cost(), self.stream_cost()):
                self.streaming, self.chunk = False, 0
                self.switches += 1
            else:
                self.chunk = min(2 * self.chunk, self.chunk_max)

    def declined(self) -> None:
        """The cloud ended a stream asking for speculative rounds (it carries others' work, and a draft node
        buys it more than its row costs): speculate, and weigh streaming again only after `declined_rounds` rounds."""
        if self.streaming:
            self.switches += 1
        self.streaming, self.chunk, self.rounds = False, 0, self.min_rounds - self.declined_rounds

    def stream_failed(self) -> None:
        """A stream ended in an error: the session speculates from now on (a new session tries again)."""
        if self.streaming:
            self.switches += 1
        self.streaming, self.stream_broken, self.chunk = False, True, 0

    def observe_stream(self, tokens: int, wall_ms: float, cloud_ms: float) -> None:
        """One stream chunk: tokens received, its wall time and the cloud's forward time (ms)."""
        if tokens > 0:
            cost = wall_ms if self.objective == "latency" else cloud_ms
            self._stream = [_ewma(self._stream[0], max(0.0, cost), self.weight),
                            _ewma(self._stream[1], tokens, self.weight)]
        self._probe_due = True
