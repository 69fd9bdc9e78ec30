"""The causal drafter: chains and token trees drafted by position from a causal LM's logits, whatever runs its
forward (PyTorch: edge/drafters/model.py; llama.cpp: edge/drafters/llamacpp.py).

Apart from model.py so that a draft on llama.cpp, the n-gram drafter and `cloud_only` never import the PyTorch
draft's model code (transformers' modeling modules and the paged KV pool: seconds of an edge's start on a CPU).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from shared.config import SamplingConfig
from shared.rng import position_uniform, sample_index
from shared.sampling import process_logits
from shared.verify import DraftKind

from .base import DraftBlock
from .tree import TreeShape, TreeStopped, grow_tree

# rng stream of the edge's draft samples, apart from the cloud's COIN (0) and SAMPLE (1) streams
DRAFT_STREAM = 2


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def raw_signals(logits: torch.Tensor, token: int) -> tuple[float, float, float]:
    """(NLL in nats, entropy in bits, top-1 minus top-2 probability) of softmax(logits) ([vocab])."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [vocab]
    p = logp.exp()  # [vocab]
    entropy = float(-(p * logp).nan_to_num(0.0).sum()) / math.log(2)
    top2 = torch.topk(p, 2).values  # [2]
    return float(-logp[token]), entropy, float(top2[0] - top2[1])


class CausalDrafter:
    """A causal LM drafting chains and token trees by position; a subclass runs its forward (PyTorch here,
    llama.cpp in edge/drafters/llamacpp.py) through four hooks: `_feed` (append tokens, logits of the last),
    `_crop` (keep the first n positions' KV), `_tree_level` (one batched step over a tree's new frontier) and
    `_drop_tree` (forget the tree's nodes). q is processed from the logits by shared/sampling.py either way."""

    kind: DraftKind = "sampled"
    wants_top_k = 0
    mc_dropout_samples = 0
    # the ids q is taken over (the target's tokenizer_size once paired, edge/pairing.py)
    vocab_size: int
    # the ids the draft has logits for
    logit_rows: int
    # longest context the draft holds (None: unbounded)
    max_context: int | None
    # fingerprint of the tokenizer stored with the draft (None when there is none)
    tokenizer_fingerprint: str | None
    # the tokens whose KV the drafter holds
    _ids: list[int]

    def reset(self) -> None:
        """Forget the previous text: an empty cache."""
        raise NotImplementedError

    def fork(self) -> CausalDrafter:
        """A drafter sharing this one's weights with its own cache (one per concurrent generation)."""
        raise NotImplementedError

    def _feed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Run `tokens` after `_ids`, extending the cache and `_ids`; logits of the last ([vocab])."""
        raise NotImplementedError

    def _crop(self, n: int) -> None:
        """Keep the KV of the first n held positions (`_ids` is cropped by the caller)."""
        raise NotImplementedError

    def _tree_level(self, base: int, tree: list[int], tokens: list[int]) -> torch.Tensor:
        """Feed a tree's new frontier after the `base` held positions: `tree` holds the parent offset (-1: the
        context) of every node fed so far, the last len(tokens) of them new; logits after each ([w, vocab])."""
        raise NotImplementedError

    def _drop_tree(self, base: int) -> None:
        """Forget every tree node fed after the `base` held positions."""
        raise NotImplementedError

    def _mc_dropout_variance(self, context: Sequence[int], tokens: Sequence[int]) -> list[float]:
        raise NotImplementedError

    @property
    def kv_len(self) -> int:
        """Positions whose KV the drafter holds."""
        return len(self._ids)

    def _sync(self, context: Sequence[int]) -> torch.Tensor:
        """Crop to the common prefix with `context`, feed the rest; logits after the whole context."""
        if not context:
            raise ValueError("the draft model needs a non-empty context")
        keep = min(common_prefix_len(self._ids, context), len(context) - 1)  # feed >= 1 token for logits
        self.rewind(keep)
        # where the last accepted draft token's KV is filled in: after an all-accepted round,
        # context[keep:] is [y_k, bonus] because y_k was sampled but never fed
        return self._feed(context[keep:])

    def rewind(self, n: int) -> None:
        """Keep the KV of the first n held positions (no-op when it holds fewer)."""
        if n < len(self._ids):
            self._crop(n)
            del self._ids[n:]

    @property
    def held_ids(self) -> list[int]:
        """The tokens whose KV the drafter holds (a copy)."""
        return list(self._ids)

    def logits_after(self, context: Sequence[int]) -> torch.Tensor:
        """The draft model's raw logits for the token after `context` ([vocab]); syncs the cache."""
        return self._sync(context)

    def propose(self, context: Sequence[int], k: int, cfg: SamplingConfig, seed: int) -> DraftBlock:
        block = DraftBlock(tokens=[], q_probs=[], kind=self.kind, nll=[], entropy_bits=[], margin=[])
        if k <= 0:
            return block
        logits = self._sync(context)  # [vocab]
        seen = torch.zeros(self.vocab_size, dtype=torch.bool, device=logits.device)  # [vocab]
        seen[torch.as_tensor(list(context), dtype=torch.long, device=logits.device)] = True
        for i in range(k):
            q = process_logits(logits[None], cfg, seen[None])[0].to("cpu", torch.float64)  # [vocab]
            pos = len(context) + i + 1
            if cfg.greedy:
                y = int(q.argmax())
            else:
                y = sample_index(q, position_uniform(seed, pos, DRAFT_STREAM))
            nll, ent, margin = raw_signals(logits, y)
            block.tokens.append(y)
            block.q_probs.append(float(q[y]))
            block.q_full.append(q)
            assert block.nll is not None and block.entropy_bits is not None and block.margin is not None
            block.nll.append(nll)
            block.entropy_bits.append(ent)
            block.margin.append(margin)
            seen[y] = True
            if i + 1 < k:  # y_k is not fed: its KV is filled in by the next _sync
                logits = self._feed([y])
        if self.mc_dropout_samples:
            block.mc_var = self._mc_dropout_variance(context, block.tokens)
        return block

    @torch.no_grad()
    def propose_tree(self, context: Sequence[int], shape: TreeShape, cfg: SamplingConfig, seed: int,
                     stop: Callable[[], bool] | None = None) -> DraftBlock:
        """A token tree after `context` (edge/drafters/tree.py): one forward per level over its frontier, each
        node attending to the context and its own path; the nodes' KV is dropped afterwards. `stop` is asked
        before each level after the first: when it answers True growth ends with TreeStopped."""
        root = self._sync(context)  # [vocab]
        base = len(self._ids)
        fed: dict[int, int] = {}  # grown node -> its offset after the context
        tree: list[int] = []  # parents of the fed nodes, by offset

        def expand(nodes: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
            if stop is not None and stop():
                raise TreeStopped
            for j, par in zip(nodes, parents, strict=True):
                fed[j] = len(tree)
                tree.append(-1 if par < 0 else fed[par])
            return self._tree_level(base, tree, tokens)  # [w, vocab]

        try:
            return grow_tree(root, expand, shape, cfg, context, self.vocab_size)
        finally:
            self._drop_tree(base)

    def observe(self, context: Sequence[int], draft: Sequence[int], top_k_ids: Sequence[Sequence[int]]) -> None:
        return None


