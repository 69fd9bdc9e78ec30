"""The cloud's forward cost fit and node budget (cloud/node_budget.py)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from cloud.node_budget import Acceptance, ForwardCost, NodeBudget


def test_the_fit_recovers_a_forwards_cost_from_the_forwards_it_sees() -> None:
    """Forwards of 0.19 + 0.01 x rows + 0.002 x prefill tokens s (rows 1..64, prefills 0..512, 1 % noise): the
    fit is within 5 % of each term after 400 forwards; nothing is assumed beforehand."""
    rng = random.Random(7)
    fit = ForwardCost()
    for _ in range(400):
        rows, pre = rng.randint(1, 64), rng.choice([0, 0, 0, rng.randint(1, 512)])
        fit.observe(rows, pre, (0.19 + 0.01 * rows + 0.002 * pre) * (1 + rng.gauss(0, 0.01)))
    assert fit.base_s == pytest.approx(0.19, rel=0.05)
    assert fit.row_s == pytest.approx(0.01, rel=0.05)
    assert fit.prefill_token_s == pytest.approx(0.002, rel=0.05)
    assert fit.describe()["forwards"] == 400


def test_equal_forwards_read_as_no_slope_never_a_negative_one() -> None:
    fit = ForwardCost()
    for _ in range(50):
        fit.observe(5, 0, 0.3)
    assert fit.row_s >= 0 and fit.prefill_token_s >= 0
    assert fit.predict(5) == pytest.approx(0.3, rel=0.01)


def test_a_cloud_that_only_streamed_keeps_its_measured_row_cost() -> None:
    """The start-up measurement (rows 1, 2, 4, 8, 16 twice: 0.1 + 0.03 x rows s), then what a cloud serving
    streams sees: 400 one-row forwards (1 % noise) and a prompt prefill every 50 (100-400 tokens, costing a
    little less a token the more there are: 0.1 + 0.02 x p^0.95). The fit keeps b within 10 % of 0.03 s and c of
    the prefills' own slope; a joint least-squares fit of a, b and c on the same forwards (what this fit replaced)
    reads b off the prefill line's intercept, more than 30 % under it (0.018 s here; a verify of 32 rows priced at
    one step, as a llama.cpp cloud's answer once did, is the same defect with its own prefill curve)."""
    rng = random.Random(3)
    fit, xs, ys = ForwardCost(), [], []

    def seen(rows: int, pre: int, s: float) -> None:
        fit.observe(rows, pre, s)
        xs.append([1.0, rows, pre])
        ys.append(s)

    for r in (1, 2, 4, 8, 16, 1, 2, 4, 8, 16):
        seen(r, 0, 0.1 + 0.03 * r)
    for i in range(400):
        if i % 50 == 0:
            p = rng.randint(100, 400)
            seen(0, p, 0.1 + 0.02 * p ** 0.95)
        seen(1, 0, 0.13 * (1 + rng.gauss(0, 0.01)))
    assert fit.row_s == pytest.approx(0.03, rel=0.1)
    assert 0.01 < fit.prefill_token_s < 0.02
    w = [(1 - fit.weight) ** (len(ys) - 1 - i) for i in range(len(ys))]
    X, y = np.array(xs) * np.sqrt(w)[:, None], np.array(ys) * np.sqrt(w)
    joint = np.linalg.lstsq(X, y, rcond=None)[0]
    assert joint[1] < 0.7 * 0.03, joint


def test_acceptance_reads_chain_rounds_as_their_alpha() -> None:
    """2,000 chain rounds of k = 8 whose drafts are each kept with probability 0.7 given the ones before: the
    estimate is within 0.05 of 0.7 (weighted over the last ~10 rounds, so its spread is about 0.03)."""
    rng = random.Random(3)
    acc = Acceptance()
    errs = []
    for i in range(2000):
        la = 0
        while la < 8 and rng.random() < 0.7:
            la += 1
        acc.observe(la, 8)
        if i > 100:
            errs.append(abs(acc.alpha - 0.7))
    assert sum(errs) / len(errs) < 0.05


def _budget(rows_per_forward: int, tokens_per_forward: int, seconds: float) -> NodeBudget:
    """A budget that has seen 50 forwards of this load (a = 0.19 s, b = 0.01 s a row)."""
    b = NodeBudget(max_nodes=64)
    for i in range(50):
        b.committed(tokens_per_forward)
        rows = rows_per_forward + (i % 3)  # some spread so the slope is measured
        b.forward(rows, 0, 0.19 + 0.01 * rows)
    return b


