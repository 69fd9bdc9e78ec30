"""End-to-end fixtures: a real `specsplit-cloud` process on loopback (see tests/server.py).

Module-scoped, so the tests of one module share one process; each test opens its own sessions.
`cloud`, `tokenizer` and `drafter` are the tiny pair's, as the edge modules use them; a module
that needs others (the cloud modules use the demo pair) defines its own, which take precedence.
`drafter` runs in the suite's dtype (SPECSPLIT_TEST_DTYPE, float32 unless scripts/test.sh's bfloat16 pass
names bfloat16), as the cloud does (tests/server.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from edge.drafters import ModelDrafter
from shared.hf_model import DTYPES
from tests.server import CloudProcess


@pytest.fixture(scope="module")
def cloud_server(demo_target_dir: Path) -> Iterator[CloudProcess]:
    """specsplit-cloud with the bundled demo target, auth off; `.http_url`, `.grpc_target`."""
    with CloudProcess(demo_target_dir) as cloud:
        yield cloud


@pytest.fixture(scope="session")
def tiny_cloud_server(tiny_pair: tuple[Path, Path]) -> Iterator[CloudProcess]:
    """specsplit-cloud with the tiny random target of `tiny_pair`, auth off: one process for every module that only
    reads texts and session answers from it (none kills it or reads its process-wide counters)."""
    with CloudProcess(tiny_pair[0]) as cloud:
        yield cloud


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    """In-process models run faster on one thread than fighting the server over the shared cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cloud(tiny_pair: tuple[Path, Path]) -> Iterator[CloudProcess]:
    """A fresh specsplit-cloud with the tiny target for this module (some tests kill it)."""
    with CloudProcess(tiny_pair[0]) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(tiny_pair: tuple[Path, Path]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])


@pytest.fixture(scope="module")
def drafter(tiny_pair: tuple[Path, Path]) -> ModelDrafter:
    return ModelDrafter(tiny_pair[1], dtype=DTYPES[os.environ.get("SPECSPLIT_TEST_DTYPE", "float32")])


@pytest.fixture(scope="module")
def gguf_drafter(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny draft written as a GGUF file (tests/tiny_gguf.py) and run by llama.cpp (edge/drafters/llamacpp.py)."""
    from edge.drafters.llamacpp import LlamaCppDrafter
    from tests.tiny_gguf import write_gguf

    out = tmp_path_factory.mktemp("gguf_draft")
    for f in tiny_pair[1].iterdir():  # the tokenizer files beside the GGUF, as a prepared directory holds them
        if f.name.startswith("tokenizer"):
            (out / f.name).write_bytes(f.read_bytes())
    return LlamaCppDrafter(write_gguf(tiny_pair[1], out / "model.gguf"), threads=1)
