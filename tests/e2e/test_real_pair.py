"""The real default pair end to end: SmolLM2-135M-Instruct verifies its drafts' guesses.

`scripts/setup.sh` converts the target into models/smollm2-135m-instruct (so CI has it); the drafts
models/smollm2-135m-draft (distilled) and models/smollm2-135m-draft-from-target (cut from the target) are
committed. For a chat prompt sent through the tokenizer's template, the greedy speculative text (each
tokens-only draft and the n-gram drafter, REST for some and gRPC for the other) must equal the
target's own greedy text (the cloud's POST /v1/generate) over 64 tokens, token for token, with no
token committed unverified. A divergence is accepted only where the target's two candidates are a
float tie (see test_edge_greedy.assert_equal_or_tie). The cloud, the tokenizer and the target's answer are the
session's (tests/real_pair.py), shared with the research heads' test.
"""

from __future__ import annotations

from typing import Any

import pytest

from edge.client import EdgeClient
from edge.drafters import ModelDrafter, NGramDrafter
from tests.e2e.test_edge_greedy import assert_equal_or_tie
from tests.real_pair import CUT, DRAFT, QUESTION, TARGET, chat, check_greedy, require_target, settings
from tests.server import CloudProcess

require_target()


@pytest.mark.parametrize(("kind", "transport"), [("model", "rest"), ("cut", "grpc"), ("ngram", "rest")])
def test_real_pair_greedy_speculative_equals_the_target(real_cloud: CloudProcess, real_tokenizer: Any,
                                                        references: dict[str, Any], kind: str,
                                                        transport: str) -> None:
    """kind "model": the distilled draft; "cut": the tokens-only draft cut from the target (a compact directory);
    "ngram": the n-gram drafter (the heads fed the target's states: tests/research/e2e/test_real_pair_heads.py).
    Each over one transport, both transports taken: REST and gRPC carry the same rounds (every tiny-pair greedy test
    runs both), so the real pair's own risk, its numerics, is what each kind checks."""
    if kind == "cut" and not CUT.is_dir():
        raise RuntimeError(f"{CUT} is missing: it is committed with the repository")
    tokens_only = DRAFT if kind == "model" else CUT
    s = settings(real_cloud, transport, draft=str(tokens_only))
    drafter = NGramDrafter(order=4) if kind == "ngram" else ModelDrafter(tokens_only)
    spec = EdgeClient(s, drafter=drafter, tokenizer=real_tokenizer).generate(chat(real_tokenizer, QUESTION))
    check_greedy(spec, references["result"], s)
    if kind != "ngram":  # a trained draft: some of its guesses are kept
        assert spec.metrics.accepted > 0


def test_real_target_split_over_three_ranks_gives_the_same_text(real_tokenizer: Any,
                                                                references: dict[str, Any]) -> None:
    """SmolLM2-135M-Instruct under `torchrun --nproc-per-node 3` (9 attention heads and 3 KV heads split
    3 ways): the cut draft's greedy speculative text over REST equals the one-process target's
    own over 64 tokens, and no rank holds more than a third of the weights plus 10 % (each rank's
    `rank_memory` log line against the size of model.safetensors)."""
    import httpx

    from bench.tensor_parallel import rank_memory
    from tests.e2e.test_tensor_parallel import TorchrunCloud

    with TorchrunCloud(TARGET, 3) as three:
        assert httpx.get(three.http_url + "/v1/model").json()["tensor_parallel"] == 3
        s = settings(three, "rest", draft=str(CUT))
        spec = EdgeClient(s, drafter=ModelDrafter(CUT), tokenizer=real_tokenizer).generate(
            chat(real_tokenizer, QUESTION))
        memory = rank_memory(three.log_path.read_text(errors="replace"))
    ref = references["result"]
    if spec.token_ids != ref.token_ids:  # only then is the target loaded here, to tell a float tie
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(TARGET).eval()
        assert_equal_or_tie(spec.token_ids, ref.token_ids, spec.prompt_ids, target, s.sampling())
    assert spec.metrics.local_commits == 0 and spec.metrics.accepted > 0
    whole = (TARGET / "model.safetensors").stat().st_size  # float32 weights and a small header
    assert sorted(memory) == [0, 1, 2], memory
    assert all(m["weight_bytes"] <= (1 / 3 + 0.1) * whole for m in memory.values()), (memory, whole)
