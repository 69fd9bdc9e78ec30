"""Model drafter: a small causal LM proposes k sampled tokens with their processed q.

State by position: `_ids` are the tokens whose KV is in the drafter's one-seq_id `KVPool` (the
cloud's KV layout, shared/kvpool.py: sliding-window models roll back like any other, recurrent
ones are refused at load). Each `propose(S, k)` crops the KV to the longest common prefix of
`_ids` and S and feeds the rest of S: normally one token (the round's correction), two when all
k drafts were accepted (y_k was sampled but never fed, so its KV is filled in here together with
the bonus), more after local commits or a reopen.

How many tokens a forward holds depends on timing (the k schedule, drafting ahead, a catch-up after a
correction), so in bfloat16 a position's logits would too: its kernels round differently by row count, and
a seeded sampled session could change its text with timing. A draft in any dtype but float32 therefore runs
batch-invariant like the cloud (shared/invariant.py: linear rows in whole tiles, attention in fixed key
chunks), so q is a function of the context alone: at load, shared/invariant_calibration.py measures the
smallest row tile whose kernels give a row the same bits at every row count up to FEED_ROWS, and longer
feeds run in forwards of FEED_ROWS tokens. float32 keeps the plain kernels: their differences by row count
stay in the last bits, too small to move a seeded draw (tests/e2e/test_seeded_text.py), and tiles would cost
its single-row steps time.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from shared.hf_model import check_rollback, load_causal_lm
from shared.invariant import tile_linears
from shared.invariant_calibration import Calibration, calibrate
from shared.kvpool import KVPool, Row, UnsupportedModel, attention_layout
from shared.paged_attention import exclusive
from shared.tokenizer_id import directory_fingerprint

from .causal import CausalDrafter
from .compact import is_compact, load_compact

log = logging.getLogger(__name__)
# most tokens one forward of a batch-invariant draft feeds (its calibration's largest row count; a tree level
# feeds at most tree_width <= 16 nodes)
FEED_ROWS = 64


class ModelDrafter(CausalDrafter):
    """A Hugging Face causal LM in PyTorch, its KV in a one-sequence KVPool (shared/kvpool.py)."""

    def __init__(self, model_dir: str | Path, device: str = "cpu", mc_dropout_samples: int = 0,
                 dtype: torch.dtype = torch.float32, invariant: bool | None = None) -> None:
        if not Path(model_dir).is_dir():
            raise UnsupportedModel(f"the draft model directory {model_dir} does not exist: pass --draft DIR (a local "
                                   "Hugging Face model directory; nothing is downloaded) or --draft ngram")
        # the ids of a compact draft's output rows (edge/drafters/compact.py); None: one row per id
        self.out_ids: torch.Tensor | None = None
        if is_compact(Path(model_dir)):
            self.model, self.out_ids = load_compact(Path(model_dir), device, dtype)
        else:
            self.model = load_causal_lm(Path(model_dir), device, dtype)
        # weights and KV (q is whatever the draft computes: draw and match and the verify rule read it as sent)
        self.device, self.dtype = device, dtype
        # batch-invariant forwards (see the module docstring): a position's q whatever else its forward fed;
        # None: on in every dtype but float32
        self.invariant = dtype != torch.float32 if invariant is None else invariant
        if self.invariant:
            tile_linears(self.model)
        # the ids the draft speaks (its embedding's rows), and the ids q is taken over (the target's
        # tokenizer_size once paired: rows past it are padding of the embedding table, never a token)
        self.logit_rows = int(self.model.get_input_embeddings().weight.shape[0] if self.out_ids is not None
                              else self.model.get_output_embeddings().weight.shape[0])
        self.vocab_size = self.logit_rows
        cfg = self.model.config.get_text_config()
        self.max_context: int | None = getattr(cfg, "n_positions", None) or getattr(
            cfg, "max_position_embeddings", None)
        self.has_dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules())
        self.mc_dropout_samples = mc_dropout_samples if self.has_dropout else 0
        # fingerprint of the tokenizer stored with the draft (None when its directory has none)
        self.tokenizer_fingerprint = directory_fingerprint(model_dir)
        self._layout = attention_layout(self.model.config)
        check_rollback(self.model, self._new_pool(), self.logit_rows, dtype)
        self.reset()
        # what the load measured of the invariant forwards (None: plain kernels)
        self.calibration: Calibration | None = None
        if self.invariant:
            self.calibration = calibrate(self.model, FEED_ROWS, self._pool)
            c = self.calibration
            if c.invariant:
                log.info("the %s draft's forwards are batch-invariant (row tile %d%s, %d threads, measured in %.1f s)",
                         dtype, c.tile, ", one call a tile" if c.calls else "", c.threads, c.seconds)
            else:
                log.warning("the %s draft's forwards are not batch-invariant on this machine (%s): its q, and a "
                            "seeded sampled text, may change with how tokens are fed", dtype, c.failure)

    def _new_pool(self) -> KVPool:
        pool = KVPool(self._layout, self.max_context or 1 << 20, self.device, self.dtype, invariant=self.invariant)
        template = self.__dict__.get("_template")
        if template is None:
            pool.prepare(self.model)
            self._template = pool
        else:
            pool.prepare_like(template)
        return pool

    def reset(self) -> None:
        self._pool = self._new_pool()
        self._seq_id = self._pool.allocate()
        self._ids = []

    def fork(self) -> ModelDrafter:
        """A drafter sharing this one's weights with its own cache (one per concurrent generation)."""
        twin = object.__new__(ModelDrafter)
        twin.__dict__.update(self.__dict__)
        twin.reset()
        return twin

    @torch.no_grad()
    def _feed(self, tokens: Sequence[int]) -> torch.Tensor:
        """Run `tokens` after `_ids` through the model, extending the cache; logits of the last ([vocab])."""
        ids = [int(t) for t in tokens]
        step = FEED_ROWS if self.invariant else max(len(ids), 1)
        for lo in range(0, len(ids), step):
            row = Row(self._seq_id, len(self._ids), ids[lo: lo + step], num_logits=1)
            (logits,) = self._pool.forward(self.model, [row])  # [1, rows]
            self._ids.extend(row.ids)
        return self._spread(logits[-1])  # [vocab]

    def _spread(self, logits: torch.Tensor) -> torch.Tensor:
        """The output rows' logits ([..., rows]) over the tokenizer's ids ([..., vocab]): -inf on ids a
        compact draft has no row for, so q is 0 there."""
        if self.out_ids is not None:
            full = logits.new_full((*logits.shape[:-1], self.logit_rows), float("-inf"))  # [..., ids]
            logits = full.index_copy(-1, self.out_ids, logits)
        return logits[..., : self.vocab_size]

    def _crop(self, n: int) -> None:
        self._pool.crop(self._seq_id, n)

    def _tree_level(self, base: int, tree: list[int], tokens: list[int]) -> torch.Tensor:
        row = Row(self._seq_id, base + len(tree) - len(tokens), tokens, num_logits=len(tokens), tree=tuple(tree),
                  tree_base=base)
        (logits,) = self._pool.forward(self.model, [row])  # [w, rows]
        return self._spread(logits)  # [w, vocab]

    def _drop_tree(self, base: int) -> None:
        self._pool.crop(self._seq_id, base)

    @torch.no_grad()
    def _mc_dropout_variance(self, context: Sequence[int], tokens: Sequence[int]) -> list[float]:
        """Variance of softmax(logits)(y_i) over dropout passes, one full forward per pass."""
        ids = list(context) + list(tokens[:-1])
        x = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, n]
        rows = torch.arange(len(context) - 1, len(ids), device=self.device)  # [k]
        y = torch.as_tensor(list(tokens), dtype=torch.long, device=self.device)  # [k]
        with exclusive(self.model):  # train mode and plain attention for these passes only (forks share it)
            self.model.train()
            try:
                samples = torch.stack([
                    torch.softmax(self._spread(self.model(input_ids=x).logits[0, rows].float()), -1)[torch.arange(len(y)), y]
                    for _ in range(self.mc_dropout_samples)])  # [passes, k]
            finally:
                self.model.eval()
        return samples.var(0, unbiased=False).tolist()
