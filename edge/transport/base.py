"""The transport interface: the PROTOCOL.md calls as methods on the shared wire dataclasses.

REST (httpx) and gRPC implement it; each converts to and from the dataclasses in one place and
raises only `shared.errors` types (plus the edge's CloudTimeout / CloudUnavailable).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.config import SamplingConfig
from shared.protocol import ModelInfo, OpenSessionRequest, SessionInfo, VerifyRequest, VerifyResponse


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


class Transport(Protocol):
    traffic: Traffic
    # False: no target-only generate call (gRPC); cloud_only then runs k = 0 verify rounds
    supports_generate: bool

    def open_session(self, req: OpenSessionRequest, timeout: float) -> SessionInfo: ...

    def verify(self, req: VerifyRequest, timeout: float, sampling: SamplingConfig | None = None) -> VerifyResponse:
        """One round; `sampling`, when given, travels along and must equal the session's (422 otherwise)."""
        ...

    def get_session(self, ctx_id: str, timeout: float) -> SessionInfo: ...

    def close_session(self, ctx_id: str, timeout: float) -> None: ...

    def get_model(self, timeout: float) -> ModelInfo: ...

    def generate(self, prompt_ids: list[int], cfg: SamplingConfig, seed: int, max_new_tokens: int,
                 timeout: float) -> GenerateResult: ...

    def generate_stream(self, prompt_ids: list[int], cfg: SamplingConfig, seed: int, max_new_tokens: int,
                        timeout: float) -> Iterator[int | GenerateResult]:
        """Target-only generation as it happens: each token id, then the GenerateResult."""
        ...

    def close(self) -> None: ...
