"""Batch-invariant forwards: a token's logits and KV do not depend on the other tokens of its forward.

A forward's result for one row can change with how many rows share it: matrix kernels pick their
blocking (and, for a few rows, a different code path) by shape, and attention sums over as many keys
as its call holds (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025). In
bfloat16 that is enough to flip greedy tokens, so cloud_only, a chain, a tree and a batch of 16
sessions would each write their own text. Here every per-row computation is given one shape whatever
the batch:

- **Linear layers** see their rows in whole tiles: the rows are padded with zeros to a multiple of the
  layer's tile (`tile_linears`; ROW_TILE, 16, until a smaller one is measured). A matrix kernel computes
  each output row from that row and the weight; with the row count a whole number of tiles, most kernels
  take the same path and the same reduction over the input width for every row. Where a library picks
  its path by the row count itself (oneDNN's bfloat16 kernels on a Xeon with AMX: for SmolLM2's 576-wide
  layers, 33-287 rows take another path than fewer or more), the layer runs one call per tile instead,
  so every call has one shape.
- **Attention** of a query at position p runs over the keys at positions 0, 1, ... in chunks of
  `KEY_CHUNK` positions aligned to absolute multiples of it, the chunk's keys in position order
  whatever their storage order: scores in float32 (`q k^T`, its rows among whole tiles of ROW_TILE rows),
  one maximum over every visible key, then the sum and `p v` chunk after chunk in a fixed order. Keys a
  query does not see (later positions, a padded chunk, another branch, padding) are masked to probability 0,
  which adds an exact zero, so a query's sums are the same in a decode step, a chain, a tree, a prefill
  chunk and beside any batch mates. A token tree's nodes (`TreeCall`) share the chunks before the tree
  as one set of rows; from the chunk holding the tree's first position on, each node attends over its
  own keys laid out as its path's chain would be (the positions before the tree, its ancestors, itself).
- **Tensor parallelism** (cloud/runners/tensor_parallel.py): each rank tiles its slices of the linear layers in
  ROW_TILE rows (the tile wraps transformers' forward of the layer, so the local product and the collective
  after it both see the padded rows) and attends over its own KV heads as above; a rowwise layer's partial
  products are summed in rank order (`ordered_sum`). A row's bits then depend on the group size, not on its
  batch.

Same shapes are what this module builds; same bits are a property of the kernels, the CPU, the dtype and the
thread count. shared/invariant_calibration.py measures them at start-up, on the thread and at the row counts
the server runs, picks the linear layers' tile, and says when a kernel breaks them (the cloud then reports
`batch_invariant: false`). tests/shared/test_invariant.py checks whole forwards bit for bit on the machine it
runs on, and that the unpadded path fails there.

Costs (BENCHMARKS.md, "What a cloud forward costs"): a decode row's linear work is a tile's (on bfloat16
units nearly what one row costs), and each session's attention rows are a tile of their own.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.tree import paths

if TYPE_CHECKING:
    from shared.blocks import BlockManager
    from shared.rows import Row

# rows of every attention call's products, and by default of every linear layer's input, come in whole tiles
# of this many (shared/invariant_calibration.py measures a smaller tile for the linear layers where the kernels
# allow it)
ROW_TILE = 16
# keys are summed in chunks of this many positions, aligned to absolute multiples of it
KEY_CHUNK = 64


def _tiled_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])  # [T, in]
    tile = int(self._row_tile)  # type: ignore[arg-type]
    pad = -flat.shape[0] % tile
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])  # [T + pad, in]
    f = self._untiled_forward
    if self._tile_calls and flat.shape[0] > tile:  # one call a tile: every call has the same shape
        y = torch.cat([f(c) for c in flat.split(tile)])  # type: ignore[operator]  # [T + pad, out]
    else:
        y = f(flat)  # type: ignore[operator]
    y = y[: flat.shape[0] - pad]  # [T, out]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every Linear of `model` (and GPT-2's Conv1D)."""
    from transformers.pytorch_utils import Conv1D

    return [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Conv1D))]


