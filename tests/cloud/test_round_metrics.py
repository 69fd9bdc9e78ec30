"""Round metrics that name what they measure: per-position checks of a token tree stop where its walk
stopped, prompt prefills have their own histogram, and a tree round's la_over_k is over its nodes (its
depth has la_over_depth)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from cloud.metrics import CloudMetrics
from shared.hashing import ctx_hash
from shared.tree import TreeOutcome
from shared.verify import VerifyOutcome

PROMPT = [11, 305, 23, 977, 42, 8, 1500, 61]


def checked(m: CloudMetrics, position: int) -> float:
    return m.registry.get_sample_value("specsplit_cloud_position_checked_total", {"position": str(position)}) or 0.0


def test_a_tree_path_that_ends_at_a_leaf_checks_no_deeper_position() -> None:
    """A 4-node tree whose accepted path (2 nodes) ends at a leaf: depths 1 and 2 were checked, not 3."""
    m = CloudMetrics.create(8)
    m.record_round(TreeOutcome(path=[0, 1], next_token=9, next_kind="bonus"), 4, 1.0, 0.0)
    assert [checked(m, i) for i in (1, 2, 3)] == [1.0, 1.0, 0.0]


def test_a_tree_path_stopped_by_a_rejection_checks_the_next_depth() -> None:
    m = CloudMetrics.create(8)
    m.record_round(TreeOutcome(path=[0], next_token=9, next_kind="correction"), 4, 1.0, 0.0)
    assert [checked(m, i) for i in (1, 2, 3)] == [1.0, 1.0, 0.0]


def test_a_chain_checks_the_position_after_its_accepted_ones() -> None:
    m = CloudMetrics.create(8)
    m.record_round(VerifyOutcome(accepted_len=1, next_token=9, next_kind="correction"), 3, 1.0, 0.0)
    m.record_round(VerifyOutcome(accepted_len=3, next_token=9, next_kind="bonus"), 3, 1.0, 0.0)
    assert [checked(m, i) for i in (1, 2, 3, 4)] == [2.0, 2.0, 1.0, 0.0]


def test_prompt_prefills_are_counted_apart_from_verify_forwards(client: Callable[..., TestClient]) -> None:
    c = client()
    sid = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "sampling_cfg": {"temperature": 0}}).json()["ctx_id"]
    r = c.post("/v1/verify", json={"ctx_id": sid, "ctx_len": len(PROMPT), "ctx_hash": ctx_hash(PROMPT),
                                   "draft_tokens": [], "q_token_probs": [], "k": 0})
    assert r.status_code == 200, r.text
    text = c.get("/metrics").text
    assert "specsplit_cloud_target_forward_seconds_count 1.0" in text  # the round
    assert "specsplit_cloud_prompt_prefill_seconds_count 1.0" in text  # the open


def test_a_tree_rounds_la_over_k_is_over_its_nodes(client: Callable[..., TestClient]) -> None:
    """Three nodes, depth 2: la_over_k = la / 3, la_over_depth = la / 2."""
    c = client()
    sid = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "sampling_cfg": {"temperature": 0}}).json()["ctx_id"]
    r = c.post("/v1/verify", json={"ctx_id": sid, "ctx_len": len(PROMPT), "ctx_hash": ctx_hash(PROMPT),
                                   "draft_tokens": [5, 6, 7], "q_token_probs": [0.5] * 3, "k": 3,
                                   "tree_parents": [-1, -1, 0]})
    assert r.status_code == 200, r.text
    out = r.json()
    la = out["accepted_len"]
    assert out["metrics"]["la_over_k"] == pytest.approx(la / 3)
    assert out["metrics"]["la_over_depth"] == pytest.approx(la / 2)
