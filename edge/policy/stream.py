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
Unless its first decision (below) says otherwise, the session starts speculating; after `min_rounds` rounds
it streams when streaming is cheaper by `margin`. It streams `chunk` tokens (from `chunk_min`, doubling after
each chunk while streaming stays cheaper, up to `chunk_max`); after every chunk one speculative round (the
probe) measures speculation again, and the session speculates once more when that has become cheaper by `margin` (acceptance rose,
the link improved). Chunks never exceed the cloud's `max_generate_tokens` (GET /v1/model; `limit`). A stream
that fails (a proxy that cannot pass server-sent events, a cloud in trouble, a cloud refusing the chunk) ends
streaming for the session; the next session tries again. A draft model reads the streamed tokens while the
stream goes on (edge/prefetch.py `catch_up`), so the probe pays only the last few of them; other drafters
catch up within the probe, which leans the choice towards streaming, the way the cloud alone would go.

The first decision comes before the first round (`start`), from evidence the session already has: the
measured costs carried from the client's last session when it measured both ways, else the cloud's fitted
forward cost (`ForwardFit`: what a verify of k drafts costs against one step, from the open answer, else the
cloud's model info, else the last session's) with the draft's acceptance (the API key's pooled acceptance of the
open answer, else the draft's prior), priced by the same tokens-per-cost rule:

    speculate: min over k of (t_verify(k) + link + k t_draft) / E[tokens](k),   E = 1 + a + ... + a^k
    stream:    t_verify(0) + `stream_overhead_ms`

with t_verify(k) the fit's cost of k + 1 rows in units of the cloud's one-position forward, the link and the
drafting that a round waits for as the edge measured them (the drafting, before any round, from one draft step
timed after the prompt's catch-up, edge/prefetch.py `step_ms`, when that catch-up is done by the open's answer; 0
while unmeasured, so the reading is speculation's best case; the "cloud" objective leaves both out and the
overhead too). Unless speculation is cheaper by `margin` the session streams from its first token, with no round
and no switch: a reading without the drafting is speculation's best case, so a tie there is a loss once the
draft's time is paid (probe rounds still come). Where even a round whose every draft is
accepted could not beat streaming by `margin`, no probe could ever find speculation cheaper: the session streams
without probe rounds (`probes` False), and the draft reads nothing while it does. Without a fit (an older cloud,
a cloud that has fitted too few forwards) the session starts speculating, as above.

Either way every committed token is the target's own draw at its position when the session's rounds are
greedy or draw-and-match trees (shared/tree.py) of a "strict" session (whose rounds without a tree are k = 0
rounds), so the text does not depend on the switches; the edge switches only for such sessions
(edge/speculative.py). Clocks stay outside: the caller feeds `observe_*`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

OBJECTIVES = ("latency", "cloud")
# why a session began as it did (WayControl.start_reason): the client's last session measured both ways; the
# cloud's fitted forward cost priced both ways; the cloud did not say its cost (rounds first)
START_REASONS = ("carried_costs", "cloud_costs", "no_cost_figures")
# forwards a cloud's cost fit must have seen before the edge reads it (as edge/verdict.py does)
MIN_FORWARDS = 8
# nodes of the draft's prior that a pooled acceptance is pulled towards (as CostModelK.prior_weight)
PRIOR_NODES = 3.0


def _ewma(old: float | None, new: float, w: float) -> float:
    return new if old is None else (1 - w) * old + w * new


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)


@dataclass(frozen=True)
class ForwardFit:
    """A cloud's forward cost as it fitted it (`forward_cost`: GET /v1/model, gRPC ForwardCost): base + row x rows,
    ms (the process's CPU time per forward on a CPU, wall time on a GPU; cloud/node_budget.py)."""
    base_ms: float
    row_ms: float

    @classmethod
    def of(cls, cost: Any) -> ForwardFit | None:
        """From a mapping (REST's JSON) or an object with the same fields; None when absent, fitted on fewer than
        MIN_FORWARDS forwards, or of no cost at all."""
        if cost is None:
            return None
        try:
            forwards = int(_field(cost, "forwards") or 0)
            base, row = float(_field(cost, "base_ms") or 0.0), float(_field(cost, "row_ms") or 0.0)
        except (TypeError, ValueError):
            return None
        if forwards < MIN_FORWARDS or base < 0 or row < 0 or base + row <= 0:
            return None
        return cls(base, row)

    def verify_ms(self, k: int) -> float:
        """A forward of k drafts and the token before them: k + 1 rows."""
        return self.base_ms + self.row_ms * (k + 1)

    def steps(self, k: int) -> float:
        """What a verify of k costs against one step (a one-row forward) on this cloud."""
        return self.verify_ms(k) / self.verify_ms(0)


