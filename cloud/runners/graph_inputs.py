"""The graph executor's inputs (cloud/runners/graphs.py): one forward's flat tokens, where their K/V go in the pool,
the kept rows, and per attention call the queries, keys and mask, or the paged kernel's block tables and per-token
mask numbers. Built on the host in numpy; a bucket's inputs have the bucket's shapes whatever the rows, so a
captured graph replays over them after a copy.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shared.rows import Row
from shared.tree import paths

ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64)
QUERY_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# the most tokens (R x N) a captured forward holds: larger forwards (a long prefill chunk beside many rows) run eagerly
MAX_GRAPH_TOKENS = 2048
KEY_BUCKETS = tuple(128 * 2**i for i in range(8))  # 128 .. 16384
# rows longer than this run in an attention group of their own (eager forwards)
LONG_ROW = 32

def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


@dataclass
class Group:
    """One attention call's rows: where their queries sit among the flat tokens, their keys in the pool."""
    queries: torch.Tensor  # [R x N] flat token of each query slot (padding: the spare token T)
    keys: torch.Tensor  # [R x W] pool row of each key slot (padding: the spare pool row)
    mask: torch.Tensor  # [R, 1, N, W] True where the query may see the key
    shape: tuple[int, int, int]  # R, N, W
    # [R, 1, N, W] the query's position minus the key's, for sliding-window layers (a key is seen while it is below
    # the window); None for a model without them
    distance: torch.Tensor | None = None


@dataclass
class Inputs:
    """One forward's inputs: the flat tokens (T of them, the last one or more padding) and the attention groups."""
    ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    write: torch.Tensor  # [T] pool rows of the new K/V (padding: the spare pool row)
    logits_indices: torch.Tensor  # [P] flat tokens whose logits are wanted (padding: token 0)
    groups: list[Group]
    # the Triton kernel's inputs instead of groups (cloud/runners/paged_kernel.py): tables [R, blocks] block ids
    # (padding: the spare block), and each token's row, lim, tree_n and ancestor bits ([T] each)
    paged: tuple[torch.Tensor, ...] = ()

    def copy_(self, other: Inputs) -> None:
        for a, b in ((self.ids, other.ids), (self.positions, other.positions), (self.write, other.write),
                     (self.logits_indices, other.logits_indices), *zip(self.paged, other.paged, strict=True)):
            a.copy_(b, non_blocking=True)
        for g, h in zip(self.groups, other.groups, strict=True):
            g.queries.copy_(h.queries, non_blocking=True)
            g.keys.copy_(h.keys, non_blocking=True)
            g.mask.copy_(h.mask, non_blocking=True)
            if g.distance is not None and h.distance is not None:
                g.distance.copy_(h.distance, non_blocking=True)