def test_an_idle_cloud_gives_large_budgets_and_a_loaded_one_short_chains() -> None:
    """One session of trees (13 rows, 8 tokens a forward): a node must add ~0.2 tokens, so alpha 0.9 gets ~15
    nodes; sixteen sessions of chains (80 rows, 70 tokens a forward): a node must add ~0.7, so ~3 nodes."""
    idle, loaded = _budget(13, 8, 0.32), _budget(80, 70, 0.99)
    assert idle.node_value < 0.3 < 0.6 < loaded.node_value < 1
    assert idle.budget(0.9) >= 12
    assert 1 <= loaded.budget(0.9) <= 4
    assert loaded.budget(0.5) == 1 and loaded.budget(0.97) > loaded.budget(0.9)


def test_before_any_forward_the_edges_own_choice_stands() -> None:
    assert NodeBudget(max_nodes=32).budget(0.5) == 32


def test_the_budget_counts_the_last_rounds_nodes_worth_their_row() -> None:
    """A loaded cloud (a node must add ~0.7 tokens): of a tree whose nodes are expected to add 0.99, 0.97, 0.95,
    0.3, 0.05 tokens (a confident main path, weak siblings), three are worth their row; a round whose every node
    was worth it may grow by half."""
    loaded = _budget(80, 70, 0.99)
    assert 0.6 < loaded.node_value < 0.9
    assert loaded.budget(0.9, [0.99, 0.97, 0.95, 0.3, 0.05]) == 3
    assert loaded.budget(0.9, [0.99, 0.98, 0.97, 0.96]) == 6


def test_a_node_is_expected_to_add_what_nodes_of_its_q_were_accepted_along_its_path() -> None:
    """A new session reads its draft as calibrated (a node adds its q multiplied along its path). A confident
    draft whose main path (q 0.6-0.7 each) is always kept and whose siblings (q 0.3) never are, over 200 rounds
    of a path of four with a sibling at each level: its fourth path node is then expected to add more than 0.8
    tokens (its q product says 0.2), its siblings under 0.1, and a q bin never tried still reads its prior."""
    acc = Acceptance()
    parents, q = [-1, 0, 1, 2, -1, 0, 1, 2], [0.65, 0.6, 0.7, 0.65, 0.3, 0.3, 0.3, 0.3]
    assert acc.nodes.expected(parents[:4], q[:4])[3] == pytest.approx(0.65 * 0.6 * 0.7 * 0.65)
    for _ in range(200):
        acc.nodes.observe(parents, q, [True] * 4 + [False] * 4)
    e = acc.nodes.expected(parents, q)
    assert e[3] > 0.8 and max(e[4:]) < 0.1
    assert acc.nodes.conditional(0.95) == pytest.approx(0.95)


def test_a_calibrated_draft_keeps_its_q() -> None:
    """2,000 random chains of 8 whose nodes have q uniform in (0, 1] and are each accepted with probability q once
    their parent was: the conditional acceptance of the q bin [0.7, 0.8) is within 0.1 of 0.75 on average over
    the rounds (measured 0.079: the bin's decayed window holds ~2 tried nodes, and the prior pulls it to q).
    Power: counting every node as tried, whether its parent was kept or not, gives 0.46."""
    rng = random.Random(5)
    acc = Acceptance()
    errs = []
    for i in range(2000):
        q = [rng.uniform(1e-3, 1.0) for _ in range(8)]
        kept: list[bool] = []
        for j, qj in enumerate(q):
            kept.append((j == 0 or kept[j - 1]) and rng.random() < qj)
        acc.nodes.observe(list(range(-1, 7)), q, kept)
        if i > 100:
            errs.append(abs(acc.nodes.conditional(0.75) - 0.75))
    assert sum(errs) / len(errs) < 0.1


def test_a_forwards_cost_counts_the_work_on_its_rows_outside_the_forward() -> None:
    """The cost the budget fits is the forward's whole work: a job whose answer costs 60 ms of CPU after a
    forward of a few ms gives BatchStats.cpu_s of at least 60 ms (process CPU time), while `ms` stays the
    forward's own time; the cost clock starts again after an idle wait, so 60 ms of CPU spent while the model
    thread waited for work are not the next forward's cost."""
    import asyncio
    import time

    from cloud.scheduler import Scheduler
    from shared.kvpool import Row
    from tests.cloud.fake_runner import FakeRunner, FnJob

    stats: list[Any] = []

    def burn(_: Any, __: float) -> float:
        end = time.process_time() + 0.06
        while time.process_time() < end:
            pass
        return 0.0

    runner = FakeRunner(forward=lambda rows: [torch.zeros(len(r.ids), 4) for r in rows], on_batch=stats.append)
    sched = Scheduler(time.monotonic, runner, batch_wait_ms=0)

    async def main() -> None:
        await sched.submit(FnJob(lambda _: Row(0, 0, [1, 2], 1), burn))
        await asyncio.sleep(0.05)  # the model thread is waiting for work now
        burn(None, 0.0)  # the process works while the cloud idles: no forward's cost
        await sched.submit(FnJob(lambda _: Row(0, 2, [3], 1), lambda _, __: 0.0))

    try:
        asyncio.run(main())
    finally:
        sched.shutdown()
    assert len(stats) == 2
    assert stats[0].cpu_s >= 0.06 > stats[0].ms / 1000
    assert stats[1].cpu_s < 0.05


