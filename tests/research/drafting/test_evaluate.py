"""Evaluation as the edge drafts: the bookkeeping by hand, and a head that knows the next state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from research.drafting.evaluate import evaluate, open_rows, row_hits, summarise
from research.drafting.states import load_states, states_path
from research.heads.attention_head import AttentionHead, AttentionHeadConfig
from research.heads.feature_head import FeatureHead, FeatureHeadConfig


def test_summary_counts_agreement_given_the_drafts_before_and_runs_per_call() -> None:
    hits = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    res = summarise(hits)  # leading runs 2, 1, 0, 4
    assert res["starts"] == 4
    assert res["by_position"] == [0.75, round(2 / 3, 4), 0.5, 1.0]
    assert res["tokens_per_call"] == {2: 2.25, 3: 2.5, 4: 2.75}


class NextStateOracle(AttentionHead):
    """A head that predicts the target's own next state, read from the row's stored states by position:
    its drafts are the target's greedy tokens."""

    def __init__(self, cfg: AttentionHeadConfig) -> None:
        super().__init__(cfg)
        self.row: dict[str, Any] = {}

    def forward(self, states, tokens, positions, past_k=None, past_v=None, mask=None):  # type: ignore[no-untyped-def]
        table = self.row["states"].float()  # [n, d]
        pred = table[(positions + 1 - self.row["start"]).clamp(0, table.shape[0] - 1)]  # [B, T, d]
        kv = torch.zeros(positions.shape[0], 1, positions.shape[1], 1)  # [B, 1, T, 1]
        return pred, kv, kv


def test_a_head_that_knows_the_next_state_agrees_at_every_position(tiny_work: Path, tiny_model: Any) -> None:
    rows = [r for i in range(3) for r in load_states(states_path(tiny_work, i))]
    cfg = AttentionHeadConfig(hidden_size=64, vocab_size=4096, n_out=4096, window=8)
    oracle = NextStateOracle(cfg)
    with torch.no_grad():
        oracle.out.copy_(tiny_model.lm_head.weight)
        oracle.out_ids.copy_(torch.arange(4096))
    k, hits = 5, []
    for row in rows:
        oracle.row = row
        h = row_hits(oracle, row, k)  # starts t = prompt_len - 2 .. len - k - 2
        assert h.shape == (len(row["ids"]) - k - row["prompt_len"] + 1, k)
        hits.append(h)
    res = summarise(torch.cat(hits))
    assert res["by_position"] == [1.0] * k
    assert res["tokens_per_call"] == {kk: kk + 1.0 for kk in range(2, k + 1)}
    assert evaluate(oracle, [], k)["starts"] == 0


