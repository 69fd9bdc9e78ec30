"""A cloud on IPv6 loopback (`--host ::1`): both its servers bind, the gRPC one on `[::1]:PORT` (an IPv6 host goes in
brackets before its port; `::1:PORT` binds nothing), and the edge reaches it over REST and gRPC."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge.settings import EdgeSettings
from edge.transport import transport_for
from shared.hosts import bracketed, host_port
from tests.server import CloudProcess


class Ipv6Cloud(CloudProcess):
    """The test cloud process bound to ::1, its addresses written the way clients dial them."""

    def __init__(self, model_dir: Path) -> None:
        super().__init__(model_dir)
        self.host = "::1"

    @property
    def http_url(self) -> str:
        return f"http://{bracketed(self.host)}:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return host_port(self.host, self.grpc_port)


def has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def cloud(tiny_pair: tuple[Path, Path]) -> Iterator[Ipv6Cloud]:
    if not has_ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    with Ipv6Cloud(tiny_pair[0]) as c:
        yield c


def test_the_address_of_an_ipv6_host_has_brackets() -> None:
    assert host_port("::1", 50051) == "[::1]:50051"
    assert host_port("[::1]", 50051) == "[::1]:50051"
    assert host_port("127.0.0.1", 50051) == "127.0.0.1:50051" and host_port("cloud", 1) == "cloud:1"


def test_a_cloud_on_ipv6_loopback_serves_rest_and_grpc(cloud: Ipv6Cloud) -> None:
    """Started on ::1, the cloud gets ready (REST /readyz and gRPC health on [::1]), and the edge's transports reach
    it both ways."""
    ids = set()
    for settings in (EdgeSettings(cloud_url=cloud.http_url), EdgeSettings(grpc_target=cloud.grpc_target)):
        transport = transport_for(settings)
        try:
            ids.add(transport.get_model(10.0).model_id)
        finally:
            transport.close()
    assert len(ids) == 1