def tile_linears(model: torch.nn.Module, tile: int = ROW_TILE, calls: bool = False) -> int:
    """Make every Linear of `model` (and GPT-2's Conv1D, a Linear with its weight transposed) run its rows
    in whole tiles of `tile`, in one call, or with `calls` in one call per tile (idempotent; a second call
    sets the tile and the mode); returns how many."""
    for m in linear_layers(model):
        if not hasattr(m, "_untiled_forward"):
            m._untiled_forward = m.forward  # type: ignore[assignment]  # the plain or packed forward
            m.forward = types.MethodType(_tiled_forward, m)  # type: ignore[method-assign]
        m._row_tile, m._tile_calls = tile, calls  # type: ignore[assignment]
    return len(linear_layers(model))


@dataclass
class InvariantCall:
    """Queries of several rows attended as one batch: G pseudo-rows of N queries over W keys (whole chunks),
    each pseudo-row's keys in position order. Padding is masked."""
    # [G x N] flat index of each query (padding repeats a real one; its output is dropped)
    queries: torch.Tensor
    # [G x W] pool rows of each pseudo-row's keys (padding repeats a valid row; masked)
    keys: torch.Tensor
    # [G, 1, N, W] True where query t of pseudo-row g sees key j
    mask: torch.Tensor
    # real queries: their place in the padded [G x N] output and their flat indices
    src: torch.Tensor
    dst: torch.Tensor
    shape: tuple[int, int, int]  # G, N, W

    def to(self, dev: torch.device) -> InvariantCall:
        return InvariantCall(self.queries.to(dev), self.keys.to(dev), self.mask.to(dev), self.src.to(dev),
                             self.dst.to(dev), self.shape)


@dataclass
class _Pseudo:
    """Queries that share one key list (a chain row's, or one tree node)."""
    queries: list[int]  # flat indices
    qpos: list[int]  # their positions
    keys: list[int]  # pool rows of positions lo, lo + 1, ... (lo a multiple of KEY_CHUNK)
    lo: int


