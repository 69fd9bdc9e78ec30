"""What the model thread's scheduler (cloud/scheduler.py) runs: jobs, their kinds and answers, and the figures of
each forward it hands to its model runner's `on_batch`.

A job is one request's work on the model thread, a small class per kind: a verify round (cloud/rounds.py
`RoundJob`), a session-open prefill (cloud/opening.py `PrefillJob`), a /v1/generate stream (cloud/generate.py
`DecodeJob`), a plain callable (`Call`). Each forward the scheduler asks a queued job for its row (`plan`), runs
the rows of every job it took in one forward, then hands each job its own logits (`finish`).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from shared.rows import Row
from shared.sampling import RowSampling
from shared.target_probs import TargetProbs

T = TypeVar("T")
# job kinds: running work goes before prefills
ROUND, DECODE, PREFILL = "round", "decode", "prefill"


class Pending:
    """`finish()` returns this when the job needs another forward (the next chunk of a prefill)."""


PENDING = Pending()


class Abandoned(RuntimeError):
    """The job's caller went away (`cancel`): it left the queue, or stopped after its forward in progress."""


class Wait:
    """`plan()` returns this when the job should sit this forward out (it stays queued, in its place)."""


WAIT = Wait()


class Job(abc.ABC, Generic[T]):
    """One request's work on the model thread. Subclasses say what it runs (`plan`) and what its logits give
    (`finish`); the scheduler fills in the rest of the fields."""

    def __init__(self, kind: str = ROUND, key: str | None = None, owner: str = "") -> None:
        # ROUND, DECODE (running work, first) or PREFILL (fills the rest of the token budget)
        self.kind = kind
        # whose work it is (a session, a generate stream): its next job is expected soon after an answer
        self.key = key
        # the API key's owner id (prefills are taken round-robin over owners)
        self.owner = owner
        # where the result goes (on the event loop)
        self.future: asyncio.Future[T] | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        # clock reading when admitted, and when its first forward started (queue wait = difference)
        self.since = 0.0
        self.started: float | None = None
        # its kept rows' processed probabilities, from `sampling` (None: it processes its logits itself)
        self.p: TargetProbs | None = None
        # its caller went away (`Scheduler.cancel`): no further forward runs for it
        self.cancelled = False

    @abc.abstractmethod
    def plan(self, budget: int) -> Row | None | Wait:
        """The Row to run within `budget` tokens; None when it needs no forward (`answer` is its result), or
        WAIT to sit this forward out."""

    @abc.abstractmethod
    def finish(self, logits: torch.Tensor, ms: float) -> T | Pending:
        """Apply its logits ([keep, vocab]) given the forward's wall time (ms): its result, or PENDING for another
        forward."""

    def answer(self) -> T:
        """The result when plan() returned None."""
        raise NotImplementedError(f"{type(self).__name__} always needs a forward")

    def abort(self) -> None:
        """The forward failed (or the job was dropped): leave its session as it was."""

    def unplan(self) -> None:
        """Give back what the last plan() took that nothing has used yet (prefix-cache blocks a new sequence
        matched): called when the job does not run in this forward after all, so blocks promised to rows
        already taken are not held by a job that waits; it plans again later."""

    def sampling(self, row: Row) -> RowSampling | None:
        """The sampling processing its kept logits need (a verify row, a decode step), or None: run for every job
        of a forward at once (`process_rows`) and handed to `finish` as `p` (where the logits are:
        shared/target_probs.py)."""
        return None


class Call(Job[T]):
    """A plain callable for `Scheduler.run`: it needs no forward and runs alone, between forwards, in its place in
    the queue; its answer is fn()."""

    def __init__(self, fn: Callable[[], T]) -> None:
        super().__init__()
        self.fn = fn

    def plan(self, budget: int) -> None:
        return None

    def finish(self, logits: torch.Tensor, ms: float) -> Pending:
        return PENDING  # never planned into a forward

    def answer(self) -> T:
        return self.fn()


@dataclass
class BatchStats:
    # sessions (rows) in the forward
    rows: int
    # real tokens in the forward (one flattened row: no padding)
    tokens: int
    # forward wall time, ms
    ms: float
    # tokens a right-padded batch of the same rows would have run: rows x the longest row
    padded_tokens: int = 0
    # jobs whose first forward this was: (kind, seconds queued)
    waits: list[tuple[str, float]] = field(default_factory=list)
    # tokens of verify rows and decode steps (the rest are prompt prefills and resync chunks)
    running_tokens: int = 0
    # what the forward's work cost, s: the process's CPU seconds (every thread; wall seconds on a GPU) from the
    # previous forward's end (or the wake-up from idle) to this one's: the forward, the processing and
    # verification of its rows, the requests and answers served between (None: the forward's wall time)
    cpu_s: float | None = None
