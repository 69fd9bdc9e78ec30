"""A generation as the caller sees it: its job (what was asked), the running handle that yields committed
tokens, and the result it sums up to."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .exchange import SessionParams
from .metrics import CommittedToken, EdgeMetrics, RoundRecord
from .settings import Mode


@dataclass
class GenerationResult:
    # the decoded generated text (prompt excluded)
    text: str
    # generated ids (prompt excluded)
    token_ids: list[int]
    # the prompt's ids
    prompt_ids: list[int]
    # every generated token with its origin
    tokens: list[CommittedToken]
    # one record per round (empty for REST cloud_only)
    rounds: list[RoundRecord]
    metrics: EdgeMetrics
    mode: str = "speculative"
    # why it ended: "length" (max_new_tokens), "eos", or "context" (the model's context is full)
    stop_reason: str = ""
    # the routing key every cloud call of this generation carried (X-Specsplit-Route)
    route_key: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_ids": self.prompt_ids,
                "origins": [t.origin for t in self.tokens], "mode": self.mode, "stop_reason": self.stop_reason,
                "route_key": self.route_key,
                "rounds": [r.to_dict() for r in self.rounds], "metrics": self.metrics.to_dict()}


class Generation:
    """A running generation: iterate for committed tokens; `result()` drains and summarises."""

    def __init__(self, tokens: Iterator[CommittedToken], finish: Callable[[list[CommittedToken]], GenerationResult]):
        self._tokens = tokens
        self._finish = finish
        self._seen: list[CommittedToken] = []
        self._result: GenerationResult | None = None

    def __iter__(self) -> Iterator[CommittedToken]:
        for tok in self._tokens:
            self._seen.append(tok)
            yield tok

    def close(self) -> None:
        """Stop early: ends the token source, which closes its cloud session; `result()` then
        summarises the tokens seen so far."""
        close = getattr(self._tokens, "close", None)
        if close is not None:
            close()

    def result(self) -> GenerationResult:
        if self._result is None:
            for _ in self:
                pass
            self._result = self._finish(self._seen)
        return self._result


def new_request_id() -> str:
    """A fresh request id (128 bits, URL-safe): one per generation."""
    return secrets.token_urlsafe(16)


@dataclass
class GenerationJob:
    prompt_ids: list[int]
    mode: Mode
    max_new_tokens: int
    params: SessionParams
    # routing key of the generation: the same on every call, across reopens and retries
    route_key: str
    # X-Request-Id sent on every cloud call of the generation
    request_id: str = ""
    # "cost" | "dynamic" (edge/policy/k.py, edge/policy/k.py)
    k_policy: str = "cost"
    metrics: EdgeMetrics = field(default_factory=EdgeMetrics)
    rounds: list[RoundRecord] = field(default_factory=list)
    started: float = 0.0
    stop_reason: str = ""
