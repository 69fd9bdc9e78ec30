"""Requests the target writes itself (Magpie, arXiv 2406.08464).

Given its chat template up to the start of the user's turn, an instruction model writes a plausible
user request; sampled many times at T = 1 it gives a wide spread of requests in its own distribution,
with no data set to download. Each kind below starts the user's turn with one of a few short openers
(the empty opener is plain Magpie) so that the spread covers questions, instructions, code, math word
problems, translation, summarising a given passage and answering from one; the target writes the rest.

Kept: requests that ended by themselves (the target closed its turn), of 4 to `max_words` words, with
no template tokens, not degenerate (a word 3-gram repeated 3 times), sharing no 8-gram with an
evaluation text (`heldout`), and not a near-duplicate of a request already kept (Jaccard similarity of
word 4-grams >= 0.5 against any earlier one sharing a 4-gram).

Beside them, `fixed_requests` shards a given prompt list (the product's templated prompts, the ones the
feature-fed head was trained on) from shard `FIXED_FIRST` on, so the two sources never share an index.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from research.drafting.heldout import HeldOut, ngrams
from research.drafting.target import Sampling, sample_batch, user_turn_prefix
from shared.config import SamplingConfig

# kind -> openers of the user's turn; the target continues each
KINDS: dict[str, list[str]] = {
    "open": [""],
    "question": ["What", "How", "Why", "Can you explain", "Is it true that", "Which", "Who", "When"],
    "instruction": ["Write", "Give me", "Create", "List", "Describe", "Help me", "I need", "Suggest", "Plan"],
    "code": ["Write a Python function", "How do I", "Fix this code:\n", "Explain what this code does:\n",
             "Write a JavaScript", "Write a SQL query", "Write a program"],
    "math": ["Solve", "A farmer", "If a car", "Calculate", "Maria has", "A recipe", "A class of", "Tom buys"],
    "translation": ["Translate into English:", "Translate this sentence into French:",
                    "Translate the following from Spanish to English:", "Translate to German:",
                    "What does this mean in English:"],
    "summary": ["Summarize the following passage:\n\n", "Summarize this article in a few sentences:\n\n",
                "Give a short summary of this text:\n\n", "Summarize:"],
    "passage": ["Read the passage and answer the question.\n\n", "Based on the text below, answer the question.\n\n",
                "Context:", "Here is an article:\n\n"],
    "rewrite": ["Rewrite the following", "Make this paragraph", "Edit this email:", "Proofread"],
    "roleplay": ["Pretend you are", "Imagine you are", "You are a", "Act as"],
}
# longer requests for kinds that carry a passage
MAX_NEW = {"summary": 224, "passage": 224, "translation": 96}
_WORD = re.compile(r"[A-Za-z0-9']+")
# first shard index of the fixed (templated) requests; the target's own requests use 0..FIXED_FIRST - 1
FIXED_FIRST = 1000


@dataclass
class RequestFilter:
    # evaluation 8-grams no request may share
    held: HeldOut
    # most words a request may have
    max_words: int = 220
    # word 4-gram -> indices of kept requests containing it
    index: dict[tuple[str, ...], list[int]] = field(default_factory=dict)
    # each kept request's 4-gram set
    kept: list[set[tuple[str, ...]]] = field(default_factory=list)
    # why requests were dropped
    dropped: Counter[str] = field(default_factory=Counter)

    def add(self, text: str) -> bool:
        """True (and remembered) when `text` is a usable new request."""
        words = _WORD.findall(text)
        reason = None
        if not 4 <= len(words) <= self.max_words:
            reason = "length"
        elif "<|" in text or "|>" in text:
            reason = "template"
        elif Counter(tuple(w.lower() for w in words[i:i + 3])
                     for i in range(len(words) - 2)).most_common(1)[0][1] >= 3:
            reason = "degenerate"
        elif not self.held.clean(text):
            reason = "evaluation"
        else:
            grams = ngrams(text, 4)
            near = Counter(j for g in grams for j in self.index.get(g, ()))
            for j, shared in near.items():
                if shared / max(1, len(grams | self.kept[j])) >= 0.5:
                    reason = "duplicate"
                    break
        if reason:
            self.dropped[reason] += 1
            return False
        grams = ngrams(text, 4)
        for g in grams:
            self.index.setdefault(g, []).append(len(self.kept))
        self.kept.append(grams)
        return True


def write_requests(tok: Any, model: Any, n: int, seed: int, batch: int, filt: RequestFilter) -> list[dict[str, Any]]:
    """About `n` candidate requests (fewer are kept), kinds in turn, openers at random; seeded."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    prefix = user_turn_prefix(tok)
    stop = (int(tok.convert_tokens_to_ids("<|im_end|>")), int(tok.eos_token_id))
    kinds = list(KINDS)
    rows: list[dict[str, Any]] = []
    for b0 in range(0, n, batch):
        kind = kinds[(seed * 7 + b0 // batch) % len(kinds)]
        openers = [rng.choice(KINDS[kind]) for _ in range(min(batch, n - b0))]
        prompts = [tok(prefix + o, add_special_tokens=False).input_ids for o in openers]
        s = Sampling(SamplingConfig(temperature=1.0, top_p=0.95), MAX_NEW.get(kind, 96), stop)
        for opener, new in zip(openers, sample_batch(model, prompts, s, gen), strict=True):
            if not new or new[-1] not in stop:
                filt.dropped["unfinished"] += 1
                continue
            text = (opener + tok.decode(new[:-1])).strip()
            if filt.add(text):
                rows.append({"kind": kind, "opener": opener, "text": text})
    return rows


def fixed_requests(prompts: list[str], per_shard: int, held: HeldOut, seed: int = 0) -> list[list[dict[str, Any]]]:
    """`prompts` deduplicated, shuffled with `seed`, those sharing an 8-gram with an evaluation text
    dropped, in shards of `per_shard` rows of kind "template" (shard j is stored at FIXED_FIRST + j)."""
    kept = [p for p in dict.fromkeys(prompts) if held.clean(p)]
    random.Random(seed).shuffle(kept)
    return [[{"kind": "template", "opener": "", "text": p} for p in kept[i:i + per_shard]]
            for i in range(0, len(kept), per_shard)]
