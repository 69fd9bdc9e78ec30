"""The capacity load generator: many cheap edges in one asyncio process, replaying recorded traces.

An edge here drafts nothing: a speculative session opens a session (gRPC `OpenSession`, the
prompt is prefilled), sends its trace's recorded verify requests in order (gRPC `Verify`, the
next one as soon as the answer is in), compares each answer with the recording, and closes the
session. A cloud_only session streams target-only generation of the same text (REST
`POST /v1/generate` with server-sent events: gRPC has no generate call) and compares the ids with
the trace's text, which is target greedy. gRPC aio (one HTTP/2 channel, protobuf) is the cheaper
client of the two transports per request, so verify traffic uses it; the client's own CPU time is
measured so a reader can see it stays small next to the cloud's.

Work of a case with n sessions over T traces (`assign_texts`): every session replays the same
number of texts, half from each drafter's traces, each cut after the round that reaches the
per-text token cap, so the case keeps n sessions busy until its end and covers every trace.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from bench.traces import Trace

# seconds any one call may take before it counts as an error: a patient client's, since a capacity run's sixteen
# opens on a one-core cloud queue behind each other's prefills for minutes (120 s cut off 7 of 16 llama.cpp
# streams before their first token)
CALL_TIMEOUT_S = 900.0
# fields of a verify answer compared with the recording
ANSWER_FIELDS = ("accepted_len", "correction", "next_kind", "ctx_len", "ctx_hash")


@dataclass
class TextRun:
    # session slot and the index of the trace replayed
    session: int
    trace: int
    # tokens committed (speculative: La + 1 per answered round; cloud_only: ids streamed)
    tokens: int
    # seconds since the case's start when the text's first request went out and its last answer came
    start_s: float
    end_s: float
    # speculative: latency of each Verify call; cloud_only: gap between two streamed tokens (one decode step), ms
    round_ms: list[float] = field(default_factory=list)
    # speculative: OpenSession latency (the prompt's prefill); cloud_only: time to the first token, ms
    open_ms: float = 0.0
    # answers compared with the recording (speculative: rounds; cloud_only: texts) and those that differed
    checked: int = 0
    mismatches: int = 0
    # the error that ended the text early, if any
    error: str | None = None


@dataclass
class LoadResult:
    mode: str
    sessions: int
    # wall time from the first request to the last answer, s
    wall_s: float
    texts: list[TextRun]
    # CPU seconds this process spent during the case (the load generator itself)
    client_cpu_s: float
    # largest sum over running texts of (prompt + committed) positions: the KV the load needs
    peak_positions: int
    # the first few distinct errors that ended texts early, as `describe` words them
    error_messages: list[str] = field(default_factory=list)


def first_errors(texts: Sequence[TextRun], most: int = 3) -> list[str]:
    """The first `most` distinct errors among the texts, in the order the texts ran."""
    out: list[str] = []
    for t in sorted(texts, key=lambda t: t.start_s):
        if t.error is not None and t.error not in out and len(out) < most:
            out.append(t.error)
    return out


def assign_texts(sessions: int, n_traces: int, texts: int | None = None) -> list[list[int]]:
    """Trace index of each text, per session.

    Default: every session runs the same amount of work, so all n stay busy until the end (a
    session that finished early would leave the case at lower concurrency than it claims). The
    traces are two halves of equal kind (model drafter, n-gram drafter), so session s runs trace
    s mod T, then s + T/2 (the other drafter's trace of the same prompt), then s + 1, s + 1 + T/2,
    ...: max(2, ceil(T / n)) texts (rounded up to even), one of each half in turn, and together the
    sessions cover every trace. `texts` instead: that many texts dealt round robin (a warm-up).
    """
    if sessions < 1 or n_traces < 1:
        raise ValueError(f"need at least one session and one trace, not {sessions} / {n_traces}")
    if texts is not None:
        return [[j % n_traces for j in range(s, texts, sessions)] for s in range(sessions)]
    half = max(n_traces // 2, 1)
    each = max(2, -(-n_traces // sessions))
    each += each % 2
    return [[(s + i // 2 + (i % 2) * half) % n_traces for i in range(each)] for s in range(sessions)]


class Occupancy:
    """Positions held by running texts: the load's KV demand, tracked as it changes."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, n: int) -> None:
        self.now += n
        self.peak = max(self.peak, self.now)


class VerifierStub(Protocol):
    """The parts of the gRPC aio stub (shared.pb.verify_pb2_grpc.VerifierStub) a replay calls."""

    def OpenSession(self, request: Any, timeout: float | None = None) -> Any: ...  # noqa: N802

    def Verify(self, request: Any, timeout: float | None = None) -> Any: ...  # noqa: N802

    def CloseSession(self, request: Any, timeout: float | None = None) -> Any: ...  # noqa: N802


def describe(e: Exception) -> str:
    """An error in a few words: the gRPC status code and details when it has them."""
    code = getattr(e, "code", None)
    if callable(code):
        details = getattr(e, "details", lambda: "")
        return f"{code()}: {details() if callable(details) else ''}"
    return f"{type(e).__name__}: {e}"


def answer_differs(recorded: Any, answer: Any) -> bool:
    """True when a verify answer is not the recorded one (the greedy answer is fully determined)."""
    correction = answer.correction if answer.HasField("correction") else None
    got = (answer.accepted_len, correction, answer.next_kind, answer.ctx_len, answer.ctx_hash)
    want = (recorded.accepted_len, recorded.correction, recorded.next_kind, recorded.answer_ctx_len,
            recorded.answer_ctx_hash)
    return got != want


async def replay_speculative(stub: VerifierStub, trace: Trace, index: int, session: int, max_tokens: int,
                             sampling: dict[str, float | int], t0: float, occ: Occupancy) -> TextRun:
    """One text: open, the trace's verify rounds up to the token cap, close. Stops at the first
    answer that differs from the recording (the requests after it assume the recorded context)."""
    from shared.pb import verify_pb2 as pb

    start = time.perf_counter()
    run = TextRun(session, index, 0, start - t0, 0.0)
    cfg = pb.SamplingConfig(**sampling)  # type: ignore[arg-type]
    open_req = pb.OpenSessionRequest(prompt_ids=trace.prompt_ids, sampling_cfg=cfg, seed=trace.seed,
                                     correction="strict", max_new_tokens=len(trace.token_ids),
                                     feature_encoding=trace.feature_encoding)
    held = 0
    ctx_id = ""
    try:
        info = await stub.OpenSession(open_req, timeout=CALL_TIMEOUT_S)
        ctx_id = info.ctx_id
        run.open_ms = (time.perf_counter() - start) * 1000.0
        held = len(trace.prompt_ids)
        occ.add(held)
        for i, r in enumerate(trace.rounds_for(max_tokens)):
            req = pb.VerifyRequest(ctx_id=ctx_id, ctx_len=r.ctx_len, ctx_hash=r.ctx_hash, append_ids=r.append_ids,
                                   draft_tokens=r.draft_tokens, q_token_probs=r.q_token_probs,
                                   draft_kind=r.draft_kind, k=len(r.draft_tokens), return_top_k=r.return_top_k,
                                   request_id=f"{session}-{index}-{i}", tree=r.tree_parents is not None,
                                   tree_parents=r.tree_parents or [])
            t_req = time.perf_counter()
            answer = await stub.Verify(req, timeout=CALL_TIMEOUT_S)
            run.round_ms.append((time.perf_counter() - t_req) * 1000.0)
            run.checked += 1
            run.tokens += answer.accepted_len + 1
            occ.add(answer.accepted_len + 1)
            held += answer.accepted_len + 1
            if answer_differs(r, answer):
                run.mismatches += 1
                break
    except Exception as e:  # grpc.aio.AioRpcError and friends: recorded, the case goes on
        run.error = describe(e)
    finally:
        if ctx_id:
            try:
                await stub.CloseSession(pb.CloseSessionRequest(ctx_id=ctx_id), timeout=CALL_TIMEOUT_S)
            except Exception as e:
                run.error = run.error or f"close: {describe(e)}"
        occ.add(-held)
    run.end_s = time.perf_counter() - t0
    return run


async def stream_cloud_only(http: Any, trace: Trace, index: int, session: int, max_tokens: int,
                            sampling: dict[str, float | int], t0: float, occ: Occupancy) -> TextRun:
    """One text generated by the target alone, streamed (REST server-sent events), as many tokens as
    the speculative replay of the same trace commits; the ids are checked against the trace's text."""
    n = trace.tokens_for(max_tokens)
    # exactly n tokens, as the replay commits: past an end-of-sequence token where the recording went past one
    body = json.dumps({"prompt_ids": trace.prompt_ids, "sampling_cfg": sampling, "seed": trace.seed,
                       "max_new_tokens": n, "stream": True, "stop_at_eos": False}, separators=(",", ":")).encode()
    start = time.perf_counter()
    run = TextRun(session, index, 0, start - t0, 0.0)
    ids: list[int] = []
    occ.add(len(trace.prompt_ids))
    last = start
    try:
        async with http.stream("POST", "/v1/generate", content=body, timeout=CALL_TIMEOUT_S,
                               headers={"content-type": "application/json"}) as r:
            if r.status_code >= 400:
                raise RuntimeError(f"HTTP {r.status_code}")
            event = "message"
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event == "message":
                    now = time.perf_counter()
                    if ids:
                        run.round_ms.append((now - last) * 1000.0)
                    else:
                        run.open_ms = (now - start) * 1000.0
                    last = now
                    ids.append(int(json.loads(line[5:])["token_id"]))
                    occ.add(1)
                elif line.startswith("data:") and event == "error":
                    raise RuntimeError(f"stream error {line[5:].strip()}")
    except Exception as e:
        run.error = describe(e)
    occ.add(-(len(trace.prompt_ids) + len(ids)))
    run.tokens = len(ids)
    if run.error is None:
        run.checked = 1
        run.mismatches = int(ids != trace.token_ids[:n])
    run.end_s = time.perf_counter() - t0
    return run


async def run_load(mode: str, traces: Sequence[Trace], sessions: int, max_tokens: int,
                   sampling: dict[str, float | int], grpc_target: str, http_url: str,
                   texts: int | None = None) -> LoadResult:
    """`sessions` concurrent edges of one mode ("speculative" | "cloud_only") against one cloud
    (`texts`: fewer texts than a case runs, for a warm-up)."""
    import grpc
    import httpx

    from shared.pb import verify_pb2_grpc as pb_grpc

    plan = assign_texts(sessions, len(traces), texts)
    occ = Occupancy()
    channel = grpc.aio.insecure_channel(grpc_target)
    http = httpx.AsyncClient(base_url=http_url, limits=httpx.Limits(max_connections=sessions + 4),
                             timeout=CALL_TIMEOUT_S)
    try:
        await asyncio.wait_for(channel.channel_ready(), CALL_TIMEOUT_S)
        stub = pb_grpc.VerifierStub(channel)

        async def session_loop(s: int, t0: float) -> list[TextRun]:
            out = []
            for j in plan[s]:
                if mode == "speculative":
                    out.append(await replay_speculative(stub, traces[j], j, s, max_tokens, sampling, t0, occ))
                else:
                    out.append(await stream_cloud_only(http, traces[j], j, s, max_tokens, sampling, t0, occ))
            return out

        cpu0 = time.process_time()
        t0 = time.perf_counter()
        per_session = await asyncio.gather(*(session_loop(s, t0) for s in range(sessions)))
        wall_s = time.perf_counter() - t0
        cpu_s = time.process_time() - cpu0
    finally:
        await http.aclose()
        await channel.close()
    runs = [t for texts in per_session for t in texts]
    errors = first_errors(runs)
    if errors:
        print(f"loadgen: {mode}, {sessions} sessions: {sum(t.error is not None for t in runs)} texts ended early; "
              f"first errors: {errors}", flush=True)
    return LoadResult(mode, sessions, wall_s, runs, cpu_s, occ.peak, errors)
