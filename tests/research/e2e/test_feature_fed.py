"""Feature-fed drafting against the real cloud process (tiny target, an untrained head on its output rows).

Greedy speculative text with the head equals the cloud's own target-only greedy text over 64 tokens,
over REST and gRPC, and across a reopen (the session is closed behind the edge's back mid-generation:
404, reopen with the whole S, a new feature). The head drafts every round (it is untrained: only the
first draft after the open's feature, the target's own token, is sure to be accepted); a cloud
started with `--features false` offers none, and the same generation runs on the fallback draft with
the same text.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from edge.client import EdgeClient
from edge.drafters import ModelDrafter
from edge.settings import EdgeSettings
from research.heads import HeadChoice
from tests.e2e.closes_once import ClosesOnce
from tests.server import CloudProcess
from tests.tiny_models import build_feature_head

N_NEW = 64
PROMPT = "The lighthouse keeper had not spoken to another person in eleven days."


@pytest.fixture(scope="module")
def head_dir(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_feature_head(tiny_pair[0], tmp_path_factory.mktemp("head") / "head")


@pytest.fixture(scope="module")
def no_feature_cloud(tiny_pair: tuple[Path, Path]) -> Iterator[CloudProcess]:
    with CloudProcess(tiny_pair[0], extra_args=("--features", "false")) as cloud:
        yield cloud


def settings(cloud: CloudProcess, transport: str, **kw: Any) -> EdgeSettings:
    where = {"cloud_url": cloud.http_url} if transport == "rest" else {"grpc_target": cloud.grpc_target}
    values: dict[str, Any] = {"temperature": 0, "max_new_tokens": N_NEW, "timeout_ms": 60_000, "stop_at_eos": False,
                              "repetition_penalty": 2.0,
                              "fixed_k": 4, "draft_ahead": False,
                              "stream_switch": False,  # every round a verify: the head's states are counted
                              **where, **kw}
    return EdgeSettings(**values)


def reference(cloud: CloudProcess, tokenizer: Any) -> list[int]:
    c = EdgeClient(settings(cloud, "rest", mode="cloud_only"), tokenizer=tokenizer)
    return c.generate(PROMPT).token_ids


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_feature_fed_greedy_text_equals_the_target_across_a_reopen(
        tiny_cloud_server: CloudProcess, tiny_pair: tuple[Path, Path], head_dir: Path, tokenizer: Any,
        transport: str) -> None:
    ref = reference(tiny_cloud_server, tokenizer)
    s = settings(tiny_cloud_server, transport, draft=str(tiny_pair[1]))
    plain = EdgeClient(s, tokenizer=tokenizer)
    client = EdgeClient(s, tokenizer=tokenizer, drafter=ModelDrafter(tiny_pair[1]),
                        transport=ClosesOnce(plain.transport), states_drafting=HeadChoice(head_dir))
    res = client.generate(PROMPT)
    m = res.metrics
    assert res.token_ids == ref and len(ref) == N_NEW
    assert m.reopens == 1 and m.local_commits == 0
    # every round with k > 0 drafts from the head (the last one has k = 0); the open's feature follows the
    # whole prompt, so the untrained head's first draft is the target's own greedy token
    assert m.head_rounds >= m.verify_calls - 1 and m.fallback_rounds == 0
    assert m.accepted >= 1
    assert m.feature_bytes_per_round >= 64 + 4  # int8 (asked for by default where offered), width 64


def test_a_cloud_without_features_leaves_the_edge_on_its_fallback(
        no_feature_cloud: CloudProcess, tiny_pair: tuple[Path, Path], head_dir: Path, tokenizer: Any) -> None:
    ref = reference(no_feature_cloud, tokenizer)
    s = settings(no_feature_cloud, "rest", draft=str(tiny_pair[1]))
    res = EdgeClient(s, tokenizer=tokenizer, states_drafting=HeadChoice(head_dir)).generate(PROMPT)
    assert res.token_ids == ref and len(set(ref)) > 8
    assert res.metrics.head_rounds == 0 and res.metrics.fallback_rounds == 0 and res.metrics.feature_bytes == 0


def test_int8_features_keep_the_text(tiny_cloud_server: CloudProcess, tiny_pair: tuple[Path, Path],
                                     head_dir: Path, tokenizer: Any) -> None:
    ref = reference(tiny_cloud_server, tokenizer)
    s = settings(tiny_cloud_server, "grpc", draft=str(tiny_pair[1]))
    res = EdgeClient(s, tokenizer=tokenizer, states_drafting=HeadChoice(head_dir, feature_encoding="int8")).generate(
        PROMPT)
    assert res.token_ids == ref and res.metrics.head_rounds > 0
    assert res.metrics.feature_bytes_per_round == 64 + 4 and res.metrics.open_feature_bytes == 64 + 4


@pytest.mark.parametrize("transport,tree,open_states", [("rest", "auto", 16), ("grpc", "off", 3)])
def test_an_attention_head_gets_every_committed_state_and_keeps_the_text(
        tiny_cloud_server: CloudProcess, tiny_pair: tuple[Path, Path], attention_head_dir: Path, tokenizer: Any,
        transport: str, tree: str, open_states: int) -> None:
    """The attention head asks for states at every committed position and, at an open, the prompt's last
    `open_states` (at most its window, 8): int8, 68 bytes a state; across a reopen the greedy text is the
    target's, with trees and with chains."""
    ref = reference(tiny_cloud_server, tokenizer)
    kw = {"fixed_k": None} if tree == "auto" else {}
    s = settings(tiny_cloud_server, transport, draft=str(tiny_pair[1]), tree=tree, **kw)
    plain = EdgeClient(s, tokenizer=tokenizer)
    head = HeadChoice(attention_head_dir, feature_encoding="int8", open_states=open_states)
    client = EdgeClient(s, tokenizer=tokenizer, drafter=ModelDrafter(tiny_pair[1]),
                        transport=ClosesOnce(plain.transport), states_drafting=head)
    m = (res := client.generate(PROMPT)).metrics
    assert res.token_ids == ref and m.reopens == 1 and m.local_commits == 0
    assert m.head_rounds >= m.verify_calls - 2 and (m.tree_rounds > 0) == (tree == "auto")
    opened = min(open_states, 8)
    assert m.open_feature_bytes == 2 * opened * (64 + 4)  # two opens, the prompt's last `opened` states each
    # the opens' answers carry those states (on REST in base64, 4/3 of them) and are counted apart
    assert m.open_feature_bytes < m.open_bytes_down < m.bytes_down - m.feature_bytes
    per_round = (m.accepted + m.verify_calls) * (64 + 4) / m.verify_calls  # la + 1 states a round
    assert m.feature_bytes_per_round == pytest.approx(per_round, rel=0.05)
