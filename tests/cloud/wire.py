"""REST and gRPC test clients with one interface: JSON-shaped dicts in, dicts out.

Errors come back as `WireError(status, code, body)`: REST status + error body, or the gRPC code
name + the error body from the `specsplit-error` trailing metadata, so a test can run the same
case over both transports.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import grpc
import httpx

from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc


@dataclass
class WireError(Exception):
    # REST status (int) or gRPC code name (e.g. "INVALID_ARGUMENT")
    status: int | str
    # the error body's code ("invalid_argument", ...)
    code: str
    # the whole {"error": {...}} body
    body: dict[str, Any]


class RestClient:
    name = "rest"

    def __init__(self, base_url: str, key: str | None = None, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=base_url, headers=headers, timeout=timeout)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              raw: bytes | None = None) -> dict[str, Any]:
        """JSON-encode `body` (NaN allowed, as a careless client would send it) or send `raw`."""
        content = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        headers = {"content-type": "application/json"} if content is not None else {}
        r = self.http.request(method, path, content=content, headers=headers)
        if r.status_code != 200:
            data = r.json()
            raise WireError(r.status_code, data["error"]["code"], data)
        return dict(r.json())

    def open(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/sessions", body)

    def verify(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/v1/verify", body)

    def verify_raw(self, raw: bytes) -> dict[str, Any]:
        return self._call("POST", "/v1/verify", raw=raw)

    def get(self, ctx_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/sessions/{ctx_id}")

    def close(self, ctx_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/sessions/{ctx_id}")

    def model(self) -> dict[str, Any]:
        return self._call("GET", "/v1/model")

    def shutdown(self) -> None:
        self.http.close()


def _sampling_pb(d: dict[str, Any] | None) -> pb.SamplingConfig | None:
    return None if d is None else pb.SamplingConfig(**d)


class GrpcClient:
    name = "grpc"

    def __init__(self, target: str, key: str | None = None, timeout: float = 30.0) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()
        self.timeout = timeout

    def _call(self, rpc: Any, msg: Any) -> Any:
        try:
            return rpc(msg, metadata=self.metadata, timeout=self.timeout)
        except grpc.RpcError as e:
            trailing = dict(e.trailing_metadata() or ())
            body = json.loads(trailing["specsplit-error"]) if "specsplit-error" in trailing else \
                {"error": {"code": "", "message": e.details()}}
            raise WireError(e.code().name, body["error"]["code"], body) from None

    def open(self, body: dict[str, Any]) -> dict[str, Any]:
        msg = pb.OpenSessionRequest(prompt_ids=body["prompt_ids"], seed=body.get("seed", 0),
                                    correction=body.get("correction", ""), max_new_tokens=body.get("max_new_tokens", 0))
        if body.get("sampling_cfg") is not None:
            msg.sampling_cfg.CopyFrom(_sampling_pb(body["sampling_cfg"]))
        return _info(self._call(self.stub.OpenSession, msg))

    def verify_raw(self, raw: bytes) -> dict[str, Any]:
        """Send bytes that need not parse as a VerifyRequest."""
        call = self.channel.unary_unary("/specsplit.v1.Verifier/Verify")
        return response_dict(pb.VerifyResponse.FromString(self._call(call, raw)))

    def verify(self, body: dict[str, Any]) -> dict[str, Any]:
        fields = {k: v for k, v in body.items() if k not in ("q_dists", "sampling_cfg") and v is not None}
        if "tree_parents" in fields:  # proto3 has no presence for a list: `tree` says it is a tree
            fields["tree"] = True
        msg = pb.VerifyRequest(**fields)
        for d in body.get("q_dists") or []:
            msg.q_dists.add(ids=d["ids"], probs=d["probs"])
        if body.get("sampling_cfg") is not None:
            msg.sampling_cfg.CopyFrom(_sampling_pb(body["sampling_cfg"]))
        return response_dict(self._call(self.stub.Verify, msg))

    def get(self, ctx_id: str) -> dict[str, Any]:
        return _info(self._call(self.stub.GetSession, pb.GetSessionRequest(ctx_id=ctx_id)))

    def close(self, ctx_id: str) -> dict[str, Any]:
        return {"closed": self._call(self.stub.CloseSession, pb.CloseSessionRequest(ctx_id=ctx_id)).closed}

    def model(self) -> dict[str, Any]:
        m = self._call(self.stub.GetModel, pb.GetModelRequest())
        return {"model_id": m.model_id, "vocab_size": m.vocab_size, "eos_ids": list(m.eos_ids),
                "max_context": m.max_context, "dtype": m.dtype, "device": m.device,
                "tokenizer_fingerprint": m.tokenizer_fingerprint, "max_k": m.max_k,
                "tokenizer_size": m.tokenizer_size, "feature_size": m.feature_size,
                "feature_encodings": list(m.feature_encodings), "tensor_parallel": m.tensor_parallel,
                "max_tree_nodes": m.max_tree_nodes, "max_feature_window": m.max_feature_window,
                "session_stream": m.session_stream, "max_generate_tokens": m.max_generate_tokens,
                "dtype_reason": m.dtype_reason, "batch_invariant": m.batch_invariant, "runner": m.runner,
                "numerics": m.numerics, "forward_path": m.forward_path, "batch_invariant_probe": m.batch_invariant_probe,
                "forward_cost": {f.name: getattr(m.forward_cost, f.name) for f in m.forward_cost.DESCRIPTOR.fields}}

    def shutdown(self) -> None:
        self.channel.close()


def _info(m: pb.SessionInfo) -> dict[str, Any]:
    out = {"ctx_id": m.ctx_id, "ctx_len": m.ctx_len, "ctx_hash": m.ctx_hash, "vocab_size": m.vocab_size,
           "numerics": m.numerics}
    if m.counters_json:
        out["counters"] = json.loads(m.counters_json)
    return out


def response_dict(m: pb.VerifyResponse) -> dict[str, Any]:
    """A VerifyResponse as the REST JSON would carry it."""
    return {
        "accepted_len": m.accepted_len,
        "correction": m.correction if m.HasField("correction") else None,
        "next_kind": m.next_kind,
        "target_dist": {"ids": list(m.target_dist.ids), "probs": list(m.target_dist.probs)}
        if m.HasField("target_dist") else None,
        "ctx_len": m.ctx_len, "ctx_hash": m.ctx_hash,
        "top_k_ids": [list(t.ids) for t in m.top_k_ids],
        "metrics": {"alpha_mean": m.metrics.alpha_mean, "la_over_k": m.metrics.la_over_k,
                    "prefill_ms": m.metrics.prefill_ms, "queue_ms": m.metrics.queue_ms, "row_ms": m.metrics.row_ms},
        "accepted_nodes": list(m.accepted_nodes),
        "node_budget": m.node_budget,
    }