def chain_tokens(accept: float, k: int) -> float:
    """E[tokens] of a round of k drafts, each accepted with `accept` once all before it were: 1 + a + ... + a^k."""
    a = min(max(accept, 0.0), 1.0)
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def pooled_accept(kept: Sequence[float], tried: Sequence[float], prior: float) -> float | None:
    """A pooled acceptance by q (NodeAcceptance: nodes accepted and tried per tenth of q) read as one chance that a
    draft token is accepted once its parent was, pulled to `prior` by PRIOR_NODES nodes; None when it tried none."""
    n = float(sum(tried))
    if n <= 0:
        return None
    return (float(sum(kept)) + PRIOR_NODES * prior) / (n + PRIOR_NODES)


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
    # the cloud's fitted forward cost (None: not said, or fitted on too few forwards)
    fit: ForwardFit | None = None
    # a probe round after every stream chunk; False where the fit says not even a round whose every draft is
    # accepted could beat streaming by the margin (no probe could find speculation cheaper)
    probes: bool = True
    # how the session began, "stream" (from its first token) or "speculate" (rounds first); why (START_REASONS);
    # and the figures behind it, in words ("" before `start`)
    start_way: str = ""
    start_reason: str = ""
    start_note: str = ""

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
        if last is not None:  # the same cloud: its cost and its one-position forward, until this session says them
            self.fit = self.fit or last.fit
            self.one_step_ms = self.one_step_ms or last.one_step_ms
        return self

    def know_costs(self, cost: Any) -> WayControl:
        """The cloud's forward cost as it said it (a mapping or an object: ForwardFit.of); the one known so far is
        kept when it says none. Returns self."""
        fit = ForwardFit.of(cost)
        if fit is not None:
            self.fit = fit
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

    # -- the first decision ---------------------------------------------------------------------

    def _step_ms(self) -> float:
        """One step, ms: the cloud's one-position forward as rounds measured it (the latency objective), else the
        fit's (the cloud's CPU time on a CPU: where its forward runs on several threads, more than its wall time,
        so the link and the drafting then weigh less than they should, and the rule leans to speculating)."""
        assert self.fit is not None
        if self.objective == "latency" and self.one_step_ms is not None and self.one_step_ms > 0:
            return self.one_step_ms
        return self.fit.verify_ms(0)

    def priced(self, accept: float, ks: Sequence[int], link_ms: float | None = None,
               draft_ms: float | None = None) -> tuple[float, float, int]:
        """(ms a token speculating at the best k of `ks`, ms a token streaming, that k) by the fit, with drafts
        accepted at `accept`, the link's round trip beyond the cloud's time and the drafting a round waits for per
        draft (0 while unmeasured; the "cloud" objective counts neither): the module docstring's rule."""
        assert self.fit is not None and len(ks) > 0
        fit, step, latency = self.fit, self._step_ms(), self.objective == "latency"
        link, per_draft = ((link_ms or 0.0), (draft_ms or 0.0)) if latency else (0.0, 0.0)

        def per_token(k: int) -> float:
            return (fit.steps(k) * step + link + k * per_draft) / chain_tokens(accept, k)

        best = min(ks, key=lambda k: (per_token(k), k))
        return per_token(best), step + (self.stream_overhead_ms if latency else 0.0), best

    def room(self, ks: Sequence[int], link_ms: float | None = None, draft_ms: float | None = None) -> bool:
        """Whether speculation could beat streaming by the margin on this cloud at all: a round whose every draft
        is accepted, priced by the fit (True without one)."""
        if self.fit is None or len(ks) == 0:
            return True
        spec, stream, _ = self.priced(1.0, ks, link_ms, draft_ms)
        return self._cheaper(spec, stream)

    def _carried(self) -> bool | None:
        """What measured costs carried from the last session say: stream (True), speculate (False); None: none.
        As for the cloud's figures, speculation must be cheaper by the margin (a tie streams: no round, no switch)."""
        if self.rounds < self.min_rounds or self.spec_cost() is None or self.stream_cost() is None:
            return None
        return not self._cheaper(self.spec_cost(), self.stream_cost())

    def streams_first(self, ks: Sequence[int], link_ms: float | None = None, draft_ms: float | None = None) -> bool:
        """Asked before the open: the session streams its first token whatever the open answer adds (the carried
        costs say so, or the fit known so far leaves speculation no room), so the draft need not read the prompt."""
        carried = self._carried()
        return carried if carried is not None else not self.room(ks, link_ms, draft_ms)

    def start(self, accept: float, accept_from: str, ks: Sequence[int], link_ms: float | None = None,
              draft_ms: float | None = None) -> str:
        """The first decision, before any round (module docstring): stream from the first token, or speculate
        first. `accept` is the chance a draft token is accepted (`accept_from` says whose: "pooled", "prior"),
        `ks` the draft counts a round may send. Sets start_way / start_reason / start_note; returns start_way."""
        carried, room = self._carried(), self.room(ks, link_ms, draft_ms)
        if carried is not None:
            streams, self.start_reason = carried, "carried_costs"
            spec, stream = self.spec_cost(), self.stream_cost()
            self.start_note = (f"the client's last session measured {spec or 0:.1f} ms a token speculating, "
                               + (f"{stream:.1f} ms streaming" if stream is not None else "streaming unmeasured"))
        elif self.fit is None:
            streams, self.start_reason = False, "no_cost_figures"
            self.start_note = "the cloud did not say its forward cost (or has fitted too few forwards): rounds first"
        else:
            spec, stream, k = self.priced(accept, ks, link_ms, draft_ms)
            streams, self.start_reason = not room or not self._cheaper(spec, stream), "cloud_costs"
            step = self._step_ms()
            self.start_note = (f"a verify of {k} costs {self.fit.steps(k):.1f} steps on this cloud and a draft token "
                               f"is accepted at {accept:.2f} ({accept_from}): {spec / step:.2f} steps a token "
                               f"speculating, {stream / step:.2f} streaming")
            if not room:
                self.start_note += "; no probe rounds: not even a round of accepted drafts would pay here"
        if streams and not self.stream_broken:
            self.streaming, self.chunk, self._probe_due = True, max(self.chunk, self.chunk_min), False
            self.probes = room
        self.start_way = "stream" if self.streaming else "speculate"
        return self.start_way

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
        self._probe_due = self.probes
        if not self.probes:  # no probe to wait for: the next chunk is longer at once
            self.chunk = min(2 * self.chunk, self.chunk_max)
