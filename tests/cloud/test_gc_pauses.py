"""cloud/gc_pauses.py: what is alive at startup leaves the collector's walks, and each collection's pause is
observed by generation until the undo."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry, Histogram

from cloud.gc_pauses import freeze_and_watch


def count(h: Histogram, generation: str) -> float:
    return sum(s.value for m in h.collect() for s in m.samples
               if s.name.endswith("_count") and s.labels.get("generation") == generation)


def test_startup_objects_are_frozen_and_every_collection_is_timed() -> None:
    pauses = Histogram("gc_pause_seconds", "test", ["generation"], registry=CollectorRegistry())
    alive = [{"i": i} for i in range(1000)]  # containers alive at "startup"
    undo = freeze_and_watch(pauses)
    try:
        assert gc.get_freeze_count() >= len(alive)
        gc.collect(2)
        gc.collect(0)
        assert count(pauses, "2") >= 1 and count(pauses, "0") >= 1
    finally:
        undo()
    assert gc.get_freeze_count() == 0
    before = count(pauses, "2")
    gc.collect(2)
    assert count(pauses, "2") == before  # no longer watched
