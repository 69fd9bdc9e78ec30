"""The target's forward of our own over the KV pool: one fixed sequence of tensor operations for a model's layers.

Which models: decoder-only attention families whose layer is "RMSNorm, attention with RoPE, RMSNorm, gated MLP"
(`FAMILIES`: Llama, Qwen2, Qwen3 with its q/k norms, Mistral), with full attention or a sliding window per layer
(shared/attention_layout.py); anything else keeps transformers' modules over the pool (`support` says why). q/k/v
and gate/up run as one GEMM each over a fused weight whose slices are the modules' own weights. The same code runs
with CUDA graphs on a GPU (cloud/runners/graphs.py), eagerly on a CPU, and on a tensor-parallel rank's shards
(below).

A forward's layout. Rows (sessions' rounds, decode steps, prefill chunks) are flattened to T tokens for every
linear layer. Attention either reads each token's keys in the pool through its row's block table
(cloud/runners/paged_kernel.py, `--attention triton`), runs shared/invariant.py's chunked calls (`chunked`: a CPU's
batch-invariant attention; SDPA's sums there change with the query count), or runs per group of rows as
[R rows, N queries, W keys]: a row's queries gathered from the flat tokens, its keys from the pool, and a mask
[R, N, W] saying which key each query sees (causal by position; a token tree's node sees the cached prefix and its
ancestors only, as shared/paged_plan.py's masks; on a sliding-window layer also within the window, by the
groups' query-key distances). Padding (tokens, queries, keys) points at the pool's spare row,
which no sequence owns: padded tokens write their K/V there, padded keys are masked, padded queries' outputs land
on a spare token. The output layer runs on the kept rows only (`logits`).

Batch invariance. With `tile` > 0 every linear layer runs its rows in calls of `tile` rows (one kernel shape
whatever the forward's size; on a CPU the tile and whether it takes one call per tile are measured at start-up, as
for the transformers path), and attention's padded keys only add exact zeros. Whether a row then gets the same bits
in every bucket is measured on the device (cloud/runners/invariance.py).

Tensor parallelism (`ranks` > 1, cloud/runners/tensor_parallel.py): the model's weights are the shards
transformers' tensor plan placed on this rank; each layer runs on them (`shards`) and the ranks' parts are combined
by the group's `collectives`: partial sums added in rank order, the output layer's vocabulary columns gathered.

`fused` (`--fused-kernels`): the residual add with the RMSNorm after it, RoPE, and SiLU(gate) x up after the fused
gate/up GEMM, run as Triton kernels (cloud/runners/fused_kernels.py) instead of PyTorch's separate elementwise ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from cloud.runners.graph_inputs import Inputs
from shared.attention_layout import attention_layout
from shared.invariant import TreeCall, attend_tree
from shared.invariant import attend as attend_chunks

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def support(model: torch.nn.Module) -> str | None:
    """Why this model cannot run `ModelForward` (None: it can)."""
    cfg = model.config.get_text_config()  # type: ignore[operator, union-attr]
    kind = getattr(cfg, "model_type", "")
    if kind not in FAMILIES:
        return f"{kind or type(model).__name__} is not one of {', '.join(FAMILIES)}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or not hasattr(inner, "embed_tokens") or not hasattr(inner, "norm"):
        return "not the usual decoder layout (model.embed_tokens, model.layers, model.norm)"
    a = layers[0].self_attn
    if not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention without q/k/v/o projections"
    if getattr(cfg, "rope_scaling", None) and (cfg.rope_scaling or {}).get("rope_type", "default") == "dynamic":
        return "dynamic RoPE (its frequencies change with the length)"
    return None


class ModelForward:
    """The layers of a FAMILIES model over a KV pool's tensors (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, *, tile: int = 0, kernel: bool = False, ranks: int = 1,
                 collectives: Any = None, fused: bool = False) -> None:
        inner: Any = model.model  # type: ignore[union-attr]
        cfg = model.config.get_text_config()  # type: ignore[operator, union-attr]
        self.model, self.inner, self.layers = model, inner, list(inner.layers)
        self.head = model.get_output_embeddings()  # type: ignore[operator]
        # each layer's sliding window (None: full attention)
        self.windows = attention_layout(model.config).windows
        a = self.layers[0].self_attn
        # this process's heads: all of them, or a tensor-parallel rank's share
        self.hq, self.hk = int(cfg.num_attention_heads) // ranks, int(cfg.num_key_value_heads) // ranks
        self.dh = int(getattr(a, "head_dim", 0) or cfg.hidden_size // cfg.num_attention_heads)
        self.scaling = float(getattr(a, "scaling", self.dh ** -0.5))
        self.device = local_shard(self.head.weight)[0].device
        # a tensor-parallel rank's own linear layers over its shards: id(module) -> (weight, bias, combine)
        self.shards: dict[int, tuple[torch.Tensor, torch.Tensor | None, str]] = {}
        self._vocab_split: tuple[torch.Tensor, int] | None = None
        # a group's sums and gathers (cloud/runners/tensor_parallel.py: `ordered_sum`, `gather_columns`)
        self.tp = collectives
        if ranks > 1:
            self._shard(ranks)
        self.tile = tile
        # a tiled forward's linear layers run one call per tile (one kernel shape: a GPU's default), or one call of
        # whole tiles (what the CPU's start-up measurement may choose: shared/invariant_calibration.py)
        self.calls = True
        # eager forwards attend through shared/invariant.py's chunked calls: a CPU's batch-invariant attention (SDPA's
        # sums there change with the query count); `_chunks` holds the current forward's calls per window
        self.chunked = False
        self._chunks: dict[int | None, list[Any]] | None = None
        # attention by the Triton kernel over block tables (paged_kernel.py) instead of SDPA over gathered keys
        self.kernel = kernel
        self.block = 0  # the pool's block size, set by each forward (the kernel reads block tables)
        if kernel:
            from cloud.runners.paged_kernel import attend

            self._attend = attend
        # the residual add + RMSNorm and SiLU x up as Triton kernels (cloud/runners/fused_kernels.py)
        self.fused_ops: Any = None
        if fused:
            from cloud.runners import fused_kernels

            self.fused_ops = fused_kernels
        self.silu = getattr(cfg, "hidden_act", "") == "silu"
        # RoPE's cos and sin for every position, computed once by the model's own rotary module ([max_pos, D])
        n_pos = int(getattr(cfg, "max_position_embeddings", 0) or 4096)
        pos = torch.arange(n_pos, device=self.device)[None]
        dummy = torch.zeros(1, dtype=self.head.weight.dtype, device=self.device)
        with torch.inference_mode():
            cos, sin = inner.rotary_emb(dummy, pos)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [max_pos, D]
        self.max_positions = n_pos
        # the RoPE kernel takes half a head in one power-of-two block, the whole head rotated
        half = self.dh // 2
        self.fused_rope = fused and half > 0 and half & (half - 1) == 0 and self.cos.shape[-1] == self.dh
        # q/k/v and gate/up of each layer as one weight: the modules' weights become views of it (no second copy)
        self.fused: dict[int, Any] = {}
        self.qkv_sizes = [self.hq * self.dh, self.hk * self.dh, self.hk * self.dh]
        for layer in self.layers if ranks == 1 else ():  # shards stay apart (fused copies would double them)
            a, m = layer.self_attn, layer.mlp
            for mod, parts in ((a, (a.q_proj, a.k_proj, a.v_proj)), (m, (m.gate_proj, m.up_proj))):
                f = _fuse(parts)
                if f is not None:
                    self.fused[id(mod)] = f

    def _shard(self, ranks: int) -> None:
        """A tensor-parallel rank's layers (transformers' tensor plan placed the shards): q/k/v and gate/up split by
        output (heads, MLP columns: the local product is this rank's part), o and down split by input (the ranks'
        partial products summed in rank order, `ordered_sum`), the output layer split by vocabulary (gathered), the
        embedding split by vocabulary (each id's row on one rank; the others add exact zeros) or replicated."""
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            for lin, dim in ((a.q_proj, 0), (a.k_proj, 0), (a.v_proj, 0), (a.o_proj, 1), (m.gate_proj, 0),
                             (m.up_proj, 0), (m.down_proj, 1), (self.head, 0)):
                w, place = local_shard(lin.weight)
                split = _split_dim(place)
                if split != dim and not (lin is self.head and split is None):  # a replicated output layer is whole
                    raise ValueError(f"{type(lin).__name__} weight placed {place}: not the tensor-parallel split "
                                     "this forward combines")
                bias = None if lin.bias is None else local_shard(lin.bias)[0]
                self.shards[id(lin)] = (w, bias, "sum" if dim == 1 else "gather" if split is not None and
                                        lin is self.head else "")
        w, place = local_shard(self.inner.embed_tokens.weight)
        split = _split_dim(place)
        if split == 0:
            size = -(-int(self.inner.embed_tokens.weight.shape[0]) // ranks)  # DTensor's even chunks
            self._vocab_split = (w, _rank() * size)
        elif split is not None:
            raise ValueError(f"the embedding placed {place}: not a tensor-parallel split this forward combines")
        vocab = int(self.head.weight.shape[0])
        size = -(-vocab // ranks)
        self._head_sizes = [max(0, min(size, vocab - r * size)) for r in range(ranks)]

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self._vocab_split is None:
            return self.inner.embed_tokens(ids)  # type: ignore[no-any-return]
        w, lo = self._vocab_split
        local = ids - lo
        mine = (local >= 0) & (local < w.shape[0])
        rows = F.embedding(local.clamp(0, w.shape[0] - 1), w)  # [T, d]
        return self.tp.ordered_sum(  # type: ignore[no-any-return]
            torch.where(mine[:, None], rows, rows.new_zeros(())))

    # --- the tensor work (graph-capturable: no host syncs, static shapes) --------------------------------------
    def _rows(self, x: torch.Tensor, f: Any) -> torch.Tensor:
        """f over the rows of x ([n, in] -> [n, out]); with a tile, in whole tiles of `tile` rows (one call per
        tile, or with `calls` off one call of them all)."""
        t, n = self.tile, x.shape[0]
        if not t or n in (0, t):
            return f(x)  # type: ignore[no-any-return]
        pad = -n % t  # 0 for the forward's tokens (padded to whole tiles by `inputs`); the kept rows may need it
        if pad:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        if not self.calls:
            return f(x)[:n]  # type: ignore[no-any-return]
        return torch.cat([f(x[i: i + t]) for i in range(0, n + pad, t)])[:n]

    def _linear(self, x: torch.Tensor, lin: torch.nn.Module) -> torch.Tensor:
        """`lin` over the rows of x, tiled (`_rows`); a tensor-parallel rank's shard, combined over the ranks."""
        own = self.shards.get(id(lin))
        if own is None:
            return self._rows(x, getattr(lin, "_untiled_forward", lin))  # the plain (or packed) forward
        w, bias, combine = own
        if combine == "sum":  # partial products over this rank's input slice; the bias once, after the sum
            y = self.tp.ordered_sum(self._rows(x, lambda t: F.linear(t, w)))
            return y if bias is None else y + bias
        y = self._rows(x, lambda t: F.linear(t, w, bias))
        return self.tp.gather_columns(y, self._head_sizes) if combine == "gather" else y

    def _attention(self, layer: Any, h: torch.Tensor, inp: Inputs, keys: torch.Tensor, values: torch.Tensor,
                   window: int | None) -> torch.Tensor:
        a = layer.self_attn
        T = h.shape[0]
        fused = self.fused.get(id(a))
        if fused is not None:  # one GEMM for q, k and v
            q, k, v = self._rows(h, fused).split(self.qkv_sizes, dim=-1)  # [T, Hq x D], [T, Hk x D] x 2
            q, k, v = q.view(T, self.hq, self.dh), k.view(T, self.hk, self.dh), v.view(T, self.hk, self.dh)
        else:
            q = self._linear(h, a.q_proj).view(T, self.hq, self.dh)  # [T, Hq, D]
            k = self._linear(h, a.k_proj).view(T, self.hk, self.dh)  # [T, Hk, D]
            v = self._linear(h, a.v_proj).view(T, self.hk, self.dh)
        if hasattr(a, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
            q, k = a.q_norm(q), a.k_norm(k)
        if self.fused_rope:
            q = self.fused_ops.rope(q, self.cos, self.sin, inp.positions)
            k = self.fused_ops.rope(k, self.cos, self.sin, inp.positions)
        else:
            cos, sin = self.cos[inp.positions][:, None], self.sin[inp.positions][:, None]  # [T, 1, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        keys.index_copy_(1, inp.write, k.transpose(0, 1).to(keys.dtype))  # pool [Hk, rows, D]
        values.index_copy_(1, inp.write, v.transpose(0, 1).to(values.dtype))
        if self._chunks is not None:  # the chunked calls of the pool's invariant attention (eager only)
            o = h.new_zeros(T, self.hq, self.dh)  # [T, Hq, D]: padded tokens keep zeros
            q_all = q.transpose(0, 1)  # [Hq, T, D]
            for call in self._chunks[window]:
                (attend_tree if isinstance(call, TreeCall) else attend_chunks)(call, q_all, keys, values, o,
                                                                               self.scaling, None)
            return self._linear(o.reshape(T, self.hq * self.dh), a.o_proj)
        if inp.paged:  # each token over its row's blocks, in the pool (no gathered keys)
            tables, tok_row, lim, tree_n, anc = inp.paged
            o = self._attend(q, keys, values, tables, tok_row, lim, tree_n, anc, self.scaling, self.block,
                             window or 0)  # [T, Hq, D]
            return self._linear(o.reshape(T, self.hq * self.dh), a.o_proj)
        g = self.hq // self.hk
        out = h.new_zeros(T + 1, self.hq * self.dh)  # [T + 1, Hq x D]: the last row takes padded queries
        q = torch.cat([q, q.new_zeros(1, self.hq, self.dh)])  # [T + 1, Hq, D]
        for grp in inp.groups:
            R, N, W = grp.shape
            qg = q[grp.queries].view(R, N, self.hk, g, self.dh).permute(0, 2, 3, 1, 4).reshape(R, self.hk, g * N,
                                                                                                self.dh)
            kg = keys[:, grp.keys].view(self.hk, R, W, self.dh).transpose(0, 1)  # [R, Hk, W, D]
            vg = values[:, grp.keys].view(self.hk, R, W, self.dh).transpose(0, 1)
            m = grp.mask
            if window is not None:
                assert grp.distance is not None
                m = m & (grp.distance < window)
            m = m if g == 1 else m.repeat(1, 1, g, 1)  # [R, 1, g x N, W]
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=m, scale=self.scaling)  # [R, Hk, g x N, D]
            o = o.view(R, self.hk, g, N, self.dh).permute(0, 3, 1, 2, 4).reshape(R * N, self.hq * self.dh)
            out.index_copy_(0, grp.queries, o)
        return self._linear(out[:T], a.o_proj)

    def _mlp(self, layer: Any, h: torch.Tensor) -> torch.Tensor:
        m = layer.mlp
        fused = self.fused.get(id(m))
        if fused is not None:  # one GEMM for gate and up
            gate_up = self._rows(h, fused)  # [T, 2I]
            if self.fused_ops is not None and self.silu:
                return self._linear(self.fused_ops.silu_mul(gate_up), m.down_proj)
            gate, up = gate_up.chunk(2, dim=-1)  # [T, I] each
            return self._linear(m.act_fn(gate) * up, m.down_proj)
        return self._linear(m.act_fn(self._linear(h, m.gate_proj)) * self._linear(h, m.up_proj), m.down_proj)

    def run(self, inp: Inputs, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """The model over `inp` up to the output layer: the K/V written into the pool, the final hidden states of
        the kept tokens ([P, d]). The output layer runs outside (`logits`), on the real kept rows only."""
        h = self._embed(inp.ids)  # [T, d]: the residual stream
        x = self.layers[0].input_layernorm(h)
        for i, layer in enumerate(self.layers):
            h, x = self._add_norm(h, self._attention(layer, x, inp, keys[i], values[i], self.windows[i]),
                                  layer.post_attention_layernorm)
            if i + 1 < len(self.layers):
                h, x = self._add_norm(h, self._mlp(layer, x), self.layers[i + 1].input_layernorm)
            else:
                h = h + self._mlp(layer, x)
        return self.inner.norm(h[inp.logits_indices])  # type: ignore[no-any-return]  # [P, d]

    def _add_norm(self, h: torch.Tensor, a: torch.Tensor, norm: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream plus a layer's output, and the RMSNorm of it (one Triton kernel with `fused`)."""
        if self.fused_ops is not None:
            return self.fused_ops.add_rms_norm(a, h, norm.weight, norm.variance_epsilon)  # type: ignore[no-any-return]
        h = h + a
        return h, norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer over the kept rows' final hidden states ([P, d] -> [P, vocab])."""
        return self._linear(hidden, self.head)

def local_shard(p: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A parameter's local part and its placement (a DTensor's shard and first placement; else the tensor, None)."""
    to_local = getattr(p, "to_local", None)
    return (to_local(), p.placements[0]) if callable(to_local) else (p, None)  # type: ignore[attr-defined]


def _split_dim(place: Any) -> int | None:
    """The dimension a DTensor placement splits (None: replicated, or not a DTensor)."""
    return int(place.dim) if place is not None and place.is_shard() else None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _fuse(mods: Sequence[torch.nn.Module]) -> Any:
    """One linear over the rows of x for several plain Linears of the same input (their outputs side by side), or
    None where one is not a plain Linear (packed or replaced forwards keep theirs). The modules' weights and biases
    become views of the fused tensors."""
    lins: list[torch.nn.Linear] = []
    for m in mods:
        f = getattr(m, "_untiled_forward", None) or m.forward
        if not isinstance(m, torch.nn.Linear) or getattr(f, "__func__", None) is not torch.nn.Linear.forward:
            return None
        lins.append(m)
    sizes = [int(m.weight.shape[0]) for m in lins]
    weight = torch.cat([m.weight.detach() for m in lins])  # [sum of outs, in]
    bias = None
    if any(m.bias is not None for m in lins):
        bias = torch.cat([m.bias.detach() if m.bias is not None else weight.new_zeros(n)
                          for m, n in zip(lins, sizes, strict=True)])  # [sum of outs]
    for i, (m, w) in enumerate(zip(lins, weight.split(sizes), strict=True)):
        m.weight = torch.nn.Parameter(w, requires_grad=False)
        if m.bias is not None and bias is not None:
            m.bias = torch.nn.Parameter(bias[sum(sizes[:i]): sum(sizes[: i + 1])], requires_grad=False)
    return lambda x: F.linear(x, weight, bias)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)
