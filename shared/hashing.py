"""The context hash of PROTOCOL.md: 64-bit FNV-1a over the little-endian int32 token ids; and a file's sha256."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK = 0xFFFFFFFFFFFFFFFF


def fnv1a64(ids: Iterable[int], state: int = FNV_OFFSET) -> int:
    """Extend the FNV-1a state `state` by the int32 little-endian bytes of `ids`."""
    h = state
    for tok in ids:
        for b in int(tok).to_bytes(4, "little", signed=True):
            h = ((h ^ b) * FNV_PRIME) & _MASK
    return h


def hash_hex(state: int) -> str:
    """The wire form: 16 lower-case hex digits."""
    return f"{state:016x}"


def ctx_hash(ids: Iterable[int]) -> str:
    """`ctx_hash` of a whole prefix, e.g. ctx_hash(S[:ctx_len])."""
    return hash_hex(fnv1a64(ids))


def prefix_hashes(ids: Iterable[int], state: int = FNV_OFFSET) -> list[int]:
    """FNV states after each token: out[i] is the state of the first i + 1 ids (after `state`)."""
    out = []
    h = state
    for tok in ids:
        h = fnv1a64((tok,), h)
        out.append(h)
    return out


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 16 MiB chunks."""
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()
