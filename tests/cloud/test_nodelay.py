"""Accepted REST connections have Nagle's algorithm off (TCP_NODELAY), read on a live connection.

With Nagle on, each small response waits on the client's delayed ACK: about 40 ms a request.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

import httpx
import uvicorn

from cloud.ports import bind_tcp
from cloud.rest import create_app
from cloud.service import VerifierService


def test_an_accepted_rest_connection_has_tcp_nodelay(make_service: Callable[..., VerifierService]) -> None:
    """The server's own socket for a keep-alive connection, read while the client still holds it."""
    svc = make_service()

    async def main() -> list[int]:
        sock = bind_tcp("127.0.0.1", 0, "REST", "--http-port")  # what serve() listens on
        port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(create_app(svc), log_config=None, access_log=False,
                                               lifespan="off"))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                assert (await client.get("/healthz")).status_code == 200
                conns = list(server.server_state.connections)  # the accepted connections, still open
                return [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                        for c in conns]
        finally:
            server.should_exit = True
            await task

    flags = asyncio.run(main())
    assert flags and all(f != 0 for f in flags), flags
