"""gRPC transport (stubs from shared.pb): protobuf <-> shared dataclasses, in one place."""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from shared.config import SamplingConfig
from shared.features import ENCODINGS
from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc
from shared.protocol import (
    ForwardCostInfo,
    NodeAcceptance,
    OpenSessionRequest,
    RoundMetrics,
    SessionInfo,
    SparseDist,
    StreamDone,
    StreamedToken,
    TargetFeature,
    TargetStates,
    VerifyRequest,
    VerifyResponse,
)
from shared.request_id import REQUEST_ID_HEADER, check_request_id

from .base import ROUTE_HEADER, GenerateResult, ModelInfo, Traffic, check_route_key, with_max_generate_tokens
from .errors import CloudTimeout, CloudUnavailable, error_from_grpc, with_key_hint


def sampling_to_pb(c: SamplingConfig) -> pb.SamplingConfig:
    return pb.SamplingConfig(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
                             repetition_penalty=c.repetition_penalty)


def verify_request_to_pb(req: VerifyRequest, sampling: SamplingConfig | None = None) -> pb.VerifyRequest:
    d = req.draft
    return pb.VerifyRequest(
        sampling_cfg=None if sampling is None else sampling_to_pb(sampling),
        ctx_id=req.ctx_id, ctx_len=req.ctx_len, ctx_hash=req.ctx_hash, append_ids=req.append_ids,
        draft_tokens=d.draft_tokens, q_token_probs=d.q_token_probs,
        q_dists=[pb.SparseDist(ids=q.ids, probs=q.probs) for q in d.q_dists or []],
        draft_kind=d.draft_kind, hard_mask=d.hard_mask or [], k=req.k, return_top_k=req.return_top_k,
        request_id=req.request_id, check_last=req.check_last, tree=d.tree_parents is not None,
        tree_parents=d.tree_parents or [])


def verify_response_from_pb(m: pb.VerifyResponse) -> VerifyResponse:
    return VerifyResponse(
        accepted_len=m.accepted_len, correction=m.correction if m.HasField("correction") else None,
        next_kind=m.next_kind,
        target_dist=SparseDist(list(m.target_dist.ids), list(m.target_dist.probs)) if m.HasField("target_dist") else None,
        ctx_len=m.ctx_len, ctx_hash=m.ctx_hash, top_k_ids=[list(row.ids) for row in m.top_k_ids],
        metrics=RoundMetrics(alpha_mean=m.metrics.alpha_mean, la_over_k=m.metrics.la_over_k,
                             prefill_ms=m.metrics.prefill_ms, queue_ms=m.metrics.queue_ms,
                             row_ms=m.metrics.row_ms),
        feature=feature_from_pb(m.feature) if m.HasField("feature") else None,
        accepted_nodes=list(m.accepted_nodes),
        states=states_from_pb(m.states) if m.HasField("states") else None, node_budget=m.node_budget)


def states_from_pb(m: pb.TargetStates) -> TargetStates | None:
    if m.encoding not in ENCODINGS:
        return None
    return TargetStates(m.first, m.count, m.encoding, m.data, list(m.scales))


def feature_from_pb(m: pb.TargetFeature) -> TargetFeature | None:
    if m.encoding not in ENCODINGS:
        return None
    return TargetFeature(m.prefix_len, m.encoding, bytes(m.data), m.scale)


def session_from_pb(m: pb.SessionInfo) -> SessionInfo:
    counters = json.loads(m.counters_json) if m.counters_json else {}
    return SessionInfo(ctx_id=m.ctx_id, ctx_len=m.ctx_len, ctx_hash=m.ctx_hash, vocab_size=m.vocab_size,
                       counters=counters, numerics=m.numerics, node_budget=m.node_budget,
                       tokenizer_fingerprint=m.tokenizer_fingerprint,
                       feature=feature_from_pb(m.feature) if m.HasField("feature") else None,
                       states=states_from_pb(m.states) if m.HasField("states") else None,
                       node_acceptance=NodeAcceptance(list(m.node_acceptance.kept), list(m.node_acceptance.tried))
                       if m.HasField("node_acceptance") else None,
                       forward_cost=forward_cost_from_pb(m.forward_cost) if m.HasField("forward_cost") else None)


