"""What a draft's tree node is worth: how often nodes of its q are accepted, multiplied along its path.

A node can be accepted only if its parent was; given that, a calibrated draft's node is accepted with its q, so
its expected tokens are its q multiplied along its path (the draft's own `values`). Drafts are not calibrated,
and not uniformly so: a confident draft's main path is kept far more often than its q says (greedy targets
agree with it), while a second branch at q 0.3 is kept less, and the two mix at every path value (a main path
eight deep has the value of a second branch one deep). `NodeCalibration` keeps, per tenth of q, the share of
the nodes whose parent was accepted (or that hung from the root) that were accepted themselves, with a prior of
`prior_nodes` nodes accepted at q itself (a new session reads its draft as calibrated), decayed by round. The
cloud reads its node budget from it (cloud/node_budget.py), and the edge ranks its tree's nodes by it
(edge/policy/tree.py): both sides then value a node alike, so a tree cut to the budget keeps the nodes the
budget counted.

A new session need not read its draft as calibrated: the cloud pools the acceptance of every round of one API
key (its sessions mostly share a draft) and sends it with the open answer (`node_acceptance`); both sides start
the session from it (`seed`), each bin's share kept and its weight cut to `SEED_NODES` nodes, so the session's
own rounds take over within a few (bench/replay_trees.py --fresh and --seeded compares the two starts on
recorded trees).
"""

from __future__ import annotations

from dataclasses import dataclass, field

# q is binned by tenths
Q_BINS = 10
# the most nodes a bin of a pooled acceptance weighs in a new session (`NodeCalibration.seed`)
SEED_NODES = 8.0


def q_bin(q: float) -> int:
    return min(max(int(q * Q_BINS), 0), Q_BINS - 1)


@dataclass
class NodeCalibration:
    prior_nodes: float = 2.0
    # weight of a new round
    weight: float = 0.1
    _kept: list[float] = field(default_factory=lambda: [0.0] * Q_BINS)
    _tried: list[float] = field(default_factory=lambda: [0.0] * Q_BINS)

    def observe(self, parents: list[int], q: list[float], accepted: list[bool],
                counted: list[bool] | None = None) -> None:
        """A round's nodes (parent index, -1 for the root; q) and which of them the target accepted; `counted`
        leaves out nodes whose q is not the draft's (an edge's copy branches)."""
        if not q:
            return
        kept, tried = [0.0] * Q_BINS, [0.0] * Q_BINS
        for j, (par, qj, ok) in enumerate(zip(parents, q, accepted, strict=True)):
            if counted is not None and not counted[j]:
                continue
            if par < 0 or accepted[par]:  # tried: its parent was kept
                b = q_bin(qj)
                tried[b] += 1
                kept[b] += ok
        if not sum(tried):  # nothing of the draft's own was tried: the round says nothing
            return
        for b in range(Q_BINS):
            self._kept[b] = (1 - self.weight) * self._kept[b] + kept[b]
            self._tried[b] = (1 - self.weight) * self._tried[b] + tried[b]

    def counts(self) -> tuple[list[float], list[float]]:
        """Per bin, the (decayed) nodes accepted and the nodes tried: what a pooled acceptance sends."""
        return list(self._kept), list(self._tried)

    def seed(self, kept: list[float], tried: list[float], nodes: float = SEED_NODES) -> bool:
        """Start from a pooled acceptance (per bin: nodes accepted, nodes tried), each bin's weight cut to `nodes`
        with its share kept; only while this one has seen nothing of its own (returns whether it took it)."""
        if sum(self._tried) > 0 or len(kept) != Q_BINS or len(tried) != Q_BINS:
            return False
        for b, (k, t) in enumerate(zip(kept, tried, strict=True)):
            if t > 0 and 0 <= k <= t:
                w = min(t, nodes)
                self._kept[b], self._tried[b] = k * w / t, w
        return sum(self._tried) > 0

    def conditional(self, q: float) -> float:
        """How often a node of this q is accepted once its parent was: its bin's share (prior: q)."""
        b = q_bin(q)
        return (self._kept[b] + self.prior_nodes * q) / (self._tried[b] + self.prior_nodes)

    def conditionals(self, parents: list[int], q: list[float], counted: list[bool] | None = None) -> list[float]:
        """Each node's chance of acceptance once its parent was: `conditional`, capped so that siblings' chances
        sum to at most 1. The verify keeps at most one child of a node (the target's one draw at that position),
        so the chances of siblings are exclusive; the bins by q alone cannot see that (a second branch at q 0.3
        shares its bin with main-path nodes of q 0.3, kept far more often), and a greedy target that keeps the
        first child 98 times in 100 leaves its siblings 0.02 between them. Siblings take their share in order of
        their bin's chance (ties: the drafter's order); nodes not `counted` (an edge's copy branches) get 0 and
        take none."""
        out = [0.0] * len(q)
        children: dict[int, list[int]] = {}
        for j, par in enumerate(parents):
            if counted is None or counted[j]:
                children.setdefault(par, []).append(j)
        for kids in children.values():
            left = 1.0
            for j in sorted(kids, key=lambda j: -self.conditional(q[j])):
                out[j] = min(self.conditional(q[j]), left)
                left -= out[j]
        return out

    def expected(self, parents: list[int], q: list[float]) -> list[float]:
        """Tokens each node is expected to add: `conditionals` multiplied along its path."""
        out: list[float] = []
        for par, c in zip(parents, self.conditionals(parents, q), strict=True):
            out.append(c * (out[par] if par >= 0 else 1.0))
        return out
