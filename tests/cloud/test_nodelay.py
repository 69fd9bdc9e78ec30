"""Accepted REST connections, read on a live connection: Nagle's algorithm is off (TCP_NODELAY), and an
idle keep-alive connection stays open past uvicorn's own 5 s default.

With Nagle on, each small response waits on the client's delayed ACK: about 40 ms a request. A backend that
closes idle connections before a proxy's pool does races the proxy's next request on that connection; nginx
counts the lost request as the replica failing and sends it to another replica (a reopen, or a 404).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
import uvicorn

from cloud.app import rest_config
from cloud.ports import bind_tcp
from cloud.service import VerifierService

T = TypeVar("T")


def _with_server(svc: VerifierService, body: Callable[[uvicorn.Server, int], Awaitable[T]]) -> T:
    """Run `body(server, port)` against the REST server serve() builds, on the socket serve() listens on."""
    async def main() -> T:
        sock = bind_tcp("127.0.0.1", 0, "REST", "--http-port")
        server = uvicorn.Server(rest_config(svc))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            return await body(server, sock.getsockname()[1])
        finally:
            server.should_exit = True
            await task
    return asyncio.run(main())


def test_an_accepted_rest_connection_has_tcp_nodelay(make_service: Callable[..., VerifierService]) -> None:
    """The server's own socket for a keep-alive connection, read while the client still holds it."""
    async def body(server: uvicorn.Server, port: int) -> list[int]:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            assert (await client.get("/healthz")).status_code == 200
            conns = list(server.server_state.connections)  # the accepted connections, still open
            return [c.transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
                    for c in conns]

    flags = _with_server(make_service(), body)
    assert flags and all(f != 0 for f in flags), flags


def test_an_idle_keep_alive_connection_stays_open(make_service: Callable[..., VerifierService]) -> None:
    """One connection, two requests 6 s apart: the second is answered on it (uvicorn's default closes it
    after 5 s idle; the cloud keeps it `--keep-alive-s`, 75 s, above nginx's 60 s pool timeout)."""
    svc = make_service()
    assert svc.settings.keep_alive_s > 60

    async def body(server: uvicorn.Server, port: int) -> list[bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        heads = []
        for pause in (0.0, 6.0):
            await asyncio.sleep(pause)
            writer.write(request)
            await writer.drain()
            heads.append(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5))
            length = int(next(line.split(b":")[1] for line in heads[-1].split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
        writer.close()
        return heads

    heads = _with_server(svc, body)
    assert all(h.startswith(b"HTTP/1.1 200") for h in heads), heads
