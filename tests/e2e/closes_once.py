"""A transport that closes the session behind the edge's back before its 4th verify call (a reopen follows)."""

from __future__ import annotations

from typing import Any

from shared.config import SamplingConfig
from shared.protocol import VerifyRequest, VerifyResponse


class ClosesOnce:
    """Wraps a transport; its 4th verify call finds the session closed on the cloud (404, reopen)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.verifies = inner, 0
        self.traffic, self.supports_generate = inner.traffic, inner.supports_generate

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def routed(self, route_key: str, request_id: str | None = None) -> ClosesOnce:
        return self

    def verify(self, req: VerifyRequest, timeout: float, sampling: SamplingConfig | None = None) -> VerifyResponse:
        self.verifies += 1
        if self.verifies == 4:
            self.inner.close_session(req.ctx_id, timeout)
        return self.inner.verify(req, timeout, sampling)
