"""Block accounting of the paged KV cache: no leak, no double use, the budget never exceeded."""

from __future__ import annotations

import random

import pytest

from shared.blocks import BlockManager, OutOfBlocks


def write(m: BlockManager, sid: int, past: int, tokens: list[int]) -> None:
    m.prepare_write(sid, past, len(tokens))
    m.extend(sid, tokens)


def test_thousands_of_random_steps_leak_no_block_and_never_pass_the_budget() -> None:
    """5,000 random open / round (write then crop back) / crop / close / evict steps over 3 salts and a
    small vocabulary (so prefixes repeat and blocks are shared); invariants after every step, and
    once every sequence is closed and the cache evicted, every block is on the free list."""
    rng = random.Random(0)
    m = BlockManager(block_size=4, max_blocks=64, prefix_cache=True)
    live: list[int] = []
    refused = 0
    for _ in range(5000):
        op = rng.random()
        try:
            if op < 0.2 or not live:
                sid = m.new_seq(rng.choice([b"a", b"b", b""]))
                ids = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
                got = m.match_prefix(sid, ids, len(ids))
                live.append(sid)
                if got < len(ids):
                    write(m, sid, got, ids[got:])
                m.set_length(sid, len(ids))
            elif op < 0.6:
                sid = rng.choice(live)
                n = m.seqs[sid].length
                past = rng.randrange(max(n, 1)) if rng.random() < 0.3 else n
                write(m, sid, past, [rng.randrange(3) for _ in range(rng.randrange(1, 9))])
                m.set_length(sid, rng.randrange(past, m.seqs[sid].length + 1))
            elif op < 0.7:
                sid = rng.choice(live)
                m.crop(sid, rng.randrange(m.seqs[sid].length + 1))
            elif op < 0.9:
                m.free_seq(live.pop(rng.randrange(len(live))))
            else:
                m.evict_cached(rng.randrange(4))
        except OutOfBlocks:
            refused += 1
        m.check()
        assert m.capacity <= 64
    for sid in live:
        m.free_seq(sid)
    m.evict_cached()
    m.check()
    assert len(m.free) == m.capacity and m.used == 0 and not m.by_key
    assert refused > 0 and m.hit_tokens > 0 and m.evicted_blocks > 0  # the run reached every path


def test_a_refused_write_changes_nothing() -> None:
    m = BlockManager(block_size=4, max_blocks=2)
    a = m.new_seq()
    write(m, a, 0, [1, 2, 3, 4, 5])
    with pytest.raises(OutOfBlocks):
        m.prepare_write(a, 5, 4)
    assert m.seqs[a].length == 5 and len(m.seqs[a].table) == 2
    m.check()


def test_cached_blocks_are_taken_back_least_recently_used_first() -> None:
    m = BlockManager(block_size=2, max_blocks=3, prefix_cache=True)
    for ids in ([1, 1], [2, 2], [3, 3]):
        s = m.new_seq()
        write(m, s, 0, ids)
        m.set_length(s, 2)
        m.free_seq(s)
    assert len(m.cached) == 3 and m.available() == 3
    s = m.new_seq()
    write(m, s, 0, [9])  # takes the oldest cached block: [1, 1]
    probe = m.new_seq()
    assert m.match_prefix(probe, [1, 1], 2) == 0
    assert m.match_prefix(probe, [2, 2], 2) == 2


def test_salts_keep_prefixes_apart() -> None:
    m = BlockManager(block_size=2, prefix_cache=True)
    a = m.new_seq(b"key-a")
    write(m, a, 0, [5, 6, 7])
    m.set_length(a, 3)
    assert m.match_prefix(m.new_seq(b"key-b"), [5, 6, 7], 3) == 0
    assert m.match_prefix(m.new_seq(b"key-a"), [5, 6, 7], 3) == 2


def test_an_undone_copy_on_write_gives_the_sequence_its_shared_block_back() -> None:
    """A write into a keyed block remaps it to a private copy at planning; when the forward then fails,
    `undo_writes` puts the keyed block back and frees the copy (nothing leaks, nothing is cached twice)."""
    m = BlockManager(block_size=4, max_blocks=8, prefix_cache=True)
    a = m.new_seq()
    write(m, a, 0, [1, 2, 3, 4, 5, 6, 7, 8])
    m.set_length(a, 8)
    shared = m.seqs[a].table[1]
    assert m.key_of[shared] is not None
    m.prepare_write(a, 6, 3)  # crops into the keyed block: copy-on-write
    assert m.seqs[a].table[1] != shared
    m.undo_writes()
    m.crop(a, 6)  # the caller's abort
    assert m.seqs[a].table == [m.seqs[a].table[0], shared] and m.seqs[a].length == 6
    m.check()
    m.free_seq(a)
    m.evict_cached()
    m.check()
    assert len(m.free) == m.capacity
