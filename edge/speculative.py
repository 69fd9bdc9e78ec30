"""One speculative generation against the cloud: draft, (gate), verify, commit, repeat.

The session's wire state and its recovery (S, cloud_len, the verify with its resends, reopens and resyncs)
are edge/exchange.py's CloudSession, its stream chunks edge/streaming.py's StreamingSession; this module drafts
chains and trees, lets the way controller (edge/policy/stream.py) stream target-only tokens on the same session
instead (`advance`; a stream cut short leaves the cloud ahead of S, and the next call's ctx_len crops it back),
and commits what an answer says.
Nothing is committed before an answer is used, so nothing is lost or duplicated.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from shared.errors import SpecSplitError
from shared.protocol import VerifyResponse
from shared.tree import depths
from shared.verify import sample_residual

from .drafters.base import DraftBlock, Drafter
from .drafters.tree import round_depth
from .exchange import RecoveryPolicy, SessionParams
from .metrics import EdgeMetrics, Origin, RoundRecord
from .policy.gating import GateDecision, GateThresholds, decide
from .policy.k import CostModelK, KController, RoundCosts
from .policy.stream import WayControl, pooled_accept
from .policy.tree import TreeControl
from .prefetch import AheadOutcome, DraftAhead, concat_blocks
from .streaming import StreamingSession
from .transport.base import Transport

log = logging.getLogger(__name__)


class SpeculativeRun(StreamingSession):
    """The edge side of one session; `step()` runs one round and returns the tokens it committed."""

    def __init__(self, transport: Transport, drafter: Drafter, params: SessionParams,
                 k_ctl: KController | CostModelK, metrics: EdgeMetrics, policy: RecoveryPolicy, *,
                 gate: GateThresholds | None = None, rule_triggers: bool = True,
                 detokenize: Callable[[Sequence[int]], str] | None = None,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
                 draft_ahead: bool = False, tree: TreeControl | None = None, way: WayControl | None = None,
                 stop_at_eos: bool = True, node_budget: bool = True) -> None:
        super().__init__(transport, drafter, params, metrics, policy, clock, sleep)
        self.k_ctl = k_ctl
        self.gate = gate
        self.rule_triggers = rule_triggers
        self.detokenize = detokenize or (lambda ids: "")
        self.records: list[RoundRecord] = []
        self._outcome = AheadOutcome()
        # the previous round was verified with k > 0 (the drafter's state is one round behind at most)
        self._prev_drafted = False
        # drafting while the cloud verifies (model drafter only; see prefetch.py)
        self.ahead = DraftAhead(drafter, params.sampling, params.seed, clock) \
            if draft_ahead and DraftAhead.supports(drafter) else None
        # token trees (edge/policy/tree.py) when the drafter grows them; rounds without one are chains
        self.tree = tree if tree is not None and hasattr(drafter, "propose_tree") and gate is None else None
        self._copy_path: list[int] = []  # the copy branch grafted into this round's tree
        # speculate or stream (edge/policy/stream.py): only where every committed token is the target's own draw
        # whichever way decided it (greedy, or draw-and-match trees of a "strict" session: "shortcut" draws
        # its corrections otherwise), so the text does not depend on switches
        same_text = params.sampling.greedy or (self.tree is not None and params.correction == "strict")
        self.way = way if way is not None and same_text and gate is None and not params.send_q_dists else None
        self.stop_at_eos = stop_at_eos
        self.obey_budget = node_budget  # the cloud's node_budget (CloudSession) is obeyed

    # -- session --------------------------------------------------------------------------------

    def open(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        self.S, self._states = [], []
        self._extend([int(t) for t in prompt_ids])
        self._budget = max_new_tokens
        self.drafter.reset()
        counts, link_ms, draft_ms = self._draft_counts(), *self._measured_costs()
        # the draft reads the prompt while the cloud does, unless the session streams its first token whatever the
        # open answer says: then nothing is read before that token (edge/policy/stream.py)
        if self.ahead is not None and not (self.way is not None and self.way.streams_first(counts, link_ms, draft_ms)):
            self.ahead.catch_up(self.S)
        self._open()
        if self.tree is not None and self.obey_budget and self.node_acceptance is not None:
            # a controller with nothing of its own values its nodes from the key's pooled acceptance, as the
            # cloud's budget does (shared/node_value.py); --no-node-budget: the edge's own evidence alone
            self.tree.nodes.seed(self.node_acceptance.kept, self.node_acceptance.tried)
        if self.way is not None:
            if draft_ms is None and self.ahead is not None:  # the draft step the prompt's catch-up timed, if done
                draft_ms = self.ahead.step_ms
            self._start_way(counts, link_ms, draft_ms)

    def _draft_counts(self) -> range:
        """The draft counts a round may send: a tree's nodes, the k controller's range, or its fixed k."""
        if self.tree is not None:
            n = self.tree.fixed_nodes or self.tree.max_nodes
            return range(n, n + 1) if self.tree.fixed_nodes else range(1, n + 1)
        ctl = self.k_ctl
        if not ctl.dynamic:
            return range(ctl.k, ctl.k + 1)
        return range(max(1, ctl.k_min), max(1, ctl.k_min, ctl.k_max) + 1)

    def _measured_costs(self) -> tuple[float | None, float | None]:
        """The link's round trip beyond the cloud's time and the drafting a round waits for per draft token, ms, as
        the controllers measured them so far (a tree controller carries its link from the client's last session;
        None: unmeasured)."""
        link = self.tree.rtt_ms if self.tree is not None else getattr(self.k_ctl, "rtt_ms", None)
        return link, getattr(self.k_ctl, "t_draft_ms", None)

    def _start_way(self, counts: range, link_ms: float | None, draft_ms: float | None) -> None:
        """The way controller's first decision, from the open answer's cost and acceptance (edge/policy/stream.py),
        recorded in the metrics."""
        assert self.way is not None
        self.way.know_costs(self.forward_cost)
        prior = float(getattr(self.k_ctl, "prior_accept", CostModelK.prior_accept))
        pool = self.node_acceptance if self.obey_budget else None  # --no-node-budget: the edge's own evidence
        pooled = pooled_accept(pool.kept, pool.tried, prior) if pool is not None else None
        if self.node_budget and self.obey_budget:  # the first round sends at most the open answer's budget
            counts = range(min(counts.start, self.node_budget), min(counts.stop - 1, self.node_budget) + 1)
        way = self.way.start(prior if pooled is None else pooled, "prior" if pooled is None else "pooled", counts,
                             link_ms, draft_ms)
        m = self.metrics
        m.start_way, m.start_reason, m.start_note = way, self.way.start_reason, self.way.start_note
        if way == "stream":
            log.info("streaming from the first token (%s): %s", self.way.start_reason, self.way.start_note)

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.stop()
        if self.ctx_id is None:
            return
        ctx_id, self.ctx_id = self.ctx_id, None
        try:
            self.metrics.cloud_calls += 1
            self.transport.close_session(ctx_id, self.policy.open_timeout_s)
        except SpecSplitError as e:  # best effort: the cloud expires idle sessions anyway
            log.info("closing session %s failed: %s", ctx_id, e)


    # -- one round or one stream chunk ------------------------------------------------------------

    def advance(self, remaining: int, max_context: int | None = None) -> Iterator[tuple[int, Origin]]:
        """The next round, or the next stream chunk when the way controller says streaming is cheaper;
        yields the committed (token, origin) pairs as they come."""
        n = self.way.next() if self.way is not None else 0
        if self.way is not None:
            self.metrics.switches = self.way.switches
        room = remaining if not max_context else min(remaining, max_context - len(self.S))
        if n > 0 and self.ctx_id is not None and self.cloud_len == len(self.S) and room > 0:
            yield from self.stream(min(n, room))
            return
        t0 = self.clock()
        rounds = len(self.records)
        caught = self.ahead.catch_up_ms if self.ahead is not None else 0.0
        out = self.step(remaining, max_context)
        if self.way is not None and len(self.records) > rounds:
            last = self.records[-1]
            one = getattr(self.tree if self.tree is not None else self.k_ctl, "verify_ms", None)
            # the wait for the draft to finish reading the prompt or a stream's tokens is the session's start
            # or the stream's cost, not this round's: a first round that paid a long prompt would otherwise
            # make speculating look dear for many rounds (the costs are running means)
            if self.ahead is not None:
                caught = self.ahead.catch_up_ms - caught
            wall_ms = (self.clock() - t0) * 1000 - caught
            self.way.observe_round(len(out), wall_ms, last.cloud_prefill_ms, one(0) if one is not None else None)
            self.metrics.switches = self.way.switches
        yield from out

    def step(self, remaining: int, max_context: int | None = None) -> list[tuple[int, Origin]]:
        """One round; `remaining` is the token budget left. Returns the committed (token, origin) pairs."""
        plain = False
        if self.tree is not None:
            out = self._tree_step(remaining, max_context)
            if out is not None:
                return out
            # no tree here (no room, or the drafter could not grow one): a round of k = 0, whose token is drawn
            # as draw and match draws it (the target-only draw at its position), so a tree session's text stays
            # the seed's target-only text. Greedy may run a chain (its tokens are the argmax either way); a
            # sampled chain's coin and residual are other draws
            plain = not self.params.sampling.greedy or remaining <= 1 \
                or bool(max_context and max_context - len(self.S) - 1 < 1)
        # k drafts run through the target, plus the checked last one with check_last (no bonus then)
        extra = int(self.params.check_last)
        k = 0 if plain else max(0, min(self.k_ctl.k + extra, remaining - 1 + extra))
        if self.node_budget and self.obey_budget:
            k = min(k, self.node_budget)
        if max_context:
            k = max(0, min(k, max_context - len(self.S) - 1))
        t0 = self.clock()
        block, self._outcome = self._draft_block(k)
        if block.k > 0:
            self._count_head()
        edge_ms = self._edge_ms(t0)
        decision = None
        if self.gate is not None and block.k > 0:
            decision = decide(block, self.detokenize(block.tokens), self.gate, self.rule_triggers)
            if not decision.to_cloud:
                return self._commit_local(block, block.tokens, "gate", edge_ms, decision)
        return self._send(block, decision, edge_ms, lambda: block.k > 0 and self.ahead is not None and self.ahead.start(
            self.S, block, max(self.k_ctl.k, 1), guess_next=not self.params.check_last))

    def _tree_step(self, remaining: int, max_context: int | None) -> list[tuple[int, Origin]] | None:
        """A tree round (draw and match, shared/tree.py); None when no tree can be grown here (a chain then)."""
        assert self.tree is not None
        shape = self.tree.shape()
        depth = round_depth(shape.depth, remaining)
        nodes = shape.nodes if not max_context else min(shape.nodes, max_context - len(self.S) - 1)
        if self.node_budget and self.obey_budget:
            nodes = min(nodes, self.node_budget)
        if depth < 1 or nodes < 1:
            return None
        t0 = self.clock()
        block: DraftBlock | None = None
        self._outcome = AheadOutcome()
        if self.ahead is not None:
            block, self._outcome = self.ahead.take_tree(self.S, replace(shape, depth=depth))
        if block is not None:  # grown during the last verify, after the context that was committed
            self._count_ahead(block, self._outcome)
        else:
            grow = self.drafter.propose_tree  # type: ignore[attr-defined]
            block = grow(self.S, replace(shape, depth=depth), self.params.sampling, self.params.seed)
            if block is None or block.k == 0:
                return None
        block, self._copy_path = self.tree.sent(block, self.S, depth, remaining, nodes)
        edge_ms = self._edge_ms(t0)
        self._count_head()
        tree = self.tree
        # on an answer the worker goes on: the next round's take_tree lets it finish when its guess held, else
        # stops it (every use of the drafter goes through take, take_tree, catch_up or close first)
        return self._send(block, None, edge_ms, lambda: self.ahead is not None and self.ahead.start_tree(
            self.S, block, tree.next_shape(block), remaining), keep_ahead=True)

    def _edge_ms(self, t0: float) -> float:
        """This round's drafting since t0, plus the time waited after the last answer for the worker drafting
        ahead (drafting on the critical path too); counted in the metrics."""
        wait_ms = 0.0
        if self.ahead is not None:
            wait_ms, self.ahead.wait_ms = self.ahead.wait_ms, 0.0
        edge_ms = (self.clock() - t0) * 1000 + wait_ms
        self.metrics.edge_time_ms += edge_ms
        self.metrics.ahead_wait_ms += wait_ms
        return edge_ms

    def _count_head(self) -> None:
        """Counts whether a feature-fed drafter drafted this round's block from the cloud's feature."""
        from_head = getattr(self.drafter, "last_from_head", None)
        if from_head is not None:
            self.metrics.head_rounds += int(from_head)
            self.metrics.fallback_rounds += int(not from_head)

    def _send(self, block: DraftBlock, decision: GateDecision | None, edge_ms: float, start_ahead: Callable[[], bool],
              keep_ahead: bool = False) -> list[tuple[int, Origin]]:
        """Verifies `block` (the worker drafting ahead started by `start_ahead` meanwhile, and stopped after the
        answer unless `keep_ahead`) and commits what the answer says."""
        up, down = self.transport.traffic.bytes_up, self.transport.traffic.bytes_down
        t1 = self.clock()
        calls_before = self.metrics.cloud_calls
        if start_ahead():
            self.metrics.ahead_rounds += 1
        try:
            resp = self._verify(block, decision)
            rtt_ms = (self.clock() - t1) * 1000
        except BaseException:
            if self.ahead is not None:  # the worker ends before anything else touches the drafter
                self.ahead.stop()
            raise
        if self.ahead is not None and not keep_ahead:
            self.ahead.stop()
        self.metrics.rtt_ms += rtt_ms
        traffic = (self.transport.traffic.bytes_up - up, self.transport.traffic.bytes_down - down)
        extra_calls = self.metrics.cloud_calls - calls_before - 1
        if resp is None:  # late answer discarded (--timeout-fallback): the first draft token (a tree's root's most
            # likely child), unverified
            return self._commit_local(block, block.tokens[:1], "timeout", edge_ms, decision, rtt_ms, traffic,
                                      extra_calls)
        return self._commit_verified(block, resp, edge_ms, rtt_ms, traffic, decision, extra_calls)

    def _draft_block(self, k: int) -> tuple[DraftBlock, AheadOutcome]:
        """This round's block: the part drafted ahead during the last verify when its guess held, the rest now."""
        if self.ahead is None:
            return self.drafter.propose(self.S, k, self.params.sampling, self.params.seed), AheadOutcome()
        ready, outcome = self.ahead.take(self.S, k)
        if ready is None:
            return self.drafter.propose(self.S, k, self.params.sampling, self.params.seed), outcome
        self._count_ahead(ready, outcome)
        if ready.k >= k:
            return ready, outcome
        rest = self.drafter.propose(self.S + ready.tokens, k - ready.k, self.params.sampling, self.params.seed)
        return concat_blocks(ready, rest), outcome

    def _count_ahead(self, ready: DraftBlock, outcome: AheadOutcome) -> None:
        self.metrics.ahead_hits += 1
        self.metrics.ahead_tokens += ready.k
        self.metrics.ahead_saved_ms += outcome.saved_ms


    # -- commits --------------------------------------------------------------------------------

    def _commit_verified(self, block: DraftBlock, resp: VerifyResponse, edge_ms: float, rtt_ms: float,
                         traffic: tuple[int, int], decision: GateDecision | None,
                         extra_calls: int) -> list[tuple[int, Origin]]:
        la, n_before = resp.accepted_len, len(self.S)
        # the context's tail this round fed the target (its append_ids: a local commit's tokens, the last round's
        # correction), read before the answer moves cloud_len; at least one row when none was sent
        tail = max(n_before - self.cloud_len, 1)
        kept = block.tokens[:la] if block.parents is None else [block.tokens[j] for j in resp.accepted_nodes or []]
        out: list[tuple[int, Origin]] = [(t, "accepted") for t in kept]
        if resp.next_kind == "residual":
            assert resp.target_dist is not None
            tok = sample_residual(resp.target_dist.ids, resp.target_dist.probs, block.q_full[la],
                                  self.params.seed, position=n_before + la + 1)
            out.append((tok, "residual"))
        elif resp.next_kind != "none":
            assert resp.correction is not None
            out.append((int(resp.correction), "bonus" if resp.next_kind == "bonus" else "correction"))
        self._extend([t for t, _ in out])
        self.node_budget = resp.node_budget
        if 0 <= resp.ctx_len <= len(self.S) and resp.ctx_hash == self.hash_at(resp.ctx_len):
            self.cloud_len = resp.ctx_len  # the residual (if any) goes as append_ids next round
            self._take_feature(resp.feature)
            self._take_states(resp.states)
        else:
            log.warning("cloud context %d/%s disagrees with ours after the round: reopening next round",
                        resp.ctx_len, resp.ctx_hash)
            self.ctx_id = None
        if resp.top_k_ids and block.parents is None:
            self.drafter.observe(self.S[:n_before], block.tokens, resp.top_k_ids)
        m = self.metrics
        m.verify_calls += 1
        checked = self.params.check_last and block.k > 0 and block.parents is None  # the last one is not run
        fed_drafts = block.k - int(checked)
        m.target_rows += tail + fed_drafts  # the context's unfed tail, the drafts
        m.drafted += block.k
        m.accepted += la
        m.cloud_prefill_ms += resp.metrics.prefill_ms
        cloud_ms = resp.metrics.prefill_ms + resp.metrics.queue_ms
        if block.parents is not None:
            self._observe_tree(block, la, rtt_ms, cloud_ms, resp.accepted_nodes or [], resp.metrics.row_ms)
            self._record(block.k, la, resp.next_kind, "cloud", len(out), edge_ms, rtt_ms, traffic, decision,
                         alpha=resp.metrics.alpha_mean, prefill=resp.metrics.prefill_ms, extra_calls=extra_calls,
                         queue=resp.metrics.queue_ms)
            return out
        m.record_positions(block.k, la)
        # drafting time per token is seen only after a verified round with drafts: otherwise the
        # drafter first caught up on tokens it never drafted (k = 0 rounds, local commits, the prompt)
        drafted_now = block.k - self._outcome.used if self._prev_drafted else 0
        fed = block.k - 1 if self.params.check_last and block.k > 0 else block.k  # the checked last one is
        self.k_ctl.observe(RoundCosts(k=fed, accepted_len=min(la, fed), draft_ms=edge_ms,  # the bonus's twin
                                      drafted_now=drafted_now, exchange_ms=rtt_ms, cloud_ms=cloud_ms))
        self._prev_drafted = block.k > 0
        self._record(block.k, la, resp.next_kind, "cloud", len(out), edge_ms, rtt_ms, traffic, decision,
                     alpha=resp.metrics.alpha_mean, prefill=resp.metrics.prefill_ms, extra_calls=extra_calls,
                     queue=resp.metrics.queue_ms)
        return out

    def _observe_tree(self, block: DraftBlock, la: int, rtt_ms: float, cloud_ms: float,
                      accepted: list[int], row_ms: float = 0.0) -> None:
        """A verified tree round: the tree controller's estimates, acceptance by depth, and copy branches'."""
        assert block.parents is not None and self.tree is not None
        self.metrics.tree_rounds += 1
        self.metrics.tree_nodes += block.k
        self.metrics.record_positions(max(depths(block.parents), default=0), la)
        self.tree.observe_round(block, la, accepted, self._copy_path, rtt_ms, cloud_ms, row_ms)
        if block.copied is not None:
            self.metrics.copy_nodes += sum(block.copied)
            self.metrics.copy_accepted += sum(block.copied[j] for j in accepted)
        self._prev_drafted = False

    def _commit_local(self, block: DraftBlock, tokens: list[int], why: str, edge_ms: float,
                      decision: GateDecision | None, rtt_ms: float = 0.0, traffic: tuple[int, int] = (0, 0),
                      extra_calls: int = 0) -> list[tuple[int, Origin]]:
        self._prev_drafted = False
        self._extend(tokens)
        self.metrics.local_commits += len(tokens)
        self.metrics.timeout_fallbacks += len(tokens) if why == "timeout" else 0
        self.metrics.gated_rounds += int(why == "gate")
        self._record(block.k, len(tokens), "local", why, len(tokens), edge_ms, rtt_ms, traffic, decision,
                     extra_calls=extra_calls)
        return [(t, "local") for t in tokens]

    def _record(self, k: int, la: int, next_kind: str, decided_by: str, committed: int, edge_ms: float,
                rtt_ms: float, traffic: tuple[int, int], decision: GateDecision | None, *, alpha: float = 0.0,
                prefill: float = 0.0, extra_calls: int = 0, queue: float = 0.0) -> None:
        o = self._outcome
        self.metrics.rounds += 1
        self.records.append(RoundRecord(
            index=len(self.records), k=k, accepted_len=la, next_kind=next_kind, decided_by=decided_by,
            committed=committed, la_over_k=la / k if k else 0.0, alpha_mean=alpha, edge_time_ms=edge_ms,
            cloud_prefill_ms=prefill, rtt_ms=rtt_ms, A_cum=self.metrics.acceptance_rate, bytes_up=traffic[0],
            bytes_down=traffic[1], hard_ratio=None if decision is None else decision.hard_ratio,
            triggered=False if decision is None else decision.triggered, extra_calls=max(0, extra_calls),
            ahead=o.result, ahead_used=o.used, ahead_saved_ms=o.saved_ms, cloud_queue_ms=queue))

