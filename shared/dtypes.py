"""Which dtype a model runs in when the user says `auto`: bfloat16 where the hardware multiplies it natively.

On the CPU that is Intel AMX (`amx_bf16`) or AVX512-BF16 (`avx512_bf16`): oneDNN sends bfloat16 matrix
products to those units by itself. A single row does not use them well, so one decode row is not faster
than float32 there, while a verify of 16 rows costs about what one does (BENCHMARKS.md, "bfloat16"). On
CUDA, bfloat16 where the device supports it. Elsewhere float32.
"""

from __future__ import annotations

from pathlib import Path

import torch

# the CPU flags (Linux /proc/cpuinfo) of bfloat16 matrix units, best first
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_bf16_units(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """The bfloat16 flags this CPU reports (empty where it reports none or there is no /proc/cpuinfo)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return []
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
            break
    return [f for f in BF16_FLAGS if f in flags]


def resolve_dtype(requested: str, device: str, cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, str]:
    """(dtype, why): `requested` itself unless it is "auto"."""
    if requested != "auto":
        return requested, "asked for"
    if device.startswith("cuda"):
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bfloat16", "auto: the CUDA device supports bfloat16"
        return "float32", "auto: the CUDA device lacks bfloat16"
    units = cpu_bf16_units(cpuinfo)
    if units:
        return "bfloat16", f"auto: the CPU has {' and '.join(units)}"
    return "float32", "auto: the CPU reports no bfloat16 units (amx_bf16, avx512_bf16)"
