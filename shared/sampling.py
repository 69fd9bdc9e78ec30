"""Logits -> processed probabilities, the one implementation used for q (edge) and p (cloud).

Order, as in Hugging Face generation: repetition penalty over the context, temperature, top-k,
top-p, softmax. Temperature 0 gives a one-hot distribution on the (penalised) argmax.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.config import SamplingConfig


def presence_mask(context_ids: Sequence[int], draft_ids: Sequence[int], vocab: int,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Which tokens are in the context of each of the len(draft_ids) + 1 positions.

    Row i is for the distribution of the token after context + draft_ids[:i].
    """
    n = len(draft_ids) + 1
    mask = torch.zeros(n, vocab, dtype=torch.bool, device=device)  # [n, vocab]
    if len(context_ids):
        mask[:, torch.as_tensor(list(context_ids), dtype=torch.long, device=device)] = True
    for i, tok in enumerate(draft_ids):
        mask[i + 1 :, int(tok)] = True
    return mask


def process_logits(logits: torch.Tensor, cfg: SamplingConfig, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Processed probabilities, float32, same shape as `logits` ([n, vocab]).

    `seen` ([n, vocab] bool) marks the tokens present in each row's context (repetition penalty).
    """
    x = logits.float()  # [n, vocab]
    if cfg.repetition_penalty != 1.0 and seen is not None:
        r = cfg.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if cfg.greedy:
        return torch.nn.functional.one_hot(x.argmax(-1), x.size(-1)).to(torch.float32)  # [n, vocab]
    x = x / cfg.temperature
    if 0 < cfg.top_k < x.size(-1):
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]  # [n, 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)  # [n, vocab]
    if cfg.top_p < 1.0:
        probs = _top_p(probs, cfg.top_p)
    return probs


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep a token iff the mass of the tokens strictly more likely than it is < top_p; renormalise.

    That is HF's TopPLogitsWarper rule except at exact ties: where the boundary falls inside a run
    of equal probabilities, HF keeps some of them, chosen by sort order (i.e. by token id and sort
    implementation). Here the whole run is kept, so the kept set is a function of the distribution
    alone -- the same on the edge's CPU and the cloud's GPU, and on every replay -- and it is the
    smallest such set whose mass reaches top_p. Ties are common with bf16 / fp16 logits.
    """
    sorted_p, order = probs.sort(dim=-1, descending=True)  # [n, vocab]
    mass_before = sorted_p.cumsum(-1) - sorted_p  # [n, vocab]: mass of the tokens sorted before
    # every token of a run of equal probabilities takes the mass before the run's first token
    idx = torch.arange(probs.size(-1), device=probs.device).expand_as(sorted_p)  # [n, vocab]
    run_start = torch.ones_like(sorted_p, dtype=torch.bool)  # [n, vocab]
    run_start[..., 1:] = sorted_p[..., 1:] != sorted_p[..., :-1]
    first_of_run = torch.where(run_start, idx, 0).cummax(-1).values  # [n, vocab]
    drop_sorted = mass_before.gather(-1, first_of_run) >= top_p  # the most likely run is always kept
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # [n, vocab]
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def processed_probs(logits: torch.Tensor, cfg: SamplingConfig, context_ids: Sequence[int],
                    draft_ids: Sequence[int] = ()) -> torch.Tensor:
    """`process_logits` for the len(draft_ids) + 1 rows after context, context + y_1, ...

    logits: [len(draft_ids) + 1, vocab]; returns probabilities of the same shape.
    """
    seen = None
    if cfg.repetition_penalty != 1.0:
        seen = presence_mask(context_ids, draft_ids, logits.size(-1), logits.device)
    return process_logits(logits, cfg, seen)