def _tiles(n: int, size: int) -> int:
    return -(-n // size) * size


def _bucket(n: int) -> int:
    """Pseudo-rows of one bucket share a call: short ones by their exact query count, long ones by tiles."""
    return n if n <= ROW_TILE else _tiles(n, ROW_TILE)


def _lower(r: Row, window: int | None) -> int:
    """The first key position `r`'s queries may see, rounded down to a chunk."""
    lo = 0 if window is None else max(0, min(r.positions()) - window + 1)
    return lo - lo % KEY_CHUNK


def pseudo_rows(m: BlockManager, r: Row, start: int, window: int | None) -> list[_Pseudo]:
    """`r`'s chain queries (all of a chain row; a tree row's tokens before its first node) as pseudo-rows
    whose keys are laid out by position (see the module docstring)."""
    pos, lo = r.positions(), _lower(r, window)
    if r.tree is None:
        return [_Pseudo(list(range(start, start + len(r.ids))), pos, m.slot_mapping(r.seq_id, lo, r.num_cached_tokens + len(r.ids)), lo)]
    chain = [t for t in range(len(r.ids)) if r.num_cached_tokens + t < r.tree_base]
    if not chain:
        return []
    return [_Pseudo([start + t for t in chain], [pos[t] for t in chain], m.slot_mapping(r.seq_id, lo, r.tree_base), lo)]


@dataclass
class TreeCall:
    """A token tree's nodes: over the chunks wholly before the tree (`prefix`) all nodes attend as one
    pseudo-row; from the chunk holding the tree's first position on (`tail`), each node over its own keys
    laid out as the chain its path would be (the positions before the tree, then its ancestors and itself)."""
    # [n] flat index of each node's query
    queries: torch.Tensor
    # [Wp] pool rows of the positions lo .. cut - 1 (whole chunks; may be empty)
    prefix: torch.Tensor
    # [n x Wt] pool rows of each node's positions cut, cut + 1, ... (padding repeats a valid row; masked)
    tail: torch.Tensor
    # [n, Wp] and [n, Wt]: True where node t sees the key
    prefix_mask: torch.Tensor
    tail_mask: torch.Tensor

    def to(self, dev: torch.device) -> TreeCall:
        return TreeCall(self.queries.to(dev), self.prefix.to(dev), self.tail.to(dev), self.prefix_mask.to(dev),
                        self.tail_mask.to(dev))


def tree_call(m: BlockManager, r: Row, start: int, window: int | None, dev: torch.device) -> TreeCall | None:
    """The TreeCall of `r`'s tree nodes (None: the row holds none)."""
    base, parents, pos, lo = r.tree_base, r.tree or (), r.positions(), _lower(r, window)
    nodes = [t for t in range(len(r.ids)) if r.num_cached_tokens + t >= base]
    if not nodes:
        return None
    cut = lo + (max(base - lo, 0) // KEY_CHUNK) * KEY_CHUNK  # the chunk holding position base starts here
    before = m.slot_mapping(r.seq_id, cut, base) if base > cut else []
    rows = m.slot_mapping(r.seq_id, base, base + len(parents))  # the pool row of every node
    node_paths = paths(parents)  # each node's ancestors, then itself
    tails = [before + [rows[j] for j in node_paths[r.num_cached_tokens + t - base]] for t in nodes]
    wt = _tiles(max(len(x) for x in tails), KEY_CHUNK)
    qp = torch.tensor([pos[t] for t in nodes])[:, None]  # [n, 1]
    kp = torch.arange(lo, cut)[None, :]  # [1, Wp]
    prefix_mask = kp <= qp
    kt = torch.arange(cut, cut + wt)[None, :]  # [1, Wt]
    tail_mask = torch.arange(wt)[None, :] < torch.tensor([len(x) for x in tails])[:, None]
    if window is not None:
        prefix_mask &= (qp - kp) < window
        tail_mask &= (qp - kt) < window

    def ints(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=dev)

    return TreeCall(ints([start + x for x in nodes]), ints(m.slot_mapping(r.seq_id, lo, cut) if cut > lo else []),
                    ints([k for x in tails for k in x + [x[0]] * (wt - len(x))]), prefix_mask, tail_mask)


def build_calls(m: BlockManager, rows: list[Row], starts: list[int], window: int | None,
                dev: torch.device) -> list[InvariantCall | TreeCall]:
    """The attention calls of one layer kind: pseudo-rows grouped by query count (`_bucket`), while padded
    keys stay within twice the real ones."""
    pseudo = [p for r, s in zip(rows, starts, strict=True) for p in pseudo_rows(m, r, s, window)]
    pseudo.sort(key=lambda p: (_bucket(len(p.queries)), len(p.keys)))
    calls: list[InvariantCall | TreeCall] = []
    for r, start in zip(rows, starts, strict=True):
        tc = tree_call(m, r, start, window, dev) if r.tree is not None else None
        if tc is not None:
            calls.append(tc)
    group: list[_Pseudo] = []
    for p in pseudo:
        trial = group + [p]
        n_tiles = {_bucket(len(x.queries)) for x in trial}
        padded = len(trial) * _tiles(len(p.keys), KEY_CHUNK)
        if group and (len(n_tiles) > 1 or padded > 2 * sum(_tiles(len(x.keys), KEY_CHUNK) for x in trial)):
            calls.append(_call(group, window, dev))
            trial = [p]
        group = trial
    if group:
        calls.append(_call(group, window, dev))
    return calls


def _call(group: list[_Pseudo], window: int | None, dev: torch.device) -> InvariantCall:
    G = len(group)
    N = max(len(p.queries) for p in group)
    W = _tiles(max(len(p.keys) for p in group), KEY_CHUNK)
    queries: list[int] = []
    keys: list[int] = []
    src: list[int] = []
    dst: list[int] = []
    mask = torch.zeros(G, 1, N, W, dtype=torch.bool)
    for g, p in enumerate(group):
        n, w = len(p.queries), len(p.keys)
        queries.extend(p.queries + [p.queries[0]] * (N - n))
        keys.extend(p.keys + [p.keys[0]] * (W - w))
        qp = torch.tensor(p.qpos)[:, None]  # [n, 1]
        kp = torch.arange(p.lo, p.lo + w)[None, :]  # [1, w]: key j sits at position lo + j
        seen = kp <= qp
        if window is not None:
            seen &= (qp - kp) < window
        mask[g, 0, :n, :w] = seen
        mask[g, 0, n:, 0] = True  # padded queries see one key (no empty softmax); their output is dropped
        src.extend(range(g * N, g * N + n))
        dst.extend(p.queries)

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=dev)

    return InvariantCall(t(queries), t(keys), mask, t(src), t(dst), (G, N, W))


def attend(call: InvariantCall, q_all: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
           out: torch.Tensor, scaling: float | None, softcap: float | None) -> None:
    """One call's attention (see the module docstring), written into `out` ([T, Hq, Dv]) at its queries. The
    rep query heads of one KV head and the N queries form the M = rep x N rows of its products, each product
    run over rows zero-padded to a whole number of `ROW_TILE`s; the softmax runs on the M real rows only."""
    G, N, W = call.shape
    hq, hk, d = q_all.shape[0], k_pool.shape[0], q_all.shape[-1]
    rep = hq // hk
    M = rep * N
    # KV-head-major: the gathered keys are contiguous per (KV head, pseudo-row), products need no copies
    q = q_all.index_select(1, call.queries).float().view(hk, rep, G, N, d)  # [Hk, rep, G, N, D]
    q = q.transpose(1, 2).reshape(hk, G, M, d)  # [Hk, G, rep x N, D]
    mask = call.mask.view(1, G, 1, N, W).expand(1, G, rep, N, W).reshape(1, G, M, W)  # [1, G, rep x N, W]
    k = k_pool.index_select(1, call.keys).float().view(hk, G, W, d)  # [Hk, G, W, D]
    v = v_pool.index_select(1, call.keys).float().view(hk, G, W, -1)  # [Hk, G, W, Dv]
    s = (_tiled_rows(q) @ k.transpose(-1, -2))[:, :, :M] * (scaling if scaling is not None else d ** -0.5)  # [Hk, G, M, W]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))  # [Hk, G, M, W]
    nc = W // KEY_CHUNK
    pc = p.view(hk, G, M, nc, KEY_CHUNK)
    sums = pc.sum(-1).unsqueeze(-1)  # [Hk, G, M, nc, 1]: each chunk's sum
    pv = (_tiled_rows(pc.transpose(2, 3)) @ v.view(hk, G, nc, KEY_CHUNK, -1))[..., :M, :]  # [Hk, G, nc, M, Dv]: each chunk's p v
    total, o = _in_order(sums.movedim(3, 2), pv)  # [Hk, G, M, 1], [Hk, G, M, Dv]
    o = (o / total).reshape(hk, G, rep, N, -1).permute(1, 3, 0, 2, 4).reshape(G * N, hq, -1)
    out.index_copy_(0, call.dst, o.index_select(0, call.src).to(out.dtype))  # o: [G x N, Hq, Dv]


def _in_order(sums: torch.Tensor, pv: torch.Tensor, dim: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks' sums and p v (chunks along `dim`) added one chunk after the other, first to last: the
    same additions in the same order however many chunks follow (masked ones add exact zeros)."""
    total, o = sums.select(dim, 0), pv.select(dim, 0)
    for c in range(1, pv.shape[dim]):
        total, o = total + sums.select(dim, c), o + pv.select(dim, c)
    return total, o


def _tiled_rows(x: torch.Tensor) -> torch.Tensor:
    """x ([..., M, K]) with zero rows added to a whole number of `ROW_TILE`s."""
    pad = -x.shape[-2] % ROW_TILE
    return torch.cat([x, x.new_zeros(*x.shape[:-2], pad, x.shape[-1])], -2) if pad else x


def attend_tree(call: TreeCall, q_all: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                out: torch.Tensor, scaling: float | None, softcap: float | None) -> None:
    """A TreeCall's attention: the same sums, in the same order, as each node's path run as a chain."""
    hq, hk, d = q_all.shape[0], k_pool.shape[0], q_all.shape[-1]
    rep, n = hq // hk, int(call.queries.shape[0])
    wp, wt = int(call.prefix.shape[0]), call.tail.shape[0] // n
    q = q_all.index_select(1, call.queries).float().view(hk, rep, n, d)  # [Hk, rep, n, D]
    kp = k_pool.index_select(1, call.prefix).float()  # [Hk, Wp, D]
    vp = v_pool.index_select(1, call.prefix).float()  # [Hk, Wp, Dv]
    kt = k_pool.index_select(1, call.tail).float().view(hk, n, wt, d).transpose(0, 1)  # [n, Hk, Wt, D]
    vt = v_pool.index_select(1, call.tail).float().view(hk, n, wt, -1).transpose(0, 1)  # [n, Hk, Wt, Dv]
    dv = vt.shape[-1]
    qt = _tiled_rows(q.permute(2, 0, 1, 3))  # [n, Hk, rep + pad, D]: each node's rows its own tile
    st = (qt @ kt.transpose(-1, -2))[:, :, :rep].permute(1, 2, 0, 3)  # [Hk, rep, n, Wt]
    if wp:
        sp = (_tiled_rows(q.reshape(hk, rep * n, d)) @ kp.transpose(-1, -2))[:, : rep * n]  # [Hk, rep x n, Wp]
        s = torch.cat([sp.view(hk, rep, n, wp), st], -1)  # [Hk, rep, n, Wp + Wt]
    else:
        s = st
    s = s * (scaling if scaling is not None else d ** -0.5)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    mask = torch.cat([call.prefix_mask, call.tail_mask], -1)  # [n, Wp + Wt]
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))  # [Hk, rep, n, Wp + Wt]
    npc, ntc = wp // KEY_CHUNK, wt // KEY_CHUNK
    sums = p.view(hk, rep, n, npc + ntc, KEY_CHUNK).sum(-1).permute(3, 0, 1, 2).unsqueeze(-1)  # [chunks, Hk, rep, n, 1]
    pp = p[..., :wp].reshape(hk, rep * n, npc, KEY_CHUNK).transpose(1, 2)  # [Hk, npc, rep x n, C]: all nodes
    pv_pre = (_tiled_rows(pp) @ vp.view(hk, npc, KEY_CHUNK, dv))[:, :, : rep * n]  # [Hk, npc, rep x n, Dv]
    pt = p[..., wp:].reshape(hk, rep, n, ntc, KEY_CHUNK).permute(2, 0, 3, 1, 4)  # [n, Hk, ntc, rep, C]: per node
    pv_tail = (_tiled_rows(pt) @ vt.view(n, hk, ntc, KEY_CHUNK, dv))[:, :, :, :rep]  # [n, Hk, ntc, rep, Dv]
    pv = torch.cat([pv_pre.view(hk, npc, rep, n, dv).permute(1, 0, 2, 3, 4),
                    pv_tail.permute(2, 1, 3, 0, 4)])  # [chunks, Hk, rep, n, Dv]
    total, o = _in_order(sums, pv, dim=0)  # [Hk, rep, n, 1], [Hk, rep, n, Dv]
    o = (o / total).permute(2, 0, 1, 3).reshape(n, hq, dv)  # [n, Hq, Dv]
    out.index_copy_(0, call.queries, o.to(out.dtype))