def forward_cost_from_pb(m: pb.ForwardCost) -> ForwardCostInfo:
    return ForwardCostInfo(base_ms=m.base_ms, row_ms=m.row_ms, prefill_token_ms=m.prefill_token_ms,
                           forwards=m.forwards, tokens_per_second=m.tokens_per_second, node_value=m.node_value,
                           linear_row_ms=m.linear_row_ms, per_bucket=m.per_bucket)


def streamed_from_pb(m: pb.StreamSessionEvent) -> StreamedToken | StreamDone:
    if m.WhichOneof("event") == "done":
        d = m.done
        metrics = {"decode_ms": d.metrics.decode_ms, "queue_ms": d.metrics.queue_ms,
                   "total_ms": d.metrics.total_ms, "stop_reason": d.metrics.stop_reason}
        return StreamDone(d.tokens, d.ctx_len, d.ctx_hash, metrics)
    t = m.token
    return StreamedToken(t.token_id, t.ctx_len, feature_from_pb(t.feature) if t.HasField("feature") else None,
                         states_from_pb(t.states) if t.HasField("states") else None, t.node_budget)


class _EventWatchdog:
    """Calls `expire` once when `timeout_s` pass without an event: counted from the start and from each
    `touch()`, not while `pause()`d (the caller holds an event)."""

    def __init__(self, timeout_s: float, expire: Callable[[], object]) -> None:
        self._timeout_s, self._expire = timeout_s, expire
        self._cond = threading.Condition()
        self._due: float | None = time.monotonic() + timeout_s
        self._stopped = False
        self.expired = False
        threading.Thread(target=self._watch, daemon=True, name="specsplit-stream-watchdog").start()

    def touch(self) -> None:
        with self._cond:
            self._due = time.monotonic() + self._timeout_s
            self._cond.notify()

    def pause(self) -> None:
        with self._cond:
            self._due = None

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while not self._stopped:
                left = None if self._due is None else self._due - time.monotonic()
                if left is not None and left <= 0:
                    self.expired = True
                    break
                self._cond.wait(left)
        if self.expired:
            self._expire()


def tls_credentials(ca_cert: str | None) -> grpc.ChannelCredentials:
    """TLS for a channel: the server's certificate checked against `ca_cert` (a PEM file), else gRPC's roots."""
    if ca_cert is None:
        return grpc.ssl_channel_credentials()
    with open(ca_cert, "rb") as f:
        return grpc.ssl_channel_credentials(root_certificates=f.read())