def _pool_rows(table: list[int], size: int, end: int) -> np.ndarray:
    """Pool rows (block x size + offset) of a sequence's offsets 0 .. end - 1."""
    blocks = np.asarray(table[: -(-end // size)], dtype=np.int64)
    return (blocks[:, None] * size + np.arange(size)).reshape(-1)[:end]


def _row_mask(r: Row, out: np.ndarray, distance: np.ndarray | None) -> None:
    """out[:n, :c + n] (c: the row's num_cached_tokens) = which of the row's storage offsets each of its n queries
    sees (causal by position; a tree node: the prefix before the tree and its own ancestors); `distance` (if given)
    the same slots' query position minus key position."""
    n, end = len(r.ids), r.num_cached_tokens + len(r.ids)
    if distance is not None:
        distance[:n, :end] = np.asarray(r.positions())[:, None] - np.asarray(r.positions_at(0, end))[None, :]
    if r.tree is None:
        out[:n, :end] = np.arange(end)[None, :] <= np.arange(r.num_cached_tokens, end)[:, None]
        return
    base = r.tree_base
    qp = np.asarray(r.positions())[:, None]  # [n, 1]
    kp = np.asarray(r.positions_at(0, end))[None, :]  # [1, end]
    vis = kp <= qp  # [n, end]
    anc = np.zeros((len(r.tree), len(r.tree)), dtype=bool)  # [N, N]: j' is j or one of its ancestors
    for j, path in enumerate(paths(r.tree)):
        anc[j, path] = True
    for t in range(n):
        j = r.num_cached_tokens + t - base
        if j >= 0:
            vis[t, base:end] = anc[j, : end - base]
    out[:n, :end] = vis


def _group(rows: list[Row], starts: list[int], tables: list[np.ndarray], spare: int, T: int,
           shape: tuple[int, int, int] | None, windowed: bool) -> Group:
    """The attention call of `rows` (their first flat tokens `starts`, their pool rows `tables`)."""
    n_max = max(len(r.ids) for r in rows)
    end_max = max(r.num_cached_tokens + len(r.ids) for r in rows)
    R, N, W = shape if shape is not None else (len(rows), n_max, -(-end_max // 16) * 16)
    queries = np.full((R, N), T, np.int64)
    keys = np.full((R, W), spare, np.int64)
    mask = np.zeros((R, 1, N, W), dtype=bool)
    mask[:, 0, :, 0] = True  # padded queries see one (padded) key: no row of -inf alone
    distance = np.zeros((R, 1, N, W), np.int32) if windowed else None  # padding: 0, in every window
    for i, (r, s, table) in enumerate(zip(rows, starts, tables, strict=True)):
        n = len(r.ids)
        queries[i, :n] = np.arange(s, s + n)
        keys[i, : len(table)] = table
        _row_mask(r, mask[i, 0], None if distance is None else distance[i, 0])
    return Group(torch.from_numpy(queries.reshape(-1)), torch.from_numpy(keys.reshape(-1)), torch.from_numpy(mask),
                 (R, N, W), None if distance is None else torch.from_numpy(distance))


def build_inputs(pool: Any, rows: list[Row], spare: int, shape: tuple[int, int, int] | None, tile: int,
                 max_positions: int, kernel: bool, groups: bool = True, windowed: bool = False) -> Inputs:
    """The host-side inputs of `rows` (planned: their blocks exist). `shape` (R, N, W): one padded group of
    that bucket, T = R x N; None: exact shapes, long rows in groups of their own. `tile`: T padded to whole
    tiles; `kernel`: the Triton kernel's inputs instead of SDPA groups; `groups` False: neither (an executor
    attending through shared/invariant.py's chunked calls builds its own); `windowed`: the groups carry the
    query-key distances sliding-window layers mask by. Built in numpy: this is the host's
    whole work between two replays."""
    m = pool.manager
    n_real = sum(len(r.ids) for r in rows)
    T = n_real if shape is None else shape[0] * shape[1]
    if tile:  # whole row tiles for every linear layer: padded once here, never per layer
        T = -(-T // tile) * tile
    ids = np.zeros(T, np.int64)
    pos = np.zeros(T, np.int64)
    write = np.full(T, spare, np.int64)
    keep: list[np.ndarray] = []
    tables: list[np.ndarray] = []  # each row's pool rows of offsets 0 .. num_cached_tokens + n - 1
    starts = []
    s = 0
    for r in rows:
        n, end = len(r.ids), r.num_cached_tokens + len(r.ids)
        starts.append(s)
        ids[s: s + n] = r.ids
        pos[s: s + n] = r.positions() if r.tree is not None else np.arange(r.num_cached_tokens, end)
        table = _pool_rows(m.seqs[r.seq_id].table, m.size, end)
        tables.append(table)
        write[s: s + n] = table[r.num_cached_tokens:]
        keep.append(np.arange(s + n - r.num_logits, s + n))
        s += n
    np.minimum(pos, max_positions - 1, out=pos)  # callers check rows' lengths against the context
    kept = np.concatenate(keep) if keep else np.zeros(0, np.int64)
    P = len(kept) if shape is None else T
    if shape is not None:
        sets: list[tuple[list[int], tuple[int, int, int] | None]] = [(list(range(len(rows))), shape)]
    else:
        short = [i for i, r in enumerate(rows) if len(r.ids) <= LONG_ROW]
        sets = [([i], None) for i, r in enumerate(rows) if len(r.ids) > LONG_ROW]
        if short:
            sets.insert(0, (short, None))
    keep_all = np.zeros(P, np.int64)
    keep_all[: len(kept)] = kept
    if kernel:
        return Inputs(torch.from_numpy(ids), torch.from_numpy(pos), torch.from_numpy(write),
                      torch.from_numpy(keep_all), [], _kernel_inputs(rows, m, spare // m.size, T, shape))
    made = [_group([rows[i] for i in idx], [starts[i] for i in idx], [tables[i] for i in idx], spare, T, sh,
                   windowed) for idx, sh in sets] if groups else []
    return Inputs(torch.from_numpy(ids), torch.from_numpy(pos), torch.from_numpy(write),
                  torch.from_numpy(keep_all), made)


def graph_shapes(rows: Sequence[int], queries: Sequence[int], keys: Sequence[int]) -> list[tuple[int, int, int]]:
    """The buckets (R, N, W) a deployment's lists make, each a bucket of the executor's, R x N at most
    MAX_GRAPH_TOKENS."""
    out = []
    for R in rows:
        for N in queries:
            for W in keys:
                b = (bucket(R, ROW_BUCKETS), bucket(N, QUERY_BUCKETS), bucket(W, KEY_BUCKETS))
                if None not in b and b[0] * b[1] <= MAX_GRAPH_TOKENS:  # type: ignore[operator]
                    out.append(b)
    return sorted(set(out))  # type: ignore[arg-type]


def blank(shape: tuple[int, int, int], spare: int, tile: int, block: int = 0, windowed: bool = False) -> Inputs:
    """A bucket's inputs with every slot padding (the spare row and token): what a start-up capture records.
    `block` > 0: the Triton kernel's inputs (blocks of that size) instead of SDPA groups; `windowed`: with the
    groups' distances."""
    R, N, W = shape
    T = R * N
    if tile:
        T = -(-T // tile) * tile
    ids, pos, keep = (torch.zeros(T, dtype=torch.long) for _ in range(3))
    write = torch.full((T,), spare, dtype=torch.long)
    if block:
        return Inputs(ids, pos, write, keep, [], _kernel_inputs([], None, spare // block, T, shape, block))
    mask = torch.zeros(R, 1, N, W, dtype=torch.bool)
    mask[:, 0, :, 0] = True
    return Inputs(ids, pos, write, keep,
                  [Group(torch.full((R * N,), T, dtype=torch.long), torch.full((R * W,), spare, dtype=torch.long),
                         mask, shape, torch.zeros(R, 1, N, W, dtype=torch.int32) if windowed else None)])


def _kernel_inputs(rows: list[Row], m: Any, spare_block: int, T: int, shape: tuple[int, int, int] | None,
                   block: int = 0) -> tuple[torch.Tensor, ...]:
    """The kernel's per-row block tables and per-token mask numbers (paged_kernel.py's rule) of `rows`, whose
    tokens are the first of the T flat ones; padding tokens belong to a last row of spare blocks and see one key.
    `shape` fixes the tables' size (a graph's bucket); None: exact."""
    size = m.size if m is not None else block
    R = (shape[0] if shape is not None else len(rows)) + 1  # the last: padding's row
    width = -(-(shape[2] if shape is not None else max((r.num_cached_tokens + len(r.ids) for r in rows), default=1)) // size)
    tables = np.full((R, width), spare_block, np.int32)
    tok_row = np.full(T, R - 1, np.int32)
    lim = np.ones(T, np.int32)
    tree_n = np.zeros(T, np.int32)
    anc = np.zeros(T, np.int64)
    s = 0
    for i, r in enumerate(rows):
        n, end = len(r.ids), r.num_cached_tokens + len(r.ids)
        blocks = m.seqs[r.seq_id].table[: -(-end // size)]
        tables[i, : len(blocks)] = blocks
        tok_row[s: s + n] = i
        lim[s: s + n] = np.arange(r.num_cached_tokens + 1, end + 1)  # causal by storage offset
        if r.tree is not None:
            bits = [sum(1 << a for a in path) for path in paths(r.tree)]
            for t in range(n):
                j = r.num_cached_tokens + t - r.tree_base
                if j >= 0:  # a node: the prefix, then its path's nodes
                    lim[s + t], tree_n[s + t], anc[s + t] = r.tree_base, len(r.tree), bits[j]
        s += n
    return tuple(torch.from_numpy(x) for x in (tables, tok_row, lim, tree_n, anc))


def to_device(inp: Inputs, dev: torch.device) -> Inputs:
    if dev.type == "cpu":
        return inp
    pin = dev.type == "cuda"

    def mv(t: torch.Tensor) -> torch.Tensor:
        return (t.pin_memory() if pin else t).to(dev, non_blocking=True)

    return Inputs(mv(inp.ids), mv(inp.positions), mv(inp.write), mv(inp.logits_indices),
                  [Group(mv(g.queries), mv(g.keys), mv(g.mask), g.shape,
                         None if g.distance is None else mv(g.distance)) for g in inp.groups],
                  tuple(mv(x) for x in inp.paged))
