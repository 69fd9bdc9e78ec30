"""REST JSON and protobuf conversions carry every PROTOCOL.md field, both ways."""

from __future__ import annotations

from edge.transport.grpc_transport import verify_request_to_pb, verify_response_from_pb
from edge.transport.rest import verify_request_json, verify_response_from_json
from shared.pb import verify_pb2 as pb
from shared.protocol import DraftProposal, SparseDist, VerifyRequest

PROTOCOL_REQUEST_FIELDS = {"ctx_id", "ctx_len", "ctx_hash", "append_ids", "draft_tokens", "q_token_probs", "q_dists",
                           "draft_kind", "hard_mask", "k", "return_top_k", "request_id"}


def request() -> VerifyRequest:
    return VerifyRequest(ctx_id="abc", ctx_len=7, ctx_hash="00ff", append_ids=[4],
                         draft=DraftProposal([1, 2], [0.5, 0.25], "sampled", [SparseDist([1, 3], [0.5, 0.5]),
                                                                           SparseDist([2], [1.0])], [0, 1]),
                         return_top_k=3, request_id="r1")


def test_rest_request_has_exactly_the_protocol_fields() -> None:
    d = verify_request_json(request())
    assert set(d) == PROTOCOL_REQUEST_FIELDS
    assert d["k"] == 2 and d["q_dists"] == [{"ids": [1, 3], "probs": [0.5, 0.5]}, {"ids": [2], "probs": [1.0]}]
    no_dists = request()
    no_dists.draft.q_dists = None
    assert verify_request_json(no_dists)["q_dists"] is None


def test_rest_response_parses_residual_and_metrics() -> None:
    r = verify_response_from_json({"accepted_len": 1, "correction": None, "next_kind": "residual",
                                   "target_dist": {"ids": [3, 4], "probs": [0.25, 0.75]}, "ctx_len": 8,
                                   "ctx_hash": "aa", "top_k_ids": [[1, 2]],
                                   "metrics": {"alpha_mean": 0.5, "la_over_k": 0.5, "prefill_ms": 2.0,
                                               "queue_ms": 0.1}})
    assert r.correction is None and r.target_dist is not None and r.target_dist.probs == [0.25, 0.75]
    assert r.top_k_ids == [[1, 2]] and r.metrics.prefill_ms == 2.0


def test_protobuf_request_and_response_round_trip() -> None:
    m = verify_request_to_pb(request())
    assert list(m.draft_tokens) == [1, 2] and m.k == 2 and len(m.q_dists) == 2 and list(m.hard_mask) == [0, 1]
    resp = pb.VerifyResponse(accepted_len=2, correction=0, next_kind="bonus", ctx_len=10, ctx_hash="bb",
                             top_k_ids=[pb.TopIds(ids=[5])], metrics=pb.RoundMetrics(alpha_mean=1.0))
    r = verify_response_from_pb(pb.VerifyResponse.FromString(resp.SerializeToString()))
    assert r.correction == 0 and r.target_dist is None and r.top_k_ids == [[5]]  # token 0 survives "optional"
    residual = verify_response_from_pb(pb.VerifyResponse(accepted_len=0, next_kind="residual",
                                                         target_dist=pb.SparseDist(ids=[1], probs=[1.0])))
    assert residual.correction is None and residual.target_dist is not None


def test_sampling_settings_travel_with_every_verify() -> None:
    from shared.config import SamplingConfig

    cfg = SamplingConfig(temperature=0.5, top_p=0.9, top_k=7, repetition_penalty=1.1)
    assert verify_request_json(request(), cfg)["sampling_cfg"] == cfg.to_dict()
    m = verify_request_to_pb(request(), cfg)
    assert m.HasField("sampling_cfg") and m.sampling_cfg.top_k == 7 and m.sampling_cfg.top_p == 0.9
    assert not verify_request_to_pb(request()).HasField("sampling_cfg")


COST = {"base_ms": 4.5, "row_ms": 0.25, "prefill_token_ms": 0.125, "forwards": 40, "tokens_per_second": 90.0,
        "node_value": 0.0225, "linear_row_ms": 0.5, "per_bucket": False}


def test_the_forward_cost_of_an_open_answer_is_kept_over_rest_and_grpc() -> None:
    from dataclasses import asdict

    from edge.transport.grpc_transport import session_from_pb
    from edge.transport.rest import session_from_json
    from shared.protocol import ForwardCostInfo

    opened = {"ctx_id": "c", "ctx_len": 3, "ctx_hash": "aa", "vocab_size": 10}
    rest = session_from_json({**opened, "forward_cost": {**COST, "a_newer_field": 1}})
    grpc_ = session_from_pb(pb.SessionInfo.FromString(pb.SessionInfo(**opened, forward_cost=pb.ForwardCost(**COST))
                                                      .SerializeToString()))
    assert rest.forward_cost == grpc_.forward_cost == ForwardCostInfo(**COST)
    assert asdict(rest.forward_cost) == COST
    # an older cloud's open answer (or GET /v1/sessions/{ctx_id}) says none; a malformed one reads as none
    assert session_from_json(opened).forward_cost is None
    assert session_from_pb(pb.SessionInfo(**opened)).forward_cost is None
    assert session_from_json({**opened, "forward_cost": {"base_ms": "fast"}}).forward_cost is None
    assert session_from_json({**opened, "forward_cost": [1, 2]}).forward_cost is None


def test_the_forward_cost_of_the_model_info_is_kept_over_rest_and_grpc() -> None:
    import httpx

    from edge.transport import GrpcTransport, RestTransport

    model = {"model_id": "m", "vocab_size": 10}
    rest = RestTransport("http://cloud.test")
    rest._http = httpx.Client(base_url="http://cloud.test", transport=httpx.MockTransport(
        lambda _: httpx.Response(200, json={**model, "forward_cost": COST})))
    grpc_ = GrpcTransport("127.0.0.1:1")

    class Stub:
        def GetModel(self, request: pb.GetModelRequest, timeout: float, metadata: object) -> pb.ModelInfo:
            return pb.ModelInfo(**model, forward_cost=pb.ForwardCost(**COST))

    grpc_._stub = Stub()
    kept = rest.get_model(5).forward_cost, grpc_.get_model(5).forward_cost
    assert kept[0] is not None and kept[0] == kept[1] and (kept[0].base_ms, kept[0].row_ms, kept[0].forwards) == (
        4.5, 0.25, 40)
    rest._http = httpx.Client(base_url="http://cloud.test", transport=httpx.MockTransport(
        lambda _: httpx.Response(200, json=model)))  # an older cloud
    assert rest.get_model(5).forward_cost is None
    rest.close()
    grpc_.close()
