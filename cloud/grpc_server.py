"""gRPC boundary (grpc.aio): protobuf <-> shared.protocol dataclasses, errors -> status codes.

`specsplit.v1.Verifier`, the standard `grpc.health.v1.Health` service and server reflection.
Auth: metadata `authorization: Bearer KEY` (the REST rule: any other form is no key). Order of a
call: the key (before the message is even parsed) -> the parse -> list counts (Verify: before any
conversion, so a message of a million entries is refused at the cost of a length) -> the service.
A `SpecSplitError` aborts the call with the code of `GRPC_CODES` (the one mapping), its message as
details, the REST error body as JSON in the trailing metadata `specsplit-error` (e.g.
`expected_ctx_len` of a 409) and, for 429 / 503 kinds, `retry-after` (seconds).
Metadata `x-request-id` (shared/request_id.py) is checked, echoed in the initial metadata and
carried by the log lines of the call. Proto3 has no presence for scalars: an empty draft_kind reads "sampled", an empty correction
"strict", an unset sampling_cfg the defaults, and top_p / repetition_penalty of 0 read 1.0.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from cloud.guards import bearer_key, check_dist_sizes, check_verify_counts
from cloud.ports import GRPC_OPTIONS, PortInUse, in_use_message
from cloud.service import VerifierService
from shared.config import SamplingConfig
from shared.errors import Internal, InvalidArgument, SpecSplitError
from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc
from shared.protocol import (
    DraftProposal,
    OpenSessionRequest,
    SessionInfo,
    SparseDist,
    StreamDone,
    StreamedToken,
    StreamSessionRequest,
    TargetFeature,
    TargetStates,
    VerifyRequest,
    VerifyResponse,
)
from shared.request_id import CURRENT, REQUEST_ID_HEADER, check_request_id

GRPC_CODES: dict[str, grpc.StatusCode] = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "unauthenticated": grpc.StatusCode.UNAUTHENTICATED,
    "permission_denied": grpc.StatusCode.PERMISSION_DENIED,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "payload_too_large": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
}
log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Verifier"].full_name
R = TypeVar("R")


class Malformed:
    """A request whose bytes did not parse: answered INVALID_ARGUMENT like a malformed REST body."""

    def __init__(self, error: str) -> None:
        self.error = error


def parse_message(message_class: Any, data: bytes) -> Any:
    try:
        return message_class.FromString(data)
    except DecodeError as e:
        return Malformed(str(e))


def add_verifier(servicer: VerifierServicer, server: grpc.aio.Server) -> None:
    """Register the servicer like the generated helper does, but with the raw bytes as the request:
    each method checks the key first and parses after (`_mapped`, `_streamed`)."""
    handlers = {}
    for m in pb.DESCRIPTOR.services_by_name["Verifier"].methods:
        resp = getattr(pb, m.output_type.name)
        kind = grpc.unary_stream_rpc_method_handler if m.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[m.name] = kind(getattr(servicer, m.name), request_deserializer=None,
                                response_serializer=resp.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


# --- protobuf <-> dataclasses (the one place) -------------------------------------------------
def sampling_from_pb(m: pb.SamplingConfig) -> SamplingConfig:
    return SamplingConfig(temperature=m.temperature, top_p=m.top_p or 1.0, top_k=m.top_k,
                          repetition_penalty=m.repetition_penalty or 1.0)


def open_from_pb(m: pb.OpenSessionRequest) -> OpenSessionRequest:
    cfg = sampling_from_pb(m.sampling_cfg) if m.HasField("sampling_cfg") else SamplingConfig()
    return OpenSessionRequest(list(m.prompt_ids), cfg, m.seed, m.correction or "strict", m.max_new_tokens,
                              m.feature_encoding, m.feature_window)


def states_to_pb(s: TargetStates) -> pb.TargetStates:
    return pb.TargetStates(first=s.first, count=s.count, encoding=s.encoding, data=s.data, scales=s.scales)


def feature_to_pb(f: TargetFeature) -> pb.TargetFeature:
    return pb.TargetFeature(prefix_len=f.prefix_len, encoding=f.encoding, data=f.data, scale=f.scale)


def verify_from_pb(m: pb.VerifyRequest) -> VerifyRequest:
    dists = [SparseDist(list(d.ids), list(d.probs)) for d in m.q_dists] if len(m.q_dists) else None
    draft = DraftProposal(list(m.draft_tokens), list(m.q_token_probs), m.draft_kind or "sampled", dists,
                          list(m.hard_mask) or None, list(m.tree_parents) if m.tree else None)
    return VerifyRequest(m.ctx_id, m.ctx_len, m.ctx_hash, list(m.append_ids), draft, m.return_top_k, m.request_id,
                         m.check_last)


def info_to_pb(i: SessionInfo) -> pb.SessionInfo:
    out = pb.SessionInfo(ctx_id=i.ctx_id, ctx_len=i.ctx_len, ctx_hash=i.ctx_hash, vocab_size=i.vocab_size,
                         counters_json=json.dumps(i.counters) if i.counters else "", numerics=i.numerics,
                         node_budget=i.node_budget, tokenizer_fingerprint=i.tokenizer_fingerprint)
    if i.feature is not None:
        out.feature.CopyFrom(feature_to_pb(i.feature))
    if i.states is not None:
        out.states.CopyFrom(states_to_pb(i.states))
    if i.node_acceptance is not None:
        out.node_acceptance.kept.extend(i.node_acceptance.kept)
        out.node_acceptance.tried.extend(i.node_acceptance.tried)
    if i.forward_cost is not None:
        out.forward_cost.CopyFrom(pb.ForwardCost(**asdict(i.forward_cost)))
    return out


def response_to_pb(r: VerifyResponse) -> pb.VerifyResponse:
    out = pb.VerifyResponse(accepted_len=r.accepted_len, next_kind=r.next_kind, ctx_len=r.ctx_len,
                            ctx_hash=r.ctx_hash, top_k_ids=[pb.TopIds(ids=t) for t in r.top_k_ids],
                            metrics=pb.RoundMetrics(**asdict(r.metrics)))
    if r.correction is not None:
        out.correction = r.correction
    if r.target_dist is not None:
        out.target_dist.CopyFrom(pb.SparseDist(ids=r.target_dist.ids, probs=r.target_dist.probs))
    if r.feature is not None:
        out.feature.CopyFrom(feature_to_pb(r.feature))
    if r.states is not None:
        out.states.CopyFrom(states_to_pb(r.states))
    if r.accepted_nodes is not None:
        out.accepted_nodes.extend(r.accepted_nodes)
    out.node_budget = r.node_budget
    return out


def stream_from_pb(m: pb.StreamSessionRequest) -> StreamSessionRequest:
    return StreamSessionRequest(m.ctx_id, m.ctx_len, m.ctx_hash, m.max_new_tokens,
                                m.stop_at_eos if m.HasField("stop_at_eos") else True)


def stream_event_to_pb(e: StreamedToken | StreamDone) -> pb.StreamSessionEvent:
    if isinstance(e, StreamDone):
        return pb.StreamSessionEvent(done=pb.StreamDone(tokens=e.tokens, ctx_len=e.ctx_len, ctx_hash=e.ctx_hash,
                                                        metrics=pb.StreamMetrics(**e.metrics)))
    token = pb.StreamedToken(token_id=e.token_id, ctx_len=e.ctx_len, node_budget=e.node_budget)
    if e.feature is not None:
        token.feature.CopyFrom(feature_to_pb(e.feature))
    if e.states is not None:
        token.states.CopyFrom(states_to_pb(e.states))
    return pb.StreamSessionEvent(token=token)


def check_verify_pb(m: pb.VerifyRequest, service: VerifierService) -> None:
    """The list counts of a Verify message, read as lengths before any entry is converted."""
    lim = service.limits
    check_verify_counts(declared_k=m.k, n_draft=len(m.draft_tokens), n_q=len(m.q_token_probs),
                        n_dists=len(m.q_dists) or None, n_hard=len(m.hard_mask), n_append=len(m.append_ids),
                        max_k=lim.max_k, max_context=lim.max_context,
                        n_parents=len(m.tree_parents) if m.tree else None, max_tree_nodes=lim.max_tree_nodes)
    check_dist_sizes(((len(d.ids), len(d.probs)) for d in m.q_dists), lim.vocab_size)


# --- errors (the one mapping) -----------------------------------------------------------------
Method = Callable[[Any, Any, grpc.aio.ServicerContext, str], Awaitable[R]]


def _mapped(message_class: Any) -> Callable[[Method[R]], Callable[[Any, bytes, grpc.aio.ServicerContext],
                                                                   Awaitable[R]]]:
    """Key check, parse into `message_class`, call method(self, request, context, owner), map errors."""

    def wrap(method: Method[R]) -> Callable[[Any, bytes, grpc.aio.ServicerContext], Awaitable[R]]:
        @functools.wraps(method)
        async def call(self: VerifierServicer, data: bytes, context: grpc.aio.ServicerContext) -> R:
            return await _guarded(self, context, lambda: method(self, _parsed(message_class, data), context,
                                                                self._owner(context)))

        return call

    return wrap


def _parsed(message_class: Any, data: bytes) -> Any:
    request = parse_message(message_class, data)
    if isinstance(request, Malformed):
        raise InvalidArgument(f"malformed message: {request.error}")
    return request


async def _guarded(servicer: VerifierServicer, context: grpc.aio.ServicerContext,
                   run: Callable[[], Awaitable[R]]) -> R:
    method = getattr(run, "__name__", "call")
    token = None
    try:
        token = await _begin(servicer, context)
        servicer._owner(context)  # the key before anything else, even the parse
        reply = await run()
        servicer.service.count_response("grpc", 200)
        return reply
    except SpecSplitError as err:
        await _abort(servicer, context, err)
        raise  # unreachable: abort raises
    except grpc.aio.AbortError:
        raise
    except Exception as exc:  # a bug or a device failure: INTERNAL with a body, logged
        await _crashed(servicer, context, exc, method)
        raise
    finally:
        if token is not None:
            CURRENT.reset(token)


async def _begin(servicer: VerifierServicer, context: grpc.aio.ServicerContext) -> contextvars.Token[str] | None:
    """The call's request id, if any: checked, echoed in the initial metadata and set for the log lines of the
    call; returns the token the caller resets when the call ends."""
    token = None
    rid = dict(context.invocation_metadata() or ()).get(REQUEST_ID_HEADER)
    if isinstance(rid, str):
        await context.send_initial_metadata(((REQUEST_ID_HEADER, check_request_id(rid)),))
        token = CURRENT.set(rid)
    return token


async def _crashed(servicer: VerifierServicer, context: grpc.aio.ServicerContext, exc: Exception,
                   method: str) -> None:
    crash = Internal.of(exc)
    log.error("unexpected error %s in %s", crash.details["error_id"], method, exc_info=exc)
    await _abort(servicer, context, crash)


def _streamed(message_class: Any) -> Callable[[Callable[..., AsyncGenerator[Any, None]]],
                                              Callable[[Any, bytes, grpc.aio.ServicerContext], AsyncIterator[Any]]]:
    """`_mapped` for a server-streaming method(self, request, context, owner) -> async iterator of replies:
    an error before the first reply or mid-stream aborts the call with its code, as a unary call's does; a
    caller that cancels cancels the stream (and closes the method's iterator)."""

    def wrap(method: Callable[..., AsyncGenerator[Any, None]]
             ) -> Callable[[Any, bytes, grpc.aio.ServicerContext], AsyncIterator[Any]]:
        @functools.wraps(method)
        async def call(self: VerifierServicer, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            token = None
            try:
                token = await _begin(self, context)
                self._owner(context)  # the key before anything else, even the parse
                replies = method(self, _parsed(message_class, data), context, self._owner(context))
                async with contextlib.aclosing(replies):  # a cancel closes the method's iterator
                    async for reply in replies:
                        yield reply
                self.service.count_response("grpc", 200)
            except SpecSplitError as err:
                await _abort(self, context, err)
            except grpc.aio.AbortError:
                raise
            except Exception as exc:  # a bug or a device failure: INTERNAL with a body, logged
                await _crashed(self, context, exc, method.__name__)
            finally:
                # a stream closed at shutdown is finalised outside the context its request id was set in
                if token is not None:
                    with contextlib.suppress(ValueError):
                        CURRENT.reset(token)

        return call

    return wrap


async def _abort(servicer: VerifierServicer, context: grpc.aio.ServicerContext, err: SpecSplitError) -> None:
    servicer.service.count_error(err.code)
    servicer.service.count_response("grpc", err.http_status)
    trailing = [("specsplit-error", json.dumps(err.to_body()))]
    if err.retry_after_s is not None:
        trailing.append(("retry-after", str(err.retry_after_s)))
    context.set_trailing_metadata(tuple(trailing))
    await context.abort(GRPC_CODES.get(err.code, grpc.StatusCode.INTERNAL), err.message)


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, service: VerifierService) -> None:
        self.service = service

    def _owner(self, context: grpc.aio.ServicerContext) -> str:
        auth = dict(context.invocation_metadata() or ()).get("authorization")
        return self.service.authenticate(bearer_key(auth if isinstance(auth, str) else None))

    @_mapped(pb.OpenSessionRequest)
    async def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.aio.ServicerContext,
                          owner: str) -> pb.SessionInfo:
        return info_to_pb(await self.service.open_session(open_from_pb(request), owner, CURRENT.get()))

    @_mapped(pb.VerifyRequest)
    async def Verify(self, request: pb.VerifyRequest, context: grpc.aio.ServicerContext,
                     owner: str) -> pb.VerifyResponse:
        check_verify_pb(request, self.service)
        cfg = sampling_from_pb(request.sampling_cfg) if request.HasField("sampling_cfg") else None
        return response_to_pb(await self.service.verify(verify_from_pb(request), owner, request.k, cfg))

    @_mapped(pb.GetSessionRequest)
    async def GetSession(self, request: pb.GetSessionRequest, context: grpc.aio.ServicerContext,
                         owner: str) -> pb.SessionInfo:
        return info_to_pb(self.service.get_session(request.ctx_id, owner))

    @_mapped(pb.CloseSessionRequest)
    async def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext,
                           owner: str) -> pb.CloseSessionResponse:
        self.service.close_session(request.ctx_id, owner)
        return pb.CloseSessionResponse(closed=True)

    @_mapped(pb.GetModelRequest)
    async def GetModel(self, request: pb.GetModelRequest, context: grpc.aio.ServicerContext,
                       owner: str) -> pb.ModelInfo:
        cost: dict[str, Any] = self.service.forward_cost()
        return pb.ModelInfo(**{**asdict(self.service.info), "forward_cost": pb.ForwardCost(**cost)})

    @_streamed(pb.StreamSessionRequest)
    async def StreamSession(self, request: pb.StreamSessionRequest, context: grpc.aio.ServicerContext,
                            owner: str) -> AsyncGenerator[pb.StreamSessionEvent, None]:
        events = self.service.stream_session(stream_from_pb(request), owner)  # refused before any compute
        async with contextlib.aclosing(events):  # type: ignore[type-var]
            async for e in events:
                yield stream_event_to_pb(e)


async def start_grpc(service: VerifierService, host: str, port: int
                     ) -> tuple[grpc.aio.Server, int, health_aio.HealthServicer]:
    """Build, bind and start the gRPC server; returns (server, bound port, health servicer)."""
    limit = service.settings.max_body_bytes
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                      ("grpc.max_send_message_length", 64 * 1024**2), *GRPC_OPTIONS])
    add_verifier(VerifierServicer(service), server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio raises where older versions returned 0
        bound = 0
    if not bound:
        raise PortInUse(in_use_message("gRPC", host, port, "--grpc-port"))
    await server.start()
    status = health_pb2.HealthCheckResponse.SERVING if service.ready else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health.set(name, status)
    return server, bound, health
