"""The loopback delay proxy: adds rtt to each exchange, pipelines bursts, forwards bytes intact."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from bench.delay_proxy import DelayProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        while True:
            data = self.request.recv(65536)
            if not data:
                return
            self.request.sendall(data)


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield int(server.server_address[1])
    server.shutdown()
    server.server_close()


def exchange(port: int, payload: bytes) -> tuple[bytes, float]:
    """Send payload, read the echo back; (echo, seconds)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        s.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            got += chunk
        return got, time.perf_counter() - t0


def test_each_exchange_takes_at_least_the_round_trip(echo_port: int) -> None:
    with DelayProxy("127.0.0.1", echo_port, rtt_ms=60) as proxy:
        times = [exchange(proxy.port, b"ping")[1] for _ in range(3)]
    assert min(times) >= 0.060
    assert min(times) < 0.060 + 0.100  # generous: the machine is shared


def test_zero_delay_adds_little(echo_port: int) -> None:
    with DelayProxy("127.0.0.1", echo_port, rtt_ms=0) as proxy:
        got, took = exchange(proxy.port, b"x" * 1000)
    assert got == b"x" * 1000
    assert took < 0.5


def test_a_burst_costs_the_delay_once_and_arrives_intact(echo_port: int) -> None:
    """2 MiB in many chunks through a 100 ms proxy: pipelined, so well under 2 round trips; a proxy
    that slept per chunk would take one delay per 64 KiB chunk (> 3 s)."""
    payload = bytes(range(256)) * (8 * 1024)  # 2 MiB
    with DelayProxy("127.0.0.1", echo_port, rtt_ms=100) as proxy:
        got, took = exchange(proxy.port, payload)
        counters = proxy.counters
    assert got == payload
    assert 0.100 <= took < 0.200 + 0.300
    assert counters.bytes_up == len(payload) and counters.bytes_down == len(payload)
    assert counters.connections == 1


def test_negative_delay_is_refused() -> None:
    with pytest.raises(ValueError):
        DelayProxy("127.0.0.1", 1, rtt_ms=-1)
