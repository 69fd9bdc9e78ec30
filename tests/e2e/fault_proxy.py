"""A loopback HTTP/1.1 proxy that injects faults into chosen requests, for end-to-end tests.

    with FaultProxy("127.0.0.1", cloud_port) as proxy:
        proxy.plan("/v1/verify", 2, "drop")          # the 2nd verify: applied upstream, answer dropped
        client = ... cloud_url=proxy.url ...

Faults, applied to the n-th request (1-based) whose path starts with the given prefix:
- "drop":      forward it, read the answer, then close the client connection without answering
               (the cloud applied the round; the edge sees a connection error).
- "delay":     forward it and hold the answer `delay_s` before passing it on (past the edge's timeout,
               the edge has given up and the answer is discarded).
- "duplicate": send it upstream twice in a row and pass on the second answer.
- "replay":    pass it through, and send a copy upstream again just before the next request
               (a stale duplicate that arrives after the edge has moved on).
- "refuse":    close the client connection without forwarding anything.

Only bodies framed by Content-Length are supported (what the cloud's JSON routes use). Each client
connection gets its own upstream connection; the proxy runs its own asyncio loop in a daemon thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field


@dataclass
class Fault:
    # path prefix the fault applies to, e.g. "/v1/verify"
    path: str
    # the n-th matching request (1-based)
    nth: int
    # "drop" | "delay" | "duplicate" | "replay" | "refuse"
    action: str
    # for "delay": how long the answer is held
    delay_s: float = 1.0
    # set once applied
    fired: bool = False


@dataclass
class ProxyLog:
    # (method, path) of every request seen, in order
    requests: list[tuple[str, str]] = field(default_factory=list)
    # (action, method, path) of every fault applied
    applied: list[tuple[str, str, str]] = field(default_factory=list)


async def read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes] | None:
    """One HTTP/1.1 message: (head including the blank line, body); None at end of stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    body = await reader.readexactly(length) if length else b""
    return head, body


class FaultProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.port = 0
        self.log = ProxyLog()
        self._faults: list[Fault] = []
        self._counts: dict[str, int] = {}
        self._pending_replays: list[bytes] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def plan(self, path: str, nth: int, action: str, delay_s: float = 1.0) -> Fault:
        """Schedule a fault on the nth request (counted from now) whose path starts with `path`."""
        if action not in ("drop", "delay", "duplicate", "replay", "refuse"):
            raise ValueError(f"unknown fault {action!r}")
        with self._lock:
            f = Fault(path, self._counts.get(path, 0) + nth, action, delay_s)
            self._faults.append(f)
        return f

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._serve, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        loop.run_forever()
        loop.close()

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- proxying -----------------------------------------------------------------------------

    def _match(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self.log.requests.append((method, path))
            hit = None
            for prefix in {f.path for f in self._faults} | set(self._counts):
                if path.startswith(prefix):
                    self._counts[prefix] = self._counts.get(prefix, 0) + 1
                    for f in self._faults:
                        if f.path == prefix and not f.fired and f.nth == self._counts[prefix]:
                            f.fired, hit = True, f
            if hit is not None:
                self.log.applied.append((hit.action, method, path))
            return hit

    async def _handle(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        u_reader = u_writer = None
        try:
            u_reader, u_writer = await asyncio.open_connection(*self.upstream)
            while True:
                msg = await read_message(c_reader)
                if msg is None:
                    return
                head, body = msg
                method, path = head.split(b" ", 2)[:2]
                fault = self._match(method.decode(), path.decode())
                with self._lock:
                    replays, self._pending_replays = self._pending_replays, []
                for stale in replays:  # a stale duplicate goes first, then the real request
                    u_writer.write(stale)
                    await u_writer.drain()
                    await read_message(u_reader)
                action = fault.action if fault else "pass"
                if action == "refuse":
                    return
                request = head + body
                answer = await self._exchange(u_reader, u_writer, request)
                if answer is None:
                    return
                if action == "duplicate":
                    answer = await self._exchange(u_reader, u_writer, request) or answer
                elif action == "replay":
                    with self._lock:
                        self._pending_replays.append(request)
                elif action == "drop":
                    return
                elif action == "delay":
                    assert fault is not None
                    await asyncio.sleep(fault.delay_s)
                c_writer.write(answer[0] + answer[1])
                await c_writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError, OSError):
            return
        finally:
            for w in (c_writer, u_writer):
                if w is not None:
                    with contextlib.suppress(Exception):
                        w.close()

    @staticmethod
    async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        request: bytes) -> tuple[bytes, bytes] | None:
        writer.write(request)
        await writer.drain()
        return await read_message(reader)
