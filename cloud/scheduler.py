"""The model thread's scheduler: it decides which queued work runs in each forward; its model runner
(`ModelRunner`: the service core over its runner, cloud/core.py, cloud/runners/) runs it. Nothing here
touches tensors.

Work arrives as `Job`s from the event loop (cloud/jobs.py): verify rounds, session-open prefills,
/v1/generate decode steps. Whenever the model is free, the thread builds one forward under a token budget
(`max_batch_tokens`, real tokens: a forward is one flattened row with no padding) and a row cap
(`max_batch_size`):
1. Running work first: verify rounds and decode steps, in arrival order. A round whose resync
   (`append_ids`) is longer than the budget runs its context in prefill chunks first, in the
   prefills' share of the budget (before the prefills), then its verify row.
2. Prefills fill the rest of the budget: session opens and /v1/generate prompts, chunked to what is
   left. They are taken round-robin over API keys (the key whose prefill ran least recently first,
   each key's prefills in arrival order), so one key's burst of opens cannot starve another key's.
   A forward gives prefill chunks at most a slice of its tokens when it carries rounds or decode steps, and
   also while any session is active (opened or answered within the
   last `active_s`, by `clock`: its next round is on its way; an edge sends it 10-30 ms after its answer,
   commits, drafts and encodes meanwhile, far longer than `batch_wait_ms`). The slice is
   `max_prefill_tokens_with_rounds` at most, and the model runner's `prefill_slice(running tokens)`: the
   service reads it from the measured forward cost (what keeps the forward within a share of the rounds' own).
   Only with no session active does a prefill-only forward take the whole budget.
So a round that arrives during a burst of prefills, whenever it arrives, waits at most for the forward
in progress, which carries at most the slice of prefill tokens, then
runs in the next forward, never behind the burst.
3. KV blocks: each row needs the blocks its new positions take (`blocks_needed`). When they are not
   free the thread asks for room (`make_room`: unreferenced cached prefix blocks go first, then the
   least recently used idle sessions, which answer 404 and are reopened by their edge; only sessions
   idle for a while, whether or not the forward already has rows). A job that still does not fit waits for
   a later forward while other work runs, and is refused with ResourceExhausted (429 + Retry-After)
   when it cannot fit even alone. A forward is never started
   without its blocks, so it never fails for memory and the pool never passes the budget.
4. The forward runs every row; then each job's `finish()` applies its own result (the verify rule, a
   commit). An exception in one job's plan or finish fails that job alone; a failed forward fails
   every job of the batch and each `abort()` leaves its session as it was.
Sessions that were just answered come back within a few milliseconds (the client's turnaround);
left alone they would form waves that never merge. So before a forward the thread waits, at most
`batch_wait_ms` and at most half the last forward's time, for the sessions answered within the last
three forwards that have not queued their next round yet. `batch_wait_ms = 0` never waits. A session
never has two jobs queued (its lock is held while its round is queued), so its rounds stay in order.

One forward is `_step`: select the queued jobs still wanted, build the forward (`_build`: each job's row
from `_plan`, kept when `_reserve` finds its tokens, blocks and tree sequences), run it (`_run`), finish
each job (`_finish`), report its figures (`_report`).

`run(fn)` runs a plain callable on the model thread between batches (start-up, tests). What may
enter the queue at all is decided before, per API key (cloud/admission.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from cloud.jobs import PENDING, PREFILL, Abandoned, BatchStats, Call, Job, Wait
from cloud.model_thread import ModelThread
from shared.errors import ResourceExhausted
from shared.rows import Row
from shared.sampling import process_rows

log = logging.getLogger(__name__)


class ModelRunner(Protocol):
    """What the scheduler drives, on the model thread: the forward, the KV blocks and tree sequence ids its rows
    take, room-making, and the forward's cost (the prefills' slice in, each forward's figures out)."""

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        """One forward over every row: each row's logits for its last `num_logits` ids."""

    def blocks_needed(self, row: Row) -> int:
        """KV blocks the row's new positions take."""

    def blocks_available(self) -> int:
        """KV blocks a forward can still get."""

    def tree_seqs(self, row: Row) -> int:
        """Sequence ids the row's token tree takes (a row whose tree does not fit waits for a later forward)."""

    def tree_seqs_available(self) -> int:
        """Sequence ids free for trees."""

    def make_room(self, blocks: int, progressing: bool) -> None:
        """Free this many KV blocks if it can; `progressing`: the forward already has rows (then only sessions
        idle for a while are evicted: the work that lacks blocks can wait for a later forward)."""

    def prefill_slice(self, running: int) -> int:
        """Prefill tokens a forward carrying `running` round and decode tokens may add (under
        `max_prefill_tokens_with_rounds`)."""

    def on_batch(self, stats: BatchStats) -> None:
        """Called after every forward, before its answers are handed over."""


