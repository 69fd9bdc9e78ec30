"""A new sequence's prefill in chunks (through the prefix cache), and the target-only decode step of /v1/generate
and of a session's stream: the same draw as a verify round's k = 0 bonus, at the same (seed, position) uniform."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shared.config import SamplingConfig
from shared.rng import SAMPLE, position_uniform
from shared.rows import Row
from shared.sampling import processed_probs
from shared.target_probs import TargetProbs

if TYPE_CHECKING:  # the PyTorch pool: a llama.cpp cloud never imports it
    from shared.blocks import PagedSequences


@dataclass
class Prefill:
    """A new sequence's KV, fed in chunks; its sequence is allocated on first use, and every full
    block of its prefix that the prefix cache holds (under the same salt) is reused, not recomputed."""
    # the tokens whose KV is wanted (a session's S[:-1]: its last token is fed by the first round)
    ids: list[int]
    # the longest chunk when the caller gives no budget
    chunk: int = 1024
    # prefix-cache salt: sequences share blocks only under equal salts
    salt: bytes = b""
    seq_id: int | None = None
    # positions done
    done: int = 0
    # positions taken from the prefix cache
    reused: int = 0
    # the states of the last `keep_last` positions are wanted (a session's first feature, or its first states):
    # at least those are computed, and every chunk keeps the ones it holds (0: none)
    keep_last: int = 0

    def plan(self, pool: PagedSequences, budget: int | None = None) -> Row | None:
        """The next chunk (at most `budget` tokens, default `chunk`), or None when the whole prefill is cached."""
        budget = self.chunk if budget is None else budget
        if self.seq_id is None:
            self.seq_id = pool.allocate(self.salt)
            limit = len(self.ids) - min(self.keep_last, len(self.ids))
            self.done = self.reused = pool.match_prefix(self.seq_id, self.ids, limit)
        if self.done >= len(self.ids):
            return None
        chunk = self.ids[self.done: self.done + max(budget, 1)]
        keep = max(0, min(len(chunk), self.done + len(chunk) - (len(self.ids) - self.keep_last)))
        return Row(self.seq_id, self.done, chunk, num_logits=keep if self.keep_last else 0)

    def unplan(self, pool: PagedSequences) -> None:
        """Give the prefix-cache blocks back while nothing of this prefill has run (it plans again later)."""
        if self.seq_id is not None and self.done == self.reused:
            pool.release(self.seq_id)
            self.seq_id, self.done, self.reused = None, 0, 0

    def advance(self, pool: PagedSequences, row: Row | None = None) -> bool:
        """After a forward of `row` (default: a chunk of `chunk` tokens): the chunk is cached; True when
        the whole prefill is."""
        assert self.seq_id is not None
        self.done = min(len(self.ids), self.done + self.chunk) if row is None else row.num_cached_tokens + len(row.ids)
        pool.set_length(self.seq_id, self.done)
        return self.done >= len(self.ids)


def next_token(p: torch.Tensor | TargetProbs, cfg: SamplingConfig, seed: int, position: int) -> int:
    """Target-only draw at `position` from processed p (its row 0): the same rule as a k = 0 bonus."""
    probs = TargetProbs.dense(p) if isinstance(p, torch.Tensor) else p
    if cfg.greedy:
        return probs.argmax(0)
    return probs.draw(0, position_uniform(seed, position, SAMPLE))


@dataclass
class DecodeState:
    # prompt + generated so far
    ids: list[int]
    # the pool sequence of this generation's KV (None until the first step)
    seq_id: int | None = None
    # KV of ids[:kv_len]
    kv_len: int = 0
    # prefix-cache salt
    salt: bytes = b""
    # the sequence holds only what the prefix cache gave it (nothing computed yet)
    fresh: bool = False
    # positions the prefix cache gave at the allocation
    matched: int = 0

    def plan(self, pool: PagedSequences, chunk: int) -> Row:
        """Feed ids[kv_len:] (the last token at least); a long prompt in chunks, logits only at the end."""
        if self.seq_id is None:
            self.seq_id = pool.allocate(self.salt)
            self.kv_len = self.matched = pool.match_prefix(self.seq_id, self.ids, len(self.ids) - 1)
            self.fresh = True
        c = min(self.kv_len, len(self.ids) - 1)
        todo = self.ids[c:]
        if len(todo) > chunk:
            return Row(self.seq_id, c, todo[:max(chunk, 1)], num_logits=0)
        return Row(self.seq_id, c, todo, num_logits=1)

    def unplan(self, pool: PagedSequences) -> None:
        """Give the prefix-cache blocks back while nothing of this generation has run (it plans again later)."""
        if self.seq_id is not None and self.fresh:
            pool.release(self.seq_id)
            self.seq_id, self.kv_len, self.fresh = None, 0, False

    def give_back(self, pool: PagedSequences) -> None:
        """A prompt half prefilled gives its blocks back (its full blocks stay in the prefix cache, so the
        next plan resumes from there)."""
        if self.seq_id is not None:
            pool.release(self.seq_id)
            self.seq_id, self.kv_len, self.matched, self.fresh = None, 0, 0, False

    def step(self, pool: PagedSequences, row: Row, logits: torch.Tensor, cfg: SamplingConfig, seed: int,
             p: TargetProbs | torch.Tensor | None = None) -> int | None:
        """After a forward: the token at position len(ids) + 1 (appended), or None after a prompt chunk.
        `p`: the logits' processed probabilities when the forward's rows were processed together."""
        assert self.seq_id is not None
        self.fresh = False
        self.kv_len = row.num_cached_tokens + len(row.ids)
        pool.set_length(self.seq_id, self.kv_len)
        if row.num_logits == 0:
            return None
        if p is None:
            p = processed_probs(logits, cfg, self.ids)  # [1, vocab]
        tok = next_token(p, cfg, seed, len(self.ids) + 1)
        self.ids.append(tok)
        return tok
