"""One process, one asyncio loop: uvicorn (REST) and grpc.aio (gRPC) over the same service.

SIGTERM / SIGINT start a graceful drain (`drain`): readiness goes false (REST /readyz 503, gRPC
health NOT_SERVING), new sessions are refused with 503 / UNAVAILABLE and `Retry-After`, while
verify, get and close are still served. The process waits up to `shutdown_grace_s` for its open
sessions to close and its rounds to finish (a second signal cuts the wait short), then both servers
stop, giving calls still in flight `ROUND_FINISH_S` to complete; the model worker stops before them, so
calls still waiting for it are answered 503 `unavailable` (Retry-After), not cut off.
Under tensor parallelism a lost rank turns both readiness signals off too (cloud/runners/tensor_parallel.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio

from cloud.gc_pauses import freeze_and_watch
from cloud.grpc_server import SERVICE_NAME, start_grpc
from cloud.ports import bind_tcp
from cloud.rest import create_app
from cloud.service import VerifierService
from shared.hosts import bracketed

log = logging.getLogger(__name__)
# seconds the servers give calls still in flight once the drain is over (a verify round is far shorter)
ROUND_FINISH_S = 1
# how often the drain looks at the open sessions and the model queue
DRAIN_POLL_S = 0.05


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # serve() owns the signals, so gRPC drains too before the process exits


async def drain(service: VerifierService, health: health_aio.HealthServicer, grace_s: float,
                hurry: asyncio.Event) -> None:
    """Stop taking new work, then wait up to `grace_s` (or until `hurry`) for open sessions to close
    and admitted rounds to finish; verify keeps being served meanwhile."""
    service.ready = False
    service.draining = True
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    log.info("draining", extra={"fields": {"event": "drain", "open_sessions": len(service.store),
                                           "grace_s": grace_s}})
    while loop.time() < deadline and not hurry.is_set():
        if len(service.store) == 0 and service.admission.depth == 0:
            break
        await asyncio.sleep(DRAIN_POLL_S)
    log.info("drained", extra={"fields": {"event": "drained", "open_sessions": len(service.store),
                                          "queue_depth": service.admission.depth}})


async def watch_ranks(service: VerifierService, health: health_aio.HealthServicer) -> None:
    """Tensor parallelism: gRPC health turns NOT_SERVING once a rank is lost (REST /readyz asks at each call)."""
    while service.model.healthy():
        await asyncio.sleep(DRAIN_POLL_S * 4)
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)


def rest_config(service: VerifierService) -> uvicorn.Config:
    """The REST server's configuration (its socket comes from `bind_tcp`)."""
    st = service.settings
    return uvicorn.Config(create_app(service), host=st.host, port=st.http_port, log_config=None, access_log=False,
                          lifespan="off", timeout_graceful_shutdown=ROUND_FINISH_S,
                          limit_concurrency=st.max_connections, timeout_keep_alive=st.keep_alive_s)


async def serve(service: VerifierService) -> None:
    st = service.settings
    sock = bind_tcp(st.host, st.http_port, "REST", "--http-port")  # exclusive; a port in use stops here
    # gRPC reads HOST:PORT, so an IPv6 host goes in brackets ([::1]:50051)
    grpc_server, grpc_port, health = await start_grpc(service, bracketed(st.host), st.grpc_port)
    http = _Uvicorn(rest_config(service))
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():
            hurry.set()  # a second signal: stop waiting for sessions
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    # the model's objects out of the collector's walks; pauses folded into /metrics as it is read
    unwatch = freeze_and_watch(service.metrics.gc_pause, service.metrics.registry)
    http_task = asyncio.create_task(http.serve(sockets=[sock]))
    sweeper = asyncio.create_task(service.sweep_forever())
    ranks = asyncio.create_task(watch_ranks(service, health)) if getattr(service.model, "group", None) else None
    stopper = asyncio.create_task(stop.wait())
    while not http.started and not http_task.done():
        await asyncio.sleep(0.01)
    if http.started:
        http_port = http.servers[0].sockets[0].getsockname()[1]
        log.info("serving", extra={"fields": {"event": "listening", "host": st.host, "http_port": http_port,
                                              "grpc_port": grpc_port, "model": service.info.model_id,
                                              "auth": bool(st.api_keys)}})
    await asyncio.wait({http_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    log.info("shutting down", extra={"fields": {"event": "shutdown"}})
    if not http_task.done():
        await drain(service, health, st.shutdown_grace_s, hurry)
    # the model stops first: requests still waiting for it (opens, rounds) are answered 503 `unavailable`
    # while the servers still send answers, instead of being cancelled with a traceback each
    await asyncio.to_thread(service.scheduler.shutdown)
    http.should_exit = True
    await grpc_server.stop(ROUND_FINISH_S)
    with contextlib.suppress(asyncio.CancelledError):
        await http_task
    for t in (sweeper, stopper, ranks):
        if t is not None:
            t.cancel()
    service.close()
    unwatch()
    log.info("stopped", extra={"fields": {"event": "stopped"}})
