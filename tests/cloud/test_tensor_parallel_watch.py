"""A rank whose serving loop hangs in an op stops beating although its heartbeat thread runs
(cloud/tensor_parallel.OpWatch), without processes: the group's store and clock are stand-ins."""

from __future__ import annotations

from collections import Counter
from typing import Any

from cloud.runners import tensor_parallel as tp
from cloud.runners.tensor_parallel import OP_STALE_S, Op, OpWatch, TensorGroup, serve_worker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Store:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def add(self, key: str, n: int) -> int:
        self.counts[key] += n
        return self.counts[key]


def worker(clock: Clock) -> TensorGroup:
    g = TensorGroup.__new__(TensorGroup)
    g.rank, g.size, g.watch, g._store, g._lost = 1, 2, OpWatch(clock), Store(), None
    g._watch_ranks(clock())
    return g


def test_a_rank_gets_its_start_grace_for_the_first_beat_then_stale_s(monkeypatch: Any) -> None:
    """Ranks reach the group at different times on a loaded host: before rank 0's first beat is seen, a worker
    waits START_GRACE_S + STALE_S; once seen, a counter that stops for STALE_S loses the group."""
    exits: list[int] = []
    monkeypatch.setattr(tp.os, "_exit", exits.append)
    clock = Clock()
    g = worker(clock)
    g._beat_once(clock())  # rank 0's counter is read (0: it has not beaten yet); its grace still runs
    clock.now += tp.STALE_S + 1
    g._beat_once(clock())
    assert g.lost() is None  # no beat of rank 0 yet, within the start grace
    clock.now += tp.START_GRACE_S
    g._beat_once(clock())
    assert g.lost() is not None and exits == [tp.EXIT_RANK_LOST]  # never came
    g = worker(clock)
    g._store.add("specsplit/beat/0", 1)
    g._beat_once(clock())  # seen once: STALE_S from here
    clock.now += tp.STALE_S + 0.5
    g._beat_once(clock())
    assert g.lost() is not None and exits == [tp.EXIT_RANK_LOST] * 2


def test_the_watch_tells_an_op_that_hangs_from_waiting_for_work() -> None:
    clock = Clock()
    watch = OpWatch(clock)
    clock.now += 3600  # waiting for the next op, however long, is not hanging
    assert not watch.hung()
    with watch:
        clock.now += OP_STALE_S - 1
        assert not watch.hung()
        clock.now += 2
        assert watch.hung()
    assert not watch.hung()


def test_a_worker_hung_in_a_forward_stops_beating(monkeypatch: Any) -> None:
    monkeypatch.setattr(tp.signal, "signal", lambda *a: None)  # the worker's SIG_IGN stays out of pytest
    clock = Clock()
    g = worker(clock)
    beats: list[int] = []

    class Model:
        def run_step(self, op: Any) -> None:  # the forward hangs: the heartbeat thread beats meanwhile
            for _ in range(3):
                g._beat_once(clock())
                beats.append(g._store.counts["specsplit/beat/1"])
                clock.now += OP_STALE_S
                g._store.add("specsplit/beat/0", 1)  # rank 0 is alive

    ops = iter([Op("forward", step=object()), Op("stop")])  # type: ignore[arg-type]
    monkeypatch.setattr(g, "receive", lambda: next(ops), raising=False)
    assert serve_worker(Model(), g) == 0
    assert beats == [1, 2, 2]  # on time, still within OP_STALE_S, then hung: the counter stops
    g._beat_once(clock())  # the op over, it beats again
    assert g._store.counts["specsplit/beat/1"] == 3


def test_the_serving_loop_runs_each_op_inside_the_watch(monkeypatch: Any) -> None:
    monkeypatch.setattr(tp.signal, "signal", lambda *a: None)
    seen: list[bool] = []
    g = worker(Clock())

    class Model:
        def run_step(self, op: Any) -> None:
            seen.append(g.watch._since is not None)

        def use_pool(self, *a: Any) -> None:
            seen.append(g.watch._since is not None)

    ops = iter([Op("use_pool", pool=(1, 16, True)), Op("forward", step=object()), Op("stop")])  # type: ignore[arg-type]
    monkeypatch.setattr(g, "receive", lambda: next(ops), raising=False)
    assert serve_worker(Model(), g) == 0 and seen == [True, True] and g.watch._since is None
    assert tp.OP_STALE_S > tp.STALE_S
