"""A session stream: the target's own tokens on an open session, one k = 0 verify round each.

Each token is exactly the round `verify` (cloud/rounds.py) runs for a request with no draft tokens, built
from the session's committed context: it goes through the scheduler batched with other work, counts in
admission and metrics like any round, and is the target's draw at its position (greedy: the argmax;
sampled: the draw keyed by (seed, position), as a k = 0 bonus and /v1/generate draw it). So a session's
text does not depend on which positions were streamed and which speculated (PROTOCOL.md, "Streaming on a
session"). The first round uses the client's ctx_len / ctx_hash, so the cloud keeps S[:ctx_len] (it may
hold more, committed by an earlier stream whose client left) exactly as a verify round does.

A caller that goes away (REST disconnect, gRPC cancel) cancels the stream in its round: `verify` lets an
admitted round finish and be applied, and no further round is asked for.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from cloud.core import ServiceCore
from cloud.engine import HASH_RE, check_context
from cloud.rounds import verify
from cloud.session import Session
from shared.errors import InvalidArgument
from shared.protocol import DraftProposal, StreamDone, StreamedToken, StreamSessionRequest, VerifyRequest

log = logging.getLogger(__name__)


def stream_session(core: ServiceCore, req: StreamSessionRequest,
                   owner: str) -> AsyncIterator[StreamedToken | StreamDone]:
    """Check the request now (errors before any compute leave the session as it was), then stream the
    target's own tokens on the session, one k = 0 verify round each."""
    core.refuse_when_unhealthy()
    s = core.lookup(req.ctx_id, owner)
    first = first_round(req, s, core.settings.max_generate_tokens)
    return stream_rounds(core, s, first, req, owner)


def k0_round(ctx_id: str, ctx_len: int, ctx_hash: str) -> VerifyRequest:
    """A verify round with no draft: the cloud commits one token, the target's own at position ctx_len + 1."""
    return VerifyRequest(ctx_id, ctx_len, ctx_hash, [], DraftProposal([], []))


def first_round(req: StreamSessionRequest, s: Session, max_tokens: int) -> VerifyRequest:
    """The stream's first round, after every check that can refuse it (422, 409): run before any compute,
    so a refused stream leaves the session as it was. The round checks the context again when it runs."""
    if not 1 <= req.max_new_tokens <= max_tokens:
        raise InvalidArgument(f"max_new_tokens = {req.max_new_tokens!r} is not in [1, {max_tokens}] "
                              "(--max-generate-tokens)")
    if req.ctx_len < 1:
        raise InvalidArgument(f"ctx_len = {req.ctx_len}: the context must hold at least one token")
    if not HASH_RE.fullmatch(req.ctx_hash):
        raise InvalidArgument(f"ctx_hash {req.ctx_hash!r} is not 16 lower-case hex digits")
    first = k0_round(req.ctx_id, req.ctx_len, req.ctx_hash)
    check_context(s.context, first)  # ContextMismatch (409) now, before the answer starts
    return first


async def stream_rounds(core: ServiceCore, s: Session, first: VerifyRequest, req: StreamSessionRequest,
                        owner: str) -> AsyncIterator[StreamedToken | StreamDone]:
    """Each token as its round commits it, then StreamDone; stops at max_new_tokens ("length"), after an eos
    token with stop_at_eos ("eos"), or when the next round would pass the model's context ("context")."""
    t_start = core.clock()
    round_req, last = first, None
    reason, decode_ms, queue_ms, n = "length", 0.0, 0.0, 0
    for _ in range(req.max_new_tokens):
        if round_req.ctx_len >= core.info.max_context:  # a round commits a token after ctx_len: none fits
            reason = "context"
            break
        last = await verify(core, round_req, owner, 0)
        tok = last.correction
        assert tok is not None, "a k = 0 round always answers a bonus token"
        n += 1
        s.counters.streamed += 1
        core.metrics.streamed.inc()
        decode_ms += last.metrics.prefill_ms
        queue_ms += last.metrics.queue_ms
        yield StreamedToken(tok, last.ctx_len, last.feature, last.states, last.node_budget)
        if req.stop_at_eos and tok in core.info.eos_ids:
            reason = "eos"
            break
        if core.speculate_instead(s):
            reason = "speculate"
            break
        ctx = s.context  # the session's own committed context: the next token follows it
        round_req = k0_round(s.ctx_id, len(ctx), ctx.hash_at(len(ctx)))
    ctx_len, ctx_hash = (last.ctx_len, last.ctx_hash) if last is not None else (first.ctx_len, first.ctx_hash)
    total_ms = (core.clock() - t_start) * 1000.0
    log.info("session stream", extra={"fields": {"event": "stream", "ctx_id": s.ctx_id, "tokens": n,
                                                 "stop_reason": reason, "ctx_len": ctx_len}})
    yield StreamDone(n, ctx_len, ctx_hash, {"decode_ms": decode_ms, "queue_ms": queue_ms, "total_ms": total_ms,
                                            "stop_reason": reason})
