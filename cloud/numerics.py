"""A target's numerics as one string: what decides the bits of its logits (ModelInfo.numerics, every open answer).

Two clouds with the same string compute the same logits for the same tokens in the same batch shapes: the same
weights (`weights_fingerprint`), runner, dtype, batch invariance, tensor-parallel group size, device kind and
matrix units (a CPU with AMX, AVX512-BF16, AVX512 or AVX2 runs other kernels, and other kernels sum in another
order). A session's tokens are exact under either numerics; what differs is which exact text a greedy or seeded
session gives. An edge whose session reopens on a replica of other numerics (a failover) keeps its committed
text and counts the change (PROTOCOL.md, "Model info").
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from shared.protocol import ModelInfo

# CPU flags (Linux /proc/cpuinfo) that change which matrix kernels run, best first
MATRIX_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")


def weights_fingerprint(path: Path) -> str:
    """12 hex digits over a model's configuration and the names and sizes of its weight files (a GGUF file: its
    size and first MiB, which holds its metadata); cheap at start-up, and changed by any other checkpoint."""
    h = hashlib.sha256()
    if path.is_file():
        h.update(str(path.stat().st_size).encode())
        with path.open("rb") as fh:
            h.update(fh.read(1 << 20))
        return h.hexdigest()[:12]
    for name in ("config.json", "generation_config.json"):
        if (path / name).exists():
            h.update((path / name).read_bytes())
    for f in sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES):
        h.update(f"{f.name}:{f.stat().st_size};".encode())
    return h.hexdigest()[:12]


def matrix_units(device: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's best matrix flag ("avx2", ...; "cpu" where none is known), or the CUDA device's name."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(device).replace(" ", "_") if torch.cuda.is_available() else "cuda"
    try:
        text = cpuinfo.read_text()
    except OSError:
        return "cpu"
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return next((f for f in MATRIX_FLAGS if f in flags), "cpu")


def numerics(info: ModelInfo, weights: str, units: str, tiled: bool = False) -> str:
    """The forward path shows when it is not transformers' own (other kernels, other bits). E.g. "pytorch bfloat16 invariant tp1 avx512_bf16 weights:3f9a1c2e07b4": compared whole, read by people.
    Forwards are "invariant" when measured so, "tiled" when built invariant (`tiled`: linear rows in tiles) but
    not measured or not proven (a tensor-parallel group), else "plain"."""
    path = f" {info.forward_path}" if info.forward_path not in ("", "transformers") else ""
    kernels = "invariant" if info.batch_invariant else "tiled" if tiled else "plain"
    return (f"{info.runner or 'pytorch'}{path} {info.dtype} {kernels} "
            f"tp{info.tensor_parallel} {units} weights:{weights}")
