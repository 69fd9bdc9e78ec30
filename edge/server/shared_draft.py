"""One draft model and one tokenizer shared by concurrent generations of the OpenAI server.

Scheduling of concurrent drafting: the draft model's weights are loaded once; each generation
gets its own drafter state (`ModelDrafter.fork()`: its own KV cache and token list, the same
weights) and its own n-gram counts. One lock serialises the draft model's forward passes: a
generation holds it only while proposing a block, never while it waits for the cloud, so one
generation drafts while the others' blocks are being verified, and blocks are drafted first come,
first served. On a device with a few cores, forwards one at a time are as fast as several at once
and keep each forward's latency short. The tokenizer is likewise used under a lock of its own.

A generation's draft state (its fork: with llama.cpp a context of its own) goes back to a pool when the
generation ends (`LockedDrafter.release`) and the next generation resets and reuses it, so the states that exist are never
more than the generations that ran at once, which the engine bounds (--max-generations, openai_engine.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shared.config import SamplingConfig
from shared.tokenizer_id import tokenizer_fingerprint
from shared.verify import DraftKind

from ..drafters.base import DraftBlock, Drafter
from ..settings import EdgeSettings, load_draft_model

if TYPE_CHECKING:
    from ..drafters.causal import CausalDrafter


class LockedDrafter:
    """A generation's own drafter whose proposals take the shared model's lock; counts the wait."""

    def __init__(self, inner: Drafter, lock: threading.Lock, clock: Callable[[], float] = time.perf_counter,
                 release: Callable[[], None] | None = None) -> None:
        self.inner = inner
        # gives the draft model's fork this generation holds back to the pool (`release`)
        self._release = release
        self.lock = lock
        self.clock = clock
        self.kind: DraftKind = inner.kind
        self.wants_top_k = inner.wants_top_k
        self.max_context = inner.max_context
        # seconds this generation waited for the draft model while others drafted
        self.wait_s = 0.0

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.inner, "vocab_size", None)

    @vocab_size.setter
    def vocab_size(self, value: int | None) -> None:
        self.inner.vocab_size = value  # type: ignore[attr-defined]

    def reset(self) -> None:
        self.inner.reset()  # the generation's own state: no lock

    def propose(self, context: Sequence[int], k: int, cfg: SamplingConfig, seed: int) -> DraftBlock:
        t0 = self.clock()
        with self.lock:
            self.wait_s += self.clock() - t0
            return self.inner.propose(context, k, cfg, seed)

    def observe(self, context: Sequence[int], draft: Sequence[int], top_k_ids: Sequence[Sequence[int]]) -> None:
        self.inner.observe(context, draft, top_k_ids)

    def release(self) -> None:
        """The generation ended: its model state goes back to the pool (once); this drafter drafts no more."""
        release, self._release = self._release, None
        if release is not None:
            release()


class SharedDraftModel:
    """Builds a drafter per generation from EdgeSettings, over weights loaded once."""

    def __init__(self, settings: EdgeSettings) -> None:

        self.settings = settings
        self.lock = threading.Lock()
        self.model: CausalDrafter | None = None
        if settings.draft != "ngram":
            self.model = load_draft_model(settings)
        # forks of finished generations, reset and reused by the next (`give_back`)
        self._idle: list[CausalDrafter] = []
        self._idle_lock = threading.Lock()

    def for_generation(self) -> Drafter:
        """A fresh drafter for one generation (the n-gram drafter needs no lock: it holds no model)."""
        from ..drafters import HybridDrafter, NGramDrafter

        s = self.settings
        ngram = NGramDrafter(order=s.ngram_order, filler_top_k=s.filler_top_k)
        if self.model is None:
            return ngram
        with self._idle_lock:
            model = self._idle.pop() if self._idle else None
        if model is None:
            model = self.model.fork()
        else:
            model.reset()
        drafter: Drafter = HybridDrafter(model, ngram, s.hybrid_min_level) if s.hybrid else model
        return LockedDrafter(drafter, self.lock, release=lambda: self._give_back(model))

    def _give_back(self, model: CausalDrafter) -> None:
        with self._idle_lock:
            self._idle.append(model)


class LockedTokenizer:
    """The parts of a Hugging Face tokenizer the edge uses, one call at a time."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.lock = threading.Lock()
        self.eos_token_id = tokenizer.eos_token_id
        # computed once: every request's pairing check compares it with the cloud's
        self.fingerprint = tokenizer_fingerprint(tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self.lock:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        with self.lock:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))
