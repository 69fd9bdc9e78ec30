"""Drafters behind one interface: a small causal LM (sampled), an n-gram model (deterministic), both."""

from .base import DraftBlock, Drafter
from .hybrid import HybridDrafter
from .model import ModelDrafter
from .ngram import NGramDrafter, NGramStorage

__all__ = ["DraftBlock", "Drafter", "HybridDrafter", "ModelDrafter", "NGramDrafter", "NGramStorage"]
