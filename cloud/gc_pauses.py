"""The interpreter's garbage collector, kept off the verify rounds' path.

A full collection walks every container object the process holds; a loaded target, torch, transformers and
the servers leave hundreds of thousands of them, and while it walks (the interpreter lock held) no thread
moves: a round waits in the queue, in its forward or in the event loop alike (BENCHMARKS.md, "The verifier
under sustained load"). Objects alive once the model is loaded live as long as the process,
so they are moved out of the collector's sight (`gc.freeze`): later collections walk only what requests
created. Every collection's pause is measured (`specsplit_cloud_gc_pause_seconds`, by generation).

No lock on the collector's path. prometheus_client takes non-reentrant locks in `labels()` and `observe()`
and holds them while /metrics reads the series; a collection starts on whatever thread allocates, so one
that started inside a scrape and observed its pause there would wait for a lock its own thread holds (the
event loop with it, for good). The gc callback only reads the clock and appends (generation, seconds) to a
bounded buffer (a deque's append is atomic). The buffer is folded into the histogram when the registry is
read (just before the histogram's own samples) and every FOLD_EVERY_S by a small thread, so a scrape sees
every pause up to its own start. The buffer holds at most MAX_BUFFERED pauses: past that (more than
MAX_BUFFERED collections within FOLD_EVERY_S) a pause is dropped, counted (`GcPauses.dropped`) and the next
fold logs how many were.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)
# pauses buffered between two folds at most (a pause is a 2-tuple: well under 1 MB in all)
MAX_BUFFERED = 4096
# seconds between two folds of the buffer outside scrapes
FOLD_EVERY_S = 1.0


class GcPauses:
    """Each collection's pause, buffered by the gc callback and observed into `histogram` by `fold`."""

    def __init__(self, histogram: Histogram, clock: Callable[[], float] = time.perf_counter,
                 max_buffered: int = MAX_BUFFERED) -> None:
        self.histogram, self.clock, self.max_buffered = histogram, clock, max_buffered
        # (generation, seconds) of collections not yet observed; appended by the callback, popped by `fold`
        self.buffer: deque[tuple[int, float]] = deque()
        # pauses the full buffer could not take, since the start
        self.dropped = 0
        self._logged_dropped = 0
        self._started = 0.0
        self._fold_lock = threading.Lock()  # never taken by the callback

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """gc.callbacks entry: clock reads and one append, no lock (see the module docstring)."""
        if phase == "start":
            self._started = self.clock()
        elif len(self.buffer) < self.max_buffered:
            self.buffer.append((info.get("generation", -1), self.clock() - self._started))
        else:
            self.dropped += 1

    def fold(self) -> None:
        """Observe every buffered pause into the histogram (any thread but the callback's)."""
        with self._fold_lock:
            while self.buffer:
                generation, seconds = self.buffer.popleft()
                self.histogram.labels(str(generation)).observe(seconds)
            dropped = self.dropped
            if dropped > self._logged_dropped:
                log.warning("%d garbage-collection pauses not measured: more than %d collections between two "
                            "folds", dropped - self._logged_dropped, self.max_buffered)
                self._logged_dropped = dropped


class _FoldedHistogram:
    """Stands for the histogram in its registry: a read folds the buffer first."""

    def __init__(self, pauses: GcPauses) -> None:
        self.pauses = pauses

    def describe(self) -> Iterable[Metric]:
        return self.pauses.histogram.describe()

    def collect(self) -> Iterable[Metric]:
        self.pauses.fold()
        return self.pauses.histogram.collect()


def freeze_and_watch(pauses: Histogram, registry: CollectorRegistry | None = None,
                     clock: Callable[[], float] = time.perf_counter, fold_every_s: float = FOLD_EVERY_S,
                     max_buffered: int = MAX_BUFFERED) -> Callable[[], None]:
    """Collect once, freeze what is alive, and observe each later collection's pause (folded when `registry`,
    the histogram's, is read and every `fold_every_s`); returns the undo."""
    gc.collect()
    gc.freeze()
    watch = GcPauses(pauses, clock, max_buffered)
    reader = _FoldedHistogram(watch)
    if registry is not None:
        registry.unregister(pauses)
        registry.register(reader)
    stop = threading.Event()

    def fold_forever() -> None:
        while not stop.wait(fold_every_s):
            watch.fold()

    folder = threading.Thread(target=fold_forever, name="gc-pause-fold", daemon=True)
    gc.callbacks.append(watch.on_gc)
    folder.start()

    def undo() -> None:
        if watch.on_gc in gc.callbacks:
            gc.callbacks.remove(watch.on_gc)
        stop.set()
        folder.join()
        watch.fold()
        if registry is not None:
            registry.unregister(reader)
            registry.register(pauses)
        gc.unfreeze()

    return undo
