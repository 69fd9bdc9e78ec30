"""The edge's side of a session's wire: open and reopen, one verify with its recovery, and the cloud's
feature or states taken in (edge/speculative.py drafts and commits on top of it).

State by position. `S` is the committed context (prompt + every committed token); it only grows.
`cloud_len` is the length of the prefix of S that the cloud is known to hold. Every verify request
carries ctx_len = |S|, the hash of S and append_ids = S[cloud_len:], so whatever the cloud missed
(locally committed tokens, the edge-drawn residual, tokens after a timeout whose late answer was
discarded, tokens streamed past a cut) reaches it in the next round, and the cloud's crop to
ctx_len - len(append_ids) makes a retried request idempotent. Recovery: 429 / 413 / 5xx / connection
errors -> back off and resend; 404 -> reopen with the full S; 409 -> resend from the cloud's
expected_ctx_len when that is shorter than cloud_len, else reopen. Nothing is committed before an
answer is used, so nothing is lost or duplicated.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shared.config import SamplingConfig
from shared.errors import ContextMismatch, NotFound, ResourceExhausted, SpecSplitError, Unavailable
from shared.features import decode_feature, decode_states, feature_bytes, states_bytes
from shared.hashing import FNV_OFFSET, hash_hex, prefix_hashes
from shared.protocol import (
    DraftProposal,
    NodeAcceptance,
    OpenSessionRequest,
    SparseDist,
    TargetFeature,
    TargetStates,
    VerifyRequest,
    VerifyResponse,
)

from .drafters.base import DraftBlock, Drafter
from .metrics import EdgeMetrics
from .policy.deadline import DeadlineConfig, VerifyDeadline
from .policy.gating import GateDecision
from .transport.base import Transport
from .transport.errors import CloudTimeout, is_retryable, retry_delay

log = logging.getLogger(__name__)
# no request with a dropped answer is outstanding
NO_STALE = 1 << 62


@dataclass(frozen=True)
class RecoveryPolicy:
    # how long a verify attempt may take (edge/policy/deadline.py): adaptive unless fixed
    deadline: DeadlineConfig = DeadlineConfig()
    # on a missed verify deadline: resend (False, exact) or commit the first draft token unverified (lossy)
    timeout_fallback: bool = False
    # deadline of open / close calls (seconds)
    open_timeout_s: float = 30.0
    # resends after retryable errors, per call
    max_retries: int = 6
    # past max_retries, a call keeps waiting out the cloud's capacity answers (429 resource_exhausted, and
    # reopens of a session evicted again at once) for this many seconds of backoff in all, at the cloud's
    # Retry-After or the backoff: under a tight KV budget a generation waits its turn instead of failing
    capacity_wait_s: float = 300.0
    # first backoff and its cap (seconds); doubled per attempt
    backoff_s: float = 0.05
    backoff_max_s: float = 2.0
    # reopen / resync steps allowed in one round before giving up
    max_recoveries: int = 4

    def backoff(self, attempt: int) -> float:
        return min(self.backoff_s * 2 ** (attempt - 1), self.backoff_max_s)

    def gives_up(self, attempt: int, err: SpecSplitError, waited_s: float) -> bool:
        """After `attempt` resends and `waited_s` seconds of backoff for capacity: stop and raise `err`?"""
        if attempt < self.max_retries:
            return False
        return not (isinstance(err, (ResourceExhausted, NotFound)) and waited_s < self.capacity_wait_s)


class TokenizerChanged(Unavailable):
    """An open answer names another tokenizer than the one the edge paired with: the cloud behind the address
    was restarted (or failed over) with another model, and this session's ids would mean other text there. The
    generation stops with what it committed; the next one asks the cloud's model again (the OpenAI server picks
    its draft again when it chose it from the cloud's tokenizer)."""

    code = "tokenizer_changed"

    def __init__(self, paired: str, now: str, committed: int) -> None:
        super().__init__(f"the cloud now speaks another tokenizer (fingerprint {now}, paired with {paired}): this "
                         f"session's {committed} tokens would mean other text there; start the generation again")
        self.paired, self.now = paired, now


