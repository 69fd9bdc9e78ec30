"""One process, one asyncio loop: uvicorn (REST) and grpc.aio (gRPC) over the same service.

SIGTERM / SIGINT: readiness goes false (REST /readyz 503, gRPC health NOT_SERVING), gRPC drains
for `shutdown_grace_s`, uvicorn finishes its in-flight requests, the model worker stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn
from grpc_health.v1 import health_pb2

from cloud.grpc_server import SERVICE_NAME, start_grpc
from cloud.rest import create_app
from cloud.service import VerifierService

log = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # serve() owns the signals, so gRPC drains too before the process exits


async def serve(service: VerifierService) -> None:
    st = service.settings
    grpc_server, grpc_port, health = await start_grpc(service, st.host, st.grpc_port)
    cfg = uvicorn.Config(create_app(service), host=st.host, port=st.http_port, log_config=None,
                         access_log=False, lifespan="off", timeout_graceful_shutdown=max(1, int(st.shutdown_grace_s)),
                         limit_concurrency=st.max_connections)
    http = _Uvicorn(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    http_task = asyncio.create_task(http.serve())
    sweeper = asyncio.create_task(service.sweep_forever())
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
    service.ready = False
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    http.should_exit = True
    await grpc_server.stop(st.shutdown_grace_s)
    with contextlib.suppress(asyncio.CancelledError):
        await http_task
    for t in (sweeper, stopper):
        t.cancel()
    service.close()
    log.info("stopped", extra={"fields": {"event": "stopped"}})
