"""A loopback TCP proxy that adds a fixed one-way delay in each direction (emulated round-trip time).

    with DelayProxy("127.0.0.1", cloud_port, rtt_ms=50) as proxy:
        httpx.get(f"http://127.0.0.1:{proxy.port}/healthz")   # ~50 ms more than direct

Every chunk read from one side is written to the other side `rtt_ms / 2` after it was read. Chunks
are pipelined, not serialised: a chunk's deadline is its arrival time plus the delay, so a burst
costs the delay once, as on a real link (no bandwidth limit is modelled). The proxy runs its own
asyncio loop in a daemon thread and counts the bytes it forwards (whole TCP payload: HTTP headers
included), which gives the on-the-wire traffic of whatever passes through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass

# read size of one chunk
CHUNK = 64 * 1024


@dataclass
class WireCounters:
    # bytes forwarded client -> upstream (requests)
    bytes_up: int = 0
    # bytes forwarded upstream -> client (responses)
    bytes_down: int = 0
    # client connections accepted
    connections: int = 0


class DelayProxy:
    """127.0.0.1:port -> upstream_host:upstream_port with `rtt_ms / 2` added each way."""

    def __init__(self, upstream_host: str, upstream_port: int, rtt_ms: float, listen_port: int = 0) -> None:
        if rtt_ms < 0:
            raise ValueError(f"rtt_ms must be >= 0, got {rtt_ms}")
        self.upstream = (upstream_host, upstream_port)
        self.rtt_ms = rtt_ms
        self.one_way_s = rtt_ms / 2000.0
        self.counters = WireCounters()
        self._listen_port = listen_port
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        # connection and delivery tasks alive on the proxy's loop
        self._tasks: set[asyncio.Future[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> DelayProxy:
        self._thread = threading.Thread(target=self._serve, name=f"delay-proxy-{self.rtt_ms:g}ms", daemon=True)
        self._thread.start()
        self._ready.wait(10.0)
        if self._error is not None:
            raise RuntimeError(f"delay proxy failed to start: {self._error}") from self._error
        if not self.port:
            raise RuntimeError("delay proxy did not start within 10 s")
        return self

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(self._handle, "127.0.0.1", self._listen_port))
            self.port = int(self._server.sockets[0].getsockname()[1])
        except OSError as e:
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        self.counters.connections += 1
        me = asyncio.current_task()
        if me is not None:  # a strong reference: a half-closed connection's task is not collected mid-wait
            self._tasks.add(me)
            me.add_done_callback(self._tasks.discard)
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            c_writer.close()
            return
        up = asyncio.ensure_future(self._pipe(c_reader, u_writer, "up"))
        down = asyncio.ensure_future(self._pipe(u_reader, c_writer, "down"))
        for t in (up, down):
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        try:
            await asyncio.wait({up, down}, return_when=asyncio.ALL_COMPLETED)
        except asyncio.CancelledError:  # stop(): end this connection quietly
            up.cancel()
            down.cancel()
        finally:
            for w in (c_writer, u_writer):
                with contextlib.suppress(OSError, RuntimeError):
                    w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        """Read chunks, stamp each with its deadline, write it when the deadline comes (in order)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                deadline, data = await queue.get()
                if not data:
                    break
                wait = deadline - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
                if direction == "up":
                    self.counters.bytes_up += len(data)
                else:
                    self.counters.bytes_down += len(data)
            with contextlib.suppress(OSError, RuntimeError):
                if writer.can_write_eof():
                    writer.write_eof()

        sender = asyncio.ensure_future(deliver())
        self._tasks.add(sender)
        sender.add_done_callback(self._tasks.discard)
        try:
            while True:
                data = await reader.read(CHUNK)
                await queue.put((time.monotonic() + self.one_way_s, data))
                if not data:
                    break
        except (OSError, asyncio.IncompleteReadError):
            await queue.put((0.0, b""))
        with contextlib.suppress(OSError, ConnectionError):
            await sender

    def stop(self) -> None:
        loop, server = self._loop, self._server
        if loop is None or not loop.is_running():
            return

        async def shutdown() -> None:
            if server is not None:
                server.close()
            for _ in range(3):  # cancelled handlers may leave their pipes' tasks behind once
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        fut = asyncio.run_coroutine_threadsafe(shutdown(), loop)
        with contextlib.suppress(Exception):
            fut.result(5.0)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5.0)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
