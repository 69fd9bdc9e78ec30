"""The table of idempotent opens (cloud/idempotent_opens.py) on its own: what it keeps, and for how long."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from cloud.idempotent_opens import OpenJoiner
from shared.errors import ResourceExhausted
from shared.protocol import OpenSessionRequest, SessionInfo


class Prompt(list[int]):
    """A prompt a weak reference can follow: alive while anything (a traceback's frame) still holds it."""


def test_a_refused_open_is_forgotten_at_once_with_its_request() -> None:
    """A refused open (429 at admission) leaves no entry, and nothing of it keeps its prompt alive: not
    the entry, not a timer, not its exception's traceback."""
    joiner = OpenJoiner(keep_s=60.0)

    async def main() -> weakref.ref[Prompt]:
        prompt = Prompt([1, 2, 3])
        seen = weakref.ref(prompt)

        async def refuse(ids: list[int]) -> SessionInfo:
            raise ResourceExhausted(f"no room for {len(ids)} tokens")

        req = OpenSessionRequest(prompt)
        with pytest.raises(ResourceExhausted):
            await joiner.join("key", "req-1", req, lambda ids=prompt: refuse(ids), alive=lambda _: True)
        await asyncio.sleep(0)  # the done callbacks have run
        assert len(joiner) == 0
        del req, prompt
        return seen

    seen = asyncio.run(main())
    gc.collect()
    assert seen() is None


def test_a_cancelled_open_is_forgotten_at_once() -> None:
    joiner = OpenJoiner(keep_s=60.0, grace_s=0.0)

    async def main() -> None:
        async def never() -> SessionInfo:
            await asyncio.sleep(3600)
            raise AssertionError

        call = asyncio.ensure_future(joiner.join("key", "req-1", OpenSessionRequest([1]), never, alive=lambda _: True))
        await asyncio.sleep(0.01)
        call.cancel()  # the caller goes; after the grace (0 s) the open is cancelled
        await asyncio.sleep(0.05)
        assert len(joiner) == 0

    asyncio.run(main())


def test_one_owner_opening_with_fresh_request_ids_keeps_a_bounded_table() -> None:
    """1,000 answered opens of one key, each under a new request id: the key holds at most `max_per_owner`
    entries, the newest; another key's entry stays."""
    joiner = OpenJoiner(keep_s=60.0, max_per_owner=8)
    alive: set[str] = set()

    async def main() -> None:
        async def answer(ctx_id: str) -> SessionInfo:
            alive.add(ctx_id)
            return SessionInfo(ctx_id=ctx_id, ctx_len=1, ctx_hash="", vocab_size=10)

        await joiner.join("other", "req-0", OpenSessionRequest([1]), lambda: answer("o"), alive.__contains__)
        for i in range(1000):
            await joiner.join("key", f"req-{i}", OpenSessionRequest([1]), lambda i=i: answer(f"s{i}"),
                              alive.__contains__)
            alive.discard(f"s{i - 4}")  # the key's sessions come and go: four alive at a time
        assert len(joiner) <= 8 + 1
        again = await joiner.join("key", "req-999", OpenSessionRequest([1]), lambda: answer("new"), alive.__contains__)
        assert again.ctx_id == "s999"  # the newest still joins
        other = await joiner.join("other", "req-0", OpenSessionRequest([1]), lambda: answer("o2"), alive.__contains__)
        assert other.ctx_id == "o"

    asyncio.run(main())
