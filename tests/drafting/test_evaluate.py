"""Evaluation as the edge drafts: the bookkeeping by hand, and a head that knows the next state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from drafting.evaluate import evaluate, row_hits, summarise
from drafting.states import load_states, states_path
from edge.drafters.attention_head import AttentionHead, AttentionHeadConfig


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
