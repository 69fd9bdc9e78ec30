"""What the model thread's scheduler (cloud/scheduler.py) runs: jobs, their kinds and answers, and the figures of
each forward it hands to `on_batch`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from shared.kvpool import Row
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


@dataclass
class Job(Generic[T]):
    # the Row to run within a token budget (int), None with `answer` set when it needs no forward, or WAIT
    plan: Callable[[int], Row | None | Wait]
    # applies the job's logits ([keep, vocab]) given the forward's wall time (ms); returns its result,
    # or PENDING for another forward
    finish: Callable[[torch.Tensor, float], T | Pending]
    # the forward failed: leave the session as it was
    abort: Callable[[], None] = lambda: None
    # the answer when plan() returned None
    answer: Callable[[], T] | None = None
    # where the result goes (on the event loop)
    future: asyncio.Future[T] | None = None
    loop: asyncio.AbstractEventLoop | None = None
    # clock reading when admitted, and when its first forward started (queue wait = difference)
    since: float = 0.0
    started: float | None = None
    # a plain callable for run(): runs alone
    call: Callable[[], T] | None = None
    # whose work it is (a session, a generate stream): its next job is expected soon after an answer
    key: str | None = None
    # ROUND, DECODE (running work, first) or PREFILL (fills the rest of the token budget)
    kind: str = ROUND
    # the API key's owner id (prefills are taken round-robin over owners)
    owner: str = ""
    # give back what a first plan() took and nothing has used yet (prefix-cache blocks a new sequence
    # matched): called when the job does not run in this forward after all, so blocks promised to rows
    # already taken are not held by a job that waits; it plans again later
    unplan: Callable[[], None] = lambda: None
    # the sampling processing its kept logits need (a verify row, a decode step), or None: run for every
    # job of a forward at once (`process_rows`), and handed to `finish` as `p` (where the logits are:
    # shared/target_probs.py)
    sampling: Callable[[Row], RowSampling | None] | None = None
    p: TargetProbs | None = None
    # its caller went away (`Scheduler.cancel`): no further forward runs for it
    cancelled: bool = False


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
