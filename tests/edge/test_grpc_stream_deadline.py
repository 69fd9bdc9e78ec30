"""A gRPC session stream is bounded per event, as the REST one is: a stream that stalls after its first token
ends in CloudTimeout one verify deadline later, not after the deadline of every token it may carry; a stream
whose events come in time is not cut however long it runs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from edge.transport import GrpcTransport
from edge.transport.errors import CloudTimeout
from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc


class Stalling(pb_grpc.VerifierServicer):
    """Streams `tokens` tokens `gap_s` apart, then stalls (up to `stall_s`) or ends with `done`."""

    def __init__(self, tokens: int, gap_s: float, stall_s: float | None) -> None:
        self.tokens, self.gap_s, self.stall_s = tokens, gap_s, stall_s
        self.release = threading.Event()

    def StreamSession(self, request: Any, context: Any) -> Iterator[pb.StreamSessionEvent]:  # noqa: N802
        for i in range(self.tokens):
            time.sleep(self.gap_s)
            yield pb.StreamSessionEvent(token=pb.StreamedToken(token_id=7, ctx_len=request.ctx_len + i + 1))
        if self.stall_s is not None:
            self.release.wait(self.stall_s)
            return
        yield pb.StreamSessionEvent(done=pb.StreamDone(tokens=self.tokens))


def serve(servicer: Stalling) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


def test_a_stalled_grpc_stream_times_out_after_one_event_deadline() -> None:
    servicer = Stalling(tokens=1, gap_s=0.0, stall_s=15.0)
    server, target = serve(servicer)
    transport = GrpcTransport(target)
    try:
        got, t0 = [], time.monotonic()
        with pytest.raises(CloudTimeout):
            for ev in transport.stream_session("s", 4, "0" * 16, 256, True, 0.5):
                got.append(ev)
        assert len(got) == 1 and time.monotonic() - t0 < 5.0  # the whole stream's deadline would be 128 s
    finally:
        servicer.release.set()
        transport.close()
        server.stop(0)


def test_a_grpc_stream_with_timely_events_runs_past_one_event_deadline() -> None:
    servicer = Stalling(tokens=6, gap_s=0.15, stall_s=None)
    server, target = serve(servicer)
    transport = GrpcTransport(target)
    try:
        events = list(transport.stream_session("s", 4, "0" * 16, 6, True, 0.4))
        assert len(events) == 7 and events[-1].tokens == 6  # 0.9 s in all, each event within 0.4 s
    finally:
        transport.close()
        server.stop(0)
