"""Token-tree rounds against the real cloud process, over REST and gRPC alike.

The same tree rounds (the target's greedy token as a node's second child, decoys beside it) sent to two
sessions, one per transport, get the same answers (accepted nodes, next token, context) as the target's
greedy text; a malformed tree gets the same refusal over both (422 / INVALID_ARGUMENT).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.hashing import ctx_hash
from tests.cloud.reference import CausalLM
from tests.cloud.wire import GrpcClient, RestClient, WireError
from tests.server import CloudProcess

PROMPT = [17, 402, 9, 88, 1203, 5]


@pytest.fixture(scope="module")
def cloud(tiny_cloud_server: CloudProcess) -> CloudProcess:
    """The session's shared tiny cloud (tests/e2e/conftest.py): this module reads texts and answers only."""
    return tiny_cloud_server


@pytest.fixture(scope="module")
def reference(tiny_pair: tuple[Path, Path]) -> CausalLM:
    return CausalLM(tiny_pair[0])


def test_tree_rounds_agree_over_rest_and_grpc(cloud: CloudProcess, reference: CausalLM) -> None:
    clients = [RestClient(cloud.http_url), GrpcClient(cloud.grpc_target)]
    sids = [c.open({"prompt_ids": PROMPT, "sampling_cfg": {"temperature": 0.0}})["ctx_id"] for c in clients]
    S = list(PROMPT)
    for _ in range(5):
        a = int(reference.logits(S, 1)[0].argmax())
        b = int(reference.logits(S + [a], 1)[0].argmax())
        d1, d2, d3 = [t for t in range(3000, 3010) if t not in (a, b)][:3]
        body = {"ctx_len": len(S), "ctx_hash": ctx_hash(S), "append_ids": [], "k": 5,
                "draft_tokens": [d1, a, d2, b, d3], "q_token_probs": [0.3] * 5, "tree_parents": [-1, -1, 1, 1, 0]}
        outs = [c.verify({**body, "ctx_id": sid}) for c, sid in zip(clients, sids, strict=True)]
        for out in outs:
            assert out["accepted_nodes"] == [1, 3] and out["next_kind"] == "bonus"
        assert outs[0]["correction"] == outs[1]["correction"] == int(reference.logits(S + [a, b], 1)[0].argmax())
        S += [a, b, outs[0]["correction"]]
        # the next round appends nothing: the bonus is fed by the next forward
        assert outs[0]["ctx_len"] == outs[1]["ctx_len"] == len(S)
    for c, sid in zip(clients, sids, strict=True):
        with pytest.raises(WireError) as e:
            c.verify({"ctx_id": sid, "ctx_len": len(S), "ctx_hash": ctx_hash(S), "append_ids": [], "k": 2,
                      "draft_tokens": [4, 4], "q_token_probs": [0.5, 0.5], "tree_parents": [-1, -1]})
        assert e.value.status in (422, "INVALID_ARGUMENT") and "sibling" in e.value.body["error"]["message"]
        assert c.get(sid)["ctx_len"] == len(S)
