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
token carries its own position (RoPE and absolute embeddings get per-token `position_ids`). The
model's attention layers write their new K/V through a slot mapping into the pool (`_PagedView
.update`), then call `paged_attention` (registered with transformers' AttentionInterface and
selected only for the duration of the forward): for each row it gathers the row's own keys from
its blocks (all of them on full-attention layers, the last `window` before its first query on
sliding layers) and runs scaled dot-product attention of the row's queries over them, causal
(a query sees keys at positions <= its own, and within the window on sliding layers) by a mask,
never by zeroed keys. A row never sees another row's keys.

Memory traffic per forward and layer: the new K/V are written once (T = sum of the rows' tokens);
the keys and values each row attends to are read once (one gather over all rows: sum over rows of
c + len(ids) positions, or of the window on sliding layers). A copy happens only when a sequence
writes into a block shared through the prefix cache (copy-on-write of one block) and when the pool
grows (doubling, up to the budget).

Sliding-window layers keep the whole history in blocks and read only the window, so rollback is a
crop on every layer. Models whose layers keep recurrent or convolution state (Mamba, Jamba, LFM2,
Falcon-H1, Qwen3-Next) cannot be rolled back by position and are refused by `attention_layout`.
"""

from __future__ import annotations

import functools
import inspect
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, Cache, DynamicCache

from shared.blocks import BlockManager, OutOfBlocks
from shared.invariant import InvariantCall, TreeCall, attend, attend_tree, build_calls

FULL, SLIDING = "full_attention", "sliding_attention"


def cache_kwarg(model: Any) -> str:
    """The keyword a model's forward takes its KV cache by: `cache` from transformers 5.24 on,
    `past_key_values` before (the old name still works there, with a deprecation warning)."""
    forward = type(model).forward
    return _cache_kwarg(forward)


@functools.cache
def _cache_kwarg(forward: Any) -> str:
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def cache_of(out: Any) -> Any:
    """The KV cache a forward returned, under either name (see `cache_kwarg`)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


class UnsupportedModel(ValueError):
    """A model directory that cannot be used: no rollback by position, no tokenizer, an unreadable
    config. The message is one line for the user."""


@dataclass(frozen=True)
class AttentionLayout:
    # per layer: None for full attention, else the sliding window (a key is visible while i - j < window)
    windows: tuple[int | None, ...]
    # the model reads per-layer-type masks from a dict ({"full_attention": m, "sliding_attention": m})
    by_type: bool

    @property
    def kinds(self) -> set[int | None]:
        return set(self.windows)


def attention_layout(config: Any) -> AttentionLayout:
    """Which layers attend fully and which through a window; UnsupportedModel for anything else."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = getattr(cfg, "model_type", "?")
    n_layers = getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "n_layer", None)
    if not n_layers:
        raise UnsupportedModel(f"model type {name!r}: the config names no number of layers "
                               "(num_hidden_layers); only decoder-only attention models are supported")
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types:
        odd = sorted({t for t in types if t not in (FULL, SLIDING)})
        if odd:
            raise UnsupportedModel(
                f"model type {name!r} has {', '.join(map(repr, odd))} layers, whose recurrent or convolution "
                "state cannot be rolled back to an earlier position; only attention models are supported")
        if SLIDING in types and not window:
            raise UnsupportedModel(f"model type {name!r} has sliding layers but no sliding_window in its config")
        return AttentionLayout(tuple(window if t == SLIDING else None for t in types), by_type=len(set(types)) > 1)
    if any(hasattr(cfg, a) for a in ("state_size", "ssm_state_size", "conv_kernel", "mamba_d_state")):
        raise UnsupportedModel(f"model type {name!r} keeps a recurrent state that cannot be rolled back to an "
                               "earlier position; only attention models are supported")
    uses_window = window is not None and getattr(cfg, "use_sliding_window", True) is not False
    return AttentionLayout((int(window) if uses_window and window else None,) * int(n_layers), by_type=False)


@dataclass(frozen=True)
class Row:
    # the sequence (an id from KVPool.allocate)
    slot: int
    # positions already cached (the row's first token sits at position `past`)
    past: int
    # token ids to run after them
    ids: list[int]
    # logits wanted for the last `keep` ids (0: none, e.g. a prefill)
    keep: int
    # a token tree (shared/tree.py) stored from offset `tree_base` of the sequence on: the parents of all
    # its nodes so far (node j at offset tree_base + j; -1: the positions before tree_base), this row's ids
    # among them. A node sits at position tree_base - 1 + its depth and sees the positions before tree_base
    # and its own ancestors only. None: every token is a chain (storage offset = position).
    tree: tuple[int, ...] | None = None
    tree_base: int = 0

    def positions(self) -> list[int]:
        """Each token's position (its storage offset is past + t either way)."""
        return [_position(s, self.tree_base, self._depths()) for s in range(self.past, self.past + len(self.ids))]

    def _depths(self) -> list[int]:
        depth: list[int] = []
        for par in self.tree or ():
            depth.append(1 if par < 0 else depth[par] + 1)
        return depth


def _position(offset: int, base: int, depth: list[int]) -> int:
    return offset if offset < base or not depth else base - 1 + depth[offset - base]


# KV block size in positions (see BENCHMARKS.md, "Block size")
BLOCK_SIZE = 16
ATTENTION_NAME = "specsplit_paged"


class KVPool:
    """The paged KV of many sequences of one model (see the module docstring)."""

    def __init__(self, layout: AttentionLayout, max_positions: int, device: torch.device | str,
                 dtype: torch.dtype, *, budget_bytes: int | None = None, block_size: int = BLOCK_SIZE,
                 prefix_cache: bool = False, invariant: bool = False) -> None:
        self.layout = layout
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
            self.blocks = BlockManager(self.block_size, self.budget_bytes // block_bytes, self.prefix_cache)
        self._fit()

    def _fit(self, capacity: int | None = None) -> None:
        """Make the tensors hold `capacity` blocks (default: every block the manager has); growth
        copies what exists."""
        assert self.blocks is not None
        rows = (self.blocks.capacity if capacity is None else capacity) * self.block_size
        if self.keys and self.keys[0].shape[1] >= rows:
            return
        with torch.inference_mode(False):  # normal tensors: writable in and outside inference mode
            for store, which in ((self.keys, 1), (self.values, 2)):
                for i, shape in enumerate(self._shapes):
                    grown = torch.zeros(shape[0], rows, shape[which], dtype=self.dtype, device=self.device)
                    if i < len(store):
                        grown[:, : store[i].shape[1]] = store[i]
                        store[i] = grown
                    else:
                        store.append(grown)

    @property
    def manager(self) -> BlockManager:
        if self.blocks is None:
            raise RuntimeError("KVPool.prepare(model) must run before the pool is used")
        return self.blocks

    # --- sequences ----------------------------------------------------------------------------
    def allocate(self, salt: bytes = b"") -> int:
        """A new empty sequence; `salt` separates prefix-cache tenants."""
        return self.manager.new_seq(salt)

    def release(self, slot: int) -> None:
        self.manager.free_seq(slot)

    def length(self, slot: int) -> int:
        return self.manager.seqs[slot].length

    def crop(self, slot: int, n: int) -> None:
        """Keep the KV of the first n positions of `slot` (no-op when it holds fewer)."""
        self.manager.crop(slot, n)

    def set_length(self, slot: int, n: int) -> None:
        """The caller keeps the first n positions written (full blocks among them enter the prefix cache)."""
        if slot in self.manager.seqs:
            self.manager.set_length(slot, n)

    def match_prefix(self, slot: int, ids: list[int], limit: int) -> int:
        """Reuse cached blocks for the start of `ids` (at most `limit` positions); returns how many."""
        return self.manager.match_prefix(slot, ids, limit)

    def keep_path(self, slot: int, start: int, src: list[int], tokens: list[int]) -> list[tuple[int, int]]:
        """A tree's accepted path: the KV stored at offsets `src` (after `start`) moves to offsets 0, 1, ...
        (the positions the path holds, at which its keys were computed), and the sequence's tokens there
        become `tokens`. Returns the pool-row moves (a tensor-parallel rank applies them with `move_rows`);
        the caller then sets the length."""
        m = self.manager
        rows = [(m.slots(slot, start + a, start + a + 1)[0], m.slots(slot, start + i, start + i + 1)[0])
                for i, a in enumerate(src) if a != i]
        m.rewrite(slot, start, tokens)
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

    def blocks_needed(self, row: Row) -> int:
        m = self.manager
        if row.slot not in m.seqs:
            return 0
        return m.blocks_needed(row.slot, row.past, len(row.ids))

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    # --- the forward ------------------------------------------------------------------------
    def forward(self, model: torch.nn.Module, rows: list[Row]) -> list[torch.Tensor]:
        """Run every row in one flattened forward; returns each row's logits for its last `keep` ids
        ([keep, vocab], float32). Afterwards each sequence holds the KV of its row's ids (length
        past + len(ids)); the caller crops back what it does not keep (`set_length`).

        Three steps: `plan` (the block manager's work), `run` (the tensors' work) and `commit`. One
        process runs them back to back; under tensor parallelism (cloud/tensor_parallel.py) rank 0
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

    def plan(self, rows: list[Row]) -> ForwardPlan:
        """Give every row its blocks (copy-on-write of a shared partial block included) and resolve
        the forward's inputs, slot mapping and attention calls; OutOfBlocks when they do not fit."""
        m = self.manager
        if len({r.slot for r in rows}) != len(rows):
            raise ValueError("a sequence appears twice in one forward")
        need = sum(self.blocks_needed(r) for r in rows)
        if need > m.available():
            raise OutOfBlocks(f"this forward needs {need} KV blocks, {m.available()} are left")
        copies = []
        try:
            for r in rows:
                copy = m.prepare_write(r.slot, r.past, len(r.ids))
                if copy is not None:
                    copies.append(copy)
            batch = _Batch.build(self, rows)
        except BaseException:
            m.undo_writes()  # rows planned before the failure get their shared blocks back
            raise
        starts = [0]
        for r in rows:
            starts.append(starts[-1] + len(r.ids))
        want = [starts[b] + t for b, r in enumerate(rows) for t in range(len(r.ids) - r.keep, len(r.ids))]
        return ForwardPlan(m.capacity, copies, batch, torch.tensor(want or [0], dtype=torch.long),
                           [r.keep for r in rows])

    def run(self, model: torch.nn.Module, plan: ForwardPlan) -> list[torch.Tensor]:
        """The model over a plan (this pool must have the planning pool's blocks and layout): grow the
        tensors, copy the shared blocks written into, write the new K/V, attend; each row's logits."""
        self._fit(plan.capacity)
        for src_block, dst_block in plan.copies:  # copy-on-write of a shared partial block
            src = torch.arange(src_block * self.block_size, (src_block + 1) * self.block_size, device=self.device)
            dst = src + (dst_block - src_block) * self.block_size
            for t in (*self.keys, *self.values):
                t[:, dst] = t[:, src]
        batch = plan.batch.to(self.device)
        keep_idx = plan.keep.to(self.device)  # [P]
        view = _PagedView(self, batch)
        dummy = torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=self.device)  # masks are built per row
        masks: Any = {FULL: dummy, SLIDING: dummy} if self.layout.by_type else dummy
        with _paged_attention(model, self, batch):
            out = model(input_ids=batch.ids, position_ids=batch.positions, attention_mask=masks,
                        use_cache=True, logits_to_keep=keep_idx, **{cache_kwarg(model): view})
        logits = out.logits[0]  # [P, vocab]
        result, i = [], 0
        for keep in plan.keeps:
            result.append(logits[i: i + keep].float())  # [keep, vocab]
            i += keep
        return result

    def commit(self, rows: list[Row]) -> None:
        """After `run`: each row's sequence holds its ids (length past + len(ids))."""
        for r in rows:
            self.manager.extend(r.slot, list(r.ids))


# rows with at most this many new tokens (verify rows, decode steps) share one attention call per layer
SHORT_ROW = 16
# ... while the group's padded attention (rows x longest row x widest keys) stays within this factor of its
# real attention (sum of new tokens x keys over its rows)
GROUP_SLACK = 2.0


@dataclass
class _Group:
    """Short rows whose attention runs as one padded call: each row's queries and keys are padded to the
    group's longest, padding is masked out (never attended, never returned)."""
    # [G x W] pool rows of each row's keys (padding repeats a valid pool row; it is masked)
    keys: torch.Tensor
    # [G x N] flat index of each row's queries (padding repeats a valid query; its output is dropped)
    queries: torch.Tensor
    # [G, 1, N, W] True where query t of row g may attend key j
    mask: torch.Tensor
    # positions in the padded [G x N] output that are real, and their flat indices
    src: torch.Tensor
    dst: torch.Tensor
    shape: tuple[int, int, int]  # G, N, W

    def to(self, dev: torch.device) -> _Group:
        return _Group(self.keys.to(dev), self.queries.to(dev), self.mask.to(dev), self.src.to(dev),
                      self.dst.to(dev), self.shape)


@dataclass
class _Single:
    """A long row (a prefill chunk): its own attention call."""
    keys: torch.Tensor  # [W] pool rows
    start: int
    n: int
    mask: torch.Tensor | None  # [n, W]

    def to(self, dev: torch.device) -> _Single:
        return _Single(self.keys.to(dev), self.start, self.n, None if self.mask is None else self.mask.to(dev))


def _row_mask(r: Row, lo: int, w: int, window: int | None) -> torch.Tensor:
    """[n, w] True where query t of row r (offset past + t) may see key j (offset lo + j): by position
    (causal, and within the window on sliding layers); a tree node's keys only to the node's descendants."""
    n = len(r.ids)
    if r.tree is None:
        qp = torch.arange(r.past, r.past + n)[:, None]  # [n, 1]
        kp = torch.arange(lo, lo + w)[None, :]  # [1, W]
        seen = kp <= qp
    else:
        depth, base = r._depths(), r.tree_base
        qp = torch.tensor([_position(s, base, depth) for s in range(r.past, r.past + n)])[:, None]  # [n, 1]
        kp = torch.tensor([_position(s, base, depth) for s in range(lo, lo + w)])[None, :]  # [1, W]
        seen = kp <= qp
        anc = torch.zeros(len(depth), len(depth), dtype=torch.bool)  # [N, N]: node j' is j or an ancestor of j
        for j, par in enumerate(r.tree):
            if par >= 0:
                anc[j] = anc[par]
            anc[j, j] = True
        q_node = [s - base for s in range(r.past, r.past + n)]
        k_from = max(0, base - lo)  # the first key that is a tree node
        for t, j in enumerate(q_node):
            if j >= 0:
                seen[t, k_from:] = anc[j, lo + k_from - base: lo + w - base]
    if window is not None:
        seen &= (qp - kp) < window
    return seen


@dataclass
class _Batch:
    """The flattened batch of one forward: inputs, the write slot mapping, per-kind read plans."""
    # [1, T] token ids and positions of every row's tokens, row after row
    ids: torch.Tensor
    positions: torch.Tensor
    # [T] pool rows where the new K/V go
    write: torch.Tensor
    # per window kind (None = full): the attention calls of one layer (`InvariantCall`s in an invariant pool)
    read: dict[int | None, list[Any]]

    @classmethod
    def build(cls, pool: KVPool, rows: list[Row]) -> _Batch:
        m, dev = pool.manager, torch.device("cpu")  # built on the CPU: `to` moves it to the pool's device
        ids: list[int] = []
        pos: list[int] = []
        write: list[int] = []
        starts = []
        for r in rows:
            starts.append(len(ids))
            ids.extend(r.ids)
            pos.extend(r.positions())
            write.extend(m.slots(r.slot, r.past, r.past + len(r.ids)))
        read: dict[int | None, list[Any]] = {}
        for w in pool.layout.kinds:
            if pool.invariant:
                read[w] = build_calls(m, rows, starts, w, dev)
                continue
            calls: list[_Group | _Single] = []
            short = []
            for r, start in zip(rows, starts, strict=True):
                end, n = r.past + len(r.ids), len(r.ids)
                first = r.past if r.tree is None else min(r.positions())  # the row's lowest query position
                lo = 0 if w is None else max(0, first - w + 1)
                if n > SHORT_ROW:
                    keys = torch.tensor(m.slots(r.slot, lo, end), dtype=torch.long, device=dev)
                    calls.append(_Single(keys, start, n, _row_mask(r, lo, end - lo, w)))
                else:
                    short.append((end - lo, n, lo, r, start))
            short.sort(key=lambda t: t[0])
            group: list[tuple[int, int, int, Row, int]] = []
            for item in short:
                trial = group + [item]
                padded = len(trial) * item[0] * max(t[1] for t in trial)
                if group and padded > GROUP_SLACK * sum(t[0] * t[1] for t in trial):
                    calls.append(_group(m, group, w, dev))
                    trial = [item]
                group = trial
            if group:
                calls.append(_group(m, group, w, dev))
            read[w] = calls
        p = torch.tensor(pos, dtype=torch.long).clamp(max=pool.max_positions - 1)
        return cls(torch.tensor([ids], dtype=torch.long), p[None], torch.tensor(write, dtype=torch.long), read)

    def to(self, dev: torch.device) -> _Batch:
        if dev.type == "cpu":
            return self
        return _Batch(self.ids.to(dev), self.positions.to(dev), self.write.to(dev),
                      {w: [c.to(dev) for c in calls] for w, calls in self.read.items()})


@dataclass
class ForwardPlan:
    """One forward as the block manager resolved it: what a pool with the same blocks needs to run it
    (tensor-parallel ranks run the plan rank 0 made). Its tensors are on the CPU."""
    # blocks the KV tensors must hold
    capacity: int
    # copy-on-write of shared partial blocks, in order: (source block, destination block)
    copies: list[tuple[int, int]]
    # inputs, slot mapping and attention calls
    batch: _Batch
    # [P] flat indices (in the batch's T tokens) of the tokens whose logits are kept
    keep: torch.Tensor
    # per row, how many of those P are its (its `keep`)
    keeps: list[int]


def _group(m: BlockManager, rows: list[tuple[int, int, int, Row, int]], window: int | None,
           dev: torch.device) -> _Group:
    G, N, W = len(rows), max(t[1] for t in rows), max(t[0] for t in rows)
    keys: list[int] = []
    queries: list[int] = []
    src: list[int] = []
    dst: list[int] = []
    mask = torch.zeros(G, 1, N, W, dtype=torch.bool)
    for g, (w, n, lo, r, start) in enumerate(rows):
        slots = m.slots(r.slot, lo, lo + w)
        keys.extend(slots + [slots[0]] * (W - w))
        queries.extend(list(range(start, start + n)) + [start] * (N - n))
        mask[g, 0, :n, :w] = _row_mask(r, lo, w, window)
        mask[g, 0, n:, 0] = True  # padded queries see one key (no empty softmax); their output is dropped
        src.extend(range(g * N, g * N + n))
        dst.extend(range(start, start + n))

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=dev)

    return _Group(t(keys), t(queries), mask, t(src), t(dst), (G, N, W))


class _PagedView(Cache):
    """What the model sees as `past_key_values` during one `KVPool.forward`: writes go to the pool."""

    def __init__(self, pool: KVPool, batch: _Batch) -> None:
        super().__init__(layers=[])
        self.pool, self.batch = pool, batch

    @property
    def is_sliding(self) -> list[bool]:
        return [w is not None for w in self.pool.layout.windows]

    def __len__(self) -> int:
        return len(self.pool.layout.windows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V ([1, H, T, D]) at the batch's slot mapping; attention reads the pool."""
        k, v = self.pool.keys[layer_idx], self.pool.values[layer_idx]  # [H, rows, D]
        k.index_copy_(1, self.batch.write, key_states[0].to(k.dtype))
        v.index_copy_(1, self.batch.write, value_states[0].to(v.dtype))
        return key_states, value_states


_active = threading.local()
_CONFIGS: weakref.WeakKeyDictionary[torch.nn.Module, list[Any]] = weakref.WeakKeyDictionary()
_LOCKS: weakref.WeakKeyDictionary[torch.nn.Module, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_LOCK = threading.Lock()


def exclusive(model: torch.nn.Module) -> threading.RLock:
    """The lock of `model`'s weights: one forward at a time. The attention implementation (and the
    train / eval mode) live on modules every thread shares (drafters forked from one model, in the
    OpenAI server), so a forward switching them must not overlap another thread's forward."""
    with _LOCKS_LOCK:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
        return lock


class _paged_attention:  # noqa: N801 - a context manager used as a function
    """Select `paged_attention` for `model` during one forward, with `pool` and `batch` as its input;
    holds the model's lock (`exclusive`) meanwhile."""

    def __init__(self, model: torch.nn.Module, pool: KVPool, batch: _Batch) -> None:
        configs = _CONFIGS.get(model)
        if configs is None:  # every distinct config object its modules read the implementation from
            configs = list({id(c): c for c in (getattr(mod, "config", None) for mod in model.modules())
                            if c is not None and hasattr(c, "_attn_implementation")}.values())
            _CONFIGS[model] = configs
        self.configs, self.pool, self.batch, self.lock = configs, pool, batch, exclusive(model)

    def __enter__(self) -> None:
        self.lock.acquire()
        self.saved = [c._attn_implementation for c in self.configs]
        for c in self.configs:
            c._attn_implementation_internal = ATTENTION_NAME
        _active.batch, _active.pool = self.batch, self.pool

    def __exit__(self, *exc: object) -> None:
        try:
            for c, s in zip(self.configs, self.saved, strict=True):
                c._attn_implementation_internal = s
            _active.batch = _active.pool = None
        finally:
            self.lock.release()


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                    softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention of each row's queries ([1, Hq, T, D]) over that row's own cached keys (see the module
    docstring); returns [1, T, Hq, D] like transformers' sdpa."""
    batch: _Batch = _active.batch
    pool: KVPool = _active.pool
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    k_pool, v_pool = pool.keys[layer], pool.values[layer]  # [H, rows, D]
    q_all = query[0]  # [Hq, T, D]
    hq, hk = q_all.shape[0], k_pool.shape[0]
    out = query.new_empty(q_all.shape[1], hq, v_pool.shape[-1])  # [T, Hq, Dv]
    for call in batch.read[pool.layout.windows[layer]]:
        if isinstance(call, InvariantCall):
            attend(call, q_all, k_pool, v_pool, out, scaling, softcap)
            continue
        if isinstance(call, TreeCall):
            attend_tree(call, q_all, k_pool, v_pool, out, scaling, softcap)
            continue
        if isinstance(call, _Single):
            q = q_all[:, call.start: call.start + call.n]  # [Hq, n, D]
            k = k_pool.index_select(1, call.keys)  # [H, W, D]
            v = v_pool.index_select(1, call.keys)
            o = _attend(q, k, v, call.mask, scaling, softcap, hq != hk)  # [Hq, n, Dv]
            out[call.start: call.start + call.n] = o.transpose(0, 1)
            continue
        G, N, W = call.shape
        q = q_all.index_select(1, call.queries).view(hq, G, N, -1).transpose(0, 1)  # [G, Hq, N, D]
        k = k_pool.index_select(1, call.keys).view(hk, G, W, -1).transpose(0, 1)  # [G, H, W, D]
        v = v_pool.index_select(1, call.keys).view(hk, G, W, -1).transpose(0, 1)
        o = _attend(q, k, v, call.mask, scaling, softcap, hq != hk)  # [G, Hq, N, Dv]
        o = o.transpose(1, 2).reshape(G * N, hq, -1)  # [G x N, Hq, Dv]
        out.index_copy_(0, call.dst, o.index_select(0, call.src))
    return out[None], None


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scaling: float | None,
            softcap: float | None, gqa: bool) -> torch.Tensor:
    if softcap is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return _softcapped(q, k, v, mask, scaling, softcap)


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                scaling: float | None, softcap: float) -> torch.Tensor:
    """Attention with tanh-capped scores (Gemma2), as transformers' eager path computes it."""
    if q.shape[-3] != k.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    s = (q @ k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)  # [.., Hq, n, W]
    s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return p @ v  # [.., Hq, n, Dv]


AttentionInterface.register(ATTENTION_NAME, paged_attention)