class NextStateFeatureOracle(FeatureHead):
    """A feature-fed head whose step returns the stored state after the one it is given (found in the row's
    states): its drafts are the target's greedy tokens, as long as it is stepped once per token."""

    def __init__(self, cfg: FeatureHeadConfig) -> None:
        super().__init__(cfg)
        self.table = torch.zeros(0)

    def step(self, s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        i = torch.cdist(s, self.table).argmin(-1)  # [N] the stored state s is
        return self.table[(i + 1).clamp(max=self.table.shape[0] - 1)]


def test_the_feature_head_is_scored_on_the_same_starts(tiny_work: Path, tiny_model: Any) -> None:
    """The feature-fed head's evaluation (a baseline on the same held-out rows): an oracle of the next state
    agrees everywhere on exactly the attention head's starts; one that does not step (drafts from f_t again,
    predicting x_{t+1} for x_{t+2}) does not."""
    rows = [r for i in range(3) for r in load_states(states_path(tiny_work, i))]
    oracle = NextStateFeatureOracle(FeatureHeadConfig(hidden_size=64, vocab_size=4096, n_out=4096, embed_dim=8))
    with torch.no_grad():
        oracle.out.copy_(tiny_model.lm_head.weight)
        oracle.out_ids.copy_(torch.arange(4096))
    k, hits = 4, []
    for row in rows:
        oracle.table = row["states"].float()
        h = row_hits(oracle, row, k)
        assert h.shape == (len(row["ids"]) - k - row["prompt_len"] + 1, k)
        hits.append(h)
    assert summarise(torch.cat(hits))["by_position"] == [1.0] * k
    oracle.step = lambda s, x: s  # type: ignore[method-assign]
    lagging = torch.cat([row_hits(oracle, r, k) for r in rows])
    assert summarise(lagging)["by_position"][0] < 0.5


class _CharTok:
    """A stand-in tokenizer: a chat is 3 marker ids then one id per character."""
    eos_token_id = 2

    def apply_chat_template(self, msgs: list, add_generation_prompt: bool, tokenize: bool) -> list[int]:
        return [7, 8, 9] + [10 + ord(c) % 40 for c in msgs[0]["content"]]


def test_prompt_rows_answer_each_prompt_greedily_in_order(tiny_model: Any) -> None:
    """Rows for the benchmarks' prompts: each is the prompt's chat ids then the target's greedy answer
    (penalty 1.1) whatever the batching, with the states a training row would have."""
    from research.drafting.answers import PENALTY
    from research.drafting.evaluate import prompt_rows
    from research.drafting.states import state_start
    from research.drafting.target import Sampling, sample_batch
    from shared.config import SamplingConfig
    tok, prompts = _CharTok(), ["a short one", "a rather longer prompt", "mid"]
    rows = prompt_rows(tok, tiny_model, prompts, window=4, max_new=7, batch=2)
    s = Sampling(SamplingConfig(temperature=0.0, repetition_penalty=PENALTY), 7, (2,))
    for p, r in zip(prompts, rows, strict=True):
        chat = tok.apply_chat_template([{"content": p}], True, True)
        alone = sample_batch(tiny_model, [chat], s, torch.Generator())[0]
        assert r["ids"].tolist() == chat + alone and r["prompt_len"] == len(chat)
        assert r["start"] == state_start(len(chat), 4)
        assert r["states"].shape == (len(chat) + len(alone) - 1 - r["start"], tiny_model.config.hidden_size)


def test_on_wire_rows_carry_the_states_the_edge_decodes() -> None:
    """`on_wire`: float16 rows are the float16 states exactly; int8 rows are within one quantum (max|x|/127,
    per state) of them, differ from them somewhere, and keep every other field."""
    from research.drafting.evaluate import on_wire
    g = torch.Generator().manual_seed(0)
    S = torch.randn(5, 16, generator=g) * torch.linspace(0.5, 8.0, 5)[:, None]
    row = {"ids": torch.arange(9), "start": 2, "prompt_len": 3, "states": S}
    half = on_wire([row], "float16")[0]
    assert torch.equal(half["states"], S.half().float()) and half["ids"] is row["ids"]
    q = on_wire([row], "int8")[0]["states"]
    step = S.abs().amax(-1, keepdim=True) / 127
    assert bool(((q - S).abs() <= step / 2 + 1e-6).all()) and not torch.equal(q, S)


def test_open_rows_keep_the_prompts_last_w_states_and_the_answers_first_starts(tiny_work: Path,
                                                                               tiny_model: Any) -> None:
    """What an open with W states leaves: the states of positions prompt_len - W on, at their own positions,
    and the answer's first `first` starts; the next-state oracle still agrees on all of them."""
    rows = load_states(states_path(tiny_work, 0))
    oracle = NextStateOracle(AttentionHeadConfig(hidden_size=64, vocab_size=4096, n_out=4096, window=8))
    with torch.no_grad():
        oracle.out.copy_(tiny_model.lm_head.weight)
        oracle.out_ids.copy_(torch.arange(4096))
    k, first = 3, 5
    for w in (1, 4):
        cut = open_rows(rows, w, first=first, k=k)
        assert len(cut) == len(rows)
        for r, c in zip(rows, cut, strict=True):
            assert c["start"] == max(r["start"], r["prompt_len"] - w)
            i0 = c["start"] - r["start"]
            assert torch.equal(c["states"], r["states"][i0:i0 + c["states"].shape[0]])
            oracle.row = r  # it reads the next states from the whole row, the cut row's drafts run past it
            h = row_hits(oracle, c, k)
            # the first start, t = prompt_len - 2, drafts from f_t: an open of one state has not sent it
            assert h.shape == (first if w >= 2 else first - 1, k) and bool(h.all())
