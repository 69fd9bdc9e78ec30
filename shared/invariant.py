"""Batch-invariant forwards: a token's logits and KV do not depend on the other tokens of its forward.

A forward's result for one row can change with how many rows share it: matrix kernels pick their
blocking (and, for a few rows, a different code path) by shape, and attention sums over as many keys
as its call holds (Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025). In
bfloat16 that is enough to flip greedy tokens, so cloud_only, a chain, a tree and a batch of 16
sessions would each write their own text. Here every per-row computation has one shape whatever the
batch:

- **Linear layers** see their rows in whole tiles: the rows are padded with zeros to a multiple of
  `ROW_TILE` (16). A matrix kernel computes each output row from that row and the weight; with the row
  count a whole number of tiles, the kernel's path and its reduction over the input width are the same
  for every row (`tests/shared/test_invariant.py` checks it bit for bit on the machine it runs on, and
  that the unpadded path fails there).
- **Attention** of a query at position p runs over the keys at positions 0, 1, ... in chunks of
  `KEY_CHUNK` positions aligned to absolute multiples of it, the chunk's keys in position order
  whatever their storage order (a token tree's node gets its own ancestors' keys, laid out as the chain
  the node's path would be): scores in float32 (`q k^T`, the query among whole tiles of queries), one
  maximum over every visible key, then the sum and `p v` chunk after chunk in a fixed order. Keys a query
  does not see (later positions, a padded chunk, another branch, padding) are masked to probability 0,
  which adds an exact zero: a query's result is the same in a decode step, a chain, a tree, a prefill
  chunk and beside any batch mates.

Costs: a decode row's linear work is 16 rows' (on matrix units, or for bfloat16, nearly what one costs;
measured in BENCHMARKS.md), a tree node's attention is a tile of its own.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from shared.blocks import BlockManager
    from shared.kvpool import Row

# rows of every linear layer's input, and queries of every attention call, come in whole tiles of this many
ROW_TILE = 16
# keys are summed in chunks of this many positions, aligned to absolute multiples of it
KEY_CHUNK = 64


def _tiled_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])  # [T, in]
    pad = -flat.shape[0] % ROW_TILE
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])  # [T + pad, in]
    y = self._untiled_forward(flat)[: flat.shape[0] - pad]  # type: ignore[operator]  # [T, out]
    return y.reshape(*x.shape[:-1], y.shape[-1])


def tile_linears(model: torch.nn.Module) -> int:
    """Make every Linear of `model` (and GPT-2's Conv1D, a Linear with its weight transposed) run its rows
    in whole `ROW_TILE`s (idempotent); returns how many."""
    from transformers.pytorch_utils import Conv1D

    n = 0
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, Conv1D)) and not hasattr(m, "_untiled_forward"):
            m._untiled_forward = m.forward  # type: ignore[assignment]  # the plain or packed forward
            m.forward = types.MethodType(_tiled_forward, m)  # type: ignore[method-assign]
            n += 1
    return n


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


def pseudo_rows(m: BlockManager, r: Row, start: int, window: int | None) -> list[_Pseudo]:
    """`r`'s queries as pseudo-rows whose keys are laid out by position (see the module docstring)."""
    pos = r.positions()
    first = min(pos)
    lo = 0 if window is None else max(0, first - window + 1)
    lo -= lo % KEY_CHUNK
    end = r.past + len(r.ids)
    if r.tree is None:
        return [_Pseudo(list(range(start, start + len(r.ids))), pos, m.slots(r.slot, lo, end), lo)]
    base = r.tree_base
    out = []
    chain = [t for t in range(len(r.ids)) if r.past + t < base]  # tokens before the tree's first node
    if chain:
        out.append(_Pseudo([start + t for t in chain], [pos[t] for t in chain], m.slots(r.slot, lo, base), lo))
    prefix = m.slots(r.slot, lo, base) if base > lo else []
    parents = r.tree or ()
    for t in range(len(chain), len(r.ids)):
        node = r.past + t - base
        path = []
        while node >= 0:  # the node and its ancestors, deepest first
            path.append(node)
            node = parents[node]
        path_rows = [m.slots(r.slot, base + j, base + j + 1)[0] for j in reversed(path)]
        out.append(_Pseudo([start + t], [pos[t]], prefix + path_rows, lo))
    return out


def build_calls(m: BlockManager, rows: list[Row], starts: list[int], window: int | None,
                dev: torch.device) -> list[InvariantCall]:
    """The attention calls of one layer kind: pseudo-rows grouped by query count (`_bucket`), while padded
    keys stay within twice the real ones."""
    pseudo = [p for r, s in zip(rows, starts, strict=True) for p in pseudo_rows(m, r, s, window)]
    pseudo.sort(key=lambda p: (_bucket(len(p.queries)), len(p.keys)))
    calls: list[InvariantCall] = []
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
    rep query heads of one KV head and the N queries form the M = rep x N rows of its products, padded with
    rows that see key 0 to a whole number of `ROW_TILE`s."""
    G, N, W = call.shape
    hq, hk, d = q_all.shape[0], k_pool.shape[0], q_all.shape[-1]
    rep = hq // hk
    M, pad = rep * N, -(rep * N) % ROW_TILE
    q = q_all.index_select(1, call.queries).float().view(hk, rep, G, N, d)  # [Hk, rep, G, N, D]
    q = q.permute(2, 0, 1, 3, 4).reshape(G, hk, M, d)  # [G, Hk, rep x N, D]
    mask = call.mask.expand(G, rep, N, W).reshape(G, 1, M, W)  # [G, 1, rep x N, W]
    if pad:
        q = torch.cat([q, q.new_zeros(G, hk, pad, d)], 2)  # [G, Hk, M + pad, D]
        extra = torch.zeros(G, 1, pad, W, dtype=torch.bool, device=mask.device)
        extra[..., 0] = True
        mask = torch.cat([mask, extra], 2)  # [G, 1, M + pad, W]
    k = k_pool.index_select(1, call.keys).float().view(hk, G, W, d).transpose(0, 1)  # [G, Hk, W, D]
    v = v_pool.index_select(1, call.keys).float().view(hk, G, W, -1).transpose(0, 1)  # [G, Hk, W, Dv]
    s = (q @ k.transpose(-1, -2)) * (scaling if scaling is not None else d ** -0.5)  # [G, Hk, M + pad, W]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))  # [G, Hk, M + pad, W]
    total = p.new_zeros(G, hk, M + pad, 1)
    o = p.new_zeros(G, hk, M + pad, v.shape[-1])  # [G, Hk, M + pad, Dv]
    for c in range(0, W, KEY_CHUNK):  # a fixed order of fixed-size sums: extra chunks add exact zeros
        pc = p[..., c: c + KEY_CHUNK]
        total = total + pc.sum(-1, keepdim=True)
        o = o + pc @ v[:, :, c: c + KEY_CHUNK]
    o = (o / total)[:, :, :M].reshape(G, hk, rep, N, -1).permute(0, 3, 1, 2, 4).reshape(G * N, hq, -1)
    out.index_copy_(0, call.dst, o.index_select(0, call.src).to(out.dtype))  # o: [G x N, Hq, Dv]
