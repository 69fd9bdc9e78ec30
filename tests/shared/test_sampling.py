"""shared.sampling processes logits exactly as Hugging Face's logits processors do (repetition
penalty over the context, temperature, top-k, top-p, then softmax), row by row over a growing
context, except for one documented choice at exact top-p ties."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shared.config import SamplingConfig
from shared.sampling import presence_mask, process_logits, processed_probs

V = 64
CONTEXT = [5, 9, 9, 17, 40, 2]
DRAFT = [9, 33, 33, 50]  # y_1 repeats the context, y_2 is new, y_3 repeats y_2


def hf_probs(logits_row: torch.Tensor, cfg: SamplingConfig, input_ids: list[int]) -> torch.Tensor:
    """HF's processors for one row ([V]), in generate()'s order; probabilities ([V])."""
    procs = LogitsProcessorList()
    if cfg.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(penalty=float(cfg.repetition_penalty)))
    if cfg.greedy:
        scores = procs(torch.LongTensor([input_ids]), logits_row[None].clone())
        return torch.nn.functional.one_hot(scores.argmax(-1), V).float()[0]
    procs.append(TemperatureLogitsWarper(float(cfg.temperature)))
    if cfg.top_k:
        procs.append(TopKLogitsWarper(top_k=cfg.top_k))
    if cfg.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=cfg.top_p))
    scores = procs(torch.LongTensor([input_ids]), logits_row[None].clone())  # [1, V]
    return torch.softmax(scores, -1)[0]


CONFIGS = [
    SamplingConfig(),
    SamplingConfig(temperature=0.7, top_k=5),
    SamplingConfig(temperature=1.3, top_p=0.9),
    SamplingConfig(temperature=0.8, top_k=20, top_p=0.8, repetition_penalty=1.3),
    SamplingConfig(temperature=1.0, top_p=0.5, repetition_penalty=0.7),  # < 1 rewards repeats
    SamplingConfig(temperature=2.0, top_k=1),
    SamplingConfig(temperature=0.0, repetition_penalty=1.5),  # greedy
    SamplingConfig(temperature=0.0),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=[str(c.to_dict()) for c in CONFIGS])
def test_processed_probs_match_hugging_face_processors(cfg: SamplingConfig) -> None:
    g = torch.Generator().manual_seed(123)
    for _ in range(10):
        logits = 3 * torch.randn(len(DRAFT) + 1, V, generator=g)  # [k + 1, V]
        # make the penalty decisive: the context's and drafts' tokens are among the likeliest
        logits[:, [9, 33]] += 4.0
        ours = processed_probs(logits, cfg, CONTEXT, DRAFT)  # [k + 1, V]
        assert ours.shape == logits.shape and ours.dtype == torch.float32
        for i in range(len(DRAFT) + 1):
            want = hf_probs(logits[i], cfg, CONTEXT + DRAFT[:i])
            torch.testing.assert_close(ours[i], want, atol=1e-6, rtol=1e-5)
            assert torch.equal(ours[i] > 0, want > 0), "same support"


def test_greedy_is_one_hot_on_the_penalised_argmax() -> None:
    logits = torch.zeros(2, V)
    logits[:, 7] = 2.0  # argmax, but in the context: 2.0 / 1.5 = 1.33 < 1.5
    logits[:, 8] = 1.5
    probs = processed_probs(logits, SamplingConfig(temperature=0.0, repetition_penalty=1.5), [7], [8])
    assert probs.tolist()[0] == torch.nn.functional.one_hot(torch.tensor(8), V).float().tolist()
    # row 1 comes after y_1 = 8, which is now penalised too: 1.5 / 1.5 = 1.0 < 1.33
    assert probs.tolist()[1] == torch.nn.functional.one_hot(torch.tensor(7), V).float().tolist()
    plain = processed_probs(logits, SamplingConfig(temperature=0.0), [7], [8])
    assert plain.argmax(-1).tolist() == [7, 7] and torch.equal(plain.sum(-1), torch.ones(2))


def test_rows_after_draft_prefixes_penalise_the_growing_context() -> None:
    cfg = SamplingConfig(repetition_penalty=2.0)
    logits = torch.ones(len(DRAFT) + 1, V)  # [k + 1, V]; all logits 1 -> penalised ones become 0.5
    probs = processed_probs(logits, cfg, CONTEXT, DRAFT)
    mask = presence_mask(CONTEXT, DRAFT, V)  # [k + 1, V]
    for i in range(len(DRAFT) + 1):
        seen = set(CONTEXT) | set(DRAFT[:i])
        assert set(torch.nonzero(mask[i]).squeeze(-1).tolist()) == seen
        low = probs[i].min()
        assert set(torch.nonzero(probs[i] == low).squeeze(-1).tolist()) == seen
    assert probs[1, 33] > probs[2, 33]  # 33 is new at row 1, seen from row 2 on


def test_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 0.0, 1.0]])
    seen = torch.tensor([[True, True, True, False]])
    out = process_logits(logits, SamplingConfig(repetition_penalty=2.0), seen)
    want = torch.softmax(torch.tensor([[1.0, -4.0, 0.0, 1.0]]), -1)
    torch.testing.assert_close(out, want)


def test_top_k_keeps_every_token_tied_with_the_kth_like_hugging_face() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 0.0]])
    cfg = SamplingConfig(top_k=2)
    ours = process_logits(logits, cfg)[0]
    assert (ours > 0).tolist() == [True, True, True, False, False]
    torch.testing.assert_close(ours, hf_probs_small(logits[0], cfg))


def hf_probs_small(row: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    procs = LogitsProcessorList([TemperatureLogitsWarper(float(cfg.temperature))])
    if cfg.top_k:
        procs.append(TopKLogitsWarper(top_k=cfg.top_k))
    if cfg.top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p=cfg.top_p))
    return torch.softmax(procs(torch.LongTensor([[0]]), row[None].clone()), -1)[0]


@pytest.mark.parametrize(("top_p", "kept"), [(0.75 - 1e-5, 2), (0.75 + 1e-5, 3), (0.5 - 1e-5, 1), (0.5 + 1e-5, 2),
                                             (0.9, 5)])
def test_top_p_keeps_the_smallest_set_whose_mass_reaches_top_p(top_p: float, kept: int) -> None:
    """Boundary: probs 1/2, 1/4, 1/8, 1/16, 1/16; a hair below a cumulative mass keeps exactly that
    prefix, a hair above takes one more token; HF agrees, except inside the tied 1/16 run
    (top_p 0.9), where we keep both and HF one."""
    logits = torch.log(torch.tensor([[0.0625, 0.5, 0.125, 0.25, 0.0625]]))
    cfg = SamplingConfig(top_p=top_p)
    ours = process_logits(logits, cfg)[0]
    order = [1, 3, 2, 0, 4]
    assert (ours > 0).tolist() == [i in order[:kept] for i in range(5)]
    hf_kept = int((hf_probs_small(logits[0], cfg) > 0).sum())
    assert hf_kept == (4 if kept == 5 else kept)


def test_top_p_keeps_a_whole_run_of_tied_probabilities_at_the_boundary() -> None:
    """Our documented choice (shared.sampling._top_p): at a boundary inside a run of equal
    probabilities the whole run is kept. HF keeps a subset chosen by sort order, so which tied
    token survives depends on token ids -- for 0.4, 0.3, 0.3 at top_p 0.5 it keeps one 0.3."""
    for row in ([0.4, 0.3, 0.3], [0.3, 0.3, 0.4], [0.3, 0.4, 0.3]):
        logits = torch.log(torch.tensor([row]))
        ours = process_logits(logits, SamplingConfig(top_p=0.5))[0]
        assert (ours > 0).all()
        hf = hf_probs_small(logits[0], SamplingConfig(top_p=0.5))
        assert int((hf > 0).sum()) == 2  # HF: {0.4, one of the 0.3s}
    logits = torch.log(torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.2]]))
    assert (process_logits(logits, SamplingConfig(top_p=0.1)) > 0).all()


def test_top_p_is_invariant_to_permuting_token_ids_even_with_ties() -> None:
    """Coarsely rounded logits (like bf16 ones) tie often; the kept set must not depend on ids."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 40, generator=g) * 2).round() / 2  # [6, 40], many ties
    for cfg in (SamplingConfig(top_p=0.6), SamplingConfig(top_p=0.9, temperature=0.7, top_k=12)):
        base = process_logits(logits, cfg)
        for _ in range(5):
            perm = torch.randperm(40, generator=g)
            torch.testing.assert_close(process_logits(logits[:, perm], cfg), base[:, perm], atol=1e-7, rtol=0)


