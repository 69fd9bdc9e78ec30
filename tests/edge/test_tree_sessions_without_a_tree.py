"""A sampled tree session whose drafter cannot grow a tree (a feature-fed head it cannot use, falling back to a
drafter without trees) runs k = 0 rounds, not sampled chain rounds: every token stays the target's own draw,
the seed's `/v1/generate` text, whichever positions were streamed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from edge.drafters import ModelDrafter
from edge.policy.tree import TreeControl
from shared.config import SamplingConfig
from tests.edge.fake_cloud import FakeCloud
from tests.edge.test_policy_stream import RandomWays

PROMPT = [5, 6, 7, 8, 9, 10]


class NoTrees:
    """The model drafter's chains, but never a tree (as a head falling back to a hybrid drafter)."""

    def __init__(self, inner: ModelDrafter) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def propose_tree(self, context: Sequence[int], shape: Any, cfg: SamplingConfig, seed: int) -> None:
        return None


@pytest.mark.parametrize("seed", [0, 1])
def test_a_sampled_tree_session_without_trees_keeps_the_seeds_text_across_switches(
        make_client: Any, fake_cloud: FakeCloud, model_drafter: ModelDrafter, seed: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    client, _ = make_client(NoTrees(model_drafter), temperature=1.0, max_new_tokens=30, stop_at_eos=False, seed=seed)
    monkeypatch.setattr(client, "_tree_control", lambda info: TreeControl(max_nodes=8))
    ways = RandomWays(seed)
    monkeypatch.setattr(client, "_way_control", lambda info, transport: ways)
    got = client.generate(PROMPT)
    want = fake_cloud.generate(PROMPT, client.settings.sampling(), seed, 30, 1.0).token_ids
    assert got.token_ids == want
    assert 0 < got.metrics.streamed < 30 and got.metrics.drafted == 0  # every round was k = 0


def test_a_sampled_shortcut_tree_session_never_streams(make_client: Any, model_drafter: ModelDrafter,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """"shortcut" draws a tree round's correction from its own rule, not the target's draw at the position: the
    text would depend on the switches, so the session only speculates; the same session with "strict" switches."""
    for correction, streams in (("shortcut", False), ("strict", True)):
        client, _ = make_client(NoTrees(model_drafter), temperature=1.0, max_new_tokens=12, correction=correction)
        monkeypatch.setattr(client, "_tree_control", lambda info: TreeControl(max_nodes=8))
        monkeypatch.setattr(client, "_way_control", lambda info, transport: RandomWays(0))
        assert (client.generate(PROMPT).metrics.streamed > 0) == streams
