"""Session streams through the edge's transports against the real cloud process (tiny target), REST and gRPC:
the tokens and the states (a session opened with a feature_window) are those of k = 0 verify rounds on a twin
session, byte for byte, at temperature 1; a verify round continues the streamed session; errors map to the
project's types and change nothing; closing the iterator early stops the stream; the routed view carries its
request id; the model info says the cloud streams, and an answer without the field reads as an older cloud."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from edge.transport import GrpcTransport, RestTransport, Transport
from shared.config import SamplingConfig
from shared.errors import ContextMismatch, InvalidArgument, NotFound
from shared.hashing import ctx_hash
from shared.pb import verify_pb2 as pb
from shared.protocol import DraftProposal, OpenSessionRequest, StreamDone, StreamedToken, VerifyRequest
from tests.server import CloudProcess

PROMPT = [5, 17, 42, 8, 99, 23, 7, 301, 64, 12]
T = 60.0
KINDS = ["rest", "grpc"]


def make(cloud: CloudProcess, kind: str) -> Transport:
    return RestTransport(cloud.http_url) if kind == "rest" else GrpcTransport(cloud.grpc_target)


def k0(ctx_id: str, ids: list[int]) -> VerifyRequest:
    return VerifyRequest(ctx_id, len(ids), ctx_hash(ids), [], DraftProposal([], []))


@pytest.mark.parametrize("kind", KINDS)
def test_the_model_info_says_the_cloud_streams_on_sessions(tiny_cloud_server: CloudProcess, kind: str) -> None:
    t = make(tiny_cloud_server, kind)
    assert t.supports_session_stream and t.get_model(T).session_stream is True
    t.close()


def test_an_older_clouds_model_info_reads_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    rest = RestTransport("http://older")
    rest._http = httpx.Client(base_url="http://older", transport=httpx.MockTransport(
        lambda _: httpx.Response(200, json={"model_id": "old", "vocab_size": 10})))
    assert rest.get_model(T).session_stream is False
    grpc_t = GrpcTransport("127.0.0.1:1")
    monkeypatch.setattr(grpc_t, "_call", lambda *_: pb.ModelInfo(model_id="old", vocab_size=10))
    assert grpc_t.get_model(T).session_stream is False
    grpc_t.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_is_the_k0_rounds_tokens_and_states(tiny_cloud_server: CloudProcess, kind: str) -> None:
    t = make(tiny_cloud_server, kind)
    req = OpenSessionRequest(PROMPT, SamplingConfig(temperature=1.0), seed=5, feature_encoding="float16",
                             feature_window=4)
    a, b = t.open_session(req, T), t.open_session(req, T)
    down, calls = t.traffic.bytes_down, t.traffic.calls
    rid = f"stream-{kind}-1"
    events = list(t.routed("route-1", rid).stream_session(a.ctx_id, a.ctx_len, a.ctx_hash, 6, False, T))
    tokens, done = events[:-1], events[-1]
    assert len(tokens) == 6 and all(isinstance(e, StreamedToken) for e in tokens) and isinstance(done, StreamDone)
    assert t.traffic.calls == calls + 1 and t.traffic.bytes_down - down > 6 * 64 * 2  # six states of width 64
    ids = list(PROMPT)
    for tok in tokens:
        assert isinstance(tok, StreamedToken)
        r = t.verify(k0(b.ctx_id, ids), T)
        assert (tok.token_id, tok.ctx_len) == (r.correction, r.ctx_len) and tok.feature is None
        assert tok.states is not None and r.states is not None
        assert (tok.states.first, tok.states.count, tok.states.data) == (r.states.first, 1, r.states.data)
        ids.append(tok.token_id)
    assert (done.tokens, done.ctx_len, done.ctx_hash) == (6, len(ids), ctx_hash(ids))
    assert done.metrics["stop_reason"] == "length" and done.metrics["total_ms"] > 0
    after_a, after_b = t.verify(k0(a.ctx_id, ids), T), t.verify(k0(b.ctx_id, ids), T)  # a round continues it
    assert after_a.correction == after_b.correction and after_a.ctx_hash == after_b.ctx_hash
    assert t.get_session(a.ctx_id, T).counters["streamed"] == 6
    logged = [json.loads(line) for line in tiny_cloud_server.log_text().splitlines() if rid in line]
    assert any(d.get("event") == "stream" and d.get("ctx_id") == a.ctx_id for d in logged)
    t.close()


@pytest.mark.parametrize("kind", KINDS)
def test_stream_errors_map_like_the_other_calls_and_change_nothing(tiny_cloud_server: CloudProcess,
                                                                    kind: str) -> None:
    t = make(tiny_cloud_server, kind)
    a = t.open_session(OpenSessionRequest(PROMPT, SamplingConfig(temperature=0.0)), T)
    with pytest.raises(ContextMismatch) as e:
        list(t.stream_session(a.ctx_id, a.ctx_len, ctx_hash([*PROMPT[:-1], 1]), 3, True, T))
    assert e.value.details["expected_ctx_len"] == len(PROMPT)
    with pytest.raises(InvalidArgument):
        list(t.stream_session(a.ctx_id, a.ctx_len, a.ctx_hash, 0, True, T))
    with pytest.raises(NotFound):
        list(t.stream_session("no-such-session", a.ctx_len, a.ctx_hash, 3, True, T))
    info = t.get_session(a.ctx_id, T)
    assert (info.ctx_len, info.ctx_hash, info.counters["rounds"]) == (a.ctx_len, a.ctx_hash, 0)
    t.close()


@pytest.mark.parametrize("kind", KINDS)
def test_closing_the_iterator_early_stops_the_stream(tiny_cloud_server: CloudProcess, kind: str) -> None:
    """Two tokens read of 240 asked for, then the iterator is closed: the session stops growing long before."""
    t = make(tiny_cloud_server, kind)
    a = t.open_session(OpenSessionRequest(PROMPT, SamplingConfig(temperature=0.0)), T)
    it: Any = t.stream_session(a.ctx_id, a.ctx_len, a.ctx_hash, 240, False, T)
    assert [next(it).ctx_len, next(it).ctx_len] == [len(PROMPT) + 1, len(PROMPT) + 2]
    it.close()
    time.sleep(0.3)
    first = t.get_session(a.ctx_id, T).ctx_len
    time.sleep(0.3)
    assert t.get_session(a.ctx_id, T).ctx_len == first < len(PROMPT) + 240
    t.close()
