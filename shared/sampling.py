"""Logits -> processed probabilities, the one implementation used for q (edge) and p (cloud).

Order, as in Hugging Face generation: repetition penalty over the context, temperature, top-k,
top-p, softmax. Temperature 0 gives a one-hot distribution on the (penalised) argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.config import SamplingConfig
from shared.rng import SAMPLE, position_uniform
from shared.target_probs import TargetProbs, draws, host_values


def presence_mask(context_ids: Sequence[int], draft_ids: Sequence[int], vocab: int,
                  device: torch.device | str = "cpu", parents: Sequence[int] | None = None) -> torch.Tensor:
    """Which tokens are in the context of each of the len(draft_ids) + 1 positions.

    Row i is for the distribution of the token after context + draft_ids[:i]; for a tree (`parents`,
    shared/tree.py) row j + 1 is after context + node j's path.
    """
    n = len(draft_ids) + 1
    mask = torch.zeros(n, vocab, dtype=torch.bool, device=device)  # [n, vocab]
    if len(context_ids):
        mask[:, torch.as_tensor(list(context_ids), dtype=torch.long, device=device)] = True
    for row, tok in _seen_drafts(draft_ids, parents):
        mask[row, tok] = True
    return mask


def _seen_drafts(draft_ids: Sequence[int], parents: Sequence[int] | None) -> list[tuple[int, int]]:
    """(row, token) for every draft token a row's context holds beyond the shared context."""
    if parents is None:
        n = len(draft_ids) + 1
        return [(row, int(y)) for i, y in enumerate(draft_ids) for row in range(i + 1, n)]
    from shared.tree import paths
    return [(j + 1, int(draft_ids[a])) for j, path in enumerate(paths(parents)) for a in path]


def _penalized(x: torch.Tensor, cfg: SamplingConfig, seen: torch.Tensor | None) -> torch.Tensor:
    """The repetition penalty applied to float32 logits ([n, vocab]) where `seen`."""
    if cfg.repetition_penalty != 1.0 and seen is not None:
        r = cfg.repetition_penalty
        cols = seen.any(0).nonzero().squeeze(-1)  # [c]: the tokens some row has seen (the rest are untouched)
        sub = x.index_select(-1, cols)  # [n, c]
        x = x.index_copy(-1, cols, torch.where(seen.index_select(-1, cols), torch.where(sub > 0, sub / r, sub * r), sub))
    return x