def test_the_open_answer_carries_the_first_rounds_budget(make_service: Any) -> None:
    """The open answer sizes the first round as later answers size theirs: the largest round before anything is
    measured, the new session's prior acceptance (alpha 0.8) read as a chain's under load (a node must add ~0.7
    tokens: 1 node), and 0 with --node-budget false."""
    import asyncio

    from shared.config import SamplingConfig
    from shared.protocol import OpenSessionRequest

    def opened(svc: Any) -> int:
        svc.budget.forward = lambda *a, **k: None  # the load as set: the open's own forward leaves it alone
        return asyncio.run(svc.open_session(OpenSessionRequest([5, 6, 7], SamplingConfig(0.0)), "")).node_budget

    svc = make_service(max_k=8, max_tree_nodes=32)
    svc.budget = NodeBudget(max_nodes=32)
    assert opened(svc) == 32
    svc.budget = _budget(80, 70, 0.99)
    assert opened(svc) == svc.budget.budget(0.8) == 1
    svc.budget = _budget(13, 8, 0.32)
    assert opened(svc) == svc.budget.budget(0.8) >= 5
    assert opened(make_service(node_budget=False)) == 0



def test_a_new_session_starts_from_its_owners_recent_budgets(make_service: Any) -> None:
    """Under load (a node must add ~0.7 tokens) the chain reading of the generic prior gives a first round of 1
    node; once an owner's rounds were given budgets of 5-9 nodes, its next session opens at their median (7),
    while another owner, and an owner with fewer than `min_rounds` budgets, still opens at the chain reading.
    Only the last `recent_rounds` budgets count (a load that changed is followed)."""
    import asyncio

    from shared.config import SamplingConfig
    from shared.protocol import OpenSessionRequest

    def opened(svc: Any, owner: str) -> int:
        svc.budget.forward = lambda *a, **k: None  # the load as set
        return asyncio.run(svc.open_session(OpenSessionRequest([5, 6, 7], SamplingConfig(0.0)), owner)).node_budget

    svc = make_service(max_k=8, max_tree_nodes=32)
    svc.budget = _budget(80, 70, 0.99)
    chain = svc.budget.budget(0.8)
    assert chain == 1
    for n in (5, 6, 7):
        svc.budget.given("a", n)
    assert opened(svc, "a") == chain  # three rounds: not yet
    for n in (8, 9):
        svc.budget.given("a", n)
    assert opened(svc, "a") == 7
    assert opened(svc, "b") == chain
    for _ in range(svc.budget.recent_rounds):
        svc.budget.given("a", 3)
    assert opened(svc, "a") == 3


