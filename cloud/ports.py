"""Binding the two listening ports, exclusively, with one-line refusals naming the port and its flag.

The REST socket is made with protocol `IPPROTO_TCP` and `TCP_NODELAY` set: asyncio turns Nagle's
algorithm off only on accepted sockets whose protocol is `IPPROTO_TCP` (`_set_nodelay`), and
Linux copies the listener's `TCP_NODELAY` to each accepted socket, so either alone would do. A
socket made with protocol 0 keeps Nagle on, and every small response then waits on the peer's
delayed ACK (about 40 ms a request).

gRPC's own binding sets SO_REUSEPORT, so a second process on a port already in use would start
without error and the kernel would split connections between the two. The verifier turns that off
(`GRPC_OPTIONS`) and checks both ports before loading the model, so a port in use stops the start
at once, with the flag that moves it, rather than after the model load and under tracebacks.
"""

from __future__ import annotations

import errno
import socket

# options of the gRPC server: an exclusive bind (no silent sharing of the port with another process)
GRPC_OPTIONS = [("grpc.so_reuseport", 0)]


class PortInUse(OSError):
    """A port another process listens on."""


def in_use_message(what: str, host: str, port: int, flag: str) -> str:
    return (f"{what} port {port} on {host} is in use (another specsplit-cloud?): stop that process or pass "
            f"{flag} PORT (0 picks a free one)")


def bind_tcp(host: str, port: int, what: str, flag: str) -> socket.socket:
    """A TCP socket bound (not yet listening) to host:port; PortInUse / OSError with one line otherwise."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT only; a listener still refuses
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise PortInUse(in_use_message(what, host, port, flag)) from None
        raise OSError(f"cannot bind the {what} port to {host}:{port}: {e.strerror}; check --host and {flag}") from None
    return sock


def check_ports_free(host: str, http_port: int, grpc_port: int) -> None:
    """Refuse at once when either port is taken (before the model is loaded)."""
    for what, port, flag in (("REST", http_port, "--http-port"), ("gRPC", grpc_port, "--grpc-port")):
        if port:
            bind_tcp(host, port, what, flag).close()
