"""The model thread's scheduler: it decides which queued work runs in each forward; the model
runner (cloud/runners/torch_runner.py, shared/kvpool.py) runs it. Nothing here touches tensors.

Work arrives as `Job`s from the event loop: verify rounds, session-open prefills, /v1/generate
decode steps. Whenever the model is free, the thread builds one forward under a token budget
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
   `max_prefill_tokens_with_rounds` at most, and `prefill_slice(running tokens)` when given: the service
   reads it from the measured forward cost (what keeps the forward within a share of the rounds' own).
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

`run(fn)` runs a plain callable on the model thread between batches (start-up, tests). What may
enter the queue at all is decided before, per API key (cloud/admission.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from cloud.jobs import PENDING, PREFILL, Abandoned, BatchStats, Job, Wait
from shared.errors import ResourceExhausted, Unavailable
from shared.kvpool import Row
from shared.sampling import process_rows

log = logging.getLogger(__name__)
T = TypeVar("T")
@dataclass
class Scheduler:
    clock: Callable[[], float]
    max_batch_size: int = 32
    max_batch_tokens: int = 1024
    # prefill tokens at most in a forward that also carries rounds or decode steps, or that runs while a
    # session is active
    max_prefill_tokens_with_rounds: int = 1 << 30
    # the slice by measured cost: prefill tokens a forward carrying this many round and decode tokens may add
    # (at most max_prefill_tokens_with_rounds; None: that cap alone)
    prefill_slice: Callable[[int], int] | None = None
    # a key answered within this long (s, by `clock`) is active: its next round is expected (0: never)
    active_s: float = 0.0
    # longest wait before a forward for recently answered sessions' next rounds, ms (0: never wait)
    batch_wait_ms: float = 5.0
    torch_threads: int = 0
    # runs `forward(rows) -> logits per row` (the model's); set before the first job
    forward: Callable[[list[Row]], list[torch.Tensor]] | None = None
    # KV blocks a row needs / blocks a forward can still get / make room for n more blocks (evictions)
    blocks_needed: Callable[[Row], int] = lambda _: 0
    blocks_available: Callable[[], int] = lambda: 1 << 62
    # sequence ids a row's token tree takes / ids free for trees (the llama.cpp runner gives each leaf one;
    # a row whose tree does not fit waits for a later forward)
    tree_seqs: Callable[[Row], int] = lambda _: 0
    tree_seqs_available: Callable[[], int] = lambda: 1 << 30
    # free this many KV blocks if it can; the flag says whether the forward already has rows (then only
    # sessions idle for a while are evicted: the work that lacks blocks can wait for a later forward)
    make_room: Callable[[int, bool], None] = lambda _, __: None
    # called on the model thread after every forward
    on_batch: Callable[[BatchStats], None] = lambda _: None
    _queue: collections.deque[Job[Any]] = field(default_factory=collections.deque)
    _between: list[Callable[[], None]] = field(default_factory=list)
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _stop: bool = False
    _thread: threading.Thread | None = None
    # model thread only: when each key was last answered (monotonic s), and the last forward's time (s)
    _answered: dict[str, float] = field(default_factory=dict)
    _last_forward_s: float = 0.0
    # model thread only: the number of the last forward that ran a prefill of each owner, and forwards run
    _served: dict[str, int] = field(default_factory=dict)
    _forwards: int = 0
    # model thread only: when each key was last answered, by `clock` (the active sessions)
    _active: dict[str, float] = field(default_factory=dict)
    # futures to settle, by event loop, handed over once per forward (`_flush`; shutdown adds from its thread)
    _settles: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = field(default_factory=dict)
    _settles_lock: threading.Lock = field(default_factory=threading.Lock)
    # what a forward's work costs, read at its end (BatchStats.cpu_s): the process's CPU time where the CPU runs
    # the model; a GPU's cloud passes wall time
    cost_clock: Callable[[], float] = time.process_time
    # model thread only: `cost_clock` at the end of the last forward's work (or when work arrived after idling)
    _cpu_mark: float = 0.0

    def __post_init__(self) -> None:
        self._cpu_mark = self.cost_clock()
        self._thread = threading.Thread(target=self._loop, name="model", daemon=True)
        self._thread.start()

    # --- the event loop's side ----------------------------------------------------------------
    async def submit(self, job: Job[T], since: float | None = None) -> tuple[T, float]:
        """Queue `job`; returns (its result, ms from `since` (default now) to its first forward)."""
        job.loop = asyncio.get_running_loop()
        job.future = job.loop.create_future()
        job.since = self.clock() if since is None else since
        with self._cv:
            if self._stop:
                raise Unavailable("this replica is shutting down: retry (elsewhere)")
            self._queue.append(job)
            self._cv.notify()
        result = await job.future
        started = job.started if job.started is not None else self.clock()
        return result, (started - job.since) * 1000.0

    async def run(self, fn: Callable[[], T], since: float | None = None) -> tuple[T, float]:
        """Run fn() alone on the model thread, in queue order."""
        return await self.submit(Job(plan=lambda _: None, finish=lambda _, __: PENDING, call=fn), since)

    def cancel(self, job: Job[Any]) -> None:
        """Nobody waits for `job` any more: it leaves the queue before its next forward (abort() gives its
        blocks back) and its future fails with Abandoned; a forward already running it finishes first."""
        with self._cv:
            job.cancelled = True
            self._cv.notify()

    def between_batches(self, fn: Callable[[], None]) -> None:
        """Run fn() on the model thread before the next batch (any thread may call this)."""
        with self._cv:
            self._between.append(fn)
            self._cv.notify()

    def forget(self, key: str) -> None:
        """`key` sends no more work (its session closed, its stream ended): never wait for it."""
        def drop() -> None:
            self._answered.pop(key, None)
            self._active.pop(key, None)

        self.between_batches(drop)

    def call_sync(self, fn: Callable[[], T]) -> T:
        """Run fn() on the model thread and wait (start-up, before the loop serves)."""
        done = threading.Event()
        box: list[Any] = []

        def wrapped() -> None:
            try:
                box.append((True, fn()))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append((False, e))
            done.set()

        self.between_batches(wrapped)
        done.wait()
        ok, value = box[0]
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            dropped = list(self._queue)
            self._queue.clear()
            self._cv.notify()
        for job in dropped:  # answered 503: the caller retries elsewhere
            self._resolve(job, error=Unavailable("this replica is shutting down: retry (elsewhere)"))
        self._flush()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

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

    def _take(self) -> list[Job[Any]]:
        with self._cv:
            jobs = list(self._queue)
        return jobs

    def _drop(self, job: Job[Any]) -> None:
        with self._cv:
            with contextlib.suppress(ValueError):
                self._queue.remove(job)

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

    def _fail(self, job: Job[Any], e: BaseException) -> None:
        self._drop(job)
        with contextlib.suppress(BaseException):
            job.abort()
        self._resolve(job, error=e)

    def _step(self) -> None:
        """Build one forward from the queue (see the module docstring), run it, hand out the results."""
        jobs = self._take()
        for job in [j for j in jobs if j.cancelled]:
            self._fail(job, Abandoned("the caller went away"))
        jobs = [j for j in jobs if not j.cancelled]
        if jobs and jobs[0].call is not None:
            self._drop(jobs[0])
            self._run_call(jobs[0])
            return
        cut = next((i for i, j in enumerate(jobs) if j.call is not None), len(jobs))  # a call keeps its place
        batch: list[tuple[Job[Any], Row]] = []
        budget, reserved = self.max_batch_tokens, 0
        seqs_left = self.tree_seqs_available()
        ordered = self._order(jobs[:cut])
        chunked: list[Job[Any]] = []  # rounds whose next forward is a resync chunk: they fill like prefills

        def candidates() -> Iterator[tuple[Job[Any], bool]]:
            yield from ((j, False) for j in ordered if j.kind != PREFILL)
            yield from ((j, True) for j in chunked)
            yield from ((j, True) for j in ordered if j.kind == PREFILL)

        running = 0  # tokens of rounds and decode steps in this forward
        active = self._any_active()
        for job, filling in candidates():
            if filling and (running or active) and budget > 0:  # the prefills' share: the slice
                cap = self.max_prefill_tokens_with_rounds
                if self.prefill_slice is not None:
                    cap = min(cap, self.prefill_slice(running))
                budget = min(budget, cap - (self.max_batch_tokens - budget - running))
            if len(batch) >= self.max_batch_size or budget <= 0:
                break
            try:
                row = job.plan(budget if filling or batch else self.max_batch_tokens)
            except BaseException as e:  # noqa: BLE001 - that request's error alone
                self._drop(job)
                self._resolve(job, error=e)
                continue
            if isinstance(row, Wait):
                continue
            if self.blocks_available() < reserved:
                # its plan took blocks promised to rows already in this forward (a new sequence matching
                # cached prefix blocks): it gives them back and waits, so no forward lacks its blocks
                job.unplan()
                if self.blocks_available() < reserved:
                    self.make_room(reserved - self.blocks_available(), True)
                continue
            if row is None:
                self._drop(job)
                try:
                    assert job.answer is not None
                    self._resolve(job, value=job.answer())
                except BaseException as e:  # noqa: BLE001
                    self._resolve(job, error=e)
                continue
            if not filling and row.keep == 0:
                chunked.append(job)  # a long resync: after the running work, in the prefills' share
                continue
            if batch and len(row.ids) > budget:
                job.unplan()
                continue  # waits for a later forward
            # a plan may have taken cached prefix blocks: count what is left now
            need, left = self.blocks_needed(row), self.blocks_available() - reserved
            if need > left:  # never a session mid-generation, even for the forward's first row
                self.make_room(need - left, True)
                left = self.blocks_available() - reserved
            if need > left:
                if not batch:
                    self._fail(job, ResourceExhausted(
                        f"the KV cache is full ({need} more blocks needed; no idle session or cached "
                        "block is left to evict); retry later", limit="kv_budget_bytes"))
                else:
                    job.unplan()
                continue  # waits for a later forward
            seqs = self.tree_seqs(row)
            if seqs > seqs_left and batch:
                job.unplan()
                continue  # waits for a later forward
            seqs_left -= seqs
            reserved += need
            budget -= len(row.ids)
            running += 0 if filling else len(row.ids)
            batch.append((job, row))
        if not batch:
            return
        self._forwards += 1
        for job, _ in batch:
            if job.kind == PREFILL:
                self._served[job.owner] = self._forwards
        now, wall = self.clock(), time.monotonic()
        waits = []
        for job, _ in batch:
            if job.started is None:
                job.started = now
                waits.append((job.kind, max(now - job.since, 0.0)))
        assert self.forward is not None
        try:
            logits = self.forward([row for _, row in batch])
        except BaseException as e:  # noqa: BLE001 - every job of the batch fails, sessions unchanged
            log.exception("batched forward failed (%d rows)", len(batch))
            for job, _ in batch:
                self._fail(job, e)
            return
        ms = (self.clock() - now) * 1000.0
        self._last_forward_s = time.monotonic() - wall
        self._process(batch, logits)
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
        # observed before the answers are handed over (`_flush`): a caller reading /metrics after its answer
        # sees this forward
        cpu = self.cost_clock()
        cycle, self._cpu_mark = cpu - self._cpu_mark, cpu
        real = sum(len(r.ids) for _, r in batch)
        padded = len(batch) * max(len(r.ids) for _, r in batch)
        self.on_batch(BatchStats(rows=len(batch), tokens=real, ms=ms, padded_tokens=padded, waits=waits,
                                 running_tokens=running, cpu_s=cycle))

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
            specs = [j.sampling(r) if j.sampling is not None and r.keep else None for j, r in batch]
            if not any(specs):
                return
            probs = process_rows(logits, specs)
        except Exception:  # noqa: BLE001 - the jobs' own finish() reports it, one by one
            return
        for (j, _), p in zip(batch, probs, strict=True):
            j.p = p

    def _run_call(self, job: Job[Any]) -> None:
        job.started = self.clock()
        try:
            assert job.call is not None
            value = job.call()
        except BaseException as e:  # noqa: BLE001
            self._resolve(job, error=e)
            return
        self._resolve(job, value=value)

    def _resolve(self, job: Job[Any], value: Any = None, error: BaseException | None = None) -> None:
        """Settle the job's future on its event loop: queued, and handed over by `_flush` once per forward
        (one wake-up of each loop for every answer of the forward, not one per answer)."""
        fut, loop = job.future, job.loop
        if fut is None or loop is None:
            return

        def settle() -> None:
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(value)

        with self._settles_lock:
            self._settles.setdefault(loop, []).append(settle)

    def _flush(self) -> None:
        with self._settles_lock:
            settles, self._settles = self._settles, {}
        for loop, fns in settles.items():

            def run(fns: list[Callable[[], None]] = fns) -> None:
                for fn in fns:
                    fn()

            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(run)
