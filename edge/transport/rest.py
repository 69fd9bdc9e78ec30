"""REST transport (httpx, one keep-alive connection pool): PROTOCOL.md JSON <-> shared dataclasses."""

from __future__ import annotations

import contextlib
import copy
import json
import ssl
from collections.abc import Generator, Iterator
from typing import Any

import httpx

from shared.config import SamplingConfig
from shared.errors import InvalidArgument
from shared.features import feature_from_json, states_from_json
from shared.protocol import (
    ForwardCostInfo,
    NodeAcceptance,
    OpenSessionRequest,
    RoundMetrics,
    SessionInfo,
    SparseDist,
    StreamDone,
    StreamedToken,
    VerifyRequest,
    VerifyResponse,
)
from shared.request_id import REQUEST_ID_HEADER, check_request_id

from .base import ROUTE_HEADER, GenerateResult, ModelInfo, Traffic, check_route_key, with_max_generate_tokens
from .errors import CloudTimeout, CloudUnavailable, error_from_body, error_from_http, with_key_hint


def verify_request_json(req: VerifyRequest, sampling: SamplingConfig | None = None) -> dict[str, Any]:
    d = req.draft
    extra: dict[str, Any] = {} if sampling is None else {"sampling_cfg": sampling.to_dict()}
    if req.check_last:  # only when asked: an older cloud never sees the field
        extra["check_last"] = True
    if d.tree_parents is not None:
        extra["tree_parents"] = d.tree_parents
    return {**extra,
        "ctx_id": req.ctx_id, "ctx_len": req.ctx_len, "ctx_hash": req.ctx_hash, "append_ids": req.append_ids,
        "draft_tokens": d.draft_tokens, "q_token_probs": d.q_token_probs,
        "q_dists": None if d.q_dists is None else [{"ids": q.ids, "probs": q.probs} for q in d.q_dists],
        "draft_kind": d.draft_kind, "hard_mask": d.hard_mask, "k": req.k,
        "return_top_k": req.return_top_k, "request_id": req.request_id,
    }


def verify_response_from_json(d: dict[str, Any]) -> VerifyResponse:
    dist = d.get("target_dist")
    m = d.get("metrics") or {}
    return VerifyResponse(
        accepted_len=int(d["accepted_len"]),
        correction=None if d.get("correction") is None else int(d["correction"]),
        next_kind=str(d["next_kind"]),
        target_dist=None if dist is None else SparseDist([int(i) for i in dist["ids"]], [float(p) for p in dist["probs"]]),
        ctx_len=int(d["ctx_len"]), ctx_hash=str(d["ctx_hash"]),
        top_k_ids=[[int(i) for i in row] for row in d.get("top_k_ids") or []],
        metrics=RoundMetrics(**{k: float(m[k]) for k in ("alpha_mean", "la_over_k", "prefill_ms", "queue_ms",
                                                                  "row_ms") if k in m}),
        feature=feature_from_json(d.get("feature")),
        accepted_nodes=None if d.get("accepted_nodes") is None else [int(j) for j in d["accepted_nodes"]],
        states=states_from_json(d.get("states")),
        node_budget=int(d.get("node_budget") or 0),
    )


def session_from_json(d: dict[str, Any]) -> SessionInfo:
    return SessionInfo(ctx_id=str(d["ctx_id"]), ctx_len=int(d["ctx_len"]), ctx_hash=str(d["ctx_hash"]),
                       vocab_size=int(d.get("vocab_size", 0)), counters=dict(d.get("counters") or {}),
                       numerics=str(d.get("numerics") or ""), node_budget=int(d.get("node_budget") or 0),
                       tokenizer_fingerprint=str(d.get("tokenizer_fingerprint") or ""),
                       feature=feature_from_json(d.get("feature")), states=states_from_json(d.get("states")),
                       node_acceptance=acceptance_from_json(d.get("node_acceptance")),
                       forward_cost=forward_cost_from_json(d.get("forward_cost")))


def acceptance_from_json(d: Any) -> NodeAcceptance | None:
    if not isinstance(d, dict):
        return None
    return NodeAcceptance([float(x) for x in d.get("kept") or []], [float(x) for x in d.get("tried") or []])


def forward_cost_from_json(d: Any) -> ForwardCostInfo | None:
    """The cloud's fitted forward cost (GET /v1/model, the open answer); None when absent or malformed: the cost only
    informs the edge's choices, so a cloud that says it badly is read as one that does not say it."""
    if not isinstance(d, dict):
        return None
    try:
        return ForwardCostInfo.from_mapping(d)
    except (TypeError, ValueError):
        return None


