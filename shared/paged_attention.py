"""The attention of one paged forward: transformers' attention interface, pointed at the pool.

The model's attention layers write their new K/V through the plan's seq_id mapping into the pool
(`PagedView.update`), then call `paged_attention` (registered with transformers' AttentionInterface and
selected only for the duration of the forward): per call of the plan it gathers the rows' own keys from
their blocks and runs scaled dot-product attention of their queries over them under the plan's masks.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol

import torch
from transformers import AttentionInterface, Cache

from shared.attention_layout import AttentionLayout
from shared.invariant import InvariantCall, TreeCall, attend, attend_tree
from shared.paged_plan import Batch, SingleCall


class KVStore(Protocol):
    """What attention reads of a KV pool (shared/kvpool.py): each layer's K and V, and its window kind."""
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    layout: AttentionLayout

ATTENTION_NAME = "specsplit_paged"


class PagedView(Cache):
    """What the model sees as `past_key_values` during one `KVPool.forward`: writes go to the pool."""

    def __init__(self, pool: KVStore, batch: Batch) -> None:
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


class use_paged_attention:  # noqa: N801 - a context manager used as a function
    """Select `paged_attention` for `model` during one forward, with `pool` and `batch` as its input;
    holds the model's lock (`exclusive`) meanwhile."""

    def __init__(self, model: torch.nn.Module, pool: KVStore, batch: Batch) -> None:
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
    batch: Batch = _active.batch
    pool: KVStore = _active.pool
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
        if isinstance(call, SingleCall):
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