def process_logits(logits: torch.Tensor, cfg: SamplingConfig, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Processed probabilities, float32, same shape as `logits` ([n, vocab]).

    `seen` ([n, vocab] bool) marks the tokens present in each row's context (repetition penalty).
    """
    x = _penalized(logits.float(), cfg, seen)  # [n, vocab]
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


# top-p looks at the most likely 128, then 1,024 tokens; a full sort only when they hold too little mass
TOP_P_HEADS = (128, 1024)


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep a token iff the mass of the tokens strictly more likely than it is < top_p; renormalise.

    That is HF's TopPLogitsWarper rule except at exact ties: where the boundary falls inside a run
    of equal probabilities, HF keeps some of them, chosen by sort order (i.e. by token id and sort
    implementation). Here the whole run is kept, so the kept set is a function of the distribution
    alone -- the same on the edge's CPU and the cloud's GPU, and on every replay -- and it is the
    smallest such set whose mass reaches top_p. Ties are common with bf16 / fp16 logits.

    The rule keeps every token at least as likely as the least likely kept one, so only that value
    is needed. It is found among the most likely TOP_P_HEADS tokens (`topk`, far cheaper than a
    sort of the vocabulary) whenever the tokens strictly above the head's last value already hold
    top_p; the prefix sums are the same numbers a full sort gives, so the kept set is identical.
    """
    top = probs.max(-1).values  # [n]: `head` tokens hold at most head x top, so smaller heads can be skipped
    reach = float(top.min()) if top.numel() else 1.0
    for head in (*(h for h in TOP_P_HEADS if h < probs.size(-1) and h * reach >= top_p), probs.size(-1)):
        vals = (probs.topk(head, dim=-1) if head < probs.size(-1) else probs.sort(dim=-1, descending=True)).values
        last = vals[..., -1:]  # [n, 1]
        # the tokens past the head are all dropped once those strictly above its last value hold top_p
        if head == probs.size(-1) or bool(((vals * (vals > last)).sum(-1) >= top_p).all()):
            break
    keep_at = _kept_in_sorted(vals, top_p)  # [n, head]: vals in descending order
    lowest_kept = torch.where(keep_at, vals, torch.inf).min(-1, keepdim=True).values  # [n, 1]
    probs = probs.masked_fill(probs < lowest_kept, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _kept_in_sorted(sorted_p: torch.Tensor, top_p: float) -> torch.Tensor:
    """For probabilities sorted in descending order ([n, m]): which ones the top-p rule keeps."""
    mass_before = sorted_p.cumsum(-1) - sorted_p  # [n, m]: mass of the tokens sorted before
    # every token of a run of equal probabilities takes the mass before the run's first token
    idx = torch.arange(sorted_p.size(-1), device=sorted_p.device).expand_as(sorted_p)  # [n, m]
    run_start = torch.ones_like(sorted_p, dtype=torch.bool)  # [n, m]
    run_start[..., 1:] = sorted_p[..., 1:] != sorted_p[..., :-1]
    first_of_run = torch.where(run_start, idx, 0).cummax(-1).values  # [n, m]
    return mass_before.gather(-1, first_of_run) < top_p  # the most likely run is always kept


def processed_probs(logits: torch.Tensor, cfg: SamplingConfig, context_ids: Sequence[int],
                    draft_ids: Sequence[int] = (), parents: Sequence[int] | None = None) -> torch.Tensor:
    """`process_logits` for the len(draft_ids) + 1 rows after context, context + y_1, ... (for a tree,
    `parents`: after context, then after each node's path).

    logits: [len(draft_ids) + 1, vocab]; returns probabilities of the same shape.
    """
    seen = None
    if cfg.repetition_penalty != 1.0:
        seen = presence_mask(context_ids, draft_ids, logits.size(-1), logits.device, parents)
    return process_logits(logits, cfg, seen)


@dataclass(frozen=True)
class RowSampling:
    """What `processed_probs` needs for one row of a forward: its config, the context before its first
    kept position, and the draft ids fed after that context (one kept position each); and what the verify rule
    will ask of its p, so a device computes it ahead for every row at once (shared/target_probs.py)."""
    cfg: SamplingConfig
    context_ids: Sequence[int]
    draft_ids: Sequence[int] = ()
    # a token tree's parents (shared/tree.py); None: the drafts are a chain
    parents: Sequence[int] | None = None
    # the session's seed, and the absolute position of each kept position's draw (its SAMPLE uniform)
    seed: int = 0
    positions: Sequence[int] = ()
    # (kept position, token) pairs whose p the rule scores: a chain's draft i at position i, a tree's node at its
    # parent's
    scored: Sequence[tuple[int, int]] = ()


def process_rows(logits: Sequence[torch.Tensor], rows: Sequence[RowSampling | None],
                 ahead: bool | None = None) -> list[TargetProbs | None]:
    """`processed_probs` of many rows at once (a forward's verify rows and decode steps), left where the logits
    are (shared/target_probs.py): the rows that share a config run as one tensor operation over all their
    positions, with the same operations per position as alone, so every row gets the probabilities it gets
    alone. Greedy rows keep their argmax only. With `ahead` (default: on a device other than the CPU) each
    sampled row's draws at `positions` and p at `scored` are computed in one batched pass, and every scalar of
    the forward crosses to the host in one copy. Rows whose entry is None are skipped (None). Raises ValueError
    when a row's probabilities are not finite and non-negative."""
    out: list[TargetProbs | None] = [None] * len(rows)
    groups: dict[SamplingConfig, list[int]] = {}
    for i, r in enumerate(rows):
        if r is not None:
            groups.setdefault(r.cfg, []).append(i)
    reads: list[torch.Tensor] = []  # every scalar the host needs, read in one copy at the end
    todo: list[tuple[list[int], torch.Tensor | None, int, int, list[tuple[int, float]], list[tuple[int, int]]]] = []
    for cfg, idx in groups.items():
        x = torch.cat([logits[i] for i in idx])  # [P, vocab]: every kept position of the group
        go_ahead = x.device.type != "cpu" if ahead is None else ahead
        seen = None
        if cfg.repetition_penalty != 1.0:
            seen = _presence_masks([rows[i] for i in idx], x.size(-1), x.device)  # type: ignore[misc]
        if cfg.greedy:  # process_logits' one-hot, kept as its argmax alone (no vocabulary-sized tensor)
            reads.append(_penalized(x.float(), cfg, seen).argmax(-1).double())  # [P]
            todo.append((idx, None, 0, 0, [], []))
            continue
        p = process_logits(x, cfg, seen)  # [P, vocab] float32
        reads.append((p.amin(-1) < 0).logical_or(~torch.isfinite(p.sum(-1))).double())  # [P]: 1 where broken
        draws_wanted: list[tuple[int, float]] = []  # (flat position, uniform)
        scored: list[tuple[int, int]] = []  # (flat position, token)
        if go_ahead:
            start = 0
            for i in idx:
                r = rows[i]
                assert r is not None
                draws_wanted += [(start + j, position_uniform(r.seed, pos, SAMPLE)) for j, pos in enumerate(r.positions)]
                scored += [(start + j, int(t)) for j, t in r.scored]
                start += logits[i].size(0)
        n_draws = len(draws_wanted)
        if draws_wanted:
            flat = torch.as_tensor([f for f, _ in draws_wanted], device=p.device)
            u = torch.as_tensor([v for _, v in draws_wanted], dtype=torch.float64, device=p.device)
            got, sure = draws(p[flat], u)  # [D], [D]
            reads += [got.double(), sure.double()]
        if scored:
            at_rows = torch.as_tensor([f for f, _ in scored], device=p.device)
            at_toks = torch.as_tensor([t for _, t in scored], device=p.device)
            reads.append(p[at_rows, at_toks].double())  # [S]
        todo.append((idx, p, n_draws, len(scored), draws_wanted, scored))
    values = host_values(torch.cat(reads)) if reads else []
    at_value = 0
    for idx, probs, n_draws, n_scored, wanted, pairs in todo:
        sizes = [logits[i].size(0) for i in idx]
        total = sum(sizes)
        head = values[at_value: at_value + total]
        at_value += total
        if probs is None:
            start = 0
            for i, n in zip(idx, sizes, strict=True):
                out[i] = TargetProbs(n, logits[i].size(-1), None, top=[int(t) for t in head[start: start + n]])
                start += n
            continue
        if any(head):
            raise ValueError("processed probabilities are not finite and non-negative")
        drawn_ids = values[at_value: at_value + n_draws]
        drawn_sure = values[at_value + n_draws: at_value + 2 * n_draws]
        at_value += 2 * n_draws
        ats = values[at_value: at_value + n_scored]
        at_value += n_scored
        owner = [0] * total  # flat position -> (row index in idx, its first flat position)
        start = 0
        firsts = []
        for k, n in enumerate(sizes):
            firsts.append(start)
            for j in range(start, start + n):
                owner[j] = k
            start += n
        drawn: list[dict[tuple[int, float], int]] = [{} for _ in idx]
        at: list[dict[tuple[int, int], float]] = [{} for _ in idx]
        for (f, uni), g, ok in zip(wanted, drawn_ids, drawn_sure, strict=True):
            if ok:  # the rest the row draws again itself (exactly the reference's draw)
                drawn[owner[f]][(f - firsts[owner[f]], uni)] = int(g)
        for (f, tok), a in zip(pairs, ats, strict=True):
            at[owner[f]][(f - firsts[owner[f]], tok)] = a
        for k, i in enumerate(idx):
            out[i] = TargetProbs(sizes[k], probs.size(-1), probs[firsts[k]: firsts[k] + sizes[k]], drawn=drawn[k],
                                 at=at[k])
    return out


def _presence_masks(rows: Sequence[RowSampling], vocab: int, device: torch.device) -> torch.Tensor:
    """`presence_mask` of each row, stacked ([sum of (len(draft_ids) + 1), vocab]), built by two scatters."""
    sizes = [len(r.draft_ids) + 1 for r in rows]
    owner = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(sizes))  # [P]: row of each position
    ctx = torch.zeros(len(rows), vocab, dtype=torch.bool)  # [R, vocab]
    r_idx = [i for i, r in enumerate(rows) for _ in r.context_ids]
    if r_idx:
        t_idx = [int(t) for r in rows for t in r.context_ids]
        ctx[torch.tensor(r_idx), torch.tensor(t_idx)] = True
    mask = ctx[owner]  # [P, vocab]
    pos: list[int] = []
    tok: list[int] = []
    start = 0
    for r, n in zip(rows, sizes, strict=True):
        for row, y in _seen_drafts(r.draft_ids, r.parents):
            pos.append(start + row)
            tok.append(y)
        start += n
    if pos:
        mask[torch.tensor(pos), torch.tensor(tok)] = True
    return mask.to(device)
