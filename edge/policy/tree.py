"""The tree controller: how many nodes of the grown tree to send, and how deep to grow the next one.

A tree round's expected committed tokens are 1 + sum over the sent nodes of P(node accepted). The verify
rule accepts a node iff the target's draw matched its whole path (shared/tree.py), which a calibrated draft
puts at the product of q along its path (edge/drafters/tree.py). Drafts are not calibrated, and not uniformly
so (a confident main path is kept more often than its q says, a second branch less), so a node is valued by
the session's own acceptance of its q given its parent kept, multiplied along its path (`ranked`, the same
reading as the cloud's node budget, shared/node_value.py); the nodes are ranked and pruned by that value, and
what error remains is scaled by c, the running ratio of accepted nodes to the values of the nodes sent
(exponentially weighted, prior 1):

    E[tokens](n) = 1 + c * (sum of the n largest values)        (the n most valuable nodes form a tree)
    rate(n) = E[tokens](n) / (t_verify(n) + RTT)

t_verify(n) = v0 + v1 (n + 1) is fitted to the cloud's reported forward and queue time over the rounds' node
counts. A cloud that says what a further row costs its forwards at the present load (each answer's `row_ms`,
measured over every session's forwards, cloud/node_budget.py) gives v1, and only v0 is fitted from this session's
answers: no round is spent measuring a slope the cloud already knows. Otherwise v1 comes from exponentially
weighted least squares with a ridge pulling v1 towards v0 / `prior_width` (a forward of `prior_width` more
tokens costs twice one of a single token, BENCHMARKS.md "The real pair"), so a
run of equal counts, which shows no slope, reads as that prior and not as free nodes; and every
`probe_every`-th round sends half the chosen count to keep the slope measured, unless a cap (the cloud's node
budget, the context's room) decides the count that round: then the probe waits. Probes cost tokens (a probe
round commits fewer), which is why a cloud's `row_ms` replaces them. RTT is the
answer's wall time minus the cloud's reported time. The tree is drafted before the choice, so drafting time
is spent either way and does not enter it.
`fixed_nodes` sends that many nodes whatever the costs. With `copy_branches` every grown tree gets the
context's own continuation grafted in before the choice (edge/drafters/lookup.py), valued by `copy`, the
running share of copy nodes accepted. Depth follows use: when the deepest sent node sits
at the last level grown, the next tree grows one level deeper; when the sent tree stops two levels short,
one level shallower (within [depth_min, depth_max]).

A client's next session starts from what its last one learned (`carry`: the acceptance by q, c, the copies'
share, the verify fit, RTT and depth): the same draft, link and cloud, where a session of a few rounds would
otherwise spend them relearning that its draft's main path is kept more often than its q says.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from shared.node_value import NodeCalibration
from shared.tree import depths

from ..drafters.base import DraftBlock
from ..drafters.lookup import CopyConfidence, graft, lookup_path, path_values
from ..drafters.tree import TreeShape, prune


@dataclass
class TreeControl:
    # most nodes a round may send (the cloud's max_tree_nodes caps it)
    max_nodes: int = 32
    # children per expanded node and nodes expanded per level
    width: int = 4
    # levels of the next tree, and their bounds
    depth: int = 6
    depth_min: int = 2
    depth_max: int = 10
    # a fixed node count (None: chosen per round by rate(n))
    fixed_nodes: int | None = None
    # weight of a new round in the calibration estimate
    weight: float = 0.2
    # accepted nodes over the sent nodes' values (running; 1 = calibrated)
    calibration: float = 1.0
    # the verify fit: weight of a new round, the prior (nodes whose forward costs one more of a single token),
    # the ridge's weight (in rounds), and the rounds between two probes at half the chosen count
    verify_weight: float = 0.15
    prior_width: float = 16.0
    ridge: float = 2.0
    probe_every: int = 4
    # the link's round trip beyond the cloud's time, ms (None until measured), and its weight
    rtt_ms: float | None = None
    rtt_weight: float = 0.4
    # what a further row costs the cloud's forwards, ms, as its last answer said (None: the cloud does not say)
    row_ms: float | None = None
    # exponentially weighted sums of the verify fit: weight, x, y, x^2, x y (x = nodes + 1, y = ms)
    _fit: list[float] = field(default_factory=lambda: [0.0] * 5)
    # copy branches grafted into each tree, the longest (they may run deeper than the draft's levels: a copied
    # run often goes on for many tokens, and each node is valued by the copies' own acceptance), and their
    # running acceptance
    copy_branches: bool = True
    copy_depth: int = 16
    copy: CopyConfidence = field(default_factory=CopyConfidence)
    # the session's acceptance by q (given the parent kept): what the draft's nodes are worth, as the cloud's
    # node budget reads it (shared/node_value.py)
    nodes: NodeCalibration = field(default_factory=NodeCalibration)
    # rounds chosen since the last probe
    _since_probe: int = 0

    def carry(self, last: TreeControl | None) -> TreeControl:
        """Start from what `last` (the same client's previous session) learned; the settings stay this one's."""
        if last is not None:
            self.calibration, self.rtt_ms, self._fit = last.calibration, last.rtt_ms, list(last._fit)
            self.row_ms = last.row_ms
            self.depth = min(max(last.depth, self.depth_min), self.depth_max)
            self.nodes, self.copy = copy.deepcopy(last.nodes), copy.deepcopy(last.copy)
        return self

    def shape(self) -> TreeShape:
        n = self.fixed_nodes or self.max_nodes
        return TreeShape(nodes=n, depth=self.depth, width=self.width)

    def expected_tokens(self, values: list[float], n: int) -> float:
        return 1.0 + self.calibration * sum(sorted(values, reverse=True)[:n])

    def verify_ms(self, n: int) -> float:
        """t_verify(n) from the fit; before any answer, in units of a row: the prior's `prior_width` + n + 1 (so a
        new edge's first tree is cut where its nodes stop paying at the prior's cost, not sent whole)."""
        w, sx, sy, sxx, sxy = self._fit
        if w <= 0:
            return self.prior_width + n + 1
        mx, my = sx / w, sy / w
        if self.row_ms is not None:  # the cloud's slope; the intercept is this session's
            return max(0.0, my + self.row_ms * (n + 1 - mx))
        var, cov = sxx / w - mx * mx, sxy / w - mx * my
        r = self.ridge / w
        # slope pulled to the prior's: v1 = v0 / prior_width, with v0 = my - v1 mx
        prior = my / (self.prior_width + mx)
        slope = max(0.0, (cov + r * prior) / (var + r))
        return max(0.0, my + slope * (n + 1 - mx))

    def choose(self, values: list[float], cap: int | None = None) -> int:
        """How many of the grown tree's nodes (values: their path confidences) to send, at most `cap` (the cloud's
        node budget, the context's room). A probe halves the edge's own choice; a round whose count the cap
        decides is sent whole (halving it would measure nothing the choice uses, and cost the cloud a forward for
        fewer tokens), and the probe comes at the next round the edge decides."""
        if self.fixed_nodes is not None:
            return min(self.fixed_nodes, len(values), cap if cap is not None else self.fixed_nodes)
        best, best_rate = 0, -1.0
        ranked = sorted(values, reverse=True)
        total = 0.0
        top = min(self.max_nodes, len(values), cap if cap is not None else self.max_nodes)
        for n in range(0, top + 1):
            if n:
                total += ranked[n - 1]
            ms = self.verify_ms(n) + (self.rtt_ms or 0.0)
            rate = (1.0 + self.calibration * total) / ms if ms > 0 else float(n)
            if rate > best_rate + 1e-12:
                best, best_rate = n, rate
        self._since_probe += 1
        capped = cap is not None and cap < self.max_nodes and best >= cap
        if self._since_probe >= self.probe_every and not capped and self.row_ms is None:
            self._since_probe, best = 0, (best + 1) // 2
        return max(best, 1)

    def ranked(self, block: DraftBlock, copy_path: list[int] | None = None) -> list[float]:
        """Each node's expected tokens: the session's acceptance of its q, capped so siblings share at most 1
        (NodeCalibration.conditionals), multiplied along its path; a node of
        a grafted copy path keeps the larger of that and its copy value (a node only the copy proposed, its
        copy value), so values never rise along a path and `prune` keeps a tree."""
        assert block.parents is not None
        copied = block.copied or [False] * block.k
        fixed = path_values(block, copy_path, self.copy.value) if copy_path else [None] * block.k
        cond = self.nodes.conditionals(block.parents, block.q_probs, [not c for c in copied])
        out: list[float] = []
        for j, par in enumerate(block.parents):
            v = cond[j] * (out[par] if par >= 0 else 1.0)
            f = fixed[j]
            out.append(v if f is None else max(v, f))
        return out

    def sent(self, block: DraftBlock, context: list[int], depth: int, remaining: int,
             nodes: int) -> tuple[DraftBlock, list[int]]:
        """The tree to send from the draft's grown `block`: the copy branch of `context` grafted in (where copy
        branches are on), every node valued (`ranked`), then pruned to the nodes worth their rows, `nodes` at
        most. Returns it and the grafted copy path (empty: none)."""
        copy_depth = min(max(depth, self.copy_depth), remaining - 1)
        copy_path = lookup_path(context, copy_depth) if self.copy_branches else []
        if copy_path:
            block = graft(block, copy_path, self.copy.value)
        values = self.ranked(block, copy_path)
        return prune(replace(block, values=values), self.choose(values, cap=nodes)), copy_path

    def observe_round(self, block: DraftBlock, accepted_len: int, accepted: list[int], copy_path: list[int],
                      exchange_ms: float, cloud_ms: float, row_ms: float = 0.0) -> None:
        """A verified tree round: the estimates (`observe`), the acceptance by q (`observe_nodes`) and the copy
        branch's confidence."""
        assert block.values is not None
        self.observe(block.k, sum(block.values), accepted_len, max(drafted_depths(block), default=0),
                     exchange_ms, cloud_ms, row_ms)
        self.observe_nodes(block, accepted)
        if block.copied is not None:
            self.copy.observe(block, copy_path, accepted)

    def next_shape(self, block: DraftBlock) -> TreeShape:
        """The shape after the round that sends `block` (its depth moves by the tree's drafted levels)."""
        return replace(self.shape(), depth=self.next_depth(max(drafted_depths(block), default=0)))

    def observe_nodes(self, block: DraftBlock, accepted: list[int]) -> None:
        """The sent tree's nodes the target accepted (indices), into the acceptance by q (copy-only nodes
        left out: their q is the copies' share, not the draft's)."""
        assert block.parents is not None
        kept = [False] * block.k
        for j in accepted:
            kept[j] = True
        counted = [not c for c in block.copied] if block.copied is not None else None
        self.nodes.observe(block.parents, block.q_probs, kept, counted)

    def observe(self, sent: int, predicted: float, accepted_len: int, deepest: int, exchange_ms: float,
                cloud_ms: float, row_ms: float = 0.0) -> None:
        """One verified tree round: `predicted` is the sum of the sent nodes' values, `deepest` the depth of
        the deepest sent node, `row_ms` the cloud's row cost its answer said (0: none)."""
        if row_ms > 0:
            self.row_ms = row_ms
        if predicted > 0:
            ratio = min(accepted_len / predicted, 4.0)
            self.calibration = (1 - self.weight) * self.calibration + self.weight * ratio
        x, y = float(sent + 1), max(0.0, cloud_ms)
        self._fit = [(1 - self.verify_weight) * f + v for f, v in zip(self._fit, (1.0, x, y, x * x, x * y),
                                                                         strict=True)]
        rtt = max(0.0, exchange_ms - cloud_ms)
        self.rtt_ms = rtt if self.rtt_ms is None else (1 - self.rtt_weight) * self.rtt_ms + self.rtt_weight * rtt
        self.depth = self.next_depth(deepest)

    def next_depth(self, deepest: int) -> int:
        """The depth after a round whose deepest drafted node sat at `deepest` (known when the tree is sent)."""
        if deepest >= self.depth:
            return min(self.depth + 1, self.depth_max)
        if deepest <= self.depth - 2:
            return max(self.depth - 1, self.depth_min)
        return self.depth


def drafted_depths(block: DraftBlock) -> list[int]:
    """The depths of a tree's drafted nodes (a copy branch may run deeper than them): they steer the next depth."""
    assert block.parents is not None
    return [d for d, c in zip(depths(block.parents), block.copied or [False] * block.k, strict=True) if not c]
