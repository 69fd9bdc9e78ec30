"""States for every committed position (PROTOCOL.md): a session opened with a feature_window gets the
target's states at the prompt's last positions with the open answer, and with every round the states at each
position the round committed (after S', then after each accepted draft or tree node), chains and trees, REST
and gRPC alike; a window over the cloud's limit, or without an encoding, is refused with 422.
Tolerances as tests/cloud/test_features.py: float16 1e-2, int8 0.05 absolute on states of magnitude ~1."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from fastapi.testclient import TestClient

from cloud.grpc_server import response_to_pb
from cloud.runners.torch_runner import TargetModel
from edge.transport.grpc_transport import verify_response_from_pb
from shared.features import decode_states, states_from_json
from shared.hashing import ctx_hash
from tests.cloud.reference import CausalLM
from tests.cloud.test_features import reference_states
from tests.cloud.test_trees import greedy_text

PROMPT = [5, 17, 42, 8, 99, 23, 7, 301, 64, 12]


@pytest.mark.parametrize("encoding,tol", [("float16", 1e-2), ("int8", 0.05)])
def test_open_and_rounds_carry_every_committed_positions_state(
        client: Callable[..., TestClient], tiny_target: TargetModel, tiny_reference: CausalLM, encoding: str,
        tol: float) -> None:
    c = client()
    opened = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "feature_encoding": encoding, "feature_window": 6,
                                          "sampling_cfg": {"temperature": 0}}).json()
    st = states_from_json(opened["states"])
    assert opened["feature"] is None and st is not None and (st.first, st.count) == (len(PROMPT) - 5, 6)
    ref = reference_states(tiny_target, PROMPT)
    assert torch.allclose(decode_states(st), ref[-6:], atol=tol)
    ctx = list(PROMPT)
    truth = greedy_text(tiny_reference, PROMPT, 12)
    rounds = [  # (draft tokens, tree parents): a chain with two right guesses, then a tree with one
        (truth[0:2] + [4000], None),
        ([4001, truth[3], 4002], [-1, -1, 1]),
    ]
    for drafts, parents in rounds:
        body = {"ctx_id": opened["ctx_id"], "ctx_len": len(ctx), "ctx_hash": ctx_hash(ctx), "append_ids": [],
                "draft_tokens": drafts, "q_token_probs": [0.5] * len(drafts), "k": len(drafts)}
        if parents is not None:
            body["tree_parents"] = parents
        r = c.post("/v1/verify", json=body).json()
        la = r["accepted_len"]
        kept = drafts[:la] if parents is None else [drafts[j] for j in r["accepted_nodes"]]
        st = states_from_json(r["states"])
        assert r["feature"] is None and st is not None and (st.first, st.count) == (len(ctx), la + 1)
        ref = reference_states(tiny_target, ctx + kept)
        assert torch.allclose(decode_states(st), ref[len(ctx) - 1:], atol=tol)
        back = verify_response_from_pb(response_to_pb(_response(r)))
        assert back.states is not None and back.states.data == st.data and back.states.first == st.first
        ctx += kept + [r["correction"]]
    assert la >= 1


def _response(d: dict):  # type: ignore[no-untyped-def]
    from edge.transport.rest import verify_response_from_json
    return verify_response_from_json(d)


def test_a_window_over_the_limit_or_without_an_encoding_is_refused(client: Callable[..., TestClient]) -> None:
    c = client(max_feature_window=8)
    assert c.get("/v1/model").json()["max_feature_window"] == 8
    for body in ({"feature_encoding": "int8", "feature_window": 9}, {"feature_window": 4},
                 {"feature_encoding": "int8", "feature_window": -1}):
        r = c.post("/v1/sessions", json={"prompt_ids": PROMPT, **body})
        assert r.status_code == 422 and "feature_window" in r.json()["error"]["message"], r.text