def test_a_new_session_values_its_nodes_from_its_owners_pooled_acceptance(make_service: Any) -> None:
    """The open answer carries the acceptance by q of every round of the owner's sessions, and the new session's own
    acceptance starts from it, each bin's weight cut to SEED_NODES with its share kept: after rounds whose main path
    (q 0.55) was always kept and whose sibling (q 0.35) never, a new session of that owner values a q-0.55 node at
    8/(8+2) + 2 x 0.55/(8+2) (not the calibrated 0.55) and a q-0.35 one at 2 x 0.35/(8+2); another owner, and a
    cloud with --node-budget false, give none and start calibrated. The wire forms carry the counts whole."""
    import asyncio
    from dataclasses import asdict

    from cloud.grpc_server import info_to_pb
    from edge.transport.grpc_transport import session_from_pb
    from edge.transport.rest import session_from_json
    from shared.config import SamplingConfig
    from shared.node_value import SEED_NODES
    from shared.protocol import OpenSessionRequest

    def opened(svc: Any, owner: str) -> Any:
        svc.budget.forward = lambda *a, **k: None
        info = asyncio.run(svc.open_session(OpenSessionRequest([5, 6, 7], SamplingConfig(0.0)), owner))
        return info, svc.store.get(info.ctx_id, owner)

    svc = make_service(max_k=8, max_tree_nodes=32)
    svc.budget = _budget(80, 70, 0.99)
    info, s = opened(svc, "a")
    assert info.node_acceptance is None and s.acceptance.nodes.conditional(0.55) == pytest.approx(0.55)
    for _ in range(30):  # rounds of other sessions of "a": a path of three at q 0.55, a sibling at q 0.35
        svc.node_budget(s, 3, 3, 4, [-1, 0, 1, 0], [0.55, 0.55, 0.55, 0.35], [True, True, True, False])
    info, s = opened(svc, "a")
    acc = info.node_acceptance
    assert acc is not None and acc.tried[5] > acc.tried[3] > SEED_NODES and acc.kept[3] == 0
    w = 2.0  # NodeCalibration.prior_nodes
    assert s.acceptance.nodes.conditional(0.55) == pytest.approx((SEED_NODES + w * 0.55) / (SEED_NODES + w))
    assert s.acceptance.nodes.conditional(0.35) == pytest.approx(w * 0.35 / (SEED_NODES + w))
    back = session_from_pb(info_to_pb(info)).node_acceptance
    assert back is not None and back.kept == pytest.approx(acc.kept) and back.tried == pytest.approx(acc.tried)
    assert session_from_json(asdict(info)).node_acceptance == acc
    other, t = opened(svc, "b")
    assert other.node_acceptance is None and t.acceptance.nodes.conditional(0.55) == pytest.approx(0.55)
    off = make_service(node_budget=False)
    assert opened(off, "a")[0].node_acceptance is None


def test_gpu_cost_reads_the_marginal_row_cost_per_bucket() -> None:
    """A GPU-like cost (flat at 5 ms up to 64 rows, then 0.05 ms a row more): with steps, the row cost at a load
    of 8 rows is the flat stretch's (near 0) where the linear fit over all forwards reads a slope from the
    compute-bound ones; at a load of 256 rows it is the compute-bound slope."""

    def cost(rows: int) -> float:
        return 0.005 + 0.00005 * max(0, rows - 64)

    fit = ForwardCost(steps=True)
    for rows in [1, 2, 4, 8, 16, 32, 64, 128, 256] * 20:
        fit.observe(rows, 0, cost(rows))
    for _ in range(200):  # the present load: 8 rows a forward
        fit.observe(8, 0, cost(8))
    assert fit.row_s < 1e-6 < fit.describe()["linear_row_ms"] / 1000
    for _ in range(200):  # then 256
        fit.observe(256, 0, cost(256))
    assert abs(fit.row_s - 0.00005) / 0.00005 < 0.05
    assert ForwardCost().marginal_row_s() is None


def test_siblings_chances_of_acceptance_sum_to_at_most_one() -> None:
    """The verify keeps at most one child of a node, so siblings' chances are exclusive. Main-path nodes of q 0.3
    that are always kept (200 rounds) make the 0.3 bin read near 1; a second branch of q 0.3 beside a first child
    of q 0.95 (a bin read at 0.98) may then add at most the 0.02 its sibling leaves, where its bin alone says
    near 1. Over 500 random trees (seed 0) with random bin counts, every node's siblings sum to at most 1 and no
    node reads more than its own bin."""
    import random

    from shared.node_value import NodeCalibration

    cal = NodeCalibration()
    for _ in range(200):
        cal.observe([-1, 0, 1], [0.3, 0.3, 0.95], [True, True, True])
        if _ % 50 == 0:
            cal.observe([-1], [0.95], [False])
    first, second = cal.conditional(0.95), cal.conditional(0.3)
    assert second > 0.9 and first > 0.9
    c = cal.conditionals([-1, -1], [0.95, 0.3])
    assert c[0] == pytest.approx(first) and c[1] == pytest.approx(1 - first)
    e = cal.expected([-1, -1, 0], [0.3, 0.95, 0.3])  # the larger bin takes its share first, whatever the order
    assert e[1] == pytest.approx(first) and e[0] == pytest.approx(1 - first) and e[2] == pytest.approx(e[0] * second)
    rng = random.Random(0)
    for _ in range(500):
        cal = NodeCalibration()
        cal._kept = [rng.uniform(0, 5) for _ in range(10)]
        cal._tried = [k + rng.uniform(0, 5) for k in cal._kept]
        n = rng.randint(1, 12)
        parents = [rng.randint(-1, j - 1) for j in range(n)]
        q = [rng.random() for _ in range(n)]
        cond = cal.conditionals(parents, q)
        for par in set(parents):
            assert sum(cond[j] for j in range(n) if parents[j] == par) <= 1 + 1e-9
        assert all(0 <= cond[j] <= cal.conditional(q[j]) + 1e-12 for j in range(n))
