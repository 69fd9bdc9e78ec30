"""Drafting while the cloud verifies: the next block is drafted during the verify exchange.

While round r's request (context S, drafts y_1..y_k) is in flight, a worker thread guesses its
answer: every draft accepted and the next token equal to the draft model's own next choice g
(sampled at its position from the edge's DRAFT stream, like any draft token). It then drafts the
next block a_1, a_2, ... after S + y_1..y_k + g, one token at a time, until it has `k_next` tokens
or the answer arrives (it stops between two tokens, so the answer waits for at most one draft
forward). When the committed context after the round is exactly S + y + g the guess held and
round r + 1 starts with a_1..a_m ready (drafting only the rest, if any); otherwise they are
dropped.

Exactness is untouched: drafts are proposals, and a_j is the very token `propose` would draw
after the same context (the draw is keyed by position, the repetition-penalty set is the
context's). The draft model's KV ends as the plain path would leave it: on a miss it is cropped
back to what it held when the worker started (S + y_1..y_{k-1}); on a hit with more tokens than
the next k it is cropped to S' + a_1..a_{k-1}. Only one thread touches the drafter at a time: the
caller joins the worker before it uses the drafter again.

Whether it pays is measured as it goes: a miss costs the wait for the worker's token in progress
when the answer comes (nothing when the worker was already done), a hit saves the drafting of the
tokens it made ready. From running means (weight `weight`) of the hit rate, the time a hit saved
and the wait per attempt, a round drafts ahead while hit rate x saved > wait and the hit rate is at
least `min_hit`; otherwise it stops, and tries again once every `probe_every` rounds.

A tree round (edge/drafters/tree.py) guesses the same way: the sent tree's main path (the most valuable
child at every level) is kept whole and the next token is the draft's own choice after it; the worker then
grows the next tree after that context, stopping between two levels when the answer comes. A tree is used
only when complete and when the guess held; either way the draft model's cache keeps the guessed context,
which the next sync crops to its common prefix with the committed one (a guess that held for a few tokens
saves feeding them).

The same worker catches the draft up where the edge would otherwise wait for it later: on the prompt while
the cloud opens the session, and on streamed tokens while the stream goes on (`catch_up`), so the first
round and the round after a stream chunk do not pay a long draft prefill on the critical path. After the first
catch-up it times one draft step (`step_ms`), so the session's first decision knows what drafting costs here. A session that
streams its first token starts none of it before that token, and one that will never probe (edge/policy/stream.py
`probes`) none at all (edge/speculative.py).

Only the model drafter drafts ahead (alone, or behind the OpenAI server's lock, which the worker
then takes per token like any proposal): the n-gram drafter's block costs microseconds (0.08 ms
per token in BENCHMARKS.md), so there is nothing to hide, and drafting after guessed tokens would
count them in its storage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field

from shared.config import SamplingConfig

from .drafters.base import DraftBlock, Drafter
from .drafters.causal import CausalDrafter
from .drafters.tree import TreeShape, TreeStopped, main_path, round_depth

log = logging.getLogger(__name__)


def concat_blocks(a: DraftBlock, b: DraftBlock) -> DraftBlock:
    """b's tokens after a's (signals too; MC-dropout variance is not carried)."""
    def join(x: list[float] | None, y: list[float] | None) -> list[float] | None:
        return None if x is None and y is None else (x or []) + (y or [])

    return DraftBlock(tokens=a.tokens + b.tokens, q_probs=a.q_probs + b.q_probs, kind=a.kind,
                      q_full=a.q_full + b.q_full, nll=join(a.nll, b.nll),
                      entropy_bits=join(a.entropy_bits, b.entropy_bits), margin=join(a.margin, b.margin))


def truncate_block(b: DraftBlock, k: int) -> DraftBlock:
    def cut(x: list[float] | None) -> list[float] | None:
        return None if x is None else x[:k]

    return DraftBlock(tokens=b.tokens[:k], q_probs=b.q_probs[:k], kind=b.kind, q_full=b.q_full[:k],
                      nll=cut(b.nll), entropy_bits=cut(b.entropy_bits), margin=cut(b.margin))


@dataclass
class AheadOutcome:
    # "hit" (the guess held), "miss" (dropped) or "" (nothing was drafted ahead)
    result: str = ""
    # draft tokens of this round taken from the block drafted ahead
    used: int = 0
    # the worker's drafting time for the guess and the used tokens (taken off the critical path), ms
    saved_ms: float = 0.0


@dataclass
class _Ahead:
    # the guessed committed context after the round: S + y_1..y_k + g
    context: list[int]
    # what the drafter held when the worker started (the plain path's state)
    kv_before: int
    # the block drafted after `context`, and the worker's elapsed time after each of its tokens, ms
    block: DraftBlock
    elapsed_ms: list[float] = field(default_factory=list)
    error: BaseException | None = None
    # a tree round's: the shape of the next tree, and the tree once grown whole
    shape: TreeShape | None = None
    tree: DraftBlock | None = None
    # a tree round's: S + the main path (the context before the guess), and set once the guess is made
    base: list[int] = field(default_factory=list)
    guessed: threading.Event = field(default_factory=threading.Event)


class DraftAhead:
    """One speculative run's drafting ahead: `start` before a verify, `stop` after, `take` next round."""

    def __init__(self, drafter: Drafter, cfg: SamplingConfig, seed: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        model = self.model_of(drafter)
        if model is None:
            raise ValueError("drafting ahead needs the model drafter (without MC dropout)")
        # proposals go through `drafter` (it may hold a lock); the KV is `model`'s
        self.drafter = drafter
        self.model = model
        self.cfg = cfg
        self.seed = seed
        self.clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ahead: _Ahead | None = None
        # time the caller waited for the worker to finish its token after the answer, ms (not yet booked)
        self.wait_ms = 0.0
        # of it, the waits for a catch-up (the prompt, streamed tokens): a session's start or a stream's cost,
        # not a round's (the way controller leaves it out of speculation's cost)
        self.catch_up_ms = 0.0
        self._catching = False
        # one draft step's time, ms, measured once after the first catch-up (the prompt), or None: the session's
        # first speculate-or-stream decision prices drafting with it (edge/speculative.py `open`)
        self.step_ms: float | None = None
        # running means: hit rate, ms a hit saved, ms waited per attempt; rounds since the last attempt
        self.weight, self.min_hit, self.probe_every = 0.2, 0.05, 8
        self.hit_rate, self.saved_per_hit, self.wait_per_try = 0.5, 0.0, 0.0
        self._tries = 0
        self._idle_rounds = 0
        self._last_wait = 0.0

    @staticmethod
    def model_of(drafter: object) -> CausalDrafter | None:
        """The model drafter that proposes for `drafter` (itself, or a LockedDrafter's inner one)."""
        inner = getattr(drafter, "inner", drafter)
        return inner if isinstance(inner, CausalDrafter) and not inner.mc_dropout_samples else None

    @classmethod
    def supports(cls, drafter: object) -> bool:
        return cls.model_of(drafter) is not None

    def worth_it(self) -> bool:
        """Whether this round should draft ahead (see the module docstring); counts skipped rounds."""
        if self._tries < 3 or (self.hit_rate >= self.min_hit
                               and self.hit_rate * self.saved_per_hit > self.wait_per_try):
            return True
        self._idle_rounds += 1
        if self._idle_rounds >= self.probe_every:
            self._idle_rounds = 0
            return True
        return False

    def _learn(self, outcome: AheadOutcome, waited: float) -> None:
        w = self.weight
        self._tries += 1
        hit = outcome.result == "hit"
        self.hit_rate = (1 - w) * self.hit_rate + w * float(hit)
        self.wait_per_try = (1 - w) * self.wait_per_try + w * waited
        if hit:
            self.saved_per_hit = outcome.saved_ms if self._tries == 1 or self.saved_per_hit == 0 else (
                (1 - w) * self.saved_per_hit + w * outcome.saved_ms)

    def start(self, context: Sequence[int], block: DraftBlock, k_next: int, guess_next: bool = True) -> bool:
        """Draft after context + block + the guess, in a worker, until `stop`; False when not started.
        `guess_next` False (the block's last token is checked, no bonus follows): no guessed token, the
        guess is that the whole block is kept."""
        if block.k == 0 or k_next <= 0 or not self.worth_it():
            return False
        sent = [int(t) for t in context] + list(block.tokens)
        limit = self.model.max_context
        if limit is not None:
            k_next = min(k_next, limit - len(sent) - 2)
            if k_next <= 0:
                return False
        self._stop.clear()
        self._ahead = _Ahead(context=sent, kv_before=self.model.kv_len, block=DraftBlock([], [], "sampled"))
        self._thread = threading.Thread(target=self._work, args=(self._ahead, k_next, guess_next),
                                        name="draft-ahead", daemon=True)
        self._thread.start()
        return True

    def _work(self, ahead: _Ahead, k_next: int, guess_next: bool = True) -> None:
        t0 = self.clock()
        try:
            if guess_next:
                guess = self.drafter.propose(ahead.context, 1, self.cfg, self.seed)
                ahead.context.append(guess.tokens[0])
            block = ahead.block
            while block.k < k_next and not self._stop.is_set():
                one = self.drafter.propose(ahead.context + block.tokens, 1, self.cfg, self.seed)
                block = concat_blocks(block, one)
                ahead.block = block
                ahead.elapsed_ms.append((self.clock() - t0) * 1000)
        except BaseException as e:  # noqa: BLE001 - reported by take(); the round goes on without it
            ahead.error = e

    def start_tree(self, context: Sequence[int], block: DraftBlock, shape: TreeShape, remaining: int) -> bool:
        """Grow the tree after context + the sent tree's main path + the guess, in a worker, until `stop`:
        `shape` is the next round's (the tree controller's depth after this round), `remaining` this round's
        token budget. The next round takes it only if it would grow the same shape."""
        path = main_path(block)
        after = len(path) + 1  # tokens the guessed round commits
        depth = round_depth(shape.depth, remaining - after)  # the next round's remaining: this one's minus after
        limit = self.model.max_context
        room = 1 << 30 if limit is None else limit - len(context) - after - depth
        if not path or depth < 1 or room < 1 or not self.worth_it():
            return False
        self._stop.clear()
        base = [int(t) for t in context] + path
        self._ahead = _Ahead(context=list(base), kv_before=self.model.kv_len, block=DraftBlock([], [], "sampled"),
                             shape=TreeShape(shape.nodes, depth, shape.width), base=base)
        self._thread = threading.Thread(target=self._grow, args=(self._ahead,), name="draft-ahead", daemon=True)
        self._thread.start()
        return True

    def _grow(self, ahead: _Ahead) -> None:
        assert ahead.shape is not None
        t0 = self.clock()
        try:
            guess = self.drafter.propose(ahead.context, 1, self.cfg, self.seed)
            ahead.context.append(guess.tokens[0])
            ahead.guessed.set()
            if not self._stop.is_set():
                ahead.tree = self.model.propose_tree(ahead.context, ahead.shape, self.cfg, self.seed,
                                                     stop=self._stop.is_set)
                ahead.elapsed_ms.append((self.clock() - t0) * 1000)
        except TreeStopped:
            pass
        except BaseException as e:  # noqa: BLE001 - reported by take_tree(); the round goes on without it
            ahead.error = e
        finally:
            ahead.guessed.set()

    def take_tree(self, committed: Sequence[int], shape: TreeShape) -> tuple[DraftBlock | None, AheadOutcome]:
        """The tree grown ahead when `committed` is the guessed context and `shape` the one it was grown in
        (the tree the plain path would grow: the round's structure does not depend on timing), else None.
        A tree takes longer to grow than a verify takes: when the main path was kept and the guess holds, the
        worker is left to finish the tree (the rest of its growth is all the round waits for)."""
        ahead = self._ahead
        if ahead is not None and ahead.shape is not None and self._thread is not None \
                and list(committed[:-1]) == ahead.base:
            ahead.guessed.wait()
            if list(committed) == ahead.context:
                self.stop(finish=True)
        self.stop()
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.shape is None:
            return None, AheadOutcome()
        if ahead.error is not None:
            log.warning("growing a tree ahead failed, growing it on the critical path: %s", ahead.error)
        held = ahead.error is None and list(committed) == ahead.context
        tree = ahead.tree
        if not held or tree is None or ahead.shape != shape:
            outcome = AheadOutcome("miss" if ahead.error is None else "")
            self._learn(outcome, self._last_wait)
            return None, outcome
        outcome = AheadOutcome("hit", tree.k, ahead.elapsed_ms[-1])
        self._learn(outcome, self._last_wait)
        return tree, outcome

    def catch_up(self, context: Sequence[int]) -> bool:
        """Feed the draft model `context` in a worker (the prompt while the cloud opens, streamed tokens while
        the stream goes on); False while the last catch-up is still running. A tree still growing ahead is
        stopped: its guess is stale once the session streams."""
        if self._thread is not None and self._thread.is_alive() and self._catching:
            return False
        self.stop()
        self._stop.clear()
        self._ahead = None  # a guess from before is stale now (the next sync crops to the common prefix)
        self._catching = True
        self._thread = threading.Thread(target=self._feed, args=([int(t) for t in context],),
                                        name="draft-catch-up", daemon=True)
        self._thread.start()
        return True

    def _feed(self, context: list[int]) -> None:
        lock = getattr(self.drafter, "lock", None)
        try:
            with lock if lock is not None else nullcontext():
                logits = self.model.logits_after(context)
                if self.step_ms is None and not self._stop.is_set():
                    # one step after the draft's own greedy guess, timed: what a drafted token costs here, known
                    # before the first round (the cache keeps the guess; the next sync crops to the common prefix)
                    t0 = self.clock()
                    self.model.logits_after([*context, int(logits.argmax())])
                    self.step_ms = (self.clock() - t0) * 1000
        except Exception as e:  # noqa: BLE001 - the next proposal syncs on the critical path instead
            log.info("catching the draft up failed: %s", e)

    def stop(self, finish: bool = False) -> None:
        """The answer is in (or the round failed): let the worker finish its token (`finish`: all its work)
        and end."""
        if self._thread is None:
            return
        t0 = self.clock()
        if not finish:
            self._stop.set()
        self._thread.join()
        self._thread = None
        self._last_wait = (self.clock() - t0) * 1000
        self.wait_ms += self._last_wait
        if self._catching:
            self.catch_up_ms += self._last_wait
            self._catching = False

    def take(self, committed: Sequence[int], k: int) -> tuple[DraftBlock | None, AheadOutcome]:
        """The ready part of the next block when `committed` is the guessed context, else None
        (the drafter is then cropped back to the plain path's state)."""
        self.stop()
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.shape is not None:  # nothing, or a tree grown for a tree round
            return None, AheadOutcome()
        if ahead.error is not None:
            log.warning("drafting ahead failed, drafting on the critical path: %s", ahead.error)
        held = ahead.error is None and len(ahead.context) == len(committed) and list(committed) == ahead.context
        if not held or k <= 0:
            self.model.rewind(ahead.kv_before)
            outcome = AheadOutcome("miss" if ahead.error is None else "")
            self._learn(outcome, self._last_wait)
            return None, outcome
        m = min(k, ahead.block.k)
        if ahead.block.k > m:  # more than this round takes: keep the KV the plain path would hold
            self.model.rewind(len(committed) + m - 1)
        # the worker's clock runs from before the guess: elapsed_ms[m - 1] covers the guess and a_1..a_m
        outcome = AheadOutcome("hit", m, ahead.elapsed_ms[m - 1] if m else 0.0)
        self._learn(outcome, self._last_wait)
        return truncate_block(ahead.block, m), outcome
