"""Fixtures of the preparation tests that run the real pip against a local index."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def pip_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """pip sees only what a test gives it (this machine's pip configuration names other indexes)."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    for name in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def pip_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """Every command modelprep runs (they still run)."""
    calls: list[list[str]] = []
    real = subprocess.run

    def record(cmd: list[str], *args: Any, **kwargs: Any) -> Any:
        calls.append([str(c) for c in cmd])
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", record)
    yield calls
