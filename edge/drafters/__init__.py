"""Drafters behind one interface: a small causal LM (sampled), an n-gram model (deterministic), both.

Each name is imported on first use, so that an edge whose draft runs on llama.cpp, the n-gram drafter or no
draft at all never imports the PyTorch draft's model code (edge/drafters/causal.py says why).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import DraftBlock, Drafter
    from .causal import CausalDrafter
    from .hybrid import HybridDrafter
    from .model import ModelDrafter
    from .ngram import NGramDrafter, NGramStorage

_WHERE = {"DraftBlock": "base", "Drafter": "base", "CausalDrafter": "causal", "HybridDrafter": "hybrid",
          "ModelDrafter": "model", "NGramDrafter": "ngram", "NGramStorage": "ngram"}
__all__ = ["CausalDrafter", "DraftBlock", "Drafter", "HybridDrafter", "ModelDrafter", "NGramDrafter", "NGramStorage"]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
