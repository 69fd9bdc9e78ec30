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


def test_llama_cpp_runs_the_coder_pairs_quantization_on_this_cpu(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The coder pair ships as Q4_K_M GGUF files, whose kernels are the ones a llama.cpp built for another CPU's
    instructions (AVX-512, AMX) dies on with SIGILL: a tiny Qwen2 (rows of 256, Q4_K's block) written as a GGUF,
    quantized to Q4_K_M by llama.cpp itself, then a forward of it, in a child process so that a crash is named."""
    import subprocess
    import sys

    import gguf

    from tests.tiny_gguf import build_qwen2, write_gguf

    f32 = write_gguf(build_qwen2(tmp_path / "qwen2", hidden=256), tmp_path / "f32.gguf")
    q4 = tmp_path / "q4_k_m.gguf"
    code = f"""
import llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
assert llama_cpp.llama_model_quantize({str(f32).encode()!r}, {str(q4).encode()!r}, p) == 0
m = llama_cpp.Llama({str(q4)!r}, n_ctx=64, n_threads=1, logits_all=True, verbose=False)
m.eval([1, 2, 3, 4])
import math
print(all(math.isfinite(x) for x in m.scores[3]))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (
        f"llama.cpp exited with {run.returncode} running Q4_K_M here (-4: SIGILL, a wheel built for another CPU: "
        f"remove ~/.cache/specsplit/llama_cpp and run scripts/setup.sh again): {run.stderr[-800:]}")
    assert run.stdout.strip().endswith("True")
    types = {t.tensor_type for t in gguf.GGUFReader(q4).tensors}
    assert gguf.GGMLQuantizationType.Q4_K in types