@dataclass
class Forward:
    """The forward being built: its rows and what is left of its budgets."""
    # tokens it may still take (lowered to the prefills' slice once it fills)
    budget: int
    # tree sequence ids still free
    seqs_left: int
    # (job, its row), in the order they run
    rows: list[tuple[Job[Any], Row]] = field(default_factory=list)
    # KV blocks promised to its rows
    reserved: int = 0
    # tokens of rounds and decode steps in it
    running: int = 0


@dataclass
class Scheduler(ModelThread):
    """The forwards' policy (the module docstring) on the model thread; the queue and the answers' way back to
    the event loops are `ModelThread`'s (cloud/model_thread.py)."""
    # runs the forwards and holds the KV their rows take
    model_runner: ModelRunner
    max_batch_size: int = 32
    max_batch_tokens: int = 1024
    # prefill tokens at most in a forward that also carries rounds or decode steps, or that runs while a
    # session is active
    max_prefill_tokens_with_rounds: int = 1 << 30
    # a key answered within this long (s, by `clock`) is active: its next round is expected (0: never)
    active_s: float = 0.0
    # longest wait before a forward for recently answered sessions' next rounds, ms (0: never wait)
    batch_wait_ms: float = 5.0
    torch_threads: int = 0
    # what a forward's work costs, read at its end (BatchStats.cpu_s): the process's CPU time where the CPU runs
    # the model; a GPU's cloud passes wall time
    cost_clock: Callable[[], float] = time.process_time
    # model thread only: when each key was last answered (monotonic s), and the last forward's time (s)
    _answered: dict[str, float] = field(default_factory=dict)
    _last_forward_s: float = 0.0
    # model thread only: the number of the last forward that ran a prefill of each owner, and forwards run
    _served: dict[str, int] = field(default_factory=dict)
    _forwards: int = 0
    # model thread only: when each key was last answered, by `clock` (the active sessions)
    _active: dict[str, float] = field(default_factory=dict)
    # model thread only: `cost_clock` at the end of the last forward's work (or when work arrived after idling)
    _cpu_mark: float = 0.0

    def __post_init__(self) -> None:
        self._cpu_mark = self.cost_clock()
        self._thread = threading.Thread(target=self._loop, name="model", daemon=True)
        self._thread.start()

    def forget(self, key: str) -> None:
        """`key` sends no more work (its session closed, its stream ended): never wait for it."""
        def drop() -> None:
            self._answered.pop(key, None)
            self._active.pop(key, None)

        self.between_batches(drop)

    # --- the model thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        while True:
            with self._cv:
                idle = not self._queue and not self._between
                while not self._queue and not self._between and not self._stop:
                    self._cv.wait()
                if idle:  # what the process spent idle is no forward's cost
                    self._cpu_mark = self.cost_clock()
                if self._stop:
                    return
                between, self._between = self._between, []
            for fn in between:
                fn()
            waited = self.cost_clock()
            self._await_stragglers()
            self._cpu_mark += self.cost_clock() - waited  # waiting for stragglers is no forward's cost (wall clock)
            with torch.inference_mode():
                self._step()
            self._flush()

    def _await_stragglers(self) -> None:
        """Wait briefly for the next rounds of sessions answered within the last three forwards."""
        if self.batch_wait_ms <= 0 or not self._answered:
            return
        now = time.monotonic()
        recent = now - 3 * self._last_forward_s
        for key in [k for k, t in self._answered.items() if t < recent]:
            del self._answered[key]
        deadline = now + min(self.batch_wait_ms / 1000.0, self._last_forward_s / 2)
        with self._cv:
            while not self._stop:
                queued = {j.key for j in self._queue}
                if len(queued) >= self.max_batch_size or all(k in queued for k in self._answered):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._cv.wait(left)

    def _step(self) -> None:
        """One forward from the queue (see the module docstring): select, build, run, finish, report."""
        jobs = self._select()
        if jobs and isinstance(jobs[0], Call):
            self._drop(jobs[0])
            self._run_call(jobs[0])
            return
        cut = next((i for i, j in enumerate(jobs) if isinstance(j, Call)), len(jobs))  # a call keeps its place
        fwd = self._build(self._order(jobs[:cut]))
        if fwd.rows:
            self._run(fwd)

    def _select(self) -> list[Job[Any]]:
        """The queued jobs, in arrival order, whose caller still waits (the others fail with Abandoned)."""
        with self._cv:
            jobs = list(self._queue)
        for job in [j for j in jobs if j.cancelled]:
            self._fail(job, Abandoned("the caller went away"))
        return [j for j in jobs if not j.cancelled]

    def _order(self, jobs: list[Job[Any]]) -> list[Job[Any]]:
        """Running work in arrival order, then prefills round-robin over owners: the owner served least
        recently first, and each owner's prefills in arrival order (see the module docstring)."""
        running = [j for j in jobs if j.kind != PREFILL]
        rank: dict[str, int] = {}
        prefills = []
        for i, j in enumerate(jobs):
            if j.kind == PREFILL:
                rank[j.owner] = rank.get(j.owner, -1) + 1
                prefills.append((self._served.get(j.owner, -1), rank[j.owner], i, j))
        return running + [t[3] for t in sorted(prefills, key=lambda t: t[:3])]

    @staticmethod
    def _candidates(ordered: list[Job[Any]], chunked: list[Job[Any]]) -> Iterator[tuple[Job[Any], bool]]:
        """(job, whether it fills the prefills' share): running work, then the resync chunks found among it
        (`chunked` grows while the running work is planned), then prefills."""
        yield from ((j, False) for j in ordered if j.kind != PREFILL)
        yield from ((j, True) for j in chunked)
        yield from ((j, True) for j in ordered if j.kind == PREFILL)

    def _build(self, ordered: list[Job[Any]]) -> Forward:
        """The forward's rows, in `ordered`'s order, within the token budget and the row cap."""
        fwd = Forward(budget=self.max_batch_tokens, seqs_left=self.model_runner.tree_seqs_available())
        chunked: list[Job[Any]] = []  # rounds whose next forward is a resync chunk: they fill like prefills
        active = self._any_active()
        for job, filling in self._candidates(ordered, chunked):
            if filling and (fwd.running or active) and fwd.budget > 0:  # the prefills' share: the slice
                cap = min(self.max_prefill_tokens_with_rounds, self.model_runner.prefill_slice(fwd.running))
                fwd.budget = min(fwd.budget, cap - (self.max_batch_tokens - fwd.budget - fwd.running))
            if len(fwd.rows) >= self.max_batch_size or fwd.budget <= 0:
                break
            row = self._plan(job, fwd, filling)
            if row is None:
                continue
            if not filling and row.num_logits == 0:
                chunked.append(job)  # a long resync: after the running work, in the prefills' share
            elif self._reserve(job, row, fwd):
                fwd.rows.append((job, row))
                fwd.budget -= len(row.ids)
                fwd.running += 0 if filling else len(row.ids)
        return fwd

    def _plan(self, job: Job[Any], fwd: Forward, filling: bool) -> Row | None:
        """The job's row for this forward, or None: it sits this one out, or it was answered or failed."""
        try:
            row = job.plan(fwd.budget if filling or fwd.rows else self.max_batch_tokens)
        except BaseException as e:  # noqa: BLE001 - that request's error alone
            self._drop(job)
            self._resolve(job, error=e)
            return None
        if isinstance(row, Wait):
            return None
        runner = self.model_runner
        if runner.blocks_available() < fwd.reserved:
            # its plan took blocks promised to rows already in this forward (a new sequence matching
            # cached prefix blocks): it gives them back and waits, so no forward lacks its blocks
            job.unplan()
            if runner.blocks_available() < fwd.reserved:
                runner.make_room(fwd.reserved - runner.blocks_available(), True)
            return None
        if row is None:  # it needs no forward (a replayed round)
            self._drop(job)
            try:
                self._resolve(job, value=job.answer())
            except BaseException as e:  # noqa: BLE001
                self._resolve(job, error=e)
        return row

    def _reserve(self, job: Job[Any], row: Row, fwd: Forward) -> bool:
        """Whether `row` joins the forward: its tokens, KV blocks (room made when they are not free) and tree
        sequence ids are reserved. Otherwise it gives back what its plan took and waits for a later forward, or
        is refused (429) when its blocks cannot be had even for the forward's first row."""
        runner = self.model_runner
        if fwd.rows and len(row.ids) > fwd.budget:
            job.unplan()
            return False
        # a plan may have taken cached prefix blocks: count what is left now
        need, left = runner.blocks_needed(row), runner.blocks_available() - fwd.reserved
        if need > left:  # never a session mid-generation, even for the forward's first row
            runner.make_room(need - left, True)
            left = runner.blocks_available() - fwd.reserved
        if need > left:
            if not fwd.rows:
                self._fail(job, ResourceExhausted(
                    f"the KV cache is full ({need} more blocks needed; no idle session or cached "
                    "block is left to evict); retry later", limit="kv_budget_bytes"))
            else:
                job.unplan()
            return False
        seqs = runner.tree_seqs(row)
        if seqs > fwd.seqs_left and fwd.rows:
            job.unplan()
            return False
        fwd.seqs_left -= seqs
        fwd.reserved += need
        return True

    def _run(self, fwd: Forward) -> None:
        """Run the forward's rows in one forward, then finish its jobs and report it."""
        self._forwards += 1
        now, wall = self.clock(), time.monotonic()
        waits = []
        for job, _ in fwd.rows:
            if job.kind == PREFILL:
                self._served[job.owner] = self._forwards
            if job.started is None:
                job.started = now
                waits.append((job.kind, max(now - job.since, 0.0)))
        try:
            logits = self.model_runner.forward([row for _, row in fwd.rows])
        except BaseException as e:  # noqa: BLE001 - every job of the batch fails, sessions unchanged
            log.exception("batched forward failed (%d rows)", len(fwd.rows))
            for job, _ in fwd.rows:
                self._fail(job, e)
            return
        ms = (self.clock() - now) * 1000.0
        self._last_forward_s = time.monotonic() - wall
        self._process(fwd.rows, logits)
        self._finish(fwd.rows, logits, ms)
        self._report(fwd, ms, waits)

    def _finish(self, batch: list[tuple[Job[Any], Row]], logits: list[torch.Tensor], ms: float) -> None:
        """Each job applies its own logits; a finished one leaves the queue and its answer is handed over."""
        for (job, _), out in zip(batch, logits, strict=True):
            try:
                result = job.finish(out, ms)
            except BaseException as e:  # noqa: BLE001 - that request's error alone
                self._fail(job, e)
                continue
            if result is PENDING:
                continue  # stays queued in its place: its next chunk joins a later forward
            self._drop(job)
            if job.key is not None:
                self._answered[job.key] = time.monotonic()
                self._active[job.key] = self.clock()
            self._resolve(job, value=result)

    def _report(self, fwd: Forward, ms: float, waits: list[tuple[str, float]]) -> None:
        """The forward's figures to the model runner: observed before the answers are handed over (`_flush`),
        so a caller reading /metrics after its answer sees this forward."""
        cpu = self.cost_clock()
        cycle, self._cpu_mark = cpu - self._cpu_mark, cpu
        real = sum(len(r.ids) for _, r in fwd.rows)
        padded = len(fwd.rows) * max(len(r.ids) for _, r in fwd.rows)
        self.model_runner.on_batch(BatchStats(rows=len(fwd.rows), tokens=real, ms=ms, padded_tokens=padded,
                                              waits=waits, running_tokens=fwd.running, cpu_s=cycle))

    def _any_active(self) -> bool:
        """Whether a key was answered within the last `active_s` (older entries are dropped)."""
        if self.active_s <= 0 or not self._active:
            return False
        since = self.clock() - self.active_s
        for key in [k for k, t in self._active.items() if t < since]:
            del self._active[key]
        return bool(self._active)

    @staticmethod
    def _process(batch: list[tuple[Job[Any], Row]], logits: list[torch.Tensor]) -> None:
        """The sampling processing of every row of the forward that needs it, as one tensor operation
        per sampling config (rows then get the probabilities they would get alone). When it fails (a
        row's logits are not finite, a broken spec), each job processes its own logits and fails alone."""
        for j, _ in batch:
            j.p = None
        try:
            specs = [j.sampling(r) if r.num_logits else None for j, r in batch]
            if not any(specs):
                return
            probs = process_rows(logits, specs)
        except Exception:  # noqa: BLE001 - the jobs' own finish() reports it, one by one
            return
        for (j, _), p in zip(batch, probs, strict=True):
            j.p = p
