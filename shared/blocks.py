"""Block accounting of a paged KV cache: fixed-size blocks, a free list, reference counts, block
tables, and a prefix cache of full blocks keyed by a hash chain. Pure bookkeeping: no tensors.

A sequence is a block table (block ids in position order) and a length n: position p lives in
block table[p // size] at offset p % size. Crop = set n and drop whole blocks past it.

Every block is in exactly one state:
- free: on the free list (never written, or forgotten);
- referenced: in at least one block table (`ref` counts the tables);
- cached: in no table, but keyed in the prefix cache (it holds the KV of a known full prefix);
  cached blocks are reused by `match_prefix` and taken back least recently used first when the
  free list runs out.

Prefix cache. A full block is keyed by the hash of (the previous block's key, its tokens), the
first block's by the sequence's salt and its tokens, so a key names the whole prefix up to and
including the block (vLLM's automatic prefix caching). Keyed blocks are read-only: a sequence that
writes into one (after a crop into the middle of it) first gets a private copy (`prepare_write`
reports it). A sequence's partial last block is always its own. The salt keeps tenants apart: two
sequences share a block only if their salts are equal.

Capacity grows by doubling up to `max_blocks` (the budget) and never past it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shared.rows import Row


class OutOfBlocks(RuntimeError):
    """No free, growable or cached block is left (the caller should have reserved)."""


@dataclass
class SeqBlocks:
    # block ids in position order
    table: list[int] = field(default_factory=list)
    # positions whose KV is valid
    length: int = 0
    # the tokens of those positions (for the prefix keys)
    tokens: list[int] = field(default_factory=list)
    # chain[i] = key of the prefix ending with block i, for the leading full blocks known so far
    chain: list[bytes] = field(default_factory=list)
    # the hash chain's start (tenant separation)
    salt: bytes = b""


def _key(prev: bytes, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens))
    return h.digest()


class BlockManager:
    def __init__(self, block_size: int, max_blocks: int | None = None, prefix_cache: bool = False,
                 initial_blocks: int = 16) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        if max_blocks is not None and max_blocks < 1:
            raise ValueError("the KV budget holds no block: raise --kv-budget-bytes")
        self.size = block_size
        # most blocks ever allocated (None: unbounded)
        self.max_blocks = max_blocks
        self.prefix_cache = prefix_cache
        self.capacity = 0  # blocks that exist (the KV tensors hold this many)
        self.ref: list[int] = []
        self.key_of: list[bytes | None] = []
        self.by_key: dict[bytes, int] = {}
        self.free: deque[int] = deque()
        self.cached: OrderedDict[int, None] = OrderedDict()  # unreferenced keyed blocks, oldest first
        self.seqs: dict[int, SeqBlocks] = {}
        self._next_seq = 0
        # counters: positions served from the prefix cache; cached blocks taken back for reuse
        self.hit_tokens = 0
        self.evicted_blocks = 0
        # copy-on-writes planned and not yet written: (sequence, source, destination). The source keeps its
        # reference until the write is committed (`extend`) or undone (`undo_writes`), so a failed forward
        # can give the sequence its block back
        self._copying: list[tuple[int, int, int]] = []
        # sequences given blocks for a write not yet committed (`undo_writes` gives those blocks back)
        self._writing: set[int] = set()
        self._grow(min(initial_blocks, max_blocks) if max_blocks else initial_blocks)

    # --- capacity ---------------------------------------------------------------------------
    def _grow(self, n: int) -> None:
        new = max(n, self.capacity)
        if self.max_blocks is not None:
            new = min(new, self.max_blocks)
        self.ref.extend([0] * (new - self.capacity))
        self.key_of.extend([None] * (new - self.capacity))
        self.free.extend(range(self.capacity, new))
        self.capacity = new

    @property
    def growable(self) -> int:
        return (1 << 62) if self.max_blocks is None else self.max_blocks - self.capacity

    def available(self) -> int:
        """Blocks a forward can still get: free, not yet grown, or cached (taken back LRU)."""
        return len(self.free) + len(self.cached) + self.growable

    @property
    def used(self) -> int:
        return self.capacity - len(self.free) - len(self.cached)

    def _take(self) -> int:
        if not self.free:
            if self.growable > 0:
                self._grow(max(2 * self.capacity, 16))
            elif self.cached:
                b, _ = self.cached.popitem(last=False)
                self._forget_key(b)
                self.free.append(b)
                self.evicted_blocks += 1
        if not self.free:
            raise OutOfBlocks(f"all {self.capacity} KV blocks are in use")
        b = self.free.popleft()
        self.ref[b] = 1
        return b

    def _forget_key(self, b: int) -> None:
        k = self.key_of[b]
        if k is not None:
            self.key_of[b] = None
            if self.by_key.get(k) == b:
                del self.by_key[k]

    def _decref(self, b: int) -> None:
        self.ref[b] -= 1
        assert self.ref[b] >= 0, f"block {b} released twice"
        if self.ref[b] == 0:
            if self.key_of[b] is not None:
                self.cached[b] = None  # most recently used at the end
            else:
                self.free.append(b)

    def evict_cached(self, n: int | None = None) -> int:
        """Forget up to n (all) unreferenced cached blocks, oldest first; returns how many."""
        done = 0
        while self.cached and (n is None or done < n):
            b, _ = self.cached.popitem(last=False)
            self._forget_key(b)
            self.free.append(b)
            done += 1
        self.evicted_blocks += done
        return done

    # --- sequences --------------------------------------------------------------------------
    def new_seq(self, salt: bytes = b"") -> int:
        seq_id = self._next_seq
        self._next_seq += 1
        self.seqs[seq_id] = SeqBlocks(salt=hashlib.blake2b(salt, digest_size=16).digest())
        return seq_id

    def free_seq(self, seq_id: int) -> None:
        """Release every block of `seq_id` (unknown or already freed ids are ignored)."""
        s = self.seqs.pop(seq_id, None)
        if s is None:
            return
        for b in reversed(s.table):
            self._decref(b)

    def crop(self, seq_id: int, n: int) -> None:
        """Keep the first n positions of `seq_id` (all of them when it holds fewer); whole blocks past
        them go back (to the free list, or to the cache when keyed)."""
        s = self.seqs[seq_id]
        n = min(max(n, 0), s.length)
        s.length = n
        del s.tokens[n:]
        del s.chain[n // self.size:]
        keep = -(-n // self.size)
        for b in reversed(s.table[keep:]):
            self._decref(b)
        del s.table[keep:]

    def blocks_needed(self, seq_id: int, num_cached_tokens: int, n_new: int) -> int:
        """New blocks a write of n_new positions at offset `num_cached_tokens` takes (after cropping to it)."""
        s = self.seqs[seq_id]
        num_cached_tokens = min(num_cached_tokens, s.length)
        have = -(-num_cached_tokens // self.size)
        need = -(-(num_cached_tokens + n_new) // self.size) - have
        if num_cached_tokens % self.size and self._shared(s.table[have - 1]):
            need += 1  # copy-on-write of the partial block
        return max(need, 0)

    def _shared(self, b: int) -> bool:
        return self.ref[b] > 1 or self.key_of[b] is not None

    def prepare_write(self, seq_id: int, num_cached_tokens: int, n_new: int) -> tuple[int, int] | None:
        """Crop `seq_id` to `num_cached_tokens` (c) and give it blocks for positions c .. c + n_new - 1. Returns
        (source, destination) when the partial block at `num_cached_tokens` was shared and must be copied into a
        private block before the write, else None. OutOfBlocks if the blocks are not there."""
        if self.blocks_needed(seq_id, num_cached_tokens, n_new) > self.available():
            raise OutOfBlocks(f"a write of {n_new} positions needs more KV blocks than are left")
        s = self.seqs[seq_id]
        if num_cached_tokens > s.length:
            raise ValueError(f"sequence {seq_id} holds {s.length} positions: a write at {num_cached_tokens} would "
                             "leave a gap")
        self.crop(seq_id, num_cached_tokens)
        self._writing.add(seq_id)
        copy = None
        if s.length % self.size and self._shared(s.table[-1]):
            src = s.table[-1]
            dst = self._take()
            s.table[-1] = dst
            self._copying.append((seq_id, src, dst))  # src is let go at `extend`, restored by `undo_writes`
            copy = (src, dst)
        end = -(-(s.length + n_new) // self.size)
        while len(s.table) < end:
            s.table.append(self._take())
        return copy

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """After the write: the new positions hold the KV of `tokens` (a copied source block is let go)."""
        s = self.seqs[seq_id]
        self._writing.discard(seq_id)
        for entry in [e for e in self._copying if e[0] == seq_id]:
            self._copying.remove(entry)
            self._decref(entry[1])
        s.tokens.extend(tokens)
        s.length += len(tokens)
        assert s.length <= len(s.table) * self.size

    def rewrite(self, seq_id: int, start: int, tokens: list[int]) -> None:
        """Positions start .. start + len(tokens) - 1 now hold the KV of `tokens` (a tree's path moved
        there); none of them may be in a block the prefix cache keys."""
        s = self.seqs[seq_id]
        assert start + len(tokens) <= s.length and len(s.chain) * self.size <= start
        s.tokens[start: start + len(tokens)] = tokens

    def undo_writes(self) -> None:
        """The forward planned since the last `extend` failed: every sequence whose shared partial block was
        remapped to a fresh one (copy-on-write) gets its source block back, the fresh one is freed, and the
        blocks given for the write go back (each sequence keeps the positions it held when planned, cropped
        to the row's `num_cached_tokens`)."""
        for seq_id, src, dst in reversed(self._copying):
            s = self.seqs.get(seq_id)
            if s is not None and dst in s.table:
                s.table[s.table.index(dst)] = src  # src kept its reference meanwhile
                self._decref(dst)
            else:
                self._decref(src)
        self._copying.clear()
        for seq_id in self._writing:
            if seq_id in self.seqs:
                self.crop(seq_id, self.seqs[seq_id].length)
        self._writing.clear()

    def set_length(self, seq_id: int, n: int) -> None:
        """The caller keeps the first n positions (a crop when n is shorter) and the full blocks among
        them enter the prefix cache."""
        s = self.seqs[seq_id]
        if n < s.length:
            self.crop(seq_id, n)
        if n > s.length:
            raise ValueError(f"sequence {seq_id} holds {s.length} positions, not {n}")
        self._register(s)

    def _register(self, s: SeqBlocks) -> None:
        if not self.prefix_cache:
            return
        for i in range(len(s.chain), s.length // self.size):
            prev = s.chain[i - 1] if i else s.salt
            key = _key(prev, s.tokens[i * self.size: (i + 1) * self.size])
            s.chain.append(key)
            b = s.table[i]
            if key not in self.by_key and self.key_of[b] is None:
                self.by_key[key] = b
                self.key_of[b] = key

    def match_prefix(self, seq_id: int, ids: list[int], limit: int) -> int:
        """Reuse cached full blocks for the first positions of `ids` (at most `limit` of them) in the
        empty sequence `seq_id`; returns the positions reused."""
        s = self.seqs[seq_id]
        if not self.prefix_cache or s.length:
            return 0
        prev = s.salt
        for i in range(min(limit, len(ids)) // self.size):
            chunk = ids[i * self.size: (i + 1) * self.size]
            key = _key(prev, chunk)
            b = self.by_key.get(key)
            if b is None:
                break
            if self.ref[b] == 0:
                del self.cached[b]
            self.ref[b] += 1
            s.table.append(b)
            s.chain.append(key)
            s.tokens.extend(chunk)
            s.length += self.size
            prev = key
        self.hit_tokens += s.length
        return s.length

    def slot_mapping(self, seq_id: int, start: int, end: int) -> list[int]:
        """Pool rows (block * size + offset) of positions start .. end - 1."""
        t, z = self.seqs[seq_id].table, self.size
        return [t[p // z] * z + p % z for p in range(start, end)]

    # --- checks -----------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the accounting invariants (tests)."""
        counts = [0] * self.capacity
        for s in self.seqs.values():
            assert len(s.table) == -(-s.length // self.size)
            for b in s.table:
                counts[b] += 1
        for _, src, _ in self._copying:
            counts[src] += 1
        assert counts == self.ref, "reference counts disagree with the block tables"
        free, cached = set(self.free), set(self.cached)
        assert len(free) == len(self.free) and not free & cached
        for b in range(self.capacity):
            states = (b in free) + (b in cached) + (self.ref[b] > 0)
            assert states == 1, f"block {b} is in {states} states"
            if b in cached:
                assert self.key_of[b] is not None
        for k, b in self.by_key.items():
            assert self.key_of[b] == k
        if self.max_blocks is not None:
            assert self.capacity <= self.max_blocks


class PagedSequences:
    """The sequences of a paged KV pool, whatever holds the tensors: the PyTorch pool (shared/kvpool.py) and the
    llama.cpp one (cloud/runners/llamacpp.py) both keep their blocks here, and the serving core reads either
    through this interface. A sequence is an id, a block table and a length; a forward's rows take blocks."""

    blocks: BlockManager | None
    block_size: int

    @property
    def manager(self) -> BlockManager:
        if self.blocks is None:
            raise RuntimeError(f"{type(self).__name__} has no blocks yet: "
                               "its prepare(...) must run before the pool is used")
        return self.blocks

    @property
    def allocated_bytes(self) -> int:
        """Bytes the pool's KV holds now."""
        raise NotImplementedError

    def allocate(self, salt: bytes = b"") -> int:
        """A new empty sequence; `salt` separates prefix-cache tenants."""
        return self.manager.new_seq(salt)

    def release(self, seq_id: int) -> None:
        self.manager.free_seq(seq_id)

    def length(self, seq_id: int) -> int:
        return self.manager.seqs[seq_id].length

    def crop(self, seq_id: int, n: int) -> None:
        """Keep the KV of the first n positions of `seq_id` (no-op when it holds fewer)."""
        self.manager.crop(seq_id, n)

    def set_length(self, seq_id: int, n: int) -> None:
        """The caller keeps the first n positions written (full blocks among them enter the prefix cache)."""
        if seq_id in self.manager.seqs:
            self.manager.set_length(seq_id, n)

    def match_prefix(self, seq_id: int, ids: list[int], limit: int) -> int:
        """Reuse cached blocks for the start of `ids` (at most `limit` positions); returns how many."""
        return self.manager.match_prefix(seq_id, ids, limit)

    def blocks_needed(self, row: Row) -> int:
        m = self.manager
        if row.seq_id not in m.seqs:
            return 0
        return m.blocks_needed(row.seq_id, row.num_cached_tokens, len(row.ids))

    def check_rows(self, rows: list[Row]) -> None:
        """One forward's rows: each sequence once, and the KV blocks they need left (OutOfBlocks if not)."""
        m = self.manager
        if len({r.seq_id for r in rows}) != len(rows):
            raise ValueError("a sequence appears twice in one forward")
        need = sum(self.blocks_needed(r) for r in rows)
        if need > m.available():
            raise OutOfBlocks(f"this forward needs {need} KV blocks, {m.available()} are left")

    def commit(self, rows: list[Row]) -> None:
        """After a forward: each row's sequence holds its ids (length num_cached_tokens + len(ids))."""
        for r in rows:
            self.manager.extend(r.seq_id, list(r.ids))
