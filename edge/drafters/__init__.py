"""Drafters behind one interface: a small causal LM (sampled) and an n-gram model (deterministic)."""

from .base import DraftBlock, Drafter
from .model import ModelDrafter
from .ngram import NGramDrafter, NGramStorage

__all__ = ["DraftBlock", "Drafter", "ModelDrafter", "NGramDrafter", "NGramStorage"]
