"""The interpreter's garbage collector, kept off the verify rounds' path.

A full collection walks every container object the process holds; a loaded target, torch, transformers and
the servers leave hundreds of thousands of them, and while it walks (the interpreter lock held) no thread
moves: a round waits in the queue, in its forward or in the event loop alike (bench.sustained traced rounds
of 200-330 ms against 9 ms idle that way). Objects alive once the model is loaded live as long as the process,
so they are moved out of the collector's sight (`gc.freeze`): later collections walk only what requests
created. Every collection's pause is measured (`specsplit_cloud_gc_pause_seconds`, by generation).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import Histogram


def freeze_and_watch(pauses: Histogram, clock: Callable[[], float] = time.perf_counter) -> Callable[[], None]:
    """Collect once, freeze what is alive, and observe each later collection's pause; returns the undo."""
    gc.collect()
    gc.freeze()
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[:] = [clock()]
        elif started:
            pauses.labels(str(info.get("generation", ""))).observe(clock() - started.pop())

    gc.callbacks.append(on_gc)

    def undo() -> None:
        if on_gc in gc.callbacks:
            gc.callbacks.remove(on_gc)
        gc.unfreeze()

    return undo
