"""KV storage for Hugging Face attention models: many sequences, crop by length, batched forwards.

Both roles use it: the cloud keeps every session in one pool and runs the rounds of several
sessions as one forward; the edge's draft model is a pool of one sequence.

Layout. For every attention layer l, `K[l]` and `V[l]` are tensors [slots, kv_heads, capacity,
head_dim]. A sequence owns a slot and a length n: its KV are K[l][slot, :, :n]. Crop is setting n
(no copy); nothing past n is ever read as valid. Rows of one forward are (slot, c, ids): the
sequence's first c positions are cached and `ids` follow at positions c, c + 1, ... Inputs are
right-padded to [B, N] (N = the longest row); row b's token t has position c_b + t (RoPE and
absolute embeddings get per-row `position_ids`), and its K/V are written in place at
K[l][slot_b, :, c_b + t]. Attention reads K[l][slots, :, :W] with W = max(c_b) + N under a mask
built here: key j is visible to the query at position i iff j <= i, and i - j < window on sliding
layers. Padded queries write past their row's length: garbage that the row's real queries never
see (it lies after them) and that the next forward overwrites.

Memory traffic per forward: the new K/V are written once (B x N positions per layer). When the
batch's slots are one contiguous range attention reads the pool in place (a view); otherwise the
batch's K/V are gathered once per layer (a copy of B x W positions), so a scheduler that keeps
busy sessions in low, adjacent slots avoids the copy. Growing the capacity or the slot count
copies the pool once (doubling).

Memory: slots x capacity x bytes per position, capacity = the longest sequence (rounded up).
Sliding-window layers keep the whole history and mask it to the window, so rollback is a crop on
every layer, at the memory cost of full attention on those layers. Models whose layers keep
recurrent or convolution state (Mamba, Jamba, LFM2, Falcon-H1, Qwen3-Next) cannot be rolled back
by position and are refused by `attention_layout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import Cache

FULL, SLIDING = "full_attention", "sliding_attention"


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
    # the sequence's slot in the pool
    slot: int
    # positions already cached (the row's first token sits at position `past`)
    past: int
    # token ids to run after them
    ids: list[int]
    # logits wanted for the last `keep` ids (0: none, e.g. a prefill)
    keep: int


class KVPool:
    """The KV of many sequences of one model (see the module docstring)."""

    def __init__(self, layout: AttentionLayout, max_positions: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        self.layout = layout
        # position ids past this are clamped (padded queries only; real rows are checked by callers)
        self.max_positions = max_positions
        self.device, self.dtype = torch.device(device), dtype
        self.keys: list[torch.Tensor | None] = [None] * len(layout.windows)  # per layer [slots, H, cap, D]
        self.values: list[torch.Tensor | None] = [None] * len(layout.windows)
        self.lengths: list[int] = []  # per slot; -1 = free
        # slots and positions the tensors hold (they grow by doubling)
        self.n_slots, self.capacity = 0, 0
        # bytes one position of one sequence takes over all layers (known after the first forward)
        self.bytes_per_position = 0

    # --- slots ------------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A free slot (the lowest, which keeps busy sequences adjacent), length 0."""
        for i, n in enumerate(self.lengths):
            if n < 0:
                self.lengths[i] = 0
                return i
        self.lengths.append(0)
        return len(self.lengths) - 1

    def release(self, slot: int) -> None:
        self.lengths[slot] = -1

    def length(self, slot: int) -> int:
        return self.lengths[slot]

    def crop(self, slot: int, n: int) -> None:
        """Keep the KV of the first n positions of `slot` (no-op when it holds fewer)."""
        if n < self.lengths[slot]:
            self.lengths[slot] = n

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)

    def _grow(self, slots: int, capacity: int) -> None:
        """Make every layer's tensors hold at least `slots` x `capacity` (doubling; copies what exists)."""
        if slots <= self.n_slots and capacity <= self.capacity:
            return
        new_slots = max(slots, 2 * self.n_slots) if slots > self.n_slots else self.n_slots
        new_cap = max(capacity, 2 * self.capacity, 16) if capacity > self.capacity else self.capacity
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is None:
                    continue
                grown = t.new_zeros(new_slots, t.shape[1], new_cap, t.shape[3])  # [slots, H, cap, D]
                grown[: t.shape[0], :, : t.shape[2]] = t
                store[i] = grown
        self.n_slots, self.capacity = new_slots, new_cap

    # --- the forward ------------------------------------------------------------------------------
    def forward(self, model: torch.nn.Module, rows: list[Row]) -> list[torch.Tensor]:
        """Run every row in one forward; returns each row's logits for its last `keep` ids ([keep, vocab],
        float32). Lengths are NOT changed: the caller sets them (crop/extend) once the answer is used."""
        if not rows:
            return []
        n = max(len(r.ids) for r in rows)
        width = max(r.past for r in rows) + n
        self._grow(len(self.lengths), width)
        B = len(rows)
        ids = torch.zeros(B, n, dtype=torch.long)  # [B, N] right-padded
        past = torch.tensor([r.past for r in rows], dtype=torch.long)  # [B]
        for b, r in enumerate(rows):
            ids[b, : len(r.ids)] = torch.tensor(r.ids, dtype=torch.long)
        pos = past[:, None] + torch.arange(n)[None, :]  # [B, N] positions of every input
        slots = torch.tensor([r.slot for r in rows], dtype=torch.long)  # [B]
        lo = int(slots.min())
        contiguous = bool((slots == torch.arange(lo, lo + B)).all())
        view = _PoolView(self, slots.to(self.device), pos.to(self.device), width,
                         slice(lo, lo + B) if contiguous else None)
        # logits are computed only at the positions some row needs (a prefill row needs none)
        want = sorted({t for r in rows for t in range(len(r.ids) - r.keep, len(r.ids))})
        keep_idx = torch.tensor(want or [n - 1], dtype=torch.long, device=self.device)  # [P]
        out = model(input_ids=ids.to(self.device), position_ids=pos.clamp(max=self.max_positions - 1).to(self.device),
                    attention_mask=self._masks(pos, width), past_key_values=view, use_cache=True,
                    logits_to_keep=keep_idx)
        logits = out.logits  # [B, P, vocab]
        where = {t: i for i, t in enumerate(want)}
        result = []
        for b, r in enumerate(rows):
            cols = [where[t] for t in range(len(r.ids) - r.keep, len(r.ids))]
            result.append(logits[b, cols].float())  # [keep, vocab]
        return result

    def _masks(self, pos: torch.Tensor, width: int) -> torch.Tensor | dict[str, torch.Tensor]:
        """Additive masks [B, 1, N, W] (0 = visible, dtype min = hidden), one per kind of layer."""
        j = torch.arange(width)[None, None, :]  # [1, 1, W]
        i = pos[:, :, None]  # [B, N, 1]
        lowest = torch.finfo(self.dtype).min

        def mask(window: int | None) -> torch.Tensor:
            seen = j <= i  # [B, N, W]
            if window is not None:
                seen &= (i - j) < window
            m = torch.zeros(seen.shape, dtype=self.dtype).masked_fill_(~seen, lowest)
            return m[:, None].to(self.device)  # [B, 1, N, W]

        if not self.layout.by_type:
            return mask(self.layout.windows[0])
        full = [w for w in self.layout.windows if w is None]
        sliding = [w for w in self.layout.windows if w is not None]
        out = {}
        if full:
            out[FULL] = mask(None)
        if sliding:
            out[SLIDING] = mask(sliding[0])
        return out