@dataclass(frozen=True)
class SessionParams:
    # shared sampling settings (q and p alike)
    sampling: SamplingConfig
    # keys coins and samples
    seed: int
    # "strict" | "shortcut"
    correction: str = "strict"
    # send the draft's sparse q distributions
    send_q_dists: bool = False
    # "" or the encoding of the target feature to ask for (a feature-fed drafter)
    feature_encoding: str = ""
    # > 0: ask for the target's state at every committed position (and the prompt's last this many at the open)
    feature_window: int = 0
    # draft one token more and have the cloud check it instead of drawing a bonus (shared/verify.py):
    # every position is decided alike, so a seed's text does not depend on the k schedule
    check_last: bool = False
    # the cloud tokenizer's fingerprint the edge paired with (edge/pairing.py; "": unchecked): an open answer
    # naming another means the cloud behind the address now holds another model, and the session stops
    tokenizer_fingerprint: str = ""

class CloudSession:
    """One session's wire state and calls; SpeculativeRun builds its rounds on it."""

    def __init__(self, transport: Transport, drafter: Drafter, params: SessionParams, metrics: EdgeMetrics,
                 policy: RecoveryPolicy, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.transport = transport
        self.drafter = drafter
        self.params = params
        self.metrics = metrics
        self.policy = policy
        self.clock = clock
        self.sleep = sleep
        # seconds of backoff this round has waited so far (RecoveryPolicy.capacity_wait_s)
        self._capacity_waited = 0.0
        self.S: list[int] = []
        # FNV-1a state after each token of S: the hash of any prefix without rehashing
        self._states: list[int] = []
        self.cloud_len = 0
        self.ctx_id: str | None = None
        self.vocab_size = 0
        # the numerics the session runs under (ModelInfo.numerics, from its first open answer)
        self.numerics = ""
        self.deadline = VerifyDeadline(policy.deadline)
        # the cloud's node budget from its last answer or open (0: none said): the next round sends at most this
        # many draft nodes, a chain's k or a tree's nodes (cloud/node_budget.py; it never changes the text)
        self.node_budget = 0
        self.node_acceptance: NodeAcceptance | None = None
        # the cloud's fitted forward cost as its last open answer said it (None: not said; edge/policy/stream.py reads
        # it, a mapping or an object with base_ms, row_ms and forwards)
        self.forward_cost: Any = None
        self._budget = 0
        # lowest crop point of a request whose answer was dropped: the cloud's S below it is ours
        self._stale_floor = NO_STALE

    def _open(self) -> None:
        """(Re)open with the whole committed S as the prompt."""
        req = OpenSessionRequest(prompt_ids=list(self.S), sampling_cfg=self.params.sampling, seed=self.params.seed,
                                 correction=self.params.correction, max_new_tokens=self._budget,
                                 feature_encoding=self.params.feature_encoding,
                                 feature_window=self.params.feature_window)
        down = self.transport.traffic.bytes_down
        info = self._call(lambda: self.transport.open_session(req, self.policy.open_timeout_s), retry_timeouts=True)
        self.metrics.open_bytes_down += self.transport.traffic.bytes_down - down
        if info.ctx_len != len(self.S) or info.ctx_hash != self.hash_at(len(self.S)):
            raise SpecSplitError(f"opened session holds {info.ctx_len} tokens / hash {info.ctx_hash}, "
                                 f"expected {len(self.S)} / {self.hash_at(len(self.S))}")
        self.ctx_id, self.cloud_len, self.vocab_size = info.ctx_id, info.ctx_len, info.vocab_size
        paired = self.params.tokenizer_fingerprint
        if paired and info.tokenizer_fingerprint and info.tokenizer_fingerprint != paired:
            raise TokenizerChanged(paired, info.tokenizer_fingerprint, len(self.S))
        if self.numerics and info.numerics and info.numerics != self.numerics:
            self.metrics.numerics_changes += 1
            log.warning("the session goes on under other numerics (%s, was %s): its %d committed tokens are kept, "
                        "and a greedy or seeded text may part from the one the first cloud would have given",
                        info.numerics, self.numerics, len(self.S))
        self.numerics = info.numerics or self.numerics
        self.node_budget = info.node_budget  # the first round's (0: none said)
        self.node_acceptance = info.node_acceptance  # the key's pooled acceptance by q (None: none said)
        self.forward_cost = getattr(info, "forward_cost", None)  # an older cloud's open answer has none
        self._stale_floor = NO_STALE
        self._take_feature(info.feature, opened=True)
        self._take_states(info.states, opened=True)

    def _take_states(self, st: TargetStates | None, opened: bool = False) -> None:
        """Hand the cloud's states at consecutive committed positions to the drafter: all of them to one that
        keeps them (`set_states`), the last as its feature to one that drafts from one vector."""
        if st is None or not self.params.feature_encoding or st.count < 1 or st.first < 1 \
                or st.first + st.count - 1 > len(self.S):
            return
        if opened:
            self.metrics.open_feature_bytes += states_bytes(st)
        else:
            self.metrics.feature_bytes += states_bytes(st)
        vectors = decode_states(st)  # [count, d]
        set_states = getattr(self.drafter, "set_states", None)
        if set_states is not None:
            set_states(self.S, st.first, vectors)
            return
        set_feature = getattr(self.drafter, "set_feature", None)
        if set_feature is not None:
            set_feature(self.S[:st.first + st.count - 1], vectors[-1])

    def _take_feature(self, f: TargetFeature | None, opened: bool = False) -> None:
        """Hand the cloud's feature to a feature-fed drafter (a reopen or a resync gets a new one)."""
        if f is None or not self.params.feature_encoding:
            return
        if opened:
            self.metrics.open_feature_bytes += feature_bytes(f)
        else:
            self.metrics.feature_bytes += feature_bytes(f)
        set_feature = getattr(self.drafter, "set_feature", None)
        if set_feature is not None and 0 < f.prefix_len <= len(self.S):
            set_feature(self.S[:f.prefix_len], decode_feature(f))

    def _extend(self, tokens: Sequence[int]) -> None:
        self._states.extend(prefix_hashes(tokens, self._states[-1] if self._states else FNV_OFFSET))
        self.S.extend(tokens)

    def hash_at(self, n: int) -> str:
        """ctx_hash of S[:n]."""
        return hash_hex(self._states[n - 1] if n else FNV_OFFSET)

    def _call(self, fn: Callable[[], object], retry_timeouts: bool = False):  # type: ignore[no-untyped-def]
        """fn() with backoff on retryable errors (and on timeouts when asked)."""
        attempt, waited = 0, 0.0
        while True:
            self.metrics.cloud_calls += 1
            try:
                return fn()
            except SpecSplitError as e:
                retry = is_retryable(e) or (retry_timeouts and isinstance(e, CloudTimeout))
                if not retry or self.policy.gives_up(attempt, e, waited):
                    raise
                attempt += 1
                self.metrics.retries += 1
                log.info("retrying after %s (attempt %d)", e.code, attempt)
                delay = retry_delay(e, self.policy.backoff(attempt))
                waited += delay
                self.sleep(delay)

    def _request(self, block: DraftBlock, decision: GateDecision | None, request_id: str) -> VerifyRequest:
        q_dists = None
        if self.params.send_q_dists and block.kind == "sampled" and block.k > 0 and block.parents is None:
            q_dists = []
            for q in block.q_full:
                ids = q.nonzero().squeeze(-1)  # [m] support of q_i
                q_dists.append(SparseDist(ids.tolist(), q[ids].tolist()))
        assert self.ctx_id is not None
        return VerifyRequest(
            ctx_id=self.ctx_id, ctx_len=len(self.S), ctx_hash=self.hash_at(len(self.S)),
            append_ids=self.S[self.cloud_len:],
            draft=DraftProposal(draft_tokens=list(block.tokens), q_token_probs=list(block.q_probs),
                                draft_kind=block.kind, q_dists=q_dists,
                                hard_mask=None if decision is None else decision.hard_mask,
                                tree_parents=None if block.parents is None else list(block.parents)),
            return_top_k=0 if block.parents is not None else self.drafter.wants_top_k, request_id=request_id,
            check_last=self.params.check_last and block.k > 0 and block.parents is None)

    def _verify(self, block: DraftBlock, decision: GateDecision | None) -> VerifyResponse | None:
        """Send the round until an answer can be used; None after a timeout with fallback."""
        attempt = recoveries = late = evicted = 0
        request_id = uuid.uuid4().hex[:16]  # kept across resends: the cloud answers a duplicate from its replay cache
        while True:
            if self.ctx_id is None:
                self._recover(recoveries := recoveries + 1, "reopen")
            req = self._request(block, decision, request_id)
            self.metrics.cloud_calls += 1
            deadline_s = self.deadline.for_attempt(late)  # longer on each resend after a missed deadline
            self.metrics.deadline_ms = deadline_s * 1000
            t0 = self.clock()
            try:
                resp = self.transport.verify(req, deadline_s, self.params.sampling)
            except CloudTimeout:
                self.metrics.timeouts += 1
                late += 1
                # the cloud may still apply it: it crops to this point, so below it nothing changes
                self._stale_floor = min(self._stale_floor, self.cloud_len)
                if self.policy.timeout_fallback and block.k > 0:
                    return None
                attempt = self._backoff_or_raise(attempt, CloudTimeout("verify timed out, retries exhausted"))
                continue
            except NotFound as e:
                # evicted (or expired): reopen. A session evicted again right after its reopen means the
                # cloud is short of memory: wait with the backoff before each further reopen, and after
                # max_retries of those give up with the cloud's own 404
                self.ctx_id = None
                evicted += 1
                if evicted > 1:
                    attempt = self._backoff_or_raise(attempt, e)
                    recoveries -= 1  # a reopen after a wait is not a resync loop
                continue
            except ContextMismatch as e:
                expected = e.details.get("expected_ctx_len")
                back_to = min(expected if isinstance(expected, int) else -1, self._stale_floor)
                if 0 <= back_to < self.cloud_len:
                    self._recover(recoveries := recoveries + 1, "resync")
                    self.cloud_len = back_to
                else:
                    self.ctx_id = None
                continue
            except SpecSplitError as e:
                if not is_retryable(e):
                    raise
                attempt = self._backoff_or_raise(attempt, e)
                continue
            self._check_answer(block, resp)
            self.deadline.observe(self.clock() - t0, (resp.metrics.queue_ms + resp.metrics.prefill_ms) / 1000)
            return resp

    def _recover(self, n: int, what: str) -> None:
        if n > self.policy.max_recoveries:
            raise ContextMismatch(f"could not resynchronise with the cloud after {n - 1} attempts: its context "
                                  "keeps disagreeing with the edge's")
        if what == "reopen":
            self.metrics.reopens += 1
            log.info("reopening the session with the full context (%d tokens)", len(self.S))
            self._open()
        else:
            self.metrics.resyncs += 1

    def _backoff_or_raise(self, attempt: int, err: SpecSplitError) -> int:
        """Wait before the next attempt of this round (RecoveryPolicy.gives_up: else raise `err`)."""
        if attempt == 0:
            self._capacity_waited = 0.0
        if self.policy.gives_up(attempt, err, self._capacity_waited):
            raise err
        self.metrics.retries += 1
        delay = retry_delay(err, self.policy.backoff(attempt + 1))
        self._capacity_waited += delay
        self.sleep(delay)
        return attempt + 1

    def _check_answer(self, block: DraftBlock, resp: VerifyResponse) -> None:
        la, kind = resp.accepted_len, resp.next_kind
        if block.parents is not None:  # a tree: the accepted nodes are a path from the root
            path = resp.accepted_nodes or []
            ok = (len(path) == la and kind in ("correction", "bonus") and resp.correction is not None
                  and all(0 <= j < block.k and block.parents[j] == (path[i - 1] if i else -1)
                          for i, j in enumerate(path)))
        elif kind == "bonus":
            ok = la == block.k and resp.correction is not None
        elif kind == "none":  # check_last: every draft kept, nothing follows
            ok = self.params.check_last and la == block.k > 0 and resp.correction is None
        elif kind == "correction":
            ok = 0 <= la < block.k and resp.correction is not None
        elif kind == "residual":
            ok = 0 <= la < block.k and resp.target_dist is not None and len(block.q_full) > la
        else:
            ok = False
        if not ok:
            raise SpecSplitError(f"verify answer out of contract: accepted_len={la}, k={block.k}, "
                                 f"next_kind={kind!r}, correction={resp.correction!r}")
