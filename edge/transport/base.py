"""The transport interface: the PROTOCOL.md calls as methods on the shared wire dataclasses.

REST (httpx) and gRPC implement it; each converts to and from the dataclasses in one place and
raises only `shared.errors` types (plus the edge's CloudTimeout / CloudUnavailable).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.config import SamplingConfig
from shared.errors import InvalidArgument
from shared.protocol import (
    ModelInfo,
    OpenSessionRequest,
    SessionInfo,
    StreamDone,
    StreamedToken,
    VerifyRequest,
    VerifyResponse,
)

# the routing key of one generation: REST header X-Specsplit-Route, gRPC metadata x-specsplit-route
# (lower case: gRPC metadata keys are). The cloud ignores it; a load balancer hashes on it to keep
# every call of the generation on one replica.
ROUTE_HEADER = "x-specsplit-route"
# what a routing key may hold: URL-safe characters, valid as an HTTP header and gRPC metadata value
ROUTE_KEY_PATTERN = re.compile(r"[A-Za-z0-9._~-]{1,128}")


def new_route_key() -> str:
    """A fresh random routing key (128 bits, URL-safe): one per generation."""
    return secrets.token_urlsafe(16)


def check_route_key(key: str) -> str:
    """`key` if it is a valid routing key, else InvalidArgument."""
    if not ROUTE_KEY_PATTERN.fullmatch(key):
        raise InvalidArgument(f"route key must be 1-128 characters of A-Z a-z 0-9 . _ ~ -, not {key!r}")
    return key


@dataclass
class GenerateResult:
    # target-only generated ids (after the prompt)
    token_ids: list[int]
    # whatever the cloud reports
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class Traffic:
    # payload bytes sent / received over the transport's life (JSON bodies or protobuf messages)
    bytes_up: int = 0
    bytes_down: int = 0
    # requests attempted
    calls: int = 0


def with_max_generate_tokens(info: ModelInfo, n: int) -> ModelInfo:
    """`info` with the cloud's `max_generate_tokens` (0 = unknown) where ModelInfo has that field; returns info."""
    if n > 0 and hasattr(info, "max_generate_tokens"):
        info.max_generate_tokens = n
    return info


class Transport(Protocol):
    traffic: Traffic
    # False: no target-only generate call (gRPC); cloud_only then runs k = 0 verify rounds
    supports_generate: bool
    # True: stream_session is implemented (the cloud must offer it too: ModelInfo.session_stream)
    supports_session_stream: bool = False

    def open_session(self, req: OpenSessionRequest, timeout: float) -> SessionInfo: ...

    def verify(self, req: VerifyRequest, timeout: float, sampling: SamplingConfig | None = None) -> VerifyResponse:
        """One round; `sampling`, when given, travels along and must equal the session's (422 otherwise)."""
        ...

    def get_session(self, ctx_id: str, timeout: float) -> SessionInfo: ...

    def close_session(self, ctx_id: str, timeout: float) -> None: ...

    def get_model(self, timeout: float) -> ModelInfo: ...

    def generate(self, prompt_ids: list[int], cfg: SamplingConfig, seed: int, max_new_tokens: int,
                 timeout: float, stop_at_eos: bool = True) -> GenerateResult: ...

    def generate_stream(self, prompt_ids: list[int], cfg: SamplingConfig, seed: int, max_new_tokens: int,
                        timeout: float, stop_at_eos: bool = True) -> Iterator[int | GenerateResult]:
        """Target-only generation as it happens: each token id, then the GenerateResult."""
        ...

    def stream_session(self, ctx_id: str, ctx_len: int, ctx_hash: str, max_new_tokens: int, stop_at_eos: bool,
                       timeout: float) -> Iterator[StreamedToken | StreamDone]:
        """The target's own tokens on an open session (PROTOCOL.md, "Streaming on a session"): each token as it
        arrives, then the StreamDone. The cloud keeps S[:ctx_len] of the session first; `timeout` bounds each
        wait for the next event (gRPC, which has no deadline per message: the call's is `timeout` per event).
        Closing the iterator early cancels the stream (the cloud stops after the round in progress, whose
        token it keeps)."""
        ...

    def routed(self, route_key: str, request_id: str | None = None) -> Transport:
        """A view sending `route_key` on every call (header / metadata ROUTE_HEADER), and `request_id`
        when given (REQUEST_ID_HEADER, shared/request_id.py); it shares this transport's connections
        and `traffic`, so closing either closes both."""
        ...

    def close(self) -> None: ...
