"""The fixed (templated) requests: sharded deterministically, evaluation overlaps dropped."""

from __future__ import annotations

from research.drafting.heldout import HeldOut
from research.drafting.requests import fixed_requests


def test_fixed_requests_shard_deterministically_without_evaluation_overlap() -> None:
    held = HeldOut(["Please explain how a refrigerator keeps food cold at home every day."])
    prompts = [f"Explain topic number {i} in simple terms." for i in range(25)]
    prompts += ["Explain how a refrigerator keeps food cold at home every day, please.",  # shares an 8-gram
                prompts[0]]  # a duplicate
    shards = fixed_requests(prompts, per_shard=10, held=held, seed=4)
    texts = [r["text"] for s in shards for r in s]
    assert [len(s) for s in shards] == [10, 10, 5]
    assert sorted(texts) == sorted(prompts[:25])
    assert texts != prompts[:25]  # shuffled
    assert shards == fixed_requests(prompts, per_shard=10, held=held, seed=4)
    assert {r["kind"] for s in shards for r in s} == {"template"}
