"""The cloud's fitted forward cost reaches the edge's transports: GET /v1/model and GetModel as the model info's
`forward_cost`, and every open answer (REST JSON, gRPC SessionInfo field 12) as of the open; GET /v1/sessions/{id}
and GetSession say none. The transports reach the cloud's own REST and gRPC servers, run in-process."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvicorn

from cloud.app import rest_config
from cloud.grpc_server import start_grpc
from cloud.ports import bind_tcp
from cloud.service import VerifierService
from edge.transport import GrpcTransport, RestTransport
from shared.config import SamplingConfig
from shared.protocol import ForwardCostInfo, OpenSessionRequest

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


@pytest.fixture(params=["rest", "grpc"])
def wired(request: pytest.FixtureRequest, make_service: Callable[..., VerifierService]
          ) -> Iterator[tuple[VerifierService, RestTransport | GrpcTransport]]:
    """(service, the edge's transport to it): the REST server and the gRPC server the cloud runs, on one event
    loop in a thread, each on a port of its own; the transport is the one `request.param` names."""
    svc = make_service()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    sock = bind_tcp("127.0.0.1", 0, "REST", "--http-port")
    rest = uvicorn.Server(rest_config(svc))
    serving = asyncio.run_coroutine_threadsafe(rest.serve(sockets=[sock]), loop)
    grpc_server, grpc_port, _ = asyncio.run_coroutine_threadsafe(start_grpc(svc, "127.0.0.1", 0), loop).result(10)
    deadline = time.monotonic() + 30
    while not rest.started and time.monotonic() < deadline:
        time.sleep(0.01)
    transport = RestTransport(f"http://127.0.0.1:{sock.getsockname()[1]}") if request.param == "rest" \
        else GrpcTransport(f"127.0.0.1:{grpc_port}")
    yield svc, transport
    transport.close()
    rest.should_exit = True
    serving.result(10)
    asyncio.run_coroutine_threadsafe(grpc_server.stop(None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


def as_said(svc: VerifierService) -> ForwardCostInfo:
    """The service's fit as the wire says it (REST JSON rounds nothing further; gRPC doubles carry it exactly)."""
    cost: dict[str, Any] = svc.forward_cost()
    return ForwardCostInfo.from_mapping(cost)


def test_the_model_info_keeps_the_forward_cost(wired: tuple[VerifierService, Any]) -> None:
    svc, transport = wired
    transport.open_session(OpenSessionRequest(PROMPT, SamplingConfig(temperature=0.0)), 30)  # a forward to fit
    info = transport.get_model(30)
    assert info.forward_cost == as_said(svc)
    assert info.forward_cost is not None and info.forward_cost.forwards >= 1 and info.forward_cost.base_ms > 0


def test_every_open_answer_says_the_cost_as_of_the_open(wired: tuple[VerifierService, Any]) -> None:
    svc, transport = wired
    first = transport.open_session(OpenSessionRequest(PROMPT, SamplingConfig(temperature=0.0)), 30)
    assert first.forward_cost == as_said(svc) and first.forward_cost is not None
    second = transport.open_session(OpenSessionRequest(PROMPT + [19, 20], SamplingConfig(temperature=0.0)), 30)
    assert second.forward_cost == as_said(svc) and second.forward_cost is not None
    assert second.forward_cost.forwards > first.forward_cost.forwards  # fresher: its own prefill counted
    assert transport.get_session(second.ctx_id, 30).forward_cost is None  # said by the open answer only