def test_processed_rows_are_distributions() -> None:
    g = torch.Generator().manual_seed(9)
    logits = 5 * torch.randn(7, V, generator=g)
    for cfg in CONFIGS:
        probs = processed_probs(logits, cfg, CONTEXT, DRAFT[:2] + [1, 2, 3, 4])
        assert probs.shape == (7, V) and (probs >= 0).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(7))


def test_processing_ignores_the_context_without_a_penalty() -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    cfg = SamplingConfig(temperature=0.9, top_p=0.95)
    assert torch.equal(processed_probs(logits, cfg, CONTEXT, [1, 2]), processed_probs(logits, cfg, [], [3, 4]))


def test_top_p_from_the_head_keeps_the_same_set_as_a_full_sort() -> None:
    """The top-p shortcut (looking at the most likely 128 / 1,024 tokens only) against the rule applied
    to a full sort, on 600 distributions: flat, peaked, with exact ties, in bf16-rounded values."""
    from shared.sampling import _kept_in_sorted, _top_p

    g = torch.Generator().manual_seed(7)
    for trial in range(600):
        vocab = (50, 300, 4096)[trial % 3]
        x = torch.randn(4, vocab, generator=g) * (0.1, 1.0, 3.0, 10.0)[trial % 4]  # [4, vocab]
        if trial % 5 == 0:
            x = (x * 4).round() / 4  # runs of equal probabilities
        if trial % 7 == 0:
            x = x.to(torch.bfloat16).float()
        p = torch.softmax(x, -1)  # [4, vocab]
        top_p = float(torch.rand(1, generator=g)) * 0.999 + 0.001
        sorted_p = p.sort(dim=-1, descending=True).values  # [4, vocab]
        lowest = torch.where(_kept_in_sorted(sorted_p, top_p), sorted_p, torch.inf).min(-1, keepdim=True).values
        want = p.masked_fill(p < lowest, 0.0)
        assert torch.equal(_top_p(p, top_p), want / want.sum(-1, keepdim=True)), trial


