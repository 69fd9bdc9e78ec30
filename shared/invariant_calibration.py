"""Whether a model's forwards are batch-invariant on this machine: measured, not assumed.

shared/invariant.py gives every per-row computation one shape whatever the batch: linear layers see their
rows in whole tiles, attention sums its keys in fixed chunks over whole tiles of query rows. Whether a kernel
then gives a row the same bits at every row count is a property of the kernel library, the CPU, the dtype and
the thread count, not of that construction, so `calibrate` measures it once at start-up, in the thread and at
the thread count that will run every forward, up to the largest forward the server makes (`max_rows`, its
--max-batch-tokens):

- **Linear layers**: one probe per distinct kernel (shape, dtype, packed or not, the output layer at its whole
  width). Random rows at each of `probe_rows(max_rows)` row counts (every count to 16, then each power of two,
  the odd count after it and one between it and the next), zero-padded to the tile as the server pads them,
  must give the bits of the same rows in a forward of max_rows rows, taken a few rows further on (a row's
  place in its forward moves). The first of LINEAR_MODES that passes every probe is kept: one call of whole
  tiles, smallest tile first, then one call per tile of ROW_TILE rows (every call one shape, for libraries
  that pick their path by the row count: oneDNN's bfloat16 kernels on AMX).
- **Attention**: per layer kind (full, each sliding window) with the model's head counts, head sizes and KV
  dtype, a sequence of random queries, keys and values runs through shared/invariant.py's calls as the
  scheduler's rows make them (`_AttentionProbe`): a decode step beside BATCH_MATES others, verify rows of 2, 5
  and 17 tokens beside other sessions' verify rows, prefill chunks of 37 and of max_rows tokens beside decode
  rows, token trees whose path is the sequence (after 0 or 2 chain tokens, one across a key chunk's edge), and a
  copy of the sequence holding its first blocks through the prefix cache. Every query compared must give the
  bits of the same query in a decode step alone.

A failure is named (`Calibration.failure`: which probe, at which row count). The server then reports
`batch_invariant: false` and runs one call per ROW_TILE rows, which narrows the differences but no longer
rules them out.

Its cost at start-up grows with max_rows and the output layer's width, whose probes at the largest row counts
dominate (BENCHMARKS.md, "What start-up calibration costs").
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shared.blocks import BlockManager
from shared.invariant import (
    KEY_CHUNK,
    ROW_TILE,
    InvariantCall,
    attend,
    attend_tree,
    build_calls,
    linear_layers,
    tile_linears,
)
from shared.rows import Row

if TYPE_CHECKING:
    from shared.kvpool import KVPool

# the linear layers' modes tried, in order: (row tile, one call per tile); one call of whole tiles first, smallest
# tile first (a single row, a matrix-vector path on most CPUs, is never one), then calls of one shape
LINEAR_MODES = ((2, False), (4, False), (8, False), (16, False), (ROW_TILE, True))
# decode rows beside the probed one in the attention probe's batch (the cloud's default --max-batch-size is 32)
BATCH_MATES = 31
# prefill chunk lengths the attention probe runs besides max_rows (an odd one: its queries pad to a tile)
CHUNKS = (37,)
# draft tokens of the attention probe's verify rows
VERIFY_K = (1, 4, 16)


@dataclass
class Calibration:
    """What `calibrate` measured."""
    # the linear layers' row tile kept (ROW_TILE when no mode passed), and whether they run one call per tile
    tile: int
    calls: bool
    # every probe gave the same bits: a row's logits do not depend on what shares its forward
    invariant: bool
    # the probes that failed ("" when none): what, and at which row count
    failure: str
    # the largest forward probed (tokens) and the torch threads the probes ran at
    max_rows: int
    threads: int
    # wall time of the calibration
    seconds: float


def probe_rows(max_rows: int) -> list[int]:
    """Row counts the linear probes run: every count to 16, then each power of two, the odd count after it and
    one between it and the next (p + p/2 + 1), and max_rows itself."""
    rows = set(range(1, min(16, max_rows) + 1)) | {max_rows}
    p = 16
    while p <= max_rows:
        rows.update(n for n in (p, p + 1, p + p // 2 + 1) if n <= max_rows)
        p *= 2
    return sorted(rows)


@torch.inference_mode()
def calibrate(model: torch.nn.Module, max_rows: int, pool: KVPool | None = None, seed: int = 0) -> Calibration:
    """Measure (see the module docstring) and set the first passing mode on `model`'s tiled layers (ROW_TILE in
    one call per tile when none passes). `pool`: the model's prepared KV pool, whose layer kinds and shapes the
    attention probes take (None: no attention probe)."""
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(seed)
    (tile, calls), failures = _linear_mode(model, max_rows, g)
    if pool is not None:
        failures += _attention_failures(model, pool, max_rows, seed)
    tile_linears(model, tile, calls)
    return Calibration(tile, calls, not failures, "; ".join(failures), max_rows, torch.get_num_threads(),
                       time.perf_counter() - t0)


# --- linear layers ----------------------------------------------------------------------------------------

def _kernels(model: torch.nn.Module) -> dict[tuple[Any, ...], tuple[str, torch.nn.Module]]:
    """One tiled layer (and its name) per distinct kernel."""
    names = {id(m): n for n, m in model.named_modules()}
    out: dict[tuple[Any, ...], tuple[str, torch.nn.Module]] = {}
    for m in linear_layers(model):
        w = getattr(m, "weight", None)
        if w is None or not hasattr(m, "_untiled_forward"):
            continue
        conv1d = type(m).__name__ == "Conv1D"  # GPT-2's: the weight is [in, out]
        fin, fout = (int(w.shape[0]), int(w.shape[1])) if conv1d else (int(w.shape[1]), int(w.shape[0]))
        key = (type(m).__name__, fin, fout, w.dtype, w.is_mkldnn, hasattr(m, "packed_weight"),
               getattr(m, "bias", None) is not None)
        out.setdefault(key, (names.get(id(m), type(m).__name__), m))
    return out


def linear_mode(model: torch.nn.Module, max_rows: int, seed: int = 0) -> tuple[tuple[int, bool], list[str]]:
    """The first of LINEAR_MODES under which every tiled linear layer of `model` passes (as `calibrate` measures
    them), without setting it: ((tile, calls), failures)."""
    return _linear_mode(model, max_rows, torch.Generator().manual_seed(seed))


def _linear_mode(model: torch.nn.Module, max_rows: int, g: torch.Generator) -> tuple[tuple[int, bool], list[str]]:
    """The first of LINEAR_MODES under which every kernel passes ((ROW_TILE, True) and the failures when none
    does). Verdicts are kept per (kernel, rows, padded rows, calls): a shape two modes share runs once."""
    rows = probe_rows(max_rows)
    ref_rows = -(-max_rows // ROW_TILE) * ROW_TILE
    kernels = list(_kernels(model).items())
    inputs: dict[tuple[Any, ...], torch.Tensor] = {}  # kernel -> x [R, in]
    refs: dict[tuple[Any, ...], torch.Tensor] = {}  # (kernel, mode) -> its forward of x [R, out]
    verdicts: dict[tuple[Any, ...], bool] = {}
    failed: list[str] = []
    for tile, calls in LINEAR_MODES:
        failure = ""
        for key, (name, m) in kernels:
            f: Callable[[torch.Tensor], torch.Tensor] = m._untiled_forward  # type: ignore[assignment]
            run = (lambda x, f=f, t=tile: torch.cat([f(c) for c in x.split(t)])) if calls else f
            mode = tile if calls else 0  # the reference forward differs by mode only with calls per tile
            if key not in inputs:  # made on the CPU (one seeded stream everywhere), run on the layer's device
                inputs[key] = torch.randn(ref_rows, key[1], generator=g).to(next(m.parameters()).device, key[3])
            x = inputs[key]
            if (key, mode) not in refs:
                refs[key, mode] = run(x)
            ref = refs[key, mode]
            for n in rows:
                padded = -(-n // tile) * tile
                s = min(1 + n % 3, ref_rows - n)  # the rows' place in the reference forward
                if (key, n, padded, mode) not in verdicts:
                    xn = x[s: s + n]
                    if padded > n:
                        xn = torch.cat([xn, x.new_zeros(padded - n, x.shape[1])])
                    verdicts[key, n, padded, mode] = torch.equal(run(xn)[:n], ref[s: s + n])
                if not verdicts[key, n, padded, mode]:
                    how = f"calls of {tile} rows" if calls else f"tile {tile}"
                    failure = f"{how}: {name} ({key[1]} -> {key[2]}, {key[3]}) at {n} rows"
                    break
            if failure:
                break
        if not failure:
            return (tile, calls), []
        failed.append(failure)
    return (ROW_TILE, True), [f"linear layers, no mode passes ({'; '.join(failed)})"]


# --- attention --------------------------------------------------------------------------------------------

def _attention_failures(model: torch.nn.Module, pool: KVPool, max_rows: int, seed: int) -> list[str]:
    """One `_AttentionProbe` per distinct layer kind and shape of `pool`; the first failure of each."""
    cfg = model.config.get_text_config()  # type: ignore[union-attr, operator]
    hq = int(cfg.num_attention_heads)
    scaling = next((float(s) for mod in model.modules() if isinstance(s := getattr(mod, "scaling", None), float)),
                   None)
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    kinds = {(w, int(k.shape[0]), int(k.shape[-1]), int(v.shape[-1]))
             for w, k, v in zip(pool.layout.windows, pool.keys, pool.values, strict=True)}
    out = []
    for w, hk, dk, dv in sorted(kinds, key=lambda x: (x[0] is not None, x[0] or 0)):
        probe = _AttentionProbe(hq, hk, dk, dv, w, scaling, softcap, pool.dtype, pool.block_size,
                                min(pool.max_positions, max_rows + KEY_CHUNK + 5), max_rows, seed, pool.device)
        failure = probe.first_failure()
        if failure:
            what = "full-attention layers" if w is None else f"sliding-window ({w}) layers"
            out.append(f"attention of the {what}: {failure}")
    return out


class _AttentionProbe:
    """One layer kind's attention over a scratch block pool. `seq` is a sequence of `length` random keys,
    values and queries; `copy` holds its first half through the prefix cache and the rest in blocks of its
    own; each tree sequence holds its first positions through the prefix cache and a token tree after them
    whose path has `seq`'s keys; mates are other sessions of random lengths, their blocks interleaved with
    `seq`'s. A query of `seq`'s at position p must give the bits of a decode step alone at p (`reference`)."""

    def __init__(self, hq: int, hk: int, dk: int, dv: int, window: int | None, scaling: float | None,
                 softcap: float | None, dtype: torch.dtype, block: int, length: int, max_rows: int,
                 seed: int, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")  # the pool's: the attention kernels measured are the device's
        self.hq, self.window, self.scaling, self.softcap = hq, window, scaling, softcap
        self.length, self.max_rows, self.rand = length, max_rows, random.Random(seed)
        g = self.g = torch.Generator().manual_seed(seed)
        m = self.m = BlockManager(block, None, prefix_cache=True)
        n = length
        self.seq, self.mates = m.new_seq(), [m.new_seq() for _ in range(BATCH_MATES)]
        self.mate_len = [self.rand.randint(1, n) for _ in self.mates]
        for lo in range(0, n, block):  # block by block, so `seq`'s blocks are not contiguous
            for s, end in [(self.seq, n), *zip(self.mates, self.mate_len, strict=True)]:
                if lo < end:
                    self._write(s, lo, min(lo + block, end) - lo)
        m.set_length(self.seq, n)  # its full blocks enter the prefix cache
        self.copy = self._sharing(n // 2, n)
        # token trees: (sequence, tree base, chain tokens before it, parents, the path's node indices)
        self.trees = []
        for base in sorted({min(KEY_CHUNK - 2, n - 2), n - 6}):
            for chain in (0, 2):
                if base - chain < 1 or base < 1:
                    continue
                parents, path = self._tree(min(5, n - base))
                self.trees.append((self._sharing(base - chain, base + len(parents)), base, chain, parents, path))
        rows = m.capacity * block
        self.k = torch.randn(hk, rows, dk, generator=g).to(device, dtype)  # [Hk, rows, Dk]
        self.v = torch.randn(hk, rows, dv, generator=g).to(device, dtype)  # [Hk, rows, Dv]
        self.q = torch.randn(hq, n, dk, generator=g).to(device, dtype)  # [Hq, n, Dk]: seq's queries by position
        mine = m.slot_mapping(self.seq, 0, n)
        self._same_keys(self.copy, list(range(n)), mine)
        for t, base, _, _, path in self.trees:
            node_pos = {j: base + d for d, j in enumerate(path)}  # the path node at depth d + 1 sits at base + d
            offsets = list(range(base)) + [base + j for j in node_pos]
            self._same_keys(t, offsets, [mine[p] for p in range(base)] + [mine[p] for p in node_pos.values()])
        self._refs: dict[int, torch.Tensor] = {}

    def _write(self, s: int, cached: int, n: int) -> None:
        self.m.prepare_write(s, cached, n)
        self.m.extend(s, list(range(cached, cached + n)))  # token i at offset i: prefix keys match `seq`'s

    def _sharing(self, shared: int, length: int) -> int:
        """A sequence whose first `shared` positions (whole blocks of them) are `seq`'s through the prefix
        cache, with blocks of its own up to `length`."""
        s = self.m.new_seq()
        have = self.m.match_prefix(s, list(range(self.length)), shared)
        self._write(s, have, length - have)
        return s

    def _same_keys(self, s: int, offsets: list[int], rows: list[int]) -> None:
        """Copy `seq`'s keys and values (pool rows `rows`) to `s`'s storage `offsets` (shared blocks hold them)."""
        dst = torch.tensor([self.m.slot_mapping(s, o, o + 1)[0] for o in offsets], device=self.device)
        src = torch.tensor(rows, device=self.device)
        self.k[:, dst], self.v[:, dst] = self.k[:, src], self.v[:, src]

    def _tree(self, depth: int) -> tuple[tuple[int, ...], list[int]]:
        """Parents of a tree whose path has `depth` nodes, a sibling beside every other one; the path's nodes."""
        parents: list[int] = []
        path: list[int] = []
        for d in range(depth):
            up = path[-1] if path else -1
            if d % 2:
                parents.append(up)
            path.append(len(parents))
            parents.append(up)
        return tuple(parents), path

    def _attend(self, rows: list[Row], queries: list[torch.Tensor]) -> torch.Tensor:
        """`rows` as one forward's attention calls; queries[i] ([Hq, len(ids), Dk]) are row i's; [T, Hq, Dv]."""
        starts = [0]
        for r in rows[:-1]:
            starts.append(starts[-1] + len(r.ids))
        q_all = torch.cat(queries, 1)  # [Hq, T, Dk]
        out = q_all.new_zeros(q_all.shape[1], self.hq, self.v.shape[-1])  # [T, Hq, Dv]
        for call in build_calls(self.m, rows, starts, self.window, self.device):
            if isinstance(call, InvariantCall):
                attend(call, q_all, self.k, self.v, out, self.scaling, self.softcap)
            else:
                attend_tree(call, q_all, self.k, self.v, out, self.scaling, self.softcap)
        return out

    def reference(self, p: int) -> torch.Tensor:
        """`seq`'s query at position p in a decode step alone ([Hq, Dv])."""
        if p not in self._refs:
            self._refs[p] = self._attend([Row(self.seq, p, [0], 1)], [self.q[:, p: p + 1]])[0]
        return self._refs[p]

    def _random_q(self, n: int) -> torch.Tensor:
        return torch.randn(self.hq, n, self.q.shape[-1], generator=self.g).to(self.device, self.q.dtype)  # [Hq, n, Dk]

    def _mates(self, count: int, tokens: Callable[[], int]) -> tuple[list[Row], list[torch.Tensor]]:
        """Rows of `count` mates, each ending at its last position with `tokens()` tokens."""
        rows, qs = [], []
        for s, n in list(zip(self.mates, self.mate_len, strict=True))[:count]:
            k = min(tokens(), n)
            rows.append(Row(s, n - k, [0] * k, k))
            qs.append(self._random_q(k))
        return rows, qs

    def _check(self, what: str, mine: Row, rows: list[Row], qs: list[torch.Tensor],
               compared: set[int] | None = None) -> str:
        """Run `mine` (a chain row of `seq`'s queries) and the mates' `rows` (queries `qs`) as one forward, in a
        shuffled order; the first of mine's queries (at the positions `compared`, default all) whose result
        differs from a decode step's, or ""."""
        pos = list(range(mine.num_cached_tokens, mine.num_cached_tokens + len(mine.ids)))
        batch = [(mine, self.q[:, pos]), *zip(rows, qs, strict=True)]
        self.rand.shuffle(batch)
        out = self._attend([r for r, _ in batch], [q for _, q in batch])
        start = sum(len(r.ids) for r, _ in batch[: [r for r, _ in batch].index(mine)])
        for t, p in enumerate(pos):
            if (compared is None or p in compared) and not torch.equal(out[start + t], self.reference(p)):
                return f"the query at position {p} in {what} ({len(out)} rows) differs from a decode step alone"
        return ""

    def _checked(self) -> list[int]:
        """Positions compared: the edges of the first key chunks, the last ones, a few at random."""
        n = self.length
        edges = {0, 1, KEY_CHUNK - 1, KEY_CHUNK, KEY_CHUNK + 1, 2 * KEY_CHUNK - 1, 2 * KEY_CHUNK, n - 2, n - 1}
        return sorted({p for p in edges if 0 <= p < n} | {self.rand.randrange(n) for _ in range(4)})

    def first_failure(self) -> str:
        """Every scenario of the class docstring, in turn; the first failure, or ""."""
        n, checked = self.length, self._checked()
        compared = set(checked)
        for p in checked:
            rows, qs = self._mates(BATCH_MATES, lambda: 1)
            failure = self._check(f"a decode step beside {len(rows)} others", Row(self.seq, p, [0], 1), rows, qs)
            for k in VERIFY_K:
                if failure or p < k:
                    continue
                rows, qs = self._mates(7, lambda: self.rand.randint(1, 17))
                failure = self._check(f"a verify row of {k + 1} tokens beside {len(rows)} others",
                                      Row(self.seq, p - k, [0] * (k + 1), k + 1), rows, qs)
            if failure:
                return failure
        for chunk in sorted({*CHUNKS, min(self.max_rows, n)}):
            for lo in range(0, n, chunk):
                hi = min(lo + chunk, n)
                if not any(lo <= p < hi for p in checked):
                    continue
                rows, qs = self._mates(3, lambda: 1)
                failure = self._check(f"a prefill chunk of {hi - lo} tokens beside {len(rows)} decode rows",
                                      Row(self.seq, lo, [0] * (hi - lo), 0), rows, qs, compared)
                start = max(lo, n // 2)
                if not failure and any(start <= p < hi for p in checked):  # seq's first blocks, the prefix cache's
                    failure = self._check(f"a prefill chunk of {hi - start} tokens over a shared prefix",
                                          Row(self.copy, start, [0] * (hi - start), 0), [], [], compared)
                if failure:
                    return failure
        for t, base, chain, parents, path in self.trees:
            rows, qs = self._mates(3, lambda: 1)
            r = Row(t, base - chain, [0] * (chain + len(parents)), 0, tree=parents, tree_base=base)
            q = self._random_q(chain + len(parents))  # [Hq, chain + nodes, Dk]: siblings random
            q[:, :chain] = self.q[:, base - chain: base]
            for d, j in enumerate(path):
                q[:, chain + j] = self.q[:, base + d]
            batch = [(r, q), *zip(rows, qs, strict=True)]
            out = self._attend([x for x, _ in batch], [y for _, y in batch])
            pos = list(range(base - chain, base)) + [base + d for d in range(len(path))]
            idx = list(range(chain)) + [chain + j for j in path]
            for p, i in zip(pos, idx, strict=True):
                if not torch.equal(out[i], self.reference(p)):
                    return (f"the query at position {p} in a token tree of {len(parents)} nodes after {chain} chain "
                            f"tokens ({len(out)} rows) differs from a decode step")
        return ""
