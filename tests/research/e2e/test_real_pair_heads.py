"""The real SmolLM2 pair with the committed heads fed the target's states (tests/e2e/test_real_pair.py's test).

research/models/smollm2-135m-head (one state a round) and research/models/smollm2-135m-attention-head (states at
every committed position), each with the draft cut from the target as its fallback, plugged in by
research.heads.HeadChoice: for a chat prompt sent through the tokenizer's template, the greedy speculative text
(also across a reopen; REST and gRPC both carry the states) must equal the target's own greedy text over 64
tokens, token for token, with no token committed unverified (a float tie excepted:
test_edge_greedy.assert_equal_or_tie). The cloud is the session's one SmolLM2 cloud (tests/real_pair.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from edge.client import EdgeClient
from edge.drafters import ModelDrafter
from research.heads import ATTENTION_HEAD, FEATURE_HEAD, HeadChoice
from tests.e2e.closes_once import ClosesOnce
from tests.real_pair import CUT, QUESTION, chat, check_greedy, require_target, settings
from tests.server import CloudProcess

require_target()


# the one-state head over both transports (their feature encodings differ), the reopen and the attention head over one
@pytest.mark.parametrize(("kind", "transport"),
                         [("head", "rest"), ("head", "grpc"), ("head-reopen", "rest"), ("attention", "grpc")])
def test_real_pair_heads_greedy_speculative_equals_the_target(real_cloud: CloudProcess, real_tokenizer: Any,
                                                              references: dict[str, Any], kind: str,
                                                              transport: str) -> None:
    """kind "head": the one-state feature-fed head; "head-reopen": the same with the session closed behind the
    edge's back before its 4th round; "attention": the attention head."""
    head_dir = ATTENTION_HEAD if kind == "attention" else FEATURE_HEAD
    for d in (head_dir, CUT):
        if not d.is_dir():
            raise RuntimeError(f"{d} is missing: it is committed with the repository")
    s = settings(real_cloud, transport, draft=str(CUT))
    transport_ = ClosesOnce(EdgeClient(s).transport) if kind == "head-reopen" else None
    spec = EdgeClient(s, drafter=ModelDrafter(CUT), tokenizer=real_tokenizer, transport=transport_,
                      states_drafting=HeadChoice(head_dir)).generate(chat(real_tokenizer, QUESTION))
    check_greedy(spec, references["result"], s)
    assert spec.metrics.accepted > 0
    # drafted from the cloud's states, a few hundred bytes each
    assert spec.metrics.head_rounds > 0 and spec.metrics.fallback_rounds <= 1 and spec.metrics.feature_bytes > 0
    assert (spec.metrics.reopens == 1) == (kind == "head-reopen")
