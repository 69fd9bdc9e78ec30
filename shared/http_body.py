"""A request body read whole under a byte limit, for the ASGI middlewares of both servers (the cloud's
REST guard and the edge's OpenAI server): the declared length is checked first, then a streamed body
is buffered up to the limit, so neither kind can make a server hold more than `max_bytes`."""

from __future__ import annotations

from typing import Literal

from starlette.types import Message, Receive, Scope

Outcome = Literal["ok", "too_big", "gone"]


async def read_limited(scope: Scope, receive: Receive, max_bytes: int) -> tuple[Outcome, bytes]:
    """("ok", body), ("too_big", b"") past max_bytes, or ("gone", b"") when the client left first."""
    declared = dict(scope["headers"]).get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        return "too_big", b""
    chunks: list[bytes] = []
    seen, more = 0, True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            return "gone", b""
        chunks.append(msg.get("body", b""))
        seen += len(chunks[-1])
        if seen > max_bytes:
            return "too_big", b""
        more = msg.get("more_body", False)
    return "ok", b"".join(chunks)


def replaying(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands the app the buffered body once, then the client's further messages."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
