"""The model worker: one thread runs every forward, off the event loop, first come first served.

Admission is bounded: `admit()` counts a model-bound request from arrival until it finishes
(waiting for its session, queued, or running); past `max_depth` it answers ResourceExhausted
(429 / RESOURCE_EXHAUSTED) at once instead of queueing without bound.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

from shared.errors import ResourceExhausted

T = TypeVar("T")


class ModelWorker:
    def __init__(self, max_depth: int, clock: Callable[[], float], torch_threads: int = 0) -> None:
        self.max_depth = max_depth
        self.clock = clock
        self.depth = 0
        self._threads = torch_threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model", initializer=self._init)

    def _init(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)

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

    async def run(self, fn: Callable[[], T], since: float | None = None) -> tuple[T, float]:
        """Run fn() on the model thread; returns (result, ms from `since` (default: now) to its start)."""
        queued = self.clock() if since is None else since
        started: list[float] = []

        def job() -> T:
            started.append(self.clock())
            with torch.inference_mode():
                return fn()

        result = await asyncio.get_running_loop().run_in_executor(self._pool, job)
        return result, (started[0] - queued) * 1000.0

    def call_sync(self, fn: Callable[[], T]) -> T:
        """Run fn() on the model thread and wait (start-up only, before the loop serves)."""
        return self._pool.submit(fn).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
