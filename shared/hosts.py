"""Which hosts a server binds to stay on this machine: loopback (127.0.0.0/8, ::1, localhost).

A server bound beyond loopback without keys answers whoever reaches it; the cloud (cloud/cli.py) and the edge's
OpenAI server (edge/server/server_auth.py) refuse that start unless told otherwise. An address with a port puts an
IPv6 host in brackets (`[::1]:50051`), as gRPC and URLs read it.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost; False for every other name or address (0.0.0.0 included)."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bracketed(host: str) -> str:
    """`host` as it goes before `:PORT`: an IPv6 address in brackets (::1 -> [::1]), a name or IPv4 as it is."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def host_port(host: str, port: int) -> str:
    """HOST:PORT with an IPv6 host in brackets: what gRPC binds and dials (`[::1]:50051`, `0.0.0.0:50051`)."""
    return f"{bracketed(host)}:{port}"
