"""The feature-fed drafter on its own: drafts from the cloud's feature when it still describes the
committed text, falls back otherwise, and its q lives on the head's output rows only."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from edge.drafters.base import DraftBlock
from research.heads.feature_head import FeatureDrafter, FeatureHead
from shared.config import SamplingConfig
from tests.tiny_models import build_feature_head

GREEDY = SamplingConfig(temperature=0)
PROMPT = [5, 17, 42, 8, 99, 23, 7]


class Recorder:
    """A fallback that records its calls and drafts token 1s."""

    kind = "sampled"
    wants_top_k = 0
    max_context = None

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, context: Sequence[int], k: int, cfg: SamplingConfig, seed: int) -> DraftBlock:
        self.calls += 1
        return DraftBlock(tokens=[1] * k, q_probs=[1.0] * k, kind="sampled")

    def observe(self, *a: object) -> None:
        return None


@pytest.fixture(scope="module")
def target(tiny_pair: tuple[Path, Path]) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()


def states(target: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The output layer's input at every position ([n, d])."""
    got: list[torch.Tensor] = []
    hook = target.get_output_embeddings().register_forward_pre_hook(lambda _m, a: got.append(a[0]))
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([ids])).logits[0]
    hook.remove()
    assert torch.allclose(got[0][0] @ target.get_output_embeddings().weight.T, logits, atol=1e-4)
    return got[0][0]


def test_the_first_draft_after_a_feature_is_the_targets_greedy_token(
        tiny_pair: tuple[Path, Path], target: torch.nn.Module, tmp_path: Path) -> None:
    head = FeatureHead.load(build_feature_head(tiny_pair[0], tmp_path / "head"))
    d = FeatureDrafter(head, Recorder())
    h = states(target, PROMPT)
    d.set_feature(PROMPT, h[-1])  # the state after the whole prompt: an open's feature
    block = d.propose(PROMPT, 3, GREEDY, 0)
    with torch.no_grad():
        want = int(target(input_ids=torch.tensor([PROMPT])).logits[0, -1].argmax())
    assert block.tokens[0] == want and d.last_from_head
    # one token after the anchor (a round's correction): the head steps through it, then drafts
    d.set_feature(PROMPT[:-1], h[-2])
    assert len(d.propose(PROMPT, 2, GREEDY, 0).tokens) == 2 and d.last_from_head


def test_a_feature_of_other_text_is_not_used(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    fallback = Recorder()
    d = FeatureDrafter(FeatureHead.load(build_feature_head(tiny_pair[0], tmp_path / "head")), fallback)
    assert d.propose(PROMPT, 2, GREEDY, 0).tokens == [1, 1] and fallback.calls == 1  # no feature yet
    d.set_feature([5, 17, 41], torch.zeros(64))  # other text than the committed S
    assert d.propose(PROMPT, 2, GREEDY, 0).tokens == [1, 1] and fallback.calls == 2 and not d.last_from_head
    d.set_feature(PROMPT + [3], torch.zeros(64))  # longer than S (a crop since)
    d.propose(PROMPT, 2, GREEDY, 0)
    assert fallback.calls == 3


def test_a_feature_of_another_width_leaves_the_drafter_on_its_fallback(tiny_pair: tuple[Path, Path],
                                                                        tmp_path: Path) -> None:
    """A cloud serving a target of another width: the head never sees its state; the generation goes on."""
    fallback = Recorder()
    d = FeatureDrafter(FeatureHead.load(build_feature_head(tiny_pair[0], tmp_path / "head")), fallback)
    d.set_feature(PROMPT, torch.zeros(64))
    assert d.usable(PROMPT)
    d.set_feature(PROMPT, torch.zeros(96))
    assert not d.usable(PROMPT)
    assert d.propose(PROMPT, 2, GREEDY, 0).tokens == [1, 1] and fallback.calls == 1 and not d.last_from_head


def test_q_is_zero_outside_the_output_rows(tiny_pair: tuple[Path, Path], target: torch.nn.Module,
                                           tmp_path: Path) -> None:
    """A reduced output layer (the first 512 of 4,096 ids): every drafted q is a distribution on them."""
    head = FeatureHead.load(build_feature_head(tiny_pair[0], tmp_path / "head", n_out=512))
    d = FeatureDrafter(head, None)
    d.set_feature(PROMPT, states(target, PROMPT)[-1])
    block = d.propose(PROMPT, 4, SamplingConfig(temperature=1.0, top_p=1.0), seed=3)
    for y, q in zip(block.tokens, block.q_full, strict=True):
        assert y < 512 and float(q[512:].sum()) == 0 and abs(float(q.sum()) - 1) < 1e-6 and q[y] > 0


@pytest.mark.parametrize("setting,offered,asked", [
    ("auto", ["float16", "int8"], "int8"), ("auto", ["float16"], "float16"), ("auto", [], ""),
    ("float16", ["float16", "int8"], "float16"), ("int8", ["float16"], "")])
def test_the_edge_asks_for_int8_states_where_offered_unless_told(setting: str, offered: list[str], asked: str) -> None:
    """The encoding an open asks for: by default int8 (half the bytes; the heads draft as well from it,
    research/README.md), float16 from a cloud offering only that; a named encoding the cloud lacks asks for
    none (the edge drafts without the head)."""
    from research.heads import HeadChoice
    from shared.protocol import ModelInfo

    info = ModelInfo("m", 10, feature_size=8, feature_encodings=offered)
    assert HeadChoice("nowhere", feature_encoding=setting).encoding_for(info) == asked  # type: ignore[arg-type]
