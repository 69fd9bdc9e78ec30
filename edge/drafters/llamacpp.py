"""The draft on llama.cpp: a GGUF file as shipped (quantized), the way devices run small models.

Everything the PyTorch drafter does, by the same code (edge/drafters/model.py `CausalDrafter`): the KV cache
is kept across rounds and cropped to the common prefix with the committed text (sequence 0 of one llama.cpp
context holds it), q of each drafted token is processed from the draft's own logits by shared/sampling.py, and
trees grow level by level through the same `grow_tree`, each level one llama.cpp batch. A tree node gets its
own sequence id that shares its parent's cells (the context and the path above it: `seq_cp` adds an id to
cells, it copies nothing), so it attends to the context and its own path only; the tree's ids are dropped
afterwards. Exactness does not rest on llama.cpp's numerics: the cloud reads q as sent.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from shared.attention_layout import UnsupportedModel
from shared.llama_invariance import invariant_ubatch
from shared.llama_runtime import GGUFContext, GGUFModel, Token, find_gguf, unavailable
from shared.tokenizer_id import directory_fingerprint

from .causal import CausalDrafter

log = logging.getLogger(__name__)

# KV cells of a drafter's context: the longest prompt + text it drafts after (a 0.5B model's float16 KV of
# 8,192 positions takes ~100 MB; the model's own trained context may be 32k)
DEFAULT_CONTEXT = 8192
# rows of logits one batch returns at most: a tree level's frontier (--tree-width, at most 16) or a chain's one; the
# buffer is this many rows of the vocabulary (512 rows of Qwen2.5's 151,936 would take 311 MB). llama.cpp wants it
# at least the context's sequence count
MAX_OUTPUTS = 128
# sequence ids of one context: the text (0) and one per tree node grown in a round (a tree of the edge's
# largest shape expands at most width x (depth - 1) nodes)
MAX_SEQS = MAX_OUTPUTS


def default_threads() -> int:
    """Half the cores, at least one and at most four: the device's other work keeps the rest."""
    import os

    return max(1, min(4, (os.cpu_count() or 2) // 2))


class LlamaCppDrafter(CausalDrafter):
    """A GGUF draft model run by llama.cpp; `path` is the .gguf file or a directory that holds one."""

    # the KV cache: sequence 0 the text, one sequence per tree node grown in a round
    _ctx: GGUFContext

    def __init__(self, path: str | Path, threads: int | None = None, context: int = DEFAULT_CONTEXT) -> None:
        why = unavailable()
        if why is not None:
            raise UnsupportedModel(why)
        gguf = find_gguf(path)
        if gguf is None:
            raise UnsupportedModel(f"no GGUF file at {path}: pass a .gguf file or a directory with model.gguf")
        self.path = gguf
        self.gguf = GGUFModel(gguf, repack=False)  # repacked weights split a batch's rows between two kernels
        self.threads = threads or default_threads()
        # micro-batches of the size whose kernels give every token its one-token bits (shared/llama_invariance.py):
        # q then does not depend on how tokens were fed (a k schedule, drafting ahead, a catch-up)
        self.ubatch = invariant_ubatch(self.gguf, self.threads, most=12)
        self.n_ctx = min(context, self.gguf.n_ctx_train or context)
        self.max_context: int | None = self.n_ctx
        # the ids the draft has logits for, and the ids q is taken over (the target's tokenizer_size once paired)
        self.logit_rows = self.vocab_size = self.gguf.n_vocab
        # fingerprint of the tokenizer stored beside the GGUF (a prepared model directory holds both)
        self.tokenizer_fingerprint = directory_fingerprint(gguf.parent)
        self.dtype = "gguf"
        self.reset()

    def reset(self) -> None:
        """An empty cache: the context this drafter holds, cleared (a reused one is not allocated again)."""
        if "_ctx" in self.__dict__:
            self._ctx.clear()
        else:
            self._ctx = GGUFContext(self.gguf, self.n_ctx, MAX_SEQS, self.threads, n_batch=256,
                                    n_outputs=MAX_OUTPUTS, n_ubatch=self.ubatch)
        self._ids: list[int] = []

    def fork(self) -> LlamaCppDrafter:
        """A drafter sharing this one's weights with its own context (one per concurrent generation)."""
        twin = object.__new__(LlamaCppDrafter)
        twin.__dict__.update((k, v) for k, v in self.__dict__.items() if k != "_ctx")  # a context of its own
        twin.reset()
        return twin

    @torch.no_grad()
    def _feed(self, tokens: Sequence[int]) -> torch.Tensor:
        start = len(self._ids)
        if start + len(tokens) > self.n_ctx:
            raise UnsupportedModel(f"the draft's context holds {self.n_ctx} positions; "
                                   f"{start + len(tokens)} were asked")
        batch = [Token(int(t), start + i, (0,), i == len(tokens) - 1) for i, t in enumerate(tokens)]
        try:
            (logits,) = self._ctx.decode(batch)  # [vocab]
        except BaseException:
            # a decode that failed after its first chunk keeps that chunk's cells: crop back to what _ids records
            self._ctx.seq_rm(0, start, -1)
            raise
        self._ids.extend(int(t) for t in tokens)
        return logits[: self.vocab_size]

    def _crop(self, n: int) -> None:
        self._ctx.seq_rm(0, n, -1)

    def _tree_level(self, base: int, tree: list[int], tokens: list[int]) -> torch.Tensor:
        if 1 + len(tree) > MAX_SEQS:
            raise UnsupportedModel(f"a tree of {len(tree)} grown nodes needs more than the draft's {MAX_SEQS} "
                                   "sequences: grow a smaller tree (--tree-nodes / --tree-width)")
        new = range(len(tree) - len(tokens), len(tree))
        batch = []
        for o, tok in zip(new, tokens, strict=True):
            parent = tree[o]
            depth = 0
            at = parent
            while at >= 0:
                depth += 1
                at = tree[at]
            self._ctx.seq_cp(0 if parent < 0 else 1 + parent, 1 + o)  # the context and the path above it
            batch.append(Token(int(tok), base + depth, (1 + o,), True))
        return self._ctx.decode(batch)[:, : self.vocab_size]  # [w, vocab]

    def _drop_tree(self, base: int) -> None:
        for s in range(1, MAX_SEQS):
            if self._ctx.seq_len(s) == 0:
                break
            self._ctx.seq_rm(s)