class _PoolView(Cache):
    """What the model sees as `past_key_values` during one `KVPool.forward`."""

    def __init__(self, pool: KVPool, slots: torch.Tensor, pos: torch.Tensor, width: int,
                 span: slice | None) -> None:
        super().__init__(layers=[])
        self.pool, self.slots, self.pos, self.width, self.span = pool, slots, pos, width, span

    @property
    def is_sliding(self) -> list[bool]:
        return [w is not None for w in self.pool.layout.windows]

    def __len__(self) -> int:
        return len(self.pool.layout.windows)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.pos[:, 0].max())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V ([B, H, N, D]) at each row's positions; return the K/V attention reads."""
        pool = self.pool
        if pool.keys[layer_idx] is None:  # first forward: the layer's shapes are known now
            shape = (pool.n_slots, key_states.shape[1], pool.capacity, key_states.shape[3])
            pool.keys[layer_idx] = key_states.new_zeros(shape)
            pool.values[layer_idx] = value_states.new_zeros(shape[:3] + (value_states.shape[3],))
            pool.bytes_per_position = sum(
                (k.shape[1] * k.shape[3] + v.shape[1] * v.shape[3]) * k.element_size()
                for k, v in zip(pool.keys, pool.values, strict=True) if k is not None and v is not None)
        k_all, v_all = pool.keys[layer_idx], pool.values[layer_idx]
        assert k_all is not None and v_all is not None
        # advanced indices on dims 0 and 2 around a slice: the indexed view is [B, N, H, D]
        k_all[self.slots[:, None], :, self.pos] = key_states.transpose(1, 2).to(k_all.dtype)
        v_all[self.slots[:, None], :, self.pos] = value_states.transpose(1, 2).to(v_all.dtype)
        if self.span is not None:
            return k_all[self.span, :, : self.width], v_all[self.span, :, : self.width]  # views [B, H, W, D]
        return (k_all[:, :, : self.width].index_select(0, self.slots),
                v_all[:, :, : self.width].index_select(0, self.slots))  # copies [B, H, W, D]
