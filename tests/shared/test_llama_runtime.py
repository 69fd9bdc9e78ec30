"""llama.cpp's runtime (shared/llama_runtime.py): a llama-cpp-python other than the pinned one is said in one
line at its first use, since this code calls its low-level API."""

from __future__ import annotations

import logging

import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from shared import llama_runtime  # noqa: E402


def test_another_llama_cpp_python_is_said_in_one_line_at_first_use(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(llama_cpp, "__version__", llama_runtime.PINNED_VERSION)
    assert llama_runtime.version_note() is None
    monkeypatch.setattr(llama_cpp, "__version__", "0.2.90")
    monkeypatch.setattr(llama_cpp, "llama_backend_init", lambda: None)
    monkeypatch.setattr(llama_runtime, "_initialised", False)
    with caplog.at_level(logging.WARNING, logger="shared.llama_runtime"):
        llama_runtime._lib()
        llama_runtime._lib()  # once: at the first use
    lines = [r.getMessage() for r in caplog.records if r.name == "shared.llama_runtime"]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "0.2.90" in lines[0] and f"llama-cpp-python=={llama_runtime.PINNED_VERSION}" in lines[0]
