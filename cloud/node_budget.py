"""The cloud's forward cost, fitted online, and the node budget it gives each session's next round.

A forward costs about

    t = a + b * rows + c * prefill_tokens        (seconds)

where rows are the tokens of verify rounds and decode steps (a round of n drafts is n + 1 rows) and prefill
tokens are those of prompts and resync chunks. t is the forward's whole work as the scheduler measures it
(BatchStats.cpu_s): the process's CPU seconds from the end of one forward's work to the end of the next one's,
so the processing of p over the vocabulary, the verify rule and the requests served between count with the
forward (on a GPU, wall seconds). `ForwardCost` fits a and b by exponentially weighted least squares over the
forwards without prefill tokens the model thread runs, and c over the prefill forwards' cost beyond a + b * rows;
nothing about this machine is built in. A joint fit of the three read b off the prefill line's intercept where the
rows stopped varying (a cloud that only streamed since its start-up measurement: one-row forwards beside prompt
prefills), and a prefill cost a little concave in its tokens then priced a verify of 32 rows as one step. A slope
the remembered forwards no longer identify keeps the last value they did (a small ridge pulls it there, 0 before
any).

The budget (Leviathan et al. 2023 section 3.4 sizes k for one sequence's latency; here the cloud sizes it for
its own throughput, as SmartSpec / TurboSpec do per batch). The cloud's committed tokens per second are
F = sum_i tau_i(n_i) / (a + b * sum_i (n_i + 1)), with tau_i(n) the tokens a round of n nodes commits for
session i. F is highest where every session's next node adds tau_i'(n) = b * F tokens: a node is worth its row
while the tokens it is expected to add exceed what the row's cost would buy at the cloud's present rate
(`node_value`). A node's expected tokens are the product along its path of how often nodes of its q were
accepted once their parent was, in the session's own rounds (`Acceptance.expected`; a calibrated draft's
would be its q multiplied along its path); the budget is the number of the last round's nodes worth their row,
half as many again when all were (room to grow). After a round
without drafts, the session's acceptance read as a chain's: the n-th node adds alpha^n, so the largest n with
alpha^n >= b * F.

- idle (one session), a dominates: b * F is small and the budget large (up to `max_tree_nodes`);
- loaded, b * sum(rows) dominates: b * F nears tau / (n + 1) and the budget shrinks to the path most likely kept.

On a GPU a forward's cost is a step function of its size: nearly flat while the weights' reads dominate (a CUDA
graph per bucket of rows), then rising once the forward is compute-bound. There (`ForwardCost.steps`) the row
cost the budget reads is the marginal cost at the present load, from the mean cost of each bucket of rows (powers
of two): the slope from the bucket the recent forwards fill to the next bucket measured above it (or from the
one below, when none above was seen), the linear fit's b until two buckets are known.

A new session's first round has no nodes of its own to read yet. Its open answer takes the median of the budgets
its owner's (API key's) recent rounds were given (`first_budget`; the last `recent_rounds` of them, any session's,
one list per key, "" when auth is off): a key's sessions mostly share a draft and see the same load, so their
recent budgets are what a round of theirs is worth now, where the generic prior (alpha 0.8 read as a chain's)
gives 2-5 nodes under load and a session of four or five rounds spends them ramping by half again a round. Before
`min_rounds` rounds of the key are known, the chain reading stands. The open answer also carries the key's pooled
acceptance by q (`pooled`, every round of the key's sessions): the new session's nodes are valued from it on both
sides (`NodeCalibration.seed`, shared/node_value.py) where a new session read its draft as calibrated, and sent
second branches a greedy target rarely keeps instead of the main path it nearly always keeps. The pool is read by
q, not as a chain's alpha: rounds the budget cut short would read as alpha near 1.

F is measured, not modelled: tokens committed over the forwards' cost, both exponentially weighted by forward.
The budget never changes the text: any number of nodes is verified exactly (shared/verify.py, shared/tree.py);
an edge that ignores it is served as before.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from shared.node_value import NodeCalibration


@dataclass
class ForwardCost:
    """Forward seconds fitted as a + b * rows + c * prefill_tokens (exponentially weighted least squares): a and b
    over the forwards without prefill tokens, c over the prefill forwards' seconds beyond a + b * rows."""
    # weight of a new forward (about 1 / the forwards the fit remembers)
    weight: float = 0.02
    # ridge on b, as much evidence as `ridge` of the remembered forwards spread by one row: keeps the fit defined
    # while the rows do not vary, pulling b to the last value the forwards identified (0 before any)
    ridge: float = 1e-3
    # forwards observed
    forwards: int = 0
    # exponentially weighted sums over the forwards without prefill tokens: X^T X [2, 2] and X^T y [2], x = (1, rows)
    _xx: np.ndarray = field(default_factory=lambda: np.zeros((2, 2)))
    _xy: np.ndarray = field(default_factory=lambda: np.zeros(2))
    # over the prefill forwards (p prefill tokens, r rows, y seconds): sums of p, p * r, p * p and p * y
    _p: np.ndarray = field(default_factory=lambda: np.zeros(4))
    # exponentially weighted count of every forward (the ridge's scale)
    _w: float = 0.0
    # the last b the forwards identified (their rows' spread outweighing the ridge tenfold)
    _known_b: float = 0.0
    _coef: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # a GPU: the row cost is the marginal cost between buckets of rows at the present load (module docstring)
    steps: bool = False
    # exponentially weighted seconds of forwards without prefill tokens, by bucket of rows (a power of two)
    _bucket_s: dict[int, float] = field(default_factory=dict)
    # exponentially weighted rows a forward (the present load)
    _load: float = 0.0

    def observe(self, rows: int, prefill_tokens: int, seconds: float) -> None:
        self._load = rows if not self.forwards else (1 - self.weight) * self._load + self.weight * rows
        if self.steps and prefill_tokens == 0 and rows > 0:
            b = _bucket(rows)
            old = self._bucket_s.get(b)
            self._bucket_s[b] = seconds if old is None else (1 - 4 * self.weight) * old + 4 * self.weight * seconds
        keep = 1 - self.weight
        self._xx, self._xy, self._p, self._w = keep * self._xx, keep * self._xy, keep * self._p, keep * self._w + 1
        if prefill_tokens:
            p = float(prefill_tokens)
            self._p += np.array([p, p * rows, p * p, p * seconds])
        else:
            x = np.array([1.0, float(rows)])
            self._xx += np.outer(x, x)
            self._xy += x * seconds
        self.forwards += 1
        self._coef = self._solve()

    def _solve(self) -> tuple[float, float, float]:
        w = self._xx[0, 0]
        a = b = 0.0
        if w > 0:
            reg = self.ridge * self._w
            coef = np.linalg.solve(self._xx + np.diag([0.0, reg]), self._xy + np.array([0.0, reg * self._known_b]))
            a, b = float(coef[0]), float(coef[1])
            if b < 0:  # a slope is never negative: refit with it at 0
                a, b = float(self._xy[0] / w), 0.0
            spread = self._xx[1, 1] - self._xx[0, 1] ** 2 / w  # the rows' weighted spread
            if spread >= 10 * reg:
                self._known_b = b
        sp, spr, spp, spy = (float(v) for v in self._p)
        c = (spy - a * sp - b * spr) / spp if spp > 0 else 0.0
        return (max(a, 0.0), b, max(c, 0.0))

    @property
    def base_s(self) -> float:
        return self._coef[0]

    @property
    def row_s(self) -> float:
        """Seconds a further row costs: the linear fit's b, or on a GPU the marginal cost at the present load."""
        marginal = self.marginal_row_s() if self.steps else None
        return self._coef[1] if marginal is None else marginal

    def marginal_row_s(self) -> float | None:
        """The slope between the present load's bucket of rows and the nearest measured bucket above it (below
        when none above was measured); None until the load's bucket and another are measured."""
        here = _bucket(max(1, round(self._load)))
        if here not in self._bucket_s:
            return None
        above = [b for b in self._bucket_s if b > here]
        below = [b for b in self._bucket_s if b < here]
        other = min(above) if above else (max(below) if below else None)
        if other is None:
            return None
        return max(0.0, (self._bucket_s[other] - self._bucket_s[here]) / (other - here))

    @property
    def prefill_token_s(self) -> float:
        return self._coef[2]

    def predict(self, rows: int, prefill_tokens: int = 0) -> float:
        return self.base_s + self.row_s * rows + self.prefill_token_s * prefill_tokens

    def describe(self) -> dict[str, float | int]:
        """What /v1/model reports: the fit in ms, and how many forwards it has seen."""
        return {"base_ms": round(self.base_s * 1000, 3), "row_ms": round(self.row_s * 1000, 4),
                "prefill_token_ms": round(self.prefill_token_s * 1000, 4), "forwards": self.forwards,
                "linear_row_ms": round(self._coef[1] * 1000, 4), "per_bucket": self.steps}


