"""The context hash of PROTOCOL.md: 64-bit FNV-1a over little-endian int32 token ids, checked
against an independent byte-level reference and published FNV-1a test vectors."""

from __future__ import annotations

import struct

import pytest

from shared.hashing import FNV_OFFSET, FNV_PRIME, ctx_hash, fnv1a64, hash_hex, prefix_hashes


def reference_fnv1a64(data: bytes) -> int:
    """Textbook FNV-1a 64: for each byte, xor then multiply by the FNV prime, mod 2^64."""
    h = 0xCBF29CE484222325
    for byte in data:
        h ^= byte
        h = (h * 0x100000001B3) % 2**64
    return h


def reference_ctx_hash(ids: list[int]) -> str:
    return f"{reference_fnv1a64(b''.join(struct.pack('<i', t) for t in ids)):016x}"


def test_reference_matches_published_fnv1a_64_vectors() -> None:
    # from the FNV reference test suite (http://www.isthe.com/chongo/tech/comp/fnv/)
    assert reference_fnv1a64(b"") == 0xCBF29CE484222325
    assert reference_fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert reference_fnv1a64(b"foobar") == 0x85944171F73967E8


def test_constants_are_the_fnv_64_parameters() -> None:
    assert (FNV_OFFSET, FNV_PRIME) == (0xCBF29CE484222325, 0x100000001B3)


def test_empty_prefix_hashes_to_the_offset_basis() -> None:
    assert ctx_hash([]) == "cbf29ce484222325"
    assert fnv1a64([]) == FNV_OFFSET


@pytest.mark.parametrize("ids", [[0], [1], [1, 2, 3], [4095, 0, 17, 17, 250], [2**31 - 1], [-1, -(2**31)],
                                 list(range(300))])
def test_ctx_hash_equals_byte_level_reference(ids: list[int]) -> None:
    assert ctx_hash(ids) == reference_ctx_hash(ids)


def test_known_answers() -> None:
    """Literal values, so a change in the reference itself would also show."""
    assert reference_ctx_hash([0]) == ctx_hash([0]) == "4d25767f9dce13f5"
    assert reference_ctx_hash([1, 2, 3]) == ctx_hash([1, 2, 3]) == "fd1f0f4381eb0395"
    assert ctx_hash([0x61]) != ctx_hash([0x61, 0])  # every id is 4 bytes, zeros included


def test_hash_depends_on_order_and_length() -> None:
    assert ctx_hash([1, 2]) != ctx_hash([2, 1])
    assert ctx_hash([0]) != ctx_hash([0, 0]) != ctx_hash([])


def test_prefix_hashes_are_the_hashes_of_each_prefix() -> None:
    ids = [7, 300, 4095, 0, 12, 12, 9]
    states = prefix_hashes(ids)
    assert len(states) == len(ids)
    for i, h in enumerate(states):
        assert hash_hex(h) == ctx_hash(ids[: i + 1]) == reference_ctx_hash(ids[: i + 1])
    # continuing from a state equals hashing the concatenation
    assert prefix_hashes(ids[3:], states[2]) == states[3:]
    assert fnv1a64(ids[4:], fnv1a64(ids[:4])) == fnv1a64(ids)


def test_hash_hex_is_16_lower_case_digits() -> None:
    assert hash_hex(0) == "0" * 16
    assert hash_hex(0xABCDEF) == "0000000000abcdef"
    assert ctx_hash([5, 6]) == ctx_hash([5, 6]).lower() and len(ctx_hash([5, 6])) == 16


def test_ids_outside_int32_are_rejected() -> None:
    with pytest.raises(OverflowError):
        ctx_hash([2**31])
