"""One paged forward, planned: the rows, their tokens' positions, where the new K/V go and which keys
each row's queries read (shared/kvpool.py runs it).

A forward's rows are (seq, c, ids): the sequence's first c positions are cached and `ids` follow at
positions c, c + 1, ... (a token tree's nodes at the depth their place in the tree gives them). All rows'
tokens run as ONE row of sum(len(ids)) tokens (no padding). Attention reads, per layer kind: short rows
(decode steps, verify rounds) grouped into padded calls, long rows (prefill chunks) a call each, or in a
batch-invariant pool the calls of shared/invariant.py. A row never sees another row's keys: causality and
windows are masks, never zeroed keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shared.attention_layout import AttentionLayout
from shared.blocks import BlockManager
from shared.invariant import build_calls
from shared.rows import Row
from shared.tree import paths

# rows with at most this many new tokens (verify rows, decode steps) share one attention call per layer
SHORT_ROW = 16
# ... while the group's padded attention (rows x longest row x widest keys) stays within this factor of its
# real attention (sum of new tokens x keys over its rows)
GROUP_SLACK = 2.0


@dataclass
class GroupCall:
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

    def to(self, dev: torch.device) -> GroupCall:
        return GroupCall(self.keys.to(dev), self.queries.to(dev), self.mask.to(dev), self.src.to(dev),
                      self.dst.to(dev), self.shape)


@dataclass
class SingleCall:
    """A long row (a prefill chunk): its own attention call."""
    keys: torch.Tensor  # [W] pool rows
    start: int
    n: int
    mask: torch.Tensor | None  # [n, W]

    def to(self, dev: torch.device) -> SingleCall:
        return SingleCall(self.keys.to(dev), self.start, self.n, None if self.mask is None else self.mask.to(dev))


def _row_mask(r: Row, lo: int, w: int, window: int | None) -> torch.Tensor:
    """[n, w] True where query t of row r (offset num_cached_tokens + t) may see key j (offset lo + j): by position
    (causal, and within the window on sliding layers); a tree node's keys only to the node's descendants."""
    n = len(r.ids)
    if r.tree is None:
        qp = torch.arange(r.num_cached_tokens, r.num_cached_tokens + n)[:, None]  # [n, 1]
        kp = torch.arange(lo, lo + w)[None, :]  # [1, W]
        seen = kp <= qp
    else:
        base = r.tree_base
        qp = torch.tensor(r.positions())[:, None]  # [n, 1]
        kp = torch.tensor(r.positions_at(lo, lo + w))[None, :]  # [1, W]
        seen = kp <= qp
        anc = torch.zeros(len(r.tree), len(r.tree), dtype=torch.bool)  # [N, N]: node j' is j or an ancestor of j
        for j, path in enumerate(paths(r.tree)):
            anc[j, path] = True
        q_node = [s - base for s in range(r.num_cached_tokens, r.num_cached_tokens + n)]
        k_from = max(0, base - lo)  # the first key that is a tree node
        for t, j in enumerate(q_node):
            if j >= 0:
                seen[t, k_from:] = anc[j, lo + k_from - base: lo + w - base]
    if window is not None:
        seen &= (qp - kp) < window
    return seen


@dataclass
class Batch:
    """The flattened batch of one forward: inputs, the write slot mapping, per-kind read plans."""
    # [1, T] token ids and positions of every row's tokens, row after row
    ids: torch.Tensor
    positions: torch.Tensor
    # [T] pool rows where the new K/V go
    write: torch.Tensor
    # per window kind (None = full): the attention calls of one layer (`InvariantCall`s in an invariant pool)
    read: dict[int | None, list[Any]]

    @classmethod
    def build(cls, m: BlockManager, layout: AttentionLayout, invariant: bool, max_positions: int,
              rows: list[Row]) -> Batch:
        """The batch of `rows` over the blocks of `m` (`invariant`: shared/invariant.py's attention calls;
        positions past `max_positions` are clamped: callers check real rows against the model's context)."""
        dev = torch.device("cpu")  # built on the CPU: `to` moves it to the pool's device
        ids: list[int] = []
        pos: list[int] = []
        write: list[int] = []
        starts = []
        for r in rows:
            starts.append(len(ids))
            ids.extend(r.ids)
            pos.extend(r.positions())
            write.extend(m.slot_mapping(r.seq_id, r.num_cached_tokens, r.num_cached_tokens + len(r.ids)))
        read: dict[int | None, list[Any]] = {}
        for w in layout.kinds:
            if invariant:
                read[w] = build_calls(m, rows, starts, w, dev)
                continue
            calls: list[GroupCall | SingleCall] = []
            short = []
            for r, start in zip(rows, starts, strict=True):
                end, n = r.num_cached_tokens + len(r.ids), len(r.ids)
                first = r.num_cached_tokens if r.tree is None else min(r.positions())  # the row's lowest query position
                lo = 0 if w is None else max(0, first - w + 1)
                if n > SHORT_ROW:
                    keys = torch.tensor(m.slot_mapping(r.seq_id, lo, end), dtype=torch.long, device=dev)
                    calls.append(SingleCall(keys, start, n, _row_mask(r, lo, end - lo, w)))
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
        p = torch.tensor(pos, dtype=torch.long).clamp(max=max_positions - 1)
        return cls(torch.tensor([ids], dtype=torch.long), p[None], torch.tensor(write, dtype=torch.long), read)

    def to(self, dev: torch.device) -> Batch:
        if dev.type == "cpu":
            return self
        return Batch(self.ids.to(dev), self.positions.to(dev), self.write.to(dev),
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
    batch: Batch
    # [P] flat indices (in the batch's T tokens) of the tokens whose logits are kept
    logits_indices: torch.Tensor
    # per row, how many of those P are its (its `num_logits`)
    num_logits: list[int]


def _group(m: BlockManager, rows: list[tuple[int, int, int, Row, int]], window: int | None,
           dev: torch.device) -> GroupCall:
    G, N, W = len(rows), max(t[1] for t in rows), max(t[0] for t in rows)
    keys: list[int] = []
    queries: list[int] = []
    src: list[int] = []
    dst: list[int] = []
    mask = torch.zeros(G, 1, N, W, dtype=torch.bool)
    for g, (w, n, lo, r, start) in enumerate(rows):
        slots = m.slot_mapping(r.seq_id, lo, lo + w)
        keys.extend(slots + [slots[0]] * (W - w))
        queries.extend(list(range(start, start + n)) + [start] * (N - n))
        mask[g, 0, :n, :w] = _row_mask(r, lo, w, window)
        mask[g, 0, n:, 0] = True  # padded queries see one key (no empty softmax); their output is dropped
        src.extend(range(g * N, g * N + n))
        dst.extend(range(start, start + n))

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=dev)

    return GroupCall(t(keys), t(queries), mask, t(src), t(dst), (G, N, W))
