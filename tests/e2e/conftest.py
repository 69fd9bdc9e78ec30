"""End-to-end fixtures: a real `specsplit-cloud` process on loopback (see tests/server.py).

Module-scoped, so the tests of one module share one process; each test opens its own sessions.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server import CloudProcess


@pytest.fixture(scope="module")
def cloud_server(demo_target_dir: Path) -> Iterator[CloudProcess]:
    """specsplit-cloud with the bundled demo target, auth off; `.http_url`, `.grpc_target`."""
    with CloudProcess(demo_target_dir) as cloud:
        yield cloud


@pytest.fixture(scope="module")
def tiny_cloud_server(tiny_pair: tuple[Path, Path]) -> Iterator[CloudProcess]:
    """specsplit-cloud with the tiny random target of `tiny_pair`, auth off."""
    with CloudProcess(tiny_pair[0]) as cloud:
        yield cloud