def test_rows_processed_together_get_exactly_what_they_get_alone() -> None:
    """`process_rows` (a forward's verify rows and decode steps, one tensor operation per config) against
    `processed_probs` row by row: 60 rows of 1-7 positions over four configs (penalty with context and
    drafts, top-p with quarter-step logits so ties sit at the boundary, top-k, greedy), bit for bit."""
    import random

    from shared.sampling import RowSampling, process_rows

    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    cfgs = [SamplingConfig(), SamplingConfig(0.7, top_p=0.9, repetition_penalty=1.1),
            SamplingConfig(0.0, repetition_penalty=1.3), SamplingConfig(1.3, top_p=0.5, top_k=20)]
    logits, rows = [], []
    for i in range(60):
        n = rng.randint(0, 6)
        logits.append((torch.randn(n + 1, V, generator=g) * 12).round() / 4)  # [n + 1, V]
        rows.append(None if i % 7 == 0 else RowSampling(
            rng.choice(cfgs), [rng.randrange(V) for _ in range(rng.randint(1, 40))],
            [rng.randrange(V) for _ in range(n)]))
    got = process_rows(logits, rows)
    for x, r, p in zip(logits, rows, got, strict=True):
        if r is None:
            assert p is None
            continue
        assert p is not None
        assert torch.equal(p.dense_probs(), processed_probs(x, r.cfg, r.context_ids, r.draft_ids).double())
