"""The graph executor: the forward of our own (cloud/runners/model_forward.py) over the KV pool, CUDA graphs per bucket.

Every forward is the same sequence of tensor operations on buffers whose shapes come from a few buckets, so on CUDA
it is captured once per bucket as a CUDA graph and replayed (nano-vllm's and vLLM's way; docs/GPU.md). On a CPU the
same function runs eagerly (the default there; the tests compare it with transformers' modules), and so does a
tensor-parallel group's (`eager_inputs` on rank 0, `eager_forward` on every rank). The output layer runs outside the
graph, on the kept rows only.

Buckets (graphs on): T = R x N with R in ROW_BUCKETS, N in QUERY_BUCKETS, W in KEY_BUCKETS; one group. `capture`
records the deployment's buckets at start-up on the model thread, largest first, in one memory pool and within a
byte bound; a forward takes the smallest captured bucket of each dimension, and one outside every bucket (a
prefill chunk, a long context) runs eagerly with exact shapes and is counted. A pool that grows (new storage)
captures them again. Without a start-up capture (tests, benches) a bucket's first forward captures its graph, at
most `max_graphs` held.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cloud.runners.graph_inputs import (
    KEY_BUCKETS,
    MAX_GRAPH_TOKENS,
    QUERY_BUCKETS,
    ROW_BUCKETS,
    Inputs,
    blank,
    bucket,
    build_inputs,
    to_device,
)
from cloud.runners.model_forward import ModelForward
from shared.invariant import build_calls
from shared.rows import Row

log = logging.getLogger(__name__)

# the linear layers' row tile of a batch-invariant forward on a GPU (one kernel shape for every forward size)
GPU_ROW_TILE = 64


class PagedForward(ModelForward):
    """The forward of a FAMILIES model over a KV pool, eager or replayed from CUDA graphs (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, graphs: bool, tile: int = 0, buckets: bool | None = None,
                 max_graphs: int = 48, max_graph_keys: int = 4096, kernel: bool = False, ranks: int = 1,
                 collectives: Any = None, fused: bool = False) -> None:
        super().__init__(model, tile=tile, kernel=kernel, ranks=ranks, collectives=collectives, fused=fused)
        self.graphs = graphs and self.device.type == "cuda"
        self.windowed = any(w is not None for w in self.windows)  # the groups carry query-key distances
        # forwards padded to the graphs' buckets (default: where graphs run; on a CPU, the same inputs eagerly)
        self.buckets = self.graphs if buckets is None else buckets or self.graphs
        self.max_graphs, self.max_graph_keys = max_graphs, max_graph_keys
        self._graphs: OrderedDict[tuple[int, int, int], tuple[Any, Inputs, torch.Tensor]] = OrderedDict()
        # whether a bucket's first forward captures its graph (False once `capture` ran at start-up)
        self.lazy = True
        # bytes the captured graphs hold (their memory pool's growth)
        self.graph_bytes = 0
        # the start-up capture's buckets and bound (captured again when the pool's storage moves), and the row,
        # query and key counts it captured
        self._planned: tuple[list[tuple[int, int, int]], int] | None = None
        self._dims: tuple[tuple[int, ...], ...] = ((), (), ())
        self._mempool: Any = None
        self._storage: int | None = None
        # forwards replayed from a graph, run eagerly, graphs captured (and seconds spent capturing)
        self.replayed = self.eager = self.captured = 0
        self.capture_s = 0.0
        # the last forward captured its graph (its time is the capture's, no forward's cost)
        self.captured_last = False

    # --- inputs ------------------------------------------------------------------------------------------------
    def inputs(self, pool: Any, rows: list[Row], spare: int, shape: tuple[int, int, int] | None) -> Inputs:
        """`build_inputs` at this executor's tile, context and attention."""
        return build_inputs(pool, rows, spare, shape, self.tile, self.max_positions, self.kernel, not self.chunked,
                            self.windowed)

    def shape_of(self, rows: list[Row]) -> tuple[int, int, int] | None:
        """The graph bucket (R, N, W) these rows fit, or None (eager). After a start-up capture: the smallest
        captured value of each dimension that fits (a short context pads its keys to the smallest captured key
        count), None where that bucket was not captured."""
        if not self.buckets:
            return None
        R0, N0, W0 = len(rows), max(len(r.ids) for r in rows), max(r.num_cached_tokens + len(r.ids) for r in rows)
        if self._planned is not None:
            R, N, W = (bucket(x, d) for x, d in zip((R0, N0, W0), self._dims, strict=True))
            return (R, N, W) if (R, N, W) in self._graphs else None  # type: ignore[return-value]
        R, N, W = bucket(R0, ROW_BUCKETS), bucket(N0, QUERY_BUCKETS), bucket(W0, KEY_BUCKETS)
        if R is None or N is None or W is None or W > self.max_graph_keys or R * N > MAX_GRAPH_TOKENS:
            return None
        return R, N, W

    def captured_dims(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """The sorted row, query and key counts of the captured graphs."""
        return tuple(tuple(sorted({s[i] for s in self._graphs})) for i in range(3))  # type: ignore[return-value]

    # --- a forward ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, pool: Any, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's kept logits ([P, vocab], rows in order) and final hidden states ([P, d]); the rows must be
        planned (`KVPool.plan`). A forward in a captured bucket replays its graph; any other runs eagerly
        (counted: `eager`)."""
        keys, values = pool.keys, pool.values
        if self._storage != keys[0].data_ptr():  # new storage (the pool grew): graphs recorded the old addresses
            self.drop_graphs()
            self._storage = keys[0].data_ptr()
            if self._planned is not None:  # the start-up buckets again, over the new storage
                self.capture(pool, *self._planned)
        spare = pool.spare_row
        self.block = pool.manager.size
        P = sum(r.num_logits for r in rows)
        shape = self.shape_of(rows)
        graph = self._graphs.get(shape) if shape is not None else None
        if graph is None and self.graphs and shape is not None and self.lazy:
            graph = self._capture(shape, self.inputs(pool, rows, spare, shape), keys, values)
        if graph is None:
            return self.eager_forward(pool, self.eager_inputs(pool, rows, None if self.graphs else shape))
        g, static, out = graph
        static.copy_(self.inputs(pool, rows, spare, shape))
        g.replay()
        self.replayed += 1
        hidden = out[:P].clone()  # [P, d]
        return self.logits(hidden), hidden

    def capture(self, pool: Any, shapes: Sequence[tuple[int, int, int]], max_bytes: int) -> None:
        """Capture a graph for each bucket (R, N, W) in `shapes` that fits the pool, largest first, in one memory
        pool, while the graphs' bytes stay within `max_bytes` (the rest run eagerly); on the model thread, at
        start-up. `graph_bytes` is what they hold."""
        if not self.graphs:
            return
        keys, values = pool.keys, pool.values
        self._storage = keys[0].data_ptr()
        self.block = pool.manager.size
        self.lazy, self._planned = False, (list(shapes), max_bytes)
        todo = sorted({s for s in shapes if s[2] <= self.max_positions}, key=lambda s: (s[0] * s[1] * s[2], s),
                      reverse=True)
        last = 0
        for shape in todo:
            if self.graph_bytes + last > max_bytes:
                log.warning("CUDA graphs: %d of %d buckets captured, %.0f MB (--graph-memory-bytes %d): the rest "
                            "run eagerly", len(self._graphs), len(todo), self.graph_bytes / 1e6, max_bytes)
                break
            before = torch.cuda.memory_reserved(self.device)
            self._capture(shape, blank(shape, pool.spare_row, self.tile, self.block if self.kernel else 0,
                                       self.windowed), keys, values)
            last = torch.cuda.memory_reserved(self.device) - before
            self.graph_bytes += last
            if self.graph_bytes > max_bytes:  # this one alone was too large: let it go, try the smaller ones
                self._graphs.pop(shape)
                self.graph_bytes -= last
                if not self._graphs:
                    self.drop_graphs()
                    torch.cuda.empty_cache()
                last = 0
        self._dims = self.captured_dims()
        log.info("CUDA graphs captured at start-up: %d buckets in %.1f s, %.0f MB", len(self._graphs), self.capture_s,
                 self.graph_bytes / 1e6)

    def _capture(self, shape: tuple[int, int, int], host: Inputs, keys: list[torch.Tensor],
                 values: list[torch.Tensor]) -> tuple[Any, Inputs, torch.Tensor]:
        t0 = time.perf_counter()
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        static = to_device(host, self.device)
        # the capture's warm-up writes its padded K/V to the spare row only; real rows' K/V are written by the
        # warm-up too, with the values the replay writes again
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            self.run(static, keys, values)
        torch.cuda.current_stream(self.device).wait_stream(s)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        # thread-local capture: another thread's CUDA work (the event loop's) is not captured into it, nor refused
        with torch.cuda.graph(g, pool=self._mempool, capture_error_mode="thread_local"):
            out = self.run(static, keys, values)
        entry = (g, static, out)
        self._graphs[shape] = entry
        self.captured += 1
        self.capture_s += time.perf_counter() - t0
        log.debug("CUDA graph captured for %d rows x %d queries x %d keys in %.0f ms (%d held)", *shape,
                  (time.perf_counter() - t0) * 1000, len(self._graphs))
        return entry

    def eager_inputs(self, pool: Any, rows: list[Row], shape: tuple[int, int, int] | None = None) -> EagerStep:
        """An eager forward's inputs, on the host (what a tensor-parallel rank 0 sends every rank)."""
        calls = None
        if self.chunked:
            starts = [0]
            for r in rows[:-1]:
                starts.append(starts[-1] + len(r.ids))
            calls = {w: build_calls(pool.manager, rows, starts, w, torch.device("cpu")) for w in set(self.windows)}
        return EagerStep(self.inputs(pool, rows, pool.spare_row, shape), calls, sum(r.num_logits for r in rows))

    def eager_forward(self, pool: Any, step: EagerStep) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` run eagerly over `pool`'s tensors: the kept logits and final hidden states (counted: `eager`)."""
        self.eager += 1
        self.block = pool.block_size
        self._chunks = None if step.calls is None else {w: [c.to(self.device) for c in calls]
                                                         for w, calls in step.calls.items()}
        try:
            hidden = self.run(to_device(step.inputs, self.device), pool.keys, pool.values)[:step.kept]
        finally:
            self._chunks = None
        return self.logits(hidden), hidden

    def drop_graphs(self) -> None:
        """Forget every graph, and their memory pool with them (a pool whose graphs are all gone is released:
        capturing into its handle again fails inside PyTorch's allocator)."""
        self._graphs.clear()
        self._mempool = None
        self.graph_bytes = 0

    def facts(self) -> dict[str, Any]:
        return {"graphs": self.graphs, "tile": self.tile, "held": len(self._graphs), "captured": self.captured,
                "capture_s": round(self.capture_s, 3), "replayed": self.replayed, "eager": self.eager,
                "graph_bytes": self.graph_bytes}


@dataclass
class EagerStep:
    """One eager forward as the host planned it: inputs, the chunked attention calls per sliding window (None: full
    attention) on a CPU (None: groups or the kernel) and the count of kept tokens."""
    inputs: Inputs
    calls: dict[int | None, list[Any]] | None
    kept: int
