"""One verify session: committed context S, its prefix hashes, the KV cache, counters.

State is by position. The session's sequence in the target's paged KV pool (`seq_id`: its id) holds
the KV of S[:kv_len] with kv_len <= |S|; a round crops it (rollback = crop: whole blocks past
kv_len go back to the pool), never rebuilds it. The model thread is
the only writer of `context`, `kv_len` and the seq_id; other threads read `context`, which is
replaced as a whole (never mutated), so a reader always sees ids and hashes that belong together.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from cloud.node_budget import Acceptance
from shared.config import SamplingConfig
from shared.errors import ContextMismatch
from shared.hashing import FNV_OFFSET, fnv1a64, hash_hex
from shared.protocol import SparseDist, VerifyResponse

if TYPE_CHECKING:  # the PyTorch pool: a llama.cpp cloud never imports it
    from shared.blocks import PagedSequences


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
    # tokens sent by session streams (each also one of `rounds`, with k = 0)
    streamed: int = 0


@dataclass
class ReplayEntry:
    # fingerprint of the request body the answer belongs to
    fingerprint: str
    # the answer sent, without its residual distribution (kept packed below)
    response: VerifyResponse
    # a residual answer's p_j: ids [m] int32 and probs [m] float64 (dropped, oldest first, beyond the
    # session's replay byte limit; the newest entry's is always kept)
    dist_ids: torch.Tensor | None = None
    dist_probs: torch.Tensor | None = None
    # the answer had a residual distribution that a newer entry's has since replaced
    dist_dropped: bool = False

    @classmethod
    def of(cls, fingerprint: str, response: VerifyResponse) -> ReplayEntry:
        d = response.target_dist
        if d is None:
            return cls(fingerprint, response)
        return cls(fingerprint, replace(response, target_dist=None),
                   torch.tensor(d.ids, dtype=torch.int32), torch.tensor(d.probs, dtype=torch.float64))

    @property
    def nbytes(self) -> int:
        """Bytes of the packed distribution (the part that grows with the vocabulary)."""
        return sum(t.numel() * t.element_size() for t in (self.dist_ids, self.dist_probs) if t is not None)

    def drop_dist(self) -> None:
        if self.dist_ids is not None:
            self.dist_ids = self.dist_probs = None
            self.dist_dropped = True

    def answer(self) -> VerifyResponse:
        """The answer as first sent; ContextMismatch (409, nothing changed) for an older residual round
        whose distribution is no longer kept: only the newest round can still be awaited by its edge."""
        if self.dist_dropped:
            raise ContextMismatch("a duplicate of an older round whose residual distribution is no longer "
                                  "kept; resend from the session's length", expected_ctx_len=self.response.ctx_len,
                                  expected_ctx_hash=self.response.ctx_hash)
        if self.dist_ids is None or self.dist_probs is None:
            return self.response
        return replace(self.response, target_dist=SparseDist(self.dist_ids.tolist(), self.dist_probs.tolist()))


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
    # the sequence of the target's KV pool holding S[:kv_len]; None once closed (released by the model thread)
    seq_id: int | None
    # bytes one cached position takes
    kv_bytes_per_token: int
    # monotonic time of the last use (LRU order and TTL)
    last_used: float
    # monotonic time of opening
    created: float
    counters: Counters = field(default_factory=Counters)
    # its acceptance read as a chain's, for its node budget (cloud/node_budget.py)
    acceptance: Acceptance = field(default_factory=Acceptance)
    # last answers by request_id, oldest first
    replies: OrderedDict[str, ReplayEntry] = field(default_factory=OrderedDict)
    # requests admitted for this session and not finished (not evictable while > 0)
    inflight: int = 0
    # set when closed, evicted or expired; a queued round then answers 404
    closed: bool = False
    # serialises this session's rounds and keeps at most one of them in the model queue
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # positions of S whose KV the sequence holds
    kv_len: int = 0
    # bytes of residual distributions the replay cache keeps beyond the newest answer's (--replay-cache-bytes)
    replay_bytes_limit: int = 1 << 20
    # "" or the encoding of the target feature each answer carries (feature-fed drafting)
    feature_encoding: str = ""
    # > 0: answers carry the states at every committed position (PROTOCOL.md) instead of one feature
    feature_window: int = 0

    @property
    def kv_bytes(self) -> int:
        return 0 if self.seq_id is None else self.kv_len * self.kv_bytes_per_token

    def set_kv_len(self, pool: PagedSequences, n: int) -> None:
        """The sequence holds the KV of S[:n] (model thread only)."""
        if self.seq_id is not None:
            pool.set_length(self.seq_id, n)
        self.kv_len = n

    def remember(self, request_id: str, fingerprint: str, response: VerifyResponse, keep: int) -> None:
        """Keep the answer for duplicates: at most `keep` entries. Residual distributions (O(vocab) each) are
        kept packed; beyond `replay_bytes_limit` the oldest lose theirs (the newest always keeps its own), so
        the cache holds at most max(limit, one distribution) bytes of them."""
        if not request_id or keep <= 0:
            return
        self.replies[request_id] = ReplayEntry.of(fingerprint, response)
        self.replies.move_to_end(request_id)
        while len(self.replies) > keep:
            self.replies.popitem(last=False)
        total = self.replay_bytes
        for entry in list(self.replies.values())[:-1]:
            if total <= self.replay_bytes_limit:
                break
            total -= entry.nbytes
            entry.drop_dist()

    @property
    def replay_bytes(self) -> int:
        return sum(e.nbytes for e in self.replies.values())

    def describe(self, now: float) -> dict[str, Any]:
        """Counters and settings for GET /v1/sessions/{ctx_id}."""
        return {**self.counters.__dict__, "prompt_len": self.prompt_len, "kv_len": self.kv_len,
                "kv_bytes": self.kv_bytes, "idle_s": round(now - self.last_used, 3),
                "age_s": round(now - self.created, 3), "seed": self.seed, "correction": self.correction,
                "max_new_tokens": self.max_new_tokens, "sampling_cfg": self.sampling_cfg.to_dict(),
                "feature_encoding": self.feature_encoding, "feature_window": self.feature_window}
