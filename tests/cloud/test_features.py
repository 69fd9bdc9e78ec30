"""Feature-fed drafting on the cloud: the model info offers it, an open and every round carry the target's
state at the position that decides the next token, REST and gRPC alike; a cloud that does not offer it
answers without it; a bad encoding is refused and changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from cloud.grpc_server import info_to_pb, response_to_pb
from cloud.runners.torch_runner import TargetModel
from cloud.service import VerifierService
from shared.features import decode_feature, feature_from_json
from shared.hashing import ctx_hash
from shared.protocol import DraftProposal, OpenSessionRequest, TargetFeature, VerifyRequest

PROMPT = [5, 17, 42, 8, 99, 23, 7]


@torch.inference_mode()
def reference_states(target: TargetModel, ids: list[int]) -> torch.Tensor:
    """The output layer's input at every position of a plain forward over `ids` ([n, d])."""
    captured: list[torch.Tensor] = []
    head = target.model.get_output_embeddings()
    hook = head.register_forward_pre_hook(lambda _m, a: captured.append(a[0]))
    try:
        target.model(input_ids=torch.tensor([ids]))
    finally:
        hook.remove()
    return captured[-1][0].float()


def test_model_info_offers_features_unless_turned_off(client: Callable[..., TestClient]) -> None:
    on = client().get("/v1/model").json()
    assert on["feature_size"] > 0 and on["feature_encodings"] == ["float16", "int8"]
    off = client(features=False).get("/v1/model").json()
    assert off["feature_size"] == 0 and off["feature_encodings"] == []


@pytest.mark.parametrize("encoding,tol", [("float16", 1e-2), ("int8", 0.05)])
def test_open_and_rounds_carry_the_state_that_decides_the_next_token(
        client: Callable[..., TestClient], tiny_target: TargetModel, encoding: str, tol: float) -> None:
    c = client()
    opened = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "feature_encoding": encoding,
                                          "sampling_cfg": {"temperature": 0}}).json()
    f = feature_from_json(opened["feature"])
    assert f is not None and f.prefix_len == len(PROMPT) and f.encoding == encoding
    ctx = list(PROMPT)
    for k in (3, 0, 2):
        draft = [11, 12, 13][:k]
        body = {"ctx_id": opened["ctx_id"], "ctx_len": len(ctx), "ctx_hash": ctx_hash(ctx), "append_ids": [],
                "draft_tokens": draft, "q_token_probs": [1.0] * k, "draft_kind": "deterministic", "k": k}
        r = c.post("/v1/verify", json=body).json()
        la = r["accepted_len"]
        ref = reference_states(tiny_target, ctx + draft)  # the plain forward over S + drafts
        f_round = feature_from_json(r["feature"])
        assert f_round is not None and f_round.prefix_len == len(ctx) + la
        h = decode_feature(f_round)
        want = ref[f_round.prefix_len - 1]
        assert h.shape == want.shape and (h - want).abs().max() <= tol * (1 + want.abs().max())
        ctx = ctx + draft[:la] + [r["correction"]]
        # the state's logits are the target's: its argmax is the greedy next token
        logits = h @ tiny_target.model.get_output_embeddings().weight.float().T
        if encoding == "float16":
            assert int(logits.argmax()) == r["correction"]
    # the open's feature is the last prompt position's state
    want = reference_states(tiny_target, PROMPT)[-1]
    assert (decode_feature(f) - want).abs().max() <= tol * (1 + want.abs().max())


def test_a_cloud_without_the_capability_answers_without_features(client: Callable[..., TestClient]) -> None:
    c = client(features=False)
    opened = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "feature_encoding": "float16"}).json()
    assert opened["feature"] is None
    body = {"ctx_id": opened["ctx_id"], "ctx_len": len(PROMPT), "ctx_hash": ctx_hash(PROMPT), "append_ids": [],
            "draft_tokens": [], "q_token_probs": [], "k": 0}
    assert c.post("/v1/verify", json=body).json()["feature"] is None


def test_a_session_that_did_not_ask_gets_no_feature(client: Callable[..., TestClient]) -> None:
    c = client()
    opened = c.post("/v1/sessions", json={"prompt_ids": PROMPT}).json()
    assert opened["feature"] is None
    body = {"ctx_id": opened["ctx_id"], "ctx_len": len(PROMPT), "ctx_hash": ctx_hash(PROMPT), "append_ids": [],
            "draft_tokens": [3], "q_token_probs": [1.0], "draft_kind": "deterministic", "k": 1}
    assert c.post("/v1/verify", json=body).json()["feature"] is None


def test_an_unknown_encoding_is_refused(client: Callable[..., TestClient]) -> None:
    c = client()
    r = c.post("/v1/sessions", json={"prompt_ids": PROMPT, "feature_encoding": "bf16"})
    assert r.status_code == 422 and "feature_encoding" in r.json()["error"]["message"]


def test_a_fully_cached_prompt_still_gets_its_feature(client: Callable[..., TestClient]) -> None:
    """Prefix sharing: the second open of a 48-token prompt takes every full block from the cache and
    still computes the last position, whose state it answers with."""
    c = client()
    prompt = list(range(3, 51))
    a = feature_from_json(c.post("/v1/sessions", json={"prompt_ids": prompt, "feature_encoding": "float16"})
                          .json()["feature"])
    b = feature_from_json(c.post("/v1/sessions", json={"prompt_ids": prompt, "feature_encoding": "float16"})
                          .json()["feature"])
    assert a is not None and b is not None and a.prefix_len == b.prefix_len == len(prompt)
    assert (decode_feature(a) - decode_feature(b)).abs().max() < 1e-2


def test_grpc_messages_carry_the_feature(make_service: Callable[..., VerifierService]) -> None:
    svc = make_service()

    async def main() -> tuple[Any, Any]:
        info = await svc.open_session(OpenSessionRequest(PROMPT, feature_encoding="int8"), "")
        req = VerifyRequest(info.ctx_id, len(PROMPT), ctx_hash(PROMPT), [], DraftProposal([4], [1.0], "deterministic"))
        return info, await svc.verify(req, "", 1)

    info, resp = asyncio.run(main())
    pi, pr = info_to_pb(info), response_to_pb(resp)
    for m, f in ((pi.feature, info.feature), (pr.feature, resp.feature)):
        assert isinstance(f, TargetFeature)
        back = TargetFeature(m.prefix_len, m.encoding, m.data, m.scale)
        assert torch.equal(decode_feature(back), decode_feature(f))
