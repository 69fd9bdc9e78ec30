"""cloud/gc_pauses.py: what is alive at startup leaves the collector's walks, each collection's pause is
observed by generation until the undo, a collection during a scrape cannot stall it, and the buffer is bounded."""

from __future__ import annotations

import gc
import logging
import threading
from collections.abc import Iterable

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.metrics_core import Metric

from cloud.gc_pauses import freeze_and_watch

# seconds a scrape may take before the test calls it stalled (one takes milliseconds)
SCRAPE_TIMEOUT_S = 10.0


def count(registry: CollectorRegistry, generation: str) -> float:
    """The histogram's count for `generation`, read through the registry as /metrics reads it."""
    return sum(s.value for m in registry.collect() for s in m.samples
               if s.name.endswith("_count") and s.labels.get("generation") == generation)


def pauses_in(registry: CollectorRegistry) -> Histogram:
    return Histogram("gc_pause_seconds", "test", ["generation"], registry=registry)


def test_startup_objects_are_frozen_and_every_collection_is_timed() -> None:
    registry = CollectorRegistry()
    pauses = pauses_in(registry)
    alive = [{"i": i} for i in range(1000)]  # containers alive at "startup"
    undo = freeze_and_watch(pauses, registry)
    try:
        assert gc.get_freeze_count() >= len(alive)
        gc.collect(2)
        gc.collect(0)
        assert count(registry, "2") >= 1 and count(registry, "0") >= 1
    finally:
        undo()
    assert gc.get_freeze_count() == 0
    before = count(registry, "2")
    gc.collect(2)
    assert count(registry, "2") == before  # no longer watched
    assert b"gc_pause_seconds_count" in generate_latest(registry)  # the histogram is back in its registry


class CollectsWhileHoldingTheLock:
    """A collector that runs a garbage collection while it holds the lock the histogram's `labels()` takes, as
    a collection that starts inside the histogram's own read does (prometheus_client's locks are not
    reentrant)."""

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram

    def collect(self) -> Iterable[Metric]:
        with self.histogram._lock:
            gc.collect(0)
        return []


def test_a_collection_during_a_scrape_does_not_stall_it() -> None:
    registry = CollectorRegistry()
    pauses = pauses_in(registry)
    undo = freeze_and_watch(pauses, registry, fold_every_s=3600)
    registry.register(CollectsWhileHoldingTheLock(pauses))
    scraped: list[bytes] = []
    scrape = threading.Thread(target=lambda: scraped.append(generate_latest(registry)), daemon=True)
    try:
        scrape.start()
        scrape.join(SCRAPE_TIMEOUT_S)
        assert not scrape.is_alive(), "a garbage collection inside a scrape stalled it"
        assert scraped and count(registry, "0") >= 1  # the collection's pause shows at the next read
    finally:
        undo()


def test_pauses_past_the_buffer_are_dropped_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    pauses = pauses_in(registry)
    undo = freeze_and_watch(pauses, registry, fold_every_s=3600, max_buffered=3)
    try:
        for _ in range(5):  # nothing folds meanwhile: 3 buffered, the rest (2, or more if gc ran itself) dropped
            gc.collect(0)
        with caplog.at_level(logging.WARNING, logger="cloud.gc_pauses"):
            folded = sum(s.value for m in registry.collect() for s in m.samples if s.name.endswith("_count"))
        assert folded == 3
        assert "garbage-collection pauses not measured" in caplog.text
    finally:
        undo()