def streamed_from_json(event: str, d: dict[str, Any]) -> StreamedToken | StreamDone:
    """One event of a session stream: a token (`data:`), or the end (`event: done`)."""
    if event == "done":
        return StreamDone(int(d["tokens"]), int(d["ctx_len"]), str(d["ctx_hash"]), dict(d.get("metrics") or {}))
    return StreamedToken(int(d["token_id"]), int(d["ctx_len"]), feature_from_json(d.get("feature")),
                         states_from_json(d.get("states")), int(d.get("node_budget") or 0))


class RestTransport:
    supports_generate = True
    supports_session_stream = True

    def __init__(self, base_url: str, api_key: str | None = None, ca_cert: str | None = None) -> None:
        headers = {"content-type": "application/json"}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self._base_url = base_url.rstrip("/")
        # an https:// URL is verified against the system's trust, or against `ca_cert` (a private CA's PEM)
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_cert) if ca_cert else True
        self._http = httpx.Client(base_url=self._base_url, headers=headers, verify=verify)
        self.traffic = Traffic()
        # per-call headers of this view: the routing key (see routed())
        self._route_headers: dict[str, str] = {}

    def routed(self, route_key: str, request_id: str | None = None) -> RestTransport:
        view = copy.copy(self)  # same httpx pool, same Traffic
        view._route_headers = {ROUTE_HEADER: check_route_key(route_key)}
        if request_id is not None:
            view._route_headers[REQUEST_ID_HEADER] = check_request_id(request_id)
        return view

    def _call(self, method: str, path: str, body: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
        content = b"" if body is None else json.dumps(body, separators=(",", ":")).encode()
        self.traffic.calls += 1
        self.traffic.bytes_up += len(content)
        try:
            r = self._http.request(method, path, content=content or None, timeout=timeout,
                                   headers=self._route_headers)
        except httpx.TimeoutException as e:
            raise CloudTimeout(f"{method} {path}: no answer within {timeout:.3f} s") from e
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as e:  # a configuration error: never retried
            raise InvalidArgument(f"the cloud URL {self._base_url!r} is not usable ({e}): pass --cloud "
                                  "http://HOST:PORT") from e
        except httpx.ConnectError as e:
            raise CloudUnavailable(f"cannot reach the cloud at {self._base_url} ({e}): is specsplit-cloud running "
                                   "there? (--cloud URL)") from e
        except httpx.TransportError as e:
            raise CloudUnavailable(f"{method} {path}: {type(e).__name__}: {e}") from e
        self.traffic.bytes_down += len(r.content)
        if r.status_code >= 400:
            raise with_key_hint(error_from_http(r.status_code, r.content, r.headers.get("retry-after")))
        try:
            out = r.json() if r.content else {}
        except ValueError as e:
            raise CloudUnavailable(f"{method} {path}: unreadable answer") from e
        if not isinstance(out, dict):
            raise CloudUnavailable(f"{method} {path}: answer is not a JSON object")
        return out

    def open_session(self, req: OpenSessionRequest, timeout: float) -> SessionInfo:
        body = {"prompt_ids": req.prompt_ids, "sampling_cfg": req.sampling_cfg.to_dict(), "seed": req.seed,
                "correction": req.correction, "max_new_tokens": req.max_new_tokens}
        if req.feature_encoding:  # only when asked: an older cloud never sees the field
            body["feature_encoding"] = req.feature_encoding
        if req.feature_window:
            body["feature_window"] = req.feature_window
        return session_from_json(self._call("POST", "/v1/sessions", body, timeout))

    def verify(self, req: VerifyRequest, timeout: float, sampling: SamplingConfig | None = None) -> VerifyResponse:
        d = self._call("POST", "/v1/verify", verify_request_json(req, sampling), timeout)
        try:
            return verify_response_from_json(d)
        except (KeyError, TypeError, ValueError) as e:
            raise CloudUnavailable(f"malformed verify answer: {e!r}") from e

    def get_session(self, ctx_id: str, timeout: float) -> SessionInfo:
        return session_from_json(self._call("GET", f"/v1/sessions/{ctx_id}", None, timeout))

    def close_session(self, ctx_id: str, timeout: float) -> None:
        self._call("DELETE", f"/v1/sessions/{ctx_id}", None, timeout)

    def get_model(self, timeout: float) -> ModelInfo:
        d = self._call("GET", "/v1/model", None, timeout)
        info = ModelInfo(model_id=str(d.get("model_id", "")), vocab_size=int(d["vocab_size"]),
                         eos_ids=[int(i) for i in d.get("eos_ids") or []], max_context=int(d.get("max_context") or 0),
                         dtype=str(d.get("dtype", "")), device=str(d.get("device", "")),
                         tokenizer_fingerprint=str(d.get("tokenizer_fingerprint", "")), max_k=int(d.get("max_k") or 0),
                         tokenizer_size=int(d.get("tokenizer_size") or 0),
                         feature_size=int(d.get("feature_size") or 0),
                         feature_encodings=[str(e) for e in d.get("feature_encodings") or []],
                         max_tree_nodes=int(d.get("max_tree_nodes") or 0),
                         max_feature_window=int(d.get("max_feature_window") or 0),
                         tensor_parallel=int(d.get("tensor_parallel") or 0),
                         session_stream=d.get("session_stream") is True,
                         dtype_reason=str(d.get("dtype_reason", "")), batch_invariant=d.get("batch_invariant") is True, runner=str(d.get("runner", "")),
                         numerics=str(d.get("numerics") or ""), forward_path=str(d.get("forward_path") or ""),
                         batch_invariant_probe=str(d.get("batch_invariant_probe") or ""),
                         forward_cost=forward_cost_from_json(d.get("forward_cost")))
        return with_max_generate_tokens(info, int(d.get("max_generate_tokens") or 0))

    def generate(self, prompt_ids: list[int], cfg: SamplingConfig, seed: int, max_new_tokens: int,
                 timeout: float, stop_at_eos: bool = True) -> GenerateResult:
        body = {"prompt_ids": prompt_ids, "sampling_cfg": cfg.to_dict(), "seed": seed,
                "max_new_tokens": max_new_tokens, "stop_at_eos": stop_at_eos}
        d = self._call("POST", "/v1/generate", body, timeout)
        return GenerateResult([int(t) for t in d["token_ids"]], dict(d.get("metrics") or {}))

    def generate_stream(self, prompt_ids: list[int], cfg: SamplingConfig, seed: int, max_new_tokens: int,
                        timeout: float, stop_at_eos: bool = True) -> Iterator[int | GenerateResult]:
        """POST /v1/generate with "stream": true (server-sent events)."""
        body = {"prompt_ids": prompt_ids, "sampling_cfg": cfg.to_dict(), "seed": seed,
                "max_new_tokens": max_new_tokens, "stream": True, "stop_at_eos": stop_at_eos}
        ids: list[int] = []
        with contextlib.closing(self._events("/v1/generate", body, timeout)) as events:
            for event, data in events:
                if event == "done":
                    yield GenerateResult(ids, dict(data.get("metrics") or {}))
                    return
                ids.append(int(data["token_id"]))
                yield ids[-1]

    def stream_session(self, ctx_id: str, ctx_len: int, ctx_hash: str, max_new_tokens: int, stop_at_eos: bool,
                       timeout: float) -> Iterator[StreamedToken | StreamDone]:
        """POST /v1/sessions/{ctx_id}/stream (server-sent events); `timeout` bounds each wait for an event."""
        body = {"ctx_len": ctx_len, "ctx_hash": ctx_hash, "max_new_tokens": max_new_tokens,
                "stop_at_eos": stop_at_eos}
        path = f"/v1/sessions/{ctx_id}/stream"
        with contextlib.closing(self._events(path, body, timeout)) as events:  # closed early: the stream stops
            for event, data in events:
                try:
                    e = streamed_from_json(event, data)
                except (KeyError, TypeError, ValueError) as err:
                    raise CloudUnavailable(f"POST {path}: malformed event: {err!r}") from err
                yield e
                if isinstance(e, StreamDone):
                    return

    def _events(self, path: str, body: dict[str, Any], timeout: float
                ) -> Generator[tuple[str, dict[str, Any]], None, None]:
        """POST `body` to `path` and read its server-sent events: (event name, data object) each until
        `event: done`; an `event: error` raises its error, an end without `done` is CloudUnavailable.
        Closing the iterator early closes the connection (the cloud then stops the stream)."""
        content = json.dumps(body, separators=(",", ":")).encode()
        self.traffic.calls += 1
        self.traffic.bytes_up += len(content)
        try:
            with self._http.stream("POST", path, content=content, timeout=timeout,
                                   headers=self._route_headers) as r:
                if r.status_code >= 400:
                    raise with_key_hint(error_from_http(r.status_code, r.read(), r.headers.get("retry-after")))
                event = "message"
                for line in r.iter_lines():
                    self.traffic.bytes_down += len(line) + 1
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data = json.loads(line[5:])
                        if event == "error":
                            raise error_from_body(data)
                        yield event, data
                        if event == "done":
                            return
                    elif not line:
                        event = "message"
        except httpx.TimeoutException as e:
            raise CloudTimeout(f"POST {path}: no answer within {timeout:.3f} s") from e
        except httpx.TransportError as e:
            raise CloudUnavailable(f"POST {path}: {type(e).__name__}: {e}") from e
        raise CloudUnavailable(f"POST {path}: the event stream ended without 'done'")

    def close(self) -> None:
        self._http.close()