class GrpcTransport:
    supports_generate = False
    supports_session_stream = True

    def __init__(self, target: str, api_key: str | None = None, tls: bool = False, ca_cert: str | None = None) -> None:
        self._target = target
        self._channel = grpc.secure_channel(target, tls_credentials(ca_cert)) if tls else grpc.insecure_channel(target)
        self._stub = pb_grpc.VerifierStub(self._channel)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.traffic = Traffic()

    def routed(self, route_key: str, request_id: str | None = None) -> GrpcTransport:
        view = copy.copy(self)  # same channel, same Traffic
        kept = tuple(m for m in self._metadata if m[0] not in (ROUTE_HEADER, REQUEST_ID_HEADER))
        view._metadata = (*kept, (ROUTE_HEADER, check_route_key(route_key)))
        if request_id is not None:
            view._metadata = (*view._metadata, (REQUEST_ID_HEADER, check_request_id(request_id)))
        return view

    def _call(self, rpc: Callable[..., Any], request: Any, timeout: float) -> Any:
        self.traffic.calls += 1
        self.traffic.bytes_up += request.ByteSize()
        try:
            reply = rpc(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e) from None
        self.traffic.bytes_down += reply.ByteSize()
        return reply

    def _error(self, e: grpc.RpcError) -> Exception:
        """A failed call's status -> the project's error (the one mapping, errors.error_from_grpc)."""
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        details = e.details() if hasattr(e, "details") else str(e)
        trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else ()
        err = with_key_hint(error_from_grpc(code, details or "", tuple(trailing or ())))
        if code == grpc.StatusCode.UNAVAILABLE and not trailing:  # no answer from a verifier at all
            err.message = (f"cannot reach the cloud at {self._target} (gRPC: {details}): is specsplit-cloud "
                           "running there? (--grpc HOST:PORT)")
            err.args = (err.message,)
        return err

    def open_session(self, req: OpenSessionRequest, timeout: float) -> SessionInfo:
        msg = pb.OpenSessionRequest(
            prompt_ids=req.prompt_ids, seed=req.seed, correction=req.correction, max_new_tokens=req.max_new_tokens,
            sampling_cfg=sampling_to_pb(req.sampling_cfg), feature_encoding=req.feature_encoding,
            feature_window=req.feature_window)
        return session_from_pb(self._call(self._stub.OpenSession, msg, timeout))

    def verify(self, req: VerifyRequest, timeout: float, sampling: SamplingConfig | None = None) -> VerifyResponse:
        return verify_response_from_pb(self._call(self._stub.Verify, verify_request_to_pb(req, sampling), timeout))

    def get_session(self, ctx_id: str, timeout: float) -> SessionInfo:
        return session_from_pb(self._call(self._stub.GetSession, pb.GetSessionRequest(ctx_id=ctx_id), timeout))

    def close_session(self, ctx_id: str, timeout: float) -> None:
        self._call(self._stub.CloseSession, pb.CloseSessionRequest(ctx_id=ctx_id), timeout)

    def get_model(self, timeout: float) -> ModelInfo:
        m = self._call(self._stub.GetModel, pb.GetModelRequest(), timeout)
        info = ModelInfo(model_id=m.model_id, vocab_size=m.vocab_size, eos_ids=list(m.eos_ids),
                         max_context=m.max_context, dtype=m.dtype, device=m.device,
                         tokenizer_fingerprint=m.tokenizer_fingerprint, max_k=m.max_k,
                         tokenizer_size=m.tokenizer_size, feature_size=m.feature_size,
                         feature_encodings=list(m.feature_encodings), tensor_parallel=m.tensor_parallel,
                         max_tree_nodes=m.max_tree_nodes, max_feature_window=m.max_feature_window,
                         session_stream=m.session_stream, dtype_reason=m.dtype_reason,
                         batch_invariant=m.batch_invariant, runner=m.runner, numerics=m.numerics,
                         forward_path=m.forward_path, batch_invariant_probe=m.batch_invariant_probe,
                         forward_cost=forward_cost_from_pb(m.forward_cost) if m.HasField("forward_cost") else None)
        return with_max_generate_tokens(info, int(getattr(m, "max_generate_tokens", 0)))

    def generate(self, prompt_ids: list[int], cfg: SamplingConfig, seed: int, max_new_tokens: int,
                 timeout: float, stop_at_eos: bool = True) -> GenerateResult:
        raise CloudUnavailable("the gRPC service has no target-only generate call")

    def generate_stream(self, prompt_ids: list[int], cfg: SamplingConfig, seed: int, max_new_tokens: int,
                        timeout: float, stop_at_eos: bool = True) -> Iterator[int | GenerateResult]:
        raise CloudUnavailable("the gRPC service has no target-only generate call")

    def stream_session(self, ctx_id: str, ctx_len: int, ctx_hash: str, max_new_tokens: int, stop_at_eos: bool,
                       timeout: float) -> Iterator[StreamedToken | StreamDone]:
        """StreamSession; `timeout` bounds each wait for an event, as on REST. gRPC has no deadline per message:
        a watchdog cancels the call when no event came within `timeout` of the last (CloudTimeout then).
        Closing the iterator early cancels the call (the cloud then stops the stream)."""
        msg = pb.StreamSessionRequest(ctx_id=ctx_id, ctx_len=ctx_len, ctx_hash=ctx_hash,
                                      max_new_tokens=max_new_tokens, stop_at_eos=stop_at_eos)
        self.traffic.calls += 1
        self.traffic.bytes_up += msg.ByteSize()
        call = self._stub.StreamSession(msg, metadata=self._metadata)
        watchdog = _EventWatchdog(timeout, call.cancel)
        try:
            for m in call:
                watchdog.pause()
                self.traffic.bytes_down += m.ByteSize()
                e = streamed_from_pb(m)
                yield e
                if isinstance(e, StreamDone):
                    return
                watchdog.touch()  # the wait for the next event starts when the caller asks for it
        except grpc.RpcError as err:
            if watchdog.expired:
                raise CloudTimeout(f"StreamSession: no event within {timeout:.3f} s") from None
            raise self._error(err) from None
        finally:
            watchdog.stop()
            call.cancel()  # a no-op once the call has ended
        raise CloudUnavailable("StreamSession: the stream ended without 'done'")

    def close(self) -> None:
        self._channel.close()