def _bucket(rows: int) -> int:
    """The power of two at or above `rows`."""
    return 1 << max(0, rows - 1).bit_length()


@dataclass
class Acceptance:
    """A session's acceptance: as a chain's (alpha = accepted positions / positions tried) and node by node.

    Chains: a round accepts la nodes along a path of at most `depth`; it tried la + 1 positions when it stopped
    short (the last one rejected) and la when everything to its depth was kept. Weighted by round, with a prior
    of `prior_tries` positions at `prior_alpha` so the first rounds do not swing the budget to either end.

    Nodes: how often nodes of each q were accepted once their parent was (shared/node_value.py), from which a
    node's expected tokens are read."""
    prior_alpha: float = 0.8
    prior_tries: float = 5.0
    weight: float = 0.1
    _kept: float = 0.0
    _tried: float = 0.0
    nodes: NodeCalibration = field(default_factory=NodeCalibration)

    def observe(self, accepted: int, depth: int) -> None:
        if depth <= 0:
            return
        tried = accepted + (1 if accepted < depth else 0)
        self._kept = (1 - self.weight) * self._kept + accepted
        self._tried = (1 - self.weight) * self._tried + tried

    @property
    def alpha(self) -> float:
        kept = self._kept + self.prior_alpha * self.prior_tries
        return min(kept / (self._tried + self.prior_tries), 0.999)


