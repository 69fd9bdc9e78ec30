"""Log lines of both processes: JSON lines (one object per record) or plain text.

`extra={"fields": {...}}` adds keys to a record (e.g. one per verify round); a line written while a
call with an X-Request-Id is served carries it as `x_request_id` (shared/request_id.py). The text
format appends the fields as `key=value` after the message.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Literal

from shared.request_id import RequestIdFilter

LogFormat = Literal["json", "text"]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        out.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = getattr(record, "fields", None)
        if fields:
            line += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        return line


def setup_logging(level: str = "info", fmt: LogFormat = "json") -> None:
    """Root logger -> stderr in `fmt` (a CLI calls this once)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
