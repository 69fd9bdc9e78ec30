"""Which layers of a Hugging Face model attend how, and the names its forward takes its cache by.

`attention_layout` reads a config: full attention, or a sliding window, per layer; models whose layers keep
recurrent or convolution state (Mamba, Jamba, LFM2, Falcon-H1, Qwen3-Next) cannot be rolled back by
position and are refused (`UnsupportedModel`, one line for the user).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

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