@dataclass
class NodeBudget:
    """The cost fit, the cloud's measured rate, and the budget rule of the module docstring."""
    # the most nodes a round may carry (--max-tree-nodes; chains are capped by --max-k on their own)
    max_nodes: int
    cost: ForwardCost = field(default_factory=ForwardCost)
    # weight of a new forward in the rate's sums
    weight: float = 0.05
    # exponentially weighted tokens committed and forward seconds
    _tokens: float = 0.0
    _seconds: float = 0.0
    # the forward's tokens counted since the last forward (answers come after their forward)
    _pending: int = 0
    # jobs (sessions, prompts, generations) per forward, recently: above one, sessions share forwards
    jobs_per_forward: float = 1.0
    # each owner's last budgets given to verified rounds, and how many a first budget needs (module docstring)
    recent_rounds: int = 32
    min_rounds: int = 4
    _recent: dict[str, deque[int]] = field(default_factory=dict)
    # each owner's acceptance by q over all its sessions' rounds (a new session's prior, module docstring)
    _pooled: dict[str, NodeCalibration] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def forward(self, rows: int, prefill_tokens: int, seconds: float, jobs: int = 1) -> None:
        """One forward ran (model thread): its rows, prefill tokens, seconds and jobs (sessions, prompts)."""
        with self._lock:
            self.cost.observe(rows, prefill_tokens, seconds)
            self.jobs_per_forward = (1 - self.weight) * self.jobs_per_forward + self.weight * jobs
            self._tokens = (1 - self.weight) * self._tokens + self._pending
            self._seconds = (1 - self.weight) * self._seconds + seconds
            self._pending = 0

    def committed(self, tokens: int) -> None:
        """Tokens a verify answer or a decode step committed."""
        with self._lock:
            self._pending += tokens

    @property
    def rate(self) -> float:
        """Committed tokens per second of forwards, recently."""
        return self._tokens / self._seconds if self._seconds > 0 else 0.0

    @property
    def node_value(self) -> float:
        """b * F: the tokens a row's time buys at the present rate; a node must add at least this."""
        return self.cost.row_s * self.rate

    def budget(self, alpha: float, expected: list[float] | None = None) -> int:
        """The most nodes worth their rows. With the last round's nodes (`expected`: the tokens each is expected
        to add, `Acceptance.expected`): as many as were worth their row, and half as many again when all were
        (room to grow). Without (a k = 0 round): the chain reading of `alpha`."""
        threshold = self.node_value
        if threshold <= 0 or self.cost.forwards < 8:  # nothing measured yet: the edge's own choice stands
            return self.max_nodes
        if expected:
            worth = sum(e >= threshold for e in expected)
            n = len(expected) + max(1, len(expected) // 2) if worth == len(expected) else worth
        elif threshold >= 1 or alpha <= 0:
            n = 1
        else:
            n = math.floor(math.log(threshold) / math.log(alpha)) if alpha < 1 else self.max_nodes
        return max(1, min(n, self.max_nodes))

    def given(self, owner: str, n: int) -> None:
        """A verified round of one of `owner`'s sessions was given the budget `n`."""
        with self._lock:
            self._recent.setdefault(owner, deque(maxlen=self.recent_rounds)).append(n)

    def pool(self, owner: str, parents: list[int], q: list[float], kept: list[bool]) -> None:
        """A verified round's nodes into its owner's pooled acceptance."""
        with self._lock:
            self._pooled.setdefault(owner, NodeCalibration()).observe(parents, q, kept)

    def pooled(self, owner: str) -> tuple[list[float], list[float]] | None:
        """The owner's pooled acceptance (per tenth of q: nodes accepted, nodes tried); None before any node."""
        with self._lock:
            c = self._pooled.get(owner)
            kept, tried = c.counts() if c is not None else ([], [])
        return (kept, tried) if sum(tried) > 0 else None

    def first_budget(self, owner: str, alpha: float) -> int:
        """A new session's first round: the median of its owner's recent rounds' budgets, or with fewer than
        `min_rounds` of them the chain reading of `alpha`."""
        with self._lock:
            recent = list(self._recent.get(owner, ()))
        if len(recent) < self.min_rounds or self.node_value <= 0 or self.cost.forwards < 8:
            return self.budget(alpha)
        return max(1, min(round(statistics.median(recent)), self.max_nodes))
