"""Drafters behind one interface: a small causal LM (sampled), an n-gram model (deterministic), both."""

from .base import DraftBlock, Drafter
from .hybrid import HybridDrafter
from .model import CausalDrafter, ModelDrafter
from .ngram import NGramDrafter, NGramStorage

__all__ = ["CausalDrafter", "DraftBlock", "Drafter", "HybridDrafter", "ModelDrafter", "NGramDrafter", "NGramStorage"]
