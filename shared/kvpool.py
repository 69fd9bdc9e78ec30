"""Paged KV storage for Hugging Face attention models: many sequences, crop by length, one
flattened (unpadded) forward for all of them.

Both roles use it: the cloud keeps every session in one pool and runs the rounds of several
sessions as one forward; the edge's draft model is a pool of one sequence.

Layout. Positions live in fixed-size blocks (shared/blocks.py keeps the accounting: block tables,
free list, reference counts, the prefix cache). For every attention layer l, `K[l]` and `V[l]` are
tensors [kv_heads, blocks x block_size, head_dim]: pool row b * block_size + o holds offset o of
block b (head-major, so a row's gathered keys are contiguous per head). A sequence (an id from `allocate`) is a block table and a length n; crop = set n and free
the whole blocks past it (no copy). Memory = blocks that exist, never more than the budget.

A forward. Rows are (seq, c, ids): the sequence's first c positions are cached and `ids` follow at
positions c, c + 1, ... All rows' tokens run as ONE row of sum(len(ids)) tokens (no padding); every
token carries its own position (RoPE and absolute embeddings get per-token `position_ids`). The plan
(shared/paged_plan.py) says where each new K/V goes and which keys each row reads; the model's attention
layers write through it into the pool and attend over each row's own keys only (shared/paged_attention.py;
shared/invariant.py in a batch-invariant pool). A row never sees another row's keys.

Memory traffic per forward and layer: the new K/V are written once (T = sum of the rows' tokens);
the keys and values each row attends to are read once (one gather over all rows: sum over rows of
c + len(ids) positions, or of the window on sliding layers). A copy happens only when a sequence
writes into a block shared through the prefix cache (copy-on-write of one block) and when the pool
grows (doubling, up to the budget; a pool whose budget takes at most half the free memory is allocated whole at
start by default and never grows).

Sliding-window layers keep the whole history in blocks and read only the window, so rollback is a
crop on every layer. Models whose layers keep recurrent or convolution state cannot be rolled back by
position and are refused by `attention_layout` (shared/attention_layout.py).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from shared.attention_layout import (
    FULL,
    SLIDING,
    AttentionLayout,
    UnsupportedModel,
    attention_layout,
    cache_kwarg,
    cache_of,
)
from shared.blocks import BlockManager, PagedSequences
from shared.paged_plan import Batch, ForwardPlan
from shared.rows import Row

log = logging.getLogger(__name__)

__all__ = ["BLOCK_SIZE", "FULL", "SLIDING", "AttentionLayout", "ForwardPlan", "KVPool", "Row", "UnsupportedModel",
           "attention_layout", "cache_kwarg", "cache_of"]

# KV block size in positions (see BENCHMARKS.md, "Block size")
BLOCK_SIZE = 16


def free_memory_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors now: the GPU's free memory, or the host's MemAvailable (None if unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def preallocates(preallocate: bool | str, budget_bytes: int | None, device: torch.device) -> bool:
    """Whether a pool allocates its whole budget at start: as told, or with "auto" when the budget takes at most
    half the memory free at start."""
    if budget_bytes is None or preallocate is False:
        return False
    if preallocate == "auto":
        free = free_memory_bytes(device)
        return free is not None and budget_bytes <= free // 2
    return True


class KVPool(PagedSequences):
    """The paged KV of many sequences of one model (see the module docstring)."""

    def __init__(self, layout: AttentionLayout, max_positions: int, device: torch.device | str,
                 dtype: torch.dtype, *, budget_bytes: int | None = None, block_size: int = BLOCK_SIZE,
                 prefix_cache: bool = False, invariant: bool = False, preallocate: bool | str = False,
                 spare: bool = False) -> None:
        self.layout = layout
        # one block past every sequence's (taken from the budget): the last of its rows takes what padded tokens
        # write and padded keys read (cloud/runners/graphs.py); no sequence ever owns it
        self.spare = block_size if spare else 0
        # allocate the whole budget when sized instead of growing it by doubling (each growth copies the pool
        # while the model waits: under load one round met it as a 200-450 ms forward); "auto": when it fits
        self.preallocate = preallocates(preallocate, budget_bytes, torch.device(device))
        # batch-invariant attention (shared/invariant.py): a query's result whatever its forward's other rows
        self.invariant = invariant
        # position ids past this are clamped (callers check real rows against the model's context)
        self.max_positions = max_positions
        self.device, self.dtype = torch.device(device), dtype
        self.budget_bytes, self.block_size, self.prefix_cache = budget_bytes, block_size, prefix_cache
        self.keys: list[torch.Tensor] = []  # per layer [H, capacity x block_size, D]
        self.values: list[torch.Tensor] = []
        # bytes one position of one sequence takes over all layers (known once `prepare` ran)
        self.bytes_per_position = 0
        self.blocks: BlockManager | None = None if budget_bytes is not None else BlockManager(
            block_size, None, prefix_cache)
        self._shapes: list[tuple[int, int, int]] = []  # per layer (kv_heads, key dim, value dim)

    # --- set-up -----------------------------------------------------------------------------
    @torch.no_grad()
    def prepare(self, model: torch.nn.Module) -> None:
        """Learn the per-layer K/V shapes (one token through the model) and size the pool from the budget."""
        if self._shapes:
            return
        from transformers import (
            DynamicCache,  # here: a llama.cpp cloud's pool never loads transformers' models
        )

        dev = next(model.parameters()).device  # type: ignore[attr-defined]
        out = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=dev), use_cache=True,
                    **{cache_kwarg(model): DynamicCache(config=model.config)})  # type: ignore[operator, arg-type]
        layers = cache_of(out).layers
        self._shapes = [(int(la.keys.shape[1]), int(la.keys.shape[3]), int(la.values.shape[3])) for la in layers]
        size = torch.tensor([], dtype=self.dtype).element_size()
        self.bytes_per_position = sum(h * (dk + dv) for h, dk, dv in self._shapes) * size
        self._sized()

    def prepare_like(self, other: KVPool) -> None:
        """`prepare` without a forward: the same model as `other`'s (already prepared)."""
        self._shapes, self.bytes_per_position = list(other._shapes), other.bytes_per_position
        self._sized()

    def _sized(self) -> None:
        if self.blocks is None:
            block_bytes = self.bytes_per_position * self.block_size
            assert self.budget_bytes is not None
            if self.budget_bytes < block_bytes:
                raise ValueError(f"kv_budget_bytes = {self.budget_bytes} holds not one KV block of "
                                 f"{block_bytes} bytes; raise it")
            blocks = self.budget_bytes // block_bytes - (1 if self.spare else 0)
            if blocks < 1:
                raise ValueError(f"kv_budget_bytes = {self.budget_bytes} holds no KV block of {block_bytes} bytes "
                                 "beside the spare one; raise it")
            self.blocks = BlockManager(self.block_size, blocks, self.prefix_cache,
                                       initial_blocks=blocks if self.preallocate else 16)
            log.info("KV pool: %s (budget %.0f MB)", "the whole budget allocated at start" if self.preallocate else
                     "grows by doubling up to the budget", self.budget_bytes / 2**20)
        self._fit()

    def _fit(self, capacity: int | None = None) -> None:
        """Make the tensors hold `capacity` blocks (default: every block the manager has); growth
        copies what exists."""
        assert self.blocks is not None
        rows = (self.blocks.capacity if capacity is None else capacity) * self.block_size + self.spare
        if self.keys and self.keys[0].shape[1] >= rows:
            return
        t0, had = time.perf_counter(), self.keys[0].shape[1] if self.keys else 0
        # a pool allocated whole on a CPU takes its pages from the OS as blocks are first written (an untouched
        # page costs no memory; no position is read before it was written: a row reads its own slots only)
        new = torch.empty if not had and self.preallocate and self.device.type == "cpu" else torch.zeros
        with torch.inference_mode(False):  # normal tensors: writable in and outside inference mode
            for store, which in ((self.keys, 1), (self.values, 2)):
                for i, shape in enumerate(self._shapes):
                    grown = new(shape[0], rows, shape[which], dtype=self.dtype, device=self.device)
                    if i < len(store):
                        grown[:, : store[i].shape[1]] = store[i]
                        store[i] = grown
                    else:
                        store.append(grown)
        if had:
            log.info("KV pool grown from %d to %d positions in %.0f ms (--kv-preallocate allocates the budget at "
                     "start instead)", had, rows, (time.perf_counter() - t0) * 1000)

    def keep_path(self, seq_id: int, start: int, src: list[int], tokens: list[int]) -> list[tuple[int, int]]:
        """A tree's accepted path: the KV stored at offsets `src` (after `start`) moves to offsets 0, 1, ...
        (the positions the path holds, at which its keys were computed), and the sequence's tokens there
        become `tokens`. Returns the pool-row moves (a tensor-parallel rank applies them with `move_rows`);
        the caller then sets the length."""
        m = self.manager
        rows = [(m.slot_mapping(seq_id, start + a, start + a + 1)[0], m.slot_mapping(seq_id, start + i, start + i + 1)[0])
                for i, a in enumerate(src) if a != i]
        m.rewrite(seq_id, start, tokens)
        self.move_rows(rows)
        return rows

    def move_rows(self, moves: list[tuple[int, int]]) -> None:
        """Copy pool rows (source, destination) on every layer; all sources are read before any write."""
        if not moves:
            return
        src = torch.tensor([a for a, _ in moves], dtype=torch.long, device=self.device)
        dst = torch.tensor([b for _, b in moves], dtype=torch.long, device=self.device)
        for t in (*self.keys, *self.values):
            t.index_copy_(1, dst, t.index_select(1, src))

    @property
    def spare_row(self) -> int:
        """The pool row no sequence owns (a pool made with `spare`)."""
        assert self.spare, "a pool without a spare block"
        return int(self.keys[0].shape[1]) - 1

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    # --- the forward ------------------------------------------------------------------------
    def forward(self, model: torch.nn.Module, rows: list[Row]) -> list[torch.Tensor]:
        """Run every row in one flattened forward; returns each row's logits for its last `num_logits` ids
        ([num_logits, vocab], float32). Afterwards each sequence holds the KV of its row's ids (length
        num_cached_tokens + len(ids)); the caller crops back what it does not keep (`set_length`).

        Three steps: `plan` (the block manager's work), `run` (the tensors' work) and `commit`. One
        process runs them back to back; under tensor parallelism (cloud/runners/tensor_parallel.py) rank 0
        plans and commits, and every rank runs rank 0's plan on its own share of the KV heads."""
        if not rows:
            return []
        self.prepare(model)
        plan = self.plan(rows)
        try:
            out = self.run(model, plan)
            self.commit(rows)
        except BaseException:
            self.manager.undo_writes()  # a failed forward leaves every sequence's blocks as they were
            raise
        return out

    def forward_with(self, run: Any, rows: list[Row]) -> Any:
        """`forward` through another executor: the rows' blocks planned (copy-on-write done), `run(self, rows)`
        writes their K/V and returns what it returns, then the sequences hold their ids. A failure leaves every
        sequence's blocks as they were."""
        m = self.manager
        self.check_rows(rows)
        try:
            copies = [c for r in rows if (c := m.prepare_write(r.seq_id, r.num_cached_tokens, len(r.ids))) is not None]
            self.copies = copies
            self.grow_and_copy(m.capacity, copies)
            out = run(self, rows)
            self.commit(rows)
        except BaseException:
            m.undo_writes()
            raise
        return out

    def grow_and_copy(self, capacity: int, copies: list[tuple[int, int]]) -> None:
        """What a forward does before its run: the tensors grown to `capacity` blocks, the copy-on-write pairs
        copied. `forward_with` keeps its pairs in `copies` (a tensor-parallel rank 0 sends them to the others)."""
        self._fit(capacity)
        self._copy_blocks(copies)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        for src_block, dst_block in copies:  # copy-on-write of a shared partial block
            src = torch.arange(src_block * self.block_size, (src_block + 1) * self.block_size, device=self.device)
            dst = src + (dst_block - src_block) * self.block_size
            for t in (*self.keys, *self.values):
                t[:, dst] = t[:, src]

    def plan(self, rows: list[Row]) -> ForwardPlan:
        """Give every row its blocks (copy-on-write of a shared partial block included) and resolve
        the forward's inputs, slot mapping and attention calls; OutOfBlocks when they do not fit."""
        m = self.manager
        self.check_rows(rows)
        copies = []
        try:
            for r in rows:
                copy = m.prepare_write(r.seq_id, r.num_cached_tokens, len(r.ids))
                if copy is not None:
                    copies.append(copy)
            batch = Batch.build(m, self.layout, self.invariant, self.max_positions, rows)
        except BaseException:
            m.undo_writes()  # rows planned before the failure get their shared blocks back
            raise
        starts = [0]
        for r in rows:
            starts.append(starts[-1] + len(r.ids))
        want = [starts[b] + t for b, r in enumerate(rows) for t in range(len(r.ids) - r.num_logits, len(r.ids))]
        return ForwardPlan(m.capacity, copies, batch, torch.tensor(want or [0], dtype=torch.long),
                           [r.num_logits for r in rows])

    def run(self, model: torch.nn.Module, plan: ForwardPlan) -> list[torch.Tensor]:
        """The model over a plan (this pool must have the planning pool's blocks and layout): grow the
        tensors, copy the shared blocks written into, write the new K/V, attend; each row's logits."""
        from shared.paged_attention import PagedView, use_paged_attention  # transformers' attention hooks

        self.grow_and_copy(plan.capacity, plan.copies)
        batch = plan.batch.to(self.device)
        keep_idx = plan.logits_indices.to(self.device)  # [P]
        view = PagedView(self, batch)
        dummy = torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=self.device)  # masks are built per row
        masks: Any = {FULL: dummy, SLIDING: dummy} if self.layout.by_type else dummy
        with use_paged_attention(model, self, batch):
            out = model(input_ids=batch.ids, position_ids=batch.positions, attention_mask=masks,
                        use_cache=True, logits_to_keep=keep_idx, **{cache_kwarg(model): view})
        logits = out.logits[0]  # [P, vocab]
        result, i = [], 0
        for n in plan.num_logits:
            result.append(logits[i: i + n].float())  # [num_logits, vocab]
            i += n
        return result
