"""Growing token trees on the edge (edge/drafters/tree.py) and choosing their size (edge/policy/tree.py).

- The model drafter's tree: every node's q is the draft's processed q at that node given its path, computed
  by a cache-free forward of the context and the path; the drafter's cache holds the context only afterwards
  (a chain drafted next equals a fresh drafter's).
- The growth rule: the kept nodes form a tree in topological order whose values never rise along a path,
  with the draft's greedy chain in it as the first children.
- The controller: the node count follows the round trip against the verify slope, a fixed count is kept,
  the depth follows how deep the sent trees reach, and every probe_every-th round sends half.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch

from edge.drafters import ModelDrafter
from edge.drafters.base import DraftBlock
from edge.drafters.lookup import graft
from edge.drafters.tree import TreeShape, grow_tree, prune
from edge.policy.tree import TreeControl
from shared.config import SamplingConfig
from shared.sampling import process_logits
from shared.tree import paths

CTX = [5, 77, 301, 42, 9, 1200, 64, 3, 18]


def test_model_tree_nodes_carry_the_drafts_q_given_their_path(model_drafter: ModelDrafter) -> None:
    cfg = SamplingConfig(temperature=0.8, repetition_penalty=1.1)
    block = model_drafter.propose_tree(CTX, TreeShape(nodes=12, depth=4, width=3), cfg, 0)
    assert block.parents is not None and block.values is not None and 1 <= block.k <= 12
    model = model_drafter.model
    for j, path in enumerate(paths(block.parents)):
        prefix = CTX + [block.tokens[a] for a in path[:-1]]
        with torch.no_grad():
            logits = model_drafter._spread(model(input_ids=torch.tensor([prefix])).logits[0, -1].float())
        seen = torch.zeros(logits.numel(), dtype=torch.bool)
        seen[torch.tensor(prefix)] = True
        q = process_logits(logits[None], cfg, seen[None])[0]
        assert abs(float(q[block.tokens[j]]) - block.q_probs[j]) < 1e-4, f"node {j}"
    assert model_drafter.held_ids == CTX
    fresh = copy.copy(model_drafter)
    fresh.reset()
    chain_after = model_drafter.propose(CTX + [7], 4, SamplingConfig(temperature=0), 0)
    chain_fresh = fresh.propose(CTX + [7], 4, SamplingConfig(temperature=0), 0)
    assert chain_after.tokens == chain_fresh.tokens


def test_grown_trees_are_topological_with_falling_values() -> None:
    g = torch.Generator().manual_seed(3)
    table = torch.randn(50, 50, generator=g) * 3  # logits of the token after token t

    def expand(nodes: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
        return table[torch.tensor(tokens)]

    cfg = SamplingConfig(temperature=0)
    block = grow_tree(table[7], expand, TreeShape(nodes=20, depth=5, width=3), cfg, [7], 50)
    assert block.parents is not None and block.values is not None and block.k == 20
    for j, par in enumerate(block.parents):
        assert -1 <= par < j
        if par >= 0:
            assert block.values[j] <= block.values[par] + 1e-12
    # the greedy chain (argmax after argmax) is the first child at every level
    tok, node = int(table[7].argmax()), -1
    for _ in range(3):
        kids = [j for j, p in enumerate(block.parents) if p == node]
        assert block.tokens[kids[0]] == tok
        node, tok = kids[0], int(table[tok].argmax())
    small = prune(block, 6)
    assert small.k == 6 and all(-1 <= p < j for j, p in enumerate(small.parents or []))


def test_controller_sends_more_nodes_over_a_slower_link() -> None:
    values = [0.9 ** (i + 1) for i in range(32)]
    counts = {}
    for rtt in (0.0, 200.0):
        ctl = TreeControl(max_nodes=32, probe_every=1000)
        for n in (8, 16, 32, 4):  # a verify cost of 30 ms + 2 ms per node, seen at several counts
            ctl.observe(n, 1.0, 1, 3, exchange_ms=30 + 2 * (n + 1) + rtt, cloud_ms=30 + 2 * (n + 1))
        counts[rtt] = ctl.choose(values)
    assert counts[200.0] > counts[0.0] >= 1


def test_a_new_controllers_first_tree_is_cut_where_its_nodes_stop_paying_at_the_priors_cost() -> None:
    """Before any answer there is no verify fit: the first tree is priced at the prior (a forward of
    `prior_width` more rows costs twice one), not sent whole. A main path of 8 nodes worth 0.99 each with 24
    weak siblings worth 0.1: the path alone (8 of 32); a slowly fading path (0.95^i): fewer than all 32."""
    assert TreeControl(max_nodes=32).choose([0.99] * 8 + [0.1] * 24) == 8
    assert 8 < TreeControl(max_nodes=32).choose([0.95 ** (i + 1) for i in range(32)]) < 32


def test_the_clouds_row_cost_gives_the_slope_and_no_round_is_spent_probing() -> None:
    """A cloud whose answers say what a row costs (row_ms): the edge's verify model takes that slope and fits
    only its intercept, so equal counts (no slope of their own) read as the cloud's row cost, never as the prior's;
    and no fourth round is halved to measure a slope. A cheap row (a GPU's 0.03 ms beside a 6 ms forward) sends
    the whole ranked tree of nodes worth anything; a CPU's 50 ms beside 700 sends fewer; the same rounds without
    row_ms keep probing (every 4th choice halved)."""
    values = [0.95 ** (i + 1) for i in range(32)]
    counts = {}
    for base, row in ((6.0, 0.03), (700.0, 50.0)):
        ctl = TreeControl(max_nodes=32)
        for _ in range(6):
            ctl.observe(8, 6.0, 6, 6, exchange_ms=base + row * 9 + 1, cloud_ms=base + row * 9, row_ms=row)
        assert abs(ctl.verify_ms(20) - ctl.verify_ms(10) - 10 * row) < 1e-6
        chosen = [ctl.choose(values) for _ in range(8)]
        assert len(set(chosen)) == 1  # no probe
        counts[row] = chosen[0]
    assert counts[0.03] == 32 > counts[50.0] >= 8
    silent = TreeControl(max_nodes=32)
    for _ in range(6):
        silent.observe(8, 6.0, 6, 6, exchange_ms=751, cloud_ms=750)
    chosen = [silent.choose(values) for _ in range(8)]
    assert chosen[3] == (chosen[0] + 1) // 2 and chosen[7] == chosen[3]


def test_controller_keeps_a_fixed_count_adapts_depth_and_probes() -> None:
    fixed = TreeControl(fixed_nodes=10)
    assert fixed.choose([0.5] * 32) == 10 and fixed.shape().nodes == 10
    ctl = TreeControl(depth=6, probe_every=2)
    ctl.observe(8, 2.0, 2, deepest=6, exchange_ms=50, cloud_ms=40)
    assert ctl.depth == 7
    ctl.observe(8, 2.0, 2, deepest=3, exchange_ms=50, cloud_ms=40)
    assert ctl.depth == 6
    first, second = ctl.choose([0.9] * 32), ctl.choose([0.9] * 32)
    assert second == (first + 1) // 2
    # a round whose count a cap decides (the cloud's budget below the edge's choice) is sent whole, and the
    # probe comes at the next round the edge decides
    assert ctl.choose([0.9] * 32) == first
    assert ctl.choose([0.9] * 32, cap=3) == 3
    assert ctl.choose([0.9] * 32, cap=3) == 3
    assert ctl.choose([0.9] * 32) == (first + 1) // 2


def _main_and_side(depth: int = 6) -> DraftBlock:
    """A confident main path (q 0.65 at every level) with one second branch (q 0.3) under each of its nodes."""
    tokens, q, parents = [], [], []
    at = -1
    for d in range(depth):
        tokens += [100 + d, 200 + d]
        q += [0.65, 0.3]
        parents += [at, at]
        at = len(tokens) - 2
    values: list[float] = []
    for par, qj in zip(parents, q, strict=True):
        values.append(qj * (values[par] if par >= 0 else 1.0))
    return DraftBlock(tokens, q, "sampled", parents=parents, values=values)


def test_nodes_are_ranked_by_the_sessions_acceptance_of_their_q() -> None:
    """A new session ranks nodes by q along the path (its acceptance's prior is q itself); once its rounds
    show the main path (q 0.65) always kept and second branches (q 0.3) never, a pruned tree keeps the main path
    to its end before any second branch, where the path value kept the shallow second branches (0.3 > 0.65^3).
    Copy-only nodes keep their copy value and leave the acceptance by q alone."""
    ctl = TreeControl(copy_branches=False)
    block = _main_and_side()
    assert ctl.ranked(block) == block.values  # prior: calibrated

    main = [j for j in range(block.k) if block.q_probs[j] == 0.65]
    for _ in range(30):
        ctl.observe_nodes(block, main)
    ranked = ctl.ranked(block)
    cut = prune(replace(block, values=ranked), len(main))
    assert cut.tokens == [block.tokens[j] for j in main]
    old = prune(block, len(main))
    assert old.tokens != cut.tokens and 201 in old.tokens  # the q-product ranking kept a second branch

    # a copy path grafted beside the main path: copy-only nodes are valued conf ** depth, shared ones the larger
    path = [100, 101, 7, 8]
    grafted = graft(block, path, ctl.copy.value)
    values = ctl.ranked(grafted, path)
    assert grafted.copied is not None
    copy_only = [j for j in range(grafted.k) if grafted.copied[j]]
    assert [values[j] for j in copy_only] == [ctl.copy.value ** 3, ctl.copy.value ** 4]
    assert all(values[j] <= (values[p] if p >= 0 else 1.0) for j, p in enumerate(grafted.parents or []))
    prune(replace(grafted, values=values), 5)  # still a tree
    before = copy.deepcopy(ctl.nodes)
    only_copies = replace(grafted, copied=[True] * grafted.k)
    ctl.observe_nodes(only_copies, list(range(grafted.k)))
    assert ctl.nodes == before


def test_a_clients_next_session_starts_from_what_its_last_one_learned() -> None:
    """TreeControl.carry: a new session's controller takes the last one's acceptance by q (so its first tree is
    the main path the last session learned to trust, where a fresh one keeps a second branch), its c, verify fit,
    RTT and depth, as copies (the new session's rounds leave the last one's alone); its own settings stay."""
    block = _main_and_side()
    main = [j for j in range(block.k) if block.q_probs[j] == 0.65]
    last = TreeControl(copy_branches=False, depth=6, depth_max=10)
    for _ in range(30):
        last.observe_nodes(block, main)
    last.observe(8, 4.0, 6, deepest=6, exchange_ms=90, cloud_ms=60)
    fresh = TreeControl(copy_branches=False, max_nodes=12)
    carried = TreeControl(copy_branches=False, max_nodes=12).carry(last)
    assert carried.max_nodes == 12 and carried.depth == last.depth == 7
    assert (carried.calibration, carried.rtt_ms, carried.verify_ms(8)) == (last.calibration, last.rtt_ms,
                                                                           last.verify_ms(8))
    n = len(main)
    assert prune(replace(block, values=carried.ranked(block)), n).tokens == [block.tokens[j] for j in main]
    assert 201 in prune(replace(block, values=fresh.ranked(block)), n).tokens
    before = copy.deepcopy(last.nodes)
    carried.observe_nodes(block, [])  # the new session's misses are its own
    assert last.nodes == before and carried.nodes != before
