"""One request id end to end: the `X-Request-Id` header (REST) / `x-request-id` metadata (gRPC).

The OpenAI server takes a caller's X-Request-Id (or makes one: the response's `id`), sends it on
every cloud call of that generation, logs it and answers with it; the cloud logs it next to the
`ctx_id` of each line it writes while serving the call and echoes it (response header / initial
metadata). It is opaque text of 1 to 128 characters from `A-Z a-z 0-9 . _ ~ : -`. It is not the
per-round `request_id` field of a verify request (the idempotency key of one round).
"""

from __future__ import annotations

import contextvars
import logging
import re

from shared.errors import InvalidArgument

# header / metadata name (lower case: gRPC metadata keys are; HTTP headers ignore case)
REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._~:-]{1,128}")
# the id of the call being served, for log lines written while serving it
CURRENT: contextvars.ContextVar[str] = contextvars.ContextVar("specsplit_request_id", default="")
# the log field that carries it
LOG_FIELD = "x_request_id"


def check_request_id(value: str) -> str:
    """`value` if it is a valid request id, else InvalidArgument naming the rule."""
    if not REQUEST_ID_PATTERN.fullmatch(value):
        raise InvalidArgument(f"X-Request-Id must be 1-128 characters of A-Z a-z 0-9 . _ ~ : -, not {value[:40]!r}")
    return value


class RequestIdFilter(logging.Filter):
    """Adds the current request id (when there is one) to a record's `fields` (see the JSON formatters)."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = CURRENT.get()
        if rid:
            fields = dict(getattr(record, "fields", None) or {})
            fields.setdefault(LOG_FIELD, rid)
            record.fields = fields
        return True
