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
import json
import logging
import os
import time
from pathlib import Path

from shared.hashing import file_sha256
from shared.protocol import ModelInfo

log = logging.getLogger(__name__)

# CPU flags (Linux /proc/cpuinfo) that change which matrix kernels run, best first
MATRIX_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
# weight files at least this large keep their sha256 in the cache (smaller ones are hashed at every start)
CACHED_FROM_BYTES = 64 << 20


def default_cache() -> Path:
    """Where weight files' digests are kept: $XDG_CACHE_HOME/specsplit (else ~/.cache/specsplit)/weights.json."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "specsplit" / "weights.json"


def weights_fingerprint(path: Path, cache: Path | None = None) -> str:
    """12 hex digits over a model's configuration and the sha256 of every byte of its weight files (a GGUF file:
    the file), so two fine-tunes of one base with the same file names and sizes differ. A large file is hashed
    once (seconds for a model of several GB, BENCHMARKS.md "What start-up calibration costs"): its digest is kept in `cache` (default `default_cache()`)
    under its path, size, modification time and inode, and read back while those hold."""
    h = hashlib.sha256()
    if path.is_file():
        files = [path]
    else:
        for name in ("config.json", "generation_config.json"):
            if (path / name).exists():
                h.update((path / name).read_bytes())
        files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    cache = cache or default_cache()
    for f in files:
        h.update(f"{f.name}:{file_digest(f, cache)};".encode())
    return h.hexdigest()[:12]


def file_digest(path: Path, cache: Path) -> str:
    """sha256 of the file, from `cache` when it was hashed there at its present size, mtime and inode."""
    st = path.stat()
    if st.st_size < CACHED_FROM_BYTES:
        return file_sha256(path)
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    if isinstance(known.get(key), str):
        return str(known[key])
    t0 = time.monotonic()
    digest = file_sha256(path)
    log.info("weights fingerprint: hashed %s (%.1f GB) in %.1f s, kept in %s", path, st.st_size / 1e9,
             time.monotonic() - t0, cache)
    known = {k: v for k, v in known.items() if not k.startswith(f"{path.resolve()}|")}  # its older versions go
    known[key] = digest
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known, indent=1) + "\n")
        tmp.replace(cache)
    except OSError as e:
        log.info("weights fingerprint: cannot keep the digest in %s (%s); it is hashed again at the next start",
                 cache, e.strerror)
    return digest


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
