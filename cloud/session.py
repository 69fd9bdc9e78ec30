"""One verify session: committed context S, its prefix hashes, the KV cache, counters.

State is by position. The session's sequence in the target's paged KV pool (`slot`: its id) holds
the KV of S[:kv_len] with kv_len <= |S|; a round crops it (rollback = crop: whole blocks past
kv_len go back to the pool), never rebuilds it. The model thread is
the only writer of `context`, `kv_len` and the slot; other threads read `context`, which is
replaced as a whole (never mutated), so a reader always sees ids and hashes that belong together.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from shared.config import SamplingConfig
from shared.hashing import FNV_OFFSET, fnv1a64, hash_hex
from shared.kvpool import KVPool
from shared.protocol import VerifyResponse


@dataclass(frozen=True)
class Context:
    # the committed token ids S
    ids: tuple[int, ...] = ()
    # FNV-1a states by length: states[n] is the state of S[:n] (states[0] = offset basis), so any
    # prefix hash is O(1)
    states: tuple[int, ...] = (FNV_OFFSET,)

    def __len__(self) -> int:
        return len(self.ids)

    def hash_at(self, n: int) -> str:
        """ctx_hash of S[:n], 0 <= n <= |S|."""
        return hash_hex(self.states[n])

    def hash_with(self, n: int, append_ids: list[int]) -> str:
        """ctx_hash of S[:n] + append_ids, without building it."""
        return hash_hex(fnv1a64(append_ids, self.states[n]))

    def cut_and_extend(self, n: int, new_ids: list[int]) -> Context:
        """S[:n] + new_ids."""
        states = list(self.states[: n + 1])
        for tok in new_ids:
            states.append(fnv1a64((tok,), states[-1]))
        return Context(self.ids[:n] + tuple(new_ids), tuple(states))

    @classmethod
    def of(cls, ids: list[int]) -> Context:
        return cls().cut_and_extend(0, ids)


@dataclass
class Counters:
    # verify rounds run on the model (a retry that recomputes counts again)
    rounds: int = 0
    # draft tokens received in those rounds (sum of k)
    drafted: int = 0
    # draft tokens accepted (sum of accepted_len)
    accepted: int = 0
    # tokens the cloud committed: accepted + the correction/bonus (the residual token is the edge's)
    emitted: int = 0
    # duplicates answered from the replay cache without touching the model or the context
    replayed: int = 0
    # total target forward time, ms
    prefill_ms: float = 0.0


@dataclass
class ReplayEntry:
    # fingerprint of the request body the answer belongs to
    fingerprint: str
    # the answer sent
    response: VerifyResponse


@dataclass
class Session:
    # unguessable id (secrets.token_urlsafe)
    ctx_id: str
    # who opened it: fingerprint of the API key ("" when auth is off)
    owner: str
    # processing applied to p; the edge applies the same to q
    sampling_cfg: SamplingConfig
    # keys every coin and sample
    seed: int
    # "strict" | "shortcut"
    correction: str
    # generation budget requested at open (reported, not enforced)
    max_new_tokens: int
    # length of the prompt at open
    prompt_len: int
    # committed context S and its prefix hashes
    context: Context
    # the slot of the target's KV pool holding S[:kv_len]; None once closed (released by the model thread)
    slot: int | None
    # bytes one cached position takes
    kv_bytes_per_token: int
    # monotonic time of the last use (LRU order and TTL)
    last_used: float
    # monotonic time of opening
    created: float
    counters: Counters = field(default_factory=Counters)
    # last answers by request_id, oldest first
    replies: OrderedDict[str, ReplayEntry] = field(default_factory=OrderedDict)
    # requests admitted for this session and not finished (not evictable while > 0)
    inflight: int = 0
    # set when closed, evicted or expired; a queued round then answers 404
    closed: bool = False
    # serialises this session's rounds and keeps at most one of them in the model queue
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # positions of S whose KV the slot holds
    kv_len: int = 0

    @property
    def kv_bytes(self) -> int:
        return 0 if self.slot is None else self.kv_len * self.kv_bytes_per_token

    def set_kv_len(self, pool: KVPool, n: int) -> None:
        """The slot holds the KV of S[:n] (model thread only)."""
        if self.slot is not None:
            pool.set_length(self.slot, n)
        self.kv_len = n

    def remember(self, request_id: str, fingerprint: str, response: VerifyResponse, keep: int) -> None:
        if not request_id or keep <= 0:
            return
        self.replies[request_id] = ReplayEntry(fingerprint, response)
        self.replies.move_to_end(request_id)
        while len(self.replies) > keep:
            self.replies.popitem(last=False)

    def describe(self, now: float) -> dict[str, Any]:
        """Counters and settings for GET /v1/sessions/{ctx_id}."""
        return {**self.counters.__dict__, "prompt_len": self.prompt_len, "kv_len": self.kv_len,
                "kv_bytes": self.kv_bytes, "idle_s": round(now - self.last_used, 3),
                "age_s": round(now - self.created, 3), "seed": self.seed, "correction": self.correction,
                "max_new_tokens": self.max_new_tokens, "sampling_cfg": self.sampling_cfg.to_dict()}
