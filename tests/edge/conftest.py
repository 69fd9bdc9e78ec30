"""Edge fixtures: the tiny random pair's tokenizer, an in-process fake cloud, drafters and clients."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from edge.client import EdgeClient
from edge.drafters import ModelDrafter, NGramDrafter
from edge.settings import EdgeSettings
from tests.edge.fake_cloud import FakeCloud


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_pair: tuple[Path, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])


@pytest.fixture
def fake_cloud(tiny_pair: tuple[Path, Path]) -> FakeCloud:
    return FakeCloud(tiny_pair[0])


@pytest.fixture(scope="session")
def _tiny_draft_model(tiny_pair: tuple[Path, Path]) -> ModelDrafter:
    return ModelDrafter(tiny_pair[1])


@pytest.fixture
def model_drafter(_tiny_draft_model: ModelDrafter) -> ModelDrafter:
    _tiny_draft_model.reset()
    return _tiny_draft_model


class FakeClock:
    """Injected clock: every reading advances 1 ms, sleeps advance by their length and are recorded."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        self.now += 0.001
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


@pytest.fixture
def make_client(fake_cloud: FakeCloud, model_drafter: ModelDrafter, tiny_tokenizer: Any,
                tiny_pair: tuple[Path, Path]) -> Callable[..., tuple[EdgeClient, FakeClock]]:
    """make_client(drafter="model"|"ngram"|Drafter, **settings) -> (client on the fake cloud, its clock)."""

    def make(drafter: Any = "model", **settings: Any) -> tuple[EdgeClient, FakeClock]:
        if drafter == "model":
            drafter = model_drafter
        elif drafter == "ngram":
            drafter = NGramDrafter(order=settings.get("ngram_order", 4), filler_top_k=settings.get("filler_top_k", 0))
        settings.setdefault("draft", str(tiny_pair[1]))
        clock = FakeClock()
        client = EdgeClient(EdgeSettings(**settings), transport=fake_cloud, drafter=drafter, tokenizer=tiny_tokenizer,
                            clock=clock, sleep=clock.sleep)
        return client, clock

    return make


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():  # type: ignore[no-untyped-def]
    """Tiny models run faster on one thread than fighting over the shared cores."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
