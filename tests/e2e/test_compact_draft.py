"""A compact draft directory (edge/drafters/compact.py): a low-rank input embedding and an output layer
over the most frequent ids only. Built here from the tiny draft itself at full rank, so its logits on
its output rows must be the plain model's; q is 0 on every other id, and greedy speculative text
against the real cloud process is still the target's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf

from edge.client import EdgeClient
from edge.drafters import ModelDrafter
from edge.settings import EdgeSettings
from shared.config import SamplingConfig
from tests.server import CloudProcess
from tests.tiny_models import build_compact_draft

PROMPT = [5, 17, 41, 99, 7, 300, 12]
KEEP = torch.arange(0, 4096, 2)  # every even id: half of the vocabulary, the target's choices among the rest


@pytest.fixture(scope="module")
def compact_dir(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_compact_draft(tiny_pair[1], tmp_path_factory.mktemp("compact") / "draft", KEEP)


def test_logits_are_the_models_own_on_its_rows_and_minus_infinity_elsewhere(
        tiny_pair: tuple[Path, Path], compact_dir: Path) -> None:
    plain = tf.AutoModelForCausalLM.from_pretrained(tiny_pair[1]).eval()
    with torch.no_grad():
        want = plain(input_ids=torch.tensor([PROMPT])).logits[0, -1].float()  # [V]
    d = ModelDrafter(compact_dir)
    assert d.logit_rows == 4096 and d.out_ids is not None and d.out_ids.numel() == 2048
    got = d.logits_after(PROMPT)  # [V]
    assert torch.allclose(got[KEEP], want[KEEP], atol=1e-4)
    odd = torch.arange(1, 4096, 2)
    assert bool(torch.isinf(got[odd]).all())
    block = d.propose(PROMPT, 4, SamplingConfig(temperature=1.0), seed=3)
    for y, q in zip(block.tokens, block.q_full, strict=True):
        assert y % 2 == 0 and float(q[odd].sum()) == 0 and abs(float(q.sum()) - 1) < 1e-6 and q[y] > 0


def test_a_broken_compact_file_is_refused_in_one_line(compact_dir: Path, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from shared.kvpool import UnsupportedModel

    bad = tmp_path / "bad"
    shutil.copytree(compact_dir, bad)
    t = load_file(str(bad / "compact.safetensors"))
    t["out.ids"] = torch.cat([t["out.ids"], torch.tensor([5000])])  # an id past the vocabulary
    save_file(t, str(bad / "compact.safetensors"))
    with pytest.raises(UnsupportedModel, match="out.weight"):
        ModelDrafter(bad)


@pytest.mark.parametrize("transport", ["rest", "grpc"])
def test_greedy_text_with_a_compact_draft_is_the_targets(tiny_cloud_server: CloudProcess, tiny_pair: tuple[Path, Path],
                                                         tokenizer: Any, tmp_path: Path, transport: str) -> None:
    """64 greedy tokens with a compact draft built without rows for every other distinct token of the
    target's own text: those positions are always rejected and corrected, and the text is the target's."""
    where = {"cloud_url": tiny_cloud_server.http_url} if transport == "rest" else {
        "grpc_target": tiny_cloud_server.grpc_target}
    s = dict(temperature=0, max_new_tokens=64, timeout_ms=60_000, stop_at_eos=False, fixed_k=4, draft_ahead=False,
             **where)
    ref = EdgeClient(EdgeSettings(mode="cloud_only", **s), tokenizer=tokenizer).generate(PROMPT).token_ids
    dropped = sorted(set(ref))[::2]
    keep = torch.tensor([i for i in range(4096) if i not in dropped])
    draft = ModelDrafter(build_compact_draft(tiny_pair[1], tmp_path / "draft", keep))
    res = EdgeClient(EdgeSettings(**s), tokenizer=tokenizer, drafter=draft).generate(PROMPT)
    assert res.token_ids == ref and len(ref) == 64
    assert dropped and sum(t in dropped for t in ref) >= 1
