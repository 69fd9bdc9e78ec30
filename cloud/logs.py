"""The verifier's log lines: JSON lines (shared/logs.py), one object per record;
`extra={"fields": {...}}` adds keys (e.g. one per round), and a line written while a call with an
X-Request-Id is served carries it as `x_request_id`."""

from __future__ import annotations

from shared.logs import JsonFormatter
from shared.logs import setup_logging as _setup


def setup_logging(level: str = "info") -> None:
    """Root logger -> stderr as JSON lines (the CLI calls this once)."""
    _setup(level, "json")


__all__ = ["JsonFormatter", "setup_logging"]
