"""The model thread and its continuous batching: queued model work of many sessions, one forward.

Work arrives as `Job`s from the event loop: verify rounds, session-open prefills, /v1/generate
decode steps. Whenever the model is free, the thread takes the queue in arrival order and builds
one batch:
- each job's `plan()` (on the model thread, reading its session) gives the `Row` it needs, or
  answers at once (a replay, a closed session: no forward);
- the oldest job always runs; a later one joins while the batch stays within `max_batch_size`
  rows and `max_batch_tokens` padded tokens (rows x longest row), and the padded tokens stay within
  PADDING_FACTOR times the real ones (verify rows of different k share a forward, which costs less
  than a second forward; a short verify row does not ride along with a long prefill chunk);
  what does not fit waits for the next forward, which starts right after this one;
- one `KVPool.forward` runs every row; then each job's `finish()` applies its own result (the verify
  rule, a commit). An exception in one job's plan or finish fails that job alone; a failed
  forward fails every job of the batch and each `abort()` leaves its session as it was.
A job that arrives while a batch runs joins the next one. Sessions that were just answered come
back within a few milliseconds (the client's turnaround); left alone they would form waves that
never merge (half the sessions in one forward, half in the next, each costing nearly a full
forward on a CPU). So before a forward the thread waits, at most `batch_wait_ms` and at most half
the last forward's time, for the sessions answered within the last three forwards that have not
queued their next round yet; it starts at once when they all have (always with one session).
`batch_wait_ms = 0` never waits. A session never has two jobs queued (its lock is held while its round is queued), so its rounds
stay in order. Prefills longer than `max_batch_tokens` run in chunks of that size, one per
forward, so the activations of one forward stay bounded by `max_batch_tokens` (one verify row
longer than that, after a long resync, runs alone).

`run(fn)` runs a plain callable on the model thread between batches (start-up, tests).
Admission (`admit`) is unchanged: past `max_depth` requests in flight -> ResourceExhausted.
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
from typing import Any, Generic, TypeVar

import torch

from shared.errors import ResourceExhausted
from shared.kvpool import Row

log = logging.getLogger(__name__)
T = TypeVar("T")
# a row joins a batch only while rows x longest row <= PADDING_FACTOR x the real tokens
PADDING_FACTOR = 4


class Pending:
    """`finish()` returns this when the job needs another forward (the next chunk of a prefill)."""


PENDING = Pending()


@dataclass
class Job(Generic[T]):
    # the Row to run, or None with `answer` set when it needs no forward
    plan: Callable[[], Row | None]
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


@dataclass
class BatchStats:
    # sessions (rows) in the forward
    rows: int
    # padded tokens: rows x the longest row
    tokens: int
    # forward wall time, ms
    ms: float


@dataclass
class Scheduler:
    max_depth: int
    clock: Callable[[], float]
    max_batch_size: int = 32
    max_batch_tokens: int = 1024
    # longest wait before a forward for recently answered sessions' next rounds, ms (0: never wait)
    batch_wait_ms: float = 5.0
    torch_threads: int = 0
    # runs `forward(rows) -> logits per row` (the model's); set before the first job
    forward: Callable[[list[Row]], list[torch.Tensor]] | None = None
    # called on the model thread after every forward
    on_batch: Callable[[BatchStats], None] = lambda _: None
    # called on the model thread between batches (slot releases, from any thread)
    depth: int = 0
    _queue: collections.deque[Job[Any]] = field(default_factory=collections.deque)
    _between: list[Callable[[], None]] = field(default_factory=list)
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _stop: bool = False
    _thread: threading.Thread | None = None
    # model thread only: when each key was last answered (monotonic s), and the last forward's time (s)
    _answered: dict[str, float] = field(default_factory=dict)
    _last_forward_s: float = 0.0

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="model", daemon=True)
        self._thread.start()

    # --- the event loop's side ----------------------------------------------------------------
    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        if self.depth >= self.max_depth:
            raise ResourceExhausted(f"{self.depth} requests are waiting for the model (max_queue_depth = "
                                    f"{self.max_depth}); retry later", limit="max_queue_depth")
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    async def submit(self, job: Job[T], since: float | None = None) -> tuple[T, float]:
        """Queue `job`; returns (its result, ms from `since` (default now) to its first forward)."""
        job.loop = asyncio.get_running_loop()
        job.future = job.loop.create_future()
        job.since = self.clock() if since is None else since
        with self._cv:
            if self._stop:
                raise RuntimeError("the model thread has stopped")
            self._queue.append(job)
            self._cv.notify()
        result = await job.future
        started = job.started if job.started is not None else self.clock()
        return result, (started - job.since) * 1000.0

    async def run(self, fn: Callable[[], T], since: float | None = None) -> tuple[T, float]:
        """Run fn() alone on the model thread, in queue order."""
        return await self.submit(Job(plan=lambda: None, finish=lambda _, __: PENDING, call=fn), since)

    def between_batches(self, fn: Callable[[], None]) -> None:
        """Run fn() on the model thread before the next batch (any thread may call this)."""
        with self._cv:
            self._between.append(fn)
            self._cv.notify()

    def forget(self, key: str) -> None:
        """`key` sends no more work (its session closed, its stream ended): never wait for it."""
        def drop() -> None:
            self._answered.pop(key, None)

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
        for job in dropped:
            self._resolve(job, error=RuntimeError("the model thread stopped"))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # --- the model thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        while True:
            with self._cv:
                while not self._queue and not self._between and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                between, self._between = self._between, []
            for fn in between:
                fn()
            self._await_stragglers()
            with torch.inference_mode():
                self._step()

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

    def _step(self) -> None:
        """Build one batch from the queue (see the module docstring), run it, hand out the results."""
        batch: list[tuple[Job[Any], Row]] = []
        longest = real = 0
        for job in self._take():
            if job.call is not None:
                if batch:
                    break  # a plain call keeps its place in the order
                self._drop(job)
                self._run_call(job)
                return
            try:
                row = job.plan()
            except BaseException as e:  # noqa: BLE001 - that request's error alone
                self._drop(job)
                self._resolve(job, error=e)
                continue
            if row is None:
                self._drop(job)
                try:
                    assert job.answer is not None
                    self._resolve(job, value=job.answer())
                except BaseException as e:  # noqa: BLE001
                    self._resolve(job, error=e)
                continue
            n = len(row.ids)
            if batch:
                wide = max(longest, n)
                rows = len(batch) + 1
                if (rows > self.max_batch_size or wide * rows > self.max_batch_tokens
                        or PADDING_FACTOR * (real + n) < wide * rows):
                    continue  # waits for a later forward
            batch.append((job, row))
            longest, real = max(longest, n), real + n
            if len(batch) >= self.max_batch_size:
                break
        if not batch:
            return
        now, wall = self.clock(), time.monotonic()
        for job, _ in batch:
            if job.started is None:
                job.started = now
        assert self.forward is not None
        try:
            logits = self.forward([row for _, row in batch])
        except BaseException as e:  # noqa: BLE001 - every job of the batch fails, sessions unchanged
            log.exception("batched forward failed (%d rows)", len(batch))
            for job, _ in batch:
                self._drop(job)
                with contextlib.suppress(BaseException):
                    job.abort()
                self._resolve(job, error=e)
            return
        ms = (self.clock() - now) * 1000.0
        self._last_forward_s = time.monotonic() - wall
        self.on_batch(BatchStats(rows=len(batch), tokens=len(batch) * longest, ms=ms))
        for (job, _), out in zip(batch, logits, strict=True):
            try:
                result = job.finish(out, ms)
            except BaseException as e:  # noqa: BLE001 - that request's error alone
                self._drop(job)
                with contextlib.suppress(BaseException):
                    job.abort()
                self._resolve(job, error=e)
                continue
            if result is PENDING:
                continue  # stays queued in its place: its next chunk joins a later forward
            self._drop(job)
            if job.key is not None:
                self._answered[job.key] = time.monotonic()
            self._resolve(job, value=result)

    def _run_call(self, job: Job[Any]) -> None:
        job.started = self.clock()
        try:
            assert job.call is not None
            value = job.call()
        except BaseException as e:  # noqa: BLE001
            self._resolve(job, error=e)
            return
        self._resolve(job, value=value)

    @staticmethod
    def _resolve(job: Job[Any], value: Any = None, error: BaseException | None = None) -> None:
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

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            loop.call_soon_threadsafe(settle)
