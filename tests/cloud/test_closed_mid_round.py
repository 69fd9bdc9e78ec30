"""A session closed (DELETE, or the store cleared at shutdown) while its round is in the model's forward:
the round answers 404 `not_found`, a chain round and a tree round alike, never 500."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from cloud.rest import VerifyBody
from cloud.service import VerifierService
from shared.config import SamplingConfig
from shared.errors import NotFound
from shared.hashing import ctx_hash
from shared.kvpool import Row
from shared.protocol import OpenSessionRequest, VerifyRequest


@pytest.fixture(scope="module")
def prompt(tiny_pair: tuple[Path, Path]) -> list[int]:
    return list(AutoTokenizer.from_pretrained(tiny_pair[0]).encode("import numpy as np\n"))


def round_request(ctx_id: str, ids: list[int], tree: bool) -> VerifyRequest:
    tokens, parents = ([5, 6, 7], [-1, -1, 0]) if tree else ([5, 6], None)
    return VerifyBody(ctx_id=ctx_id, ctx_len=len(ids), ctx_hash=ctx_hash(ids), draft_tokens=tokens,
                      q_token_probs=[0.5] * len(tokens), k=len(tokens), tree_parents=parents).to_request()


def close_during_forward(svc: VerifierService, prompt: list[int], tree: bool,
                         close: Callable[[VerifierService, str], None]) -> BaseException | None:
    """Run one round whose forward waits until `close` has run on the event loop; what the round raised."""
    in_forward, closed = threading.Event(), threading.Event()
    real = svc.forward
    assert real is not None

    def held(rows: list[Row]) -> list[torch.Tensor]:
        out = real(rows)
        if any(r.num_logits for r in rows):  # the round's verify row, not the open's prefill
            in_forward.set()
            closed.wait(10)
        return out

    async def main() -> BaseException | None:
        try:
            info = await svc.open_session(OpenSessionRequest(prompt, SamplingConfig(0.0)), "")
            svc.forward = held
            call = asyncio.ensure_future(svc.verify(round_request(info.ctx_id, prompt, tree), "", 3 if tree else 2))
            assert await asyncio.to_thread(in_forward.wait, 10)
            close(svc, info.ctx_id)
            closed.set()
            try:
                await call
            except BaseException as e:  # noqa: BLE001 - what the round answered
                return e
            return None
        finally:
            svc.forward = real
            closed.set()

    return asyncio.run(main())


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_session_deleted_while_its_round_is_in_the_forward_answers_404(
        make_service: Callable[..., VerifierService], prompt: list[int], tree: bool) -> None:
    got = close_during_forward(make_service(), prompt, tree, lambda svc, ctx_id: svc.close_session(ctx_id, ""))
    assert isinstance(got, NotFound) and got.http_status == 404, repr(got)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_round_in_the_forward_at_shutdown_answers_404(
        make_service: Callable[..., VerifierService], prompt: list[int], tree: bool) -> None:
    got = close_during_forward(make_service(), prompt, tree, lambda svc, _: svc.store.clear())
    assert isinstance(got, NotFound) and got.http_status == 404, repr(got)
