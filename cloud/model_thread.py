"""The model thread's handoff with the event loops: what cloud/scheduler.py's `Scheduler` builds on.

Jobs are queued from any event loop (`submit`); plain callables run on the model thread between forwards
(`between_batches`, `call_sync`); answers are settled on each job's own loop, handed over once per forward
(`_flush`: one wake-up of each loop for every answer of the forward, not one per answer). Which queued jobs
run in each forward is the scheduler's (its module docstring).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cloud.jobs import Call, Job
from shared.errors import Unavailable

T = TypeVar("T")


@dataclass
class ModelThread:
    clock: Callable[[], float]
    # queued jobs in arrival order, callables for before the next forward, and the condition both wait on
    _queue: collections.deque[Job[Any]] = field(init=False, default_factory=collections.deque)
    _between: list[Callable[[], None]] = field(init=False, default_factory=list)
    _cv: threading.Condition = field(init=False, default_factory=threading.Condition)
    _stop: bool = field(init=False, default=False)
    _thread: threading.Thread | None = field(init=False, default=None)
    # futures to settle, by event loop, handed over once per forward (`_flush`; shutdown adds from its thread)
    _settles: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = field(init=False, default_factory=dict)
    _settles_lock: threading.Lock = field(init=False, default_factory=threading.Lock)

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
        return await self.submit(Call(fn), since)

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
    def _drop(self, job: Job[Any]) -> None:
        with self._cv:
            with contextlib.suppress(ValueError):
                self._queue.remove(job)

    def _fail(self, job: Job[Any], e: BaseException) -> None:
        self._drop(job)
        with contextlib.suppress(BaseException):
            job.abort()
        self._resolve(job, error=e)

    def _run_call(self, job: Job[Any]) -> None:
        job.started = self.clock()
        try:
            value = job.answer()
        except BaseException as e:  # noqa: BLE001
            self._resolve(job, error=e)
            return
        self._resolve(job, value=value)

    def _resolve(self, job: Job[Any], value: Any = None, error: BaseException | None = None) -> None:
        """Settle the job's future on its event loop: queued, and handed over by `_flush` once per forward."""
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
