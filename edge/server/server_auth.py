"""The OpenAI server's own keys (`--server-api-key`), as OpenAI checks them: `Authorization: Bearer KEY`.

Every /v1 route needs one of the keys when any is configured; a missing or wrong key answers 401 in
OpenAI's body (`invalid_api_key`) before the body is read. /healthz, /readyz and /metrics stay open,
as the cloud's are. A server bound beyond loopback without a key would hand the cloud key it holds to
whoever reaches it: `check_exposure` refuses that start.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from shared.hosts import is_loopback

from .openai_errors import OpenAIError


class ServerKeys:
    """ASGI middleware: /v1 requests without one of `keys` as their Bearer token answer 401."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], on_error: Callable[[OpenAIError], None]) -> None:
        self.app, self.keys, self.on_error = app, [k.encode() for k in keys], on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() == b"bearer" and any(hmac.compare_digest(token.strip(), k) for k in self.keys):
            return await self.app(scope, receive, send)
        what = "a wrong API key" if token else "no API key (send Authorization: Bearer KEY)"
        err = OpenAIError(401, f"this server needs one of its --server-api-key keys; the request had {what}",
                          "invalid_request_error", None, "invalid_api_key")
        self.on_error(err)
        await JSONResponse(err.to_body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
            scope, receive, send)


def check_exposure(host: str, keys: Sequence[str]) -> None:
    """ValueError with one line when the server would listen beyond loopback without a key of its own."""
    if not keys and not is_loopback(host):
        raise ValueError(f"--host {host} reaches beyond this machine: pass --server-api-key KEY (or set "
                         "SPECSPLIT_EDGE_SERVER_API_KEYS) so only its clients reach the cloud with this edge's key")
