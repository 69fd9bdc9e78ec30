"""In-process fixtures: the tiny target loaded once, services built around it with a test clock."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from cloud.rest import create_app
from cloud.runners.torch_runner import TargetModel
from cloud.service import VerifierService
from cloud.settings import CloudSettings
from tests.cloud.reference import CausalLM, Drafter


class FakeClock:
    """A monotonic clock that moves only when told to (or by `step` on every read)."""

    def __init__(self, start: float = 1000.0, step: float = 0.0) -> None:
        self.now, self.step = start, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


@pytest.fixture(scope="session")
def tiny_target(tiny_pair: tuple[Path, Path]) -> TargetModel:
    torch.set_num_threads(1)  # the fastest setting on a small shared machine
    return TargetModel(tiny_pair[0])


@pytest.fixture(scope="session")
def tiny_reference(tiny_pair: tuple[Path, Path]) -> CausalLM:
    return CausalLM(tiny_pair[0])


@pytest.fixture(scope="session")
def tiny_drafter(tiny_pair: tuple[Path, Path]) -> Drafter:
    return Drafter(tiny_pair[1])


@pytest.fixture
def make_service(tiny_pair: tuple[Path, Path], tiny_target: TargetModel) -> Iterator[Any]:
    """make_service(clock=..., **settings) -> VerifierService around the shared tiny target."""
    made: list[VerifierService] = []

    def make(clock: Any = None, **overrides: Any) -> VerifierService:
        settings = CloudSettings(model=tiny_pair[0], **{"dtype": "float32", **overrides})
        kw = {"clock": clock} if clock is not None else {}
        made.append(VerifierService(settings, tiny_target, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()
    if made:  # tests that use the model directly get a roomy pool again, whatever budget the last service had
        tiny_target.use_pool(2 * 1024**3)


@pytest.fixture
def client(make_service: Callable[..., VerifierService]) -> Iterator[Callable[..., TestClient]]:
    """client(**settings) -> a TestClient on the REST app of make_service(**settings); closed after the test."""
    clients: list[TestClient] = []

    def make(**settings: Any) -> TestClient:
        clients.append(TestClient(create_app(make_service(**settings))).__enter__())
        return clients[-1]

    yield make
    for c in clients:
        c.__exit__(None, None, None)
