"""The capacity curve: the coder target's cloud at 1 .. 64 concurrent sessions, one line per round policy
(specsplit-bench --only capacity-curve).

Policies: cloud_only (POST /v1/generate streams), fixed shapes (chains of 2, 4, 8; trees of 8, 16, 32), the edge's
own tree choice without the cloud's budget ("edge"), and with it ("adaptive", the default edge against the default
cloud). Per policy and session count: tokens per cloud CPU-second, time per token p50 / p99 over every token of
every session, and every text against the target's greedy text.

Edges draft nothing during the run, so 64 sessions load the cloud as 64 devices would: before it, the 0.5B draft
(llama.cpp, or PyTorch without it) grows one greedy tree at every position of every reference text (the target's
own greedy text of the prompt; 32 nodes, 4 wide, 8 deep, no copy branches), kept in `trees.json` beside the
results so a rerun skips it. Greedy verification is deterministic, so a replayed edge cuts the tree at its position
to its policy's size (a chain: the draft's greedy path; a tree: its n most valuable nodes) and knows what the cloud
must answer: the reference's next tokens. The "edge" and "adaptive" edges rank and choose n as the edge does
(edge/policy/tree.py: nodes by the session's acceptance by q, n from the answers' times), adaptive capped by
each answer's node_budget; every level runs every prompt at least once (one session runs them one after another).
A worker is one device: its sessions run one after another, and each starts from the tree controller its last one
left (TreeControl.carry, as one edge client's sessions do), so at 16 sessions and more each starts fresh. Each row
records the commit and the start of the run that measured it (`run`).

One core each: this process (the load) on core 0, the cloud on core 1 with one torch thread, PyTorch runner
(the batch-invariant one: every shape gives the reference's text).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.cloud_proc import REPO, CloudServer
from bench.coder_pair import DRAFT, TARGET, cpu_info, cpu_seconds, humaneval_message, humaneval_prompts, pin
from bench.loadgen import CALL_TIMEOUT_S
from bench.real_pair import chat_ids, finish
from bench.real_pair import met as _met

START, END = "<!-- capacity-curve:start -->", "<!-- capacity-curve:end -->"
SESSIONS = (1, 2, 4, 8, 16, 32, 64)
POLICIES = ("cloud_only", "chain-2", "chain-4", "chain-8", "tree-8", "tree-16", "tree-32", "edge", "adaptive")
TREE = {"nodes": 32, "depth": 8, "width": 4}
# adaptive against cloud_only, tokens per cloud CPU-second, by sessions
AIM_RATIO = {1: 3.0, 16: 1.5}


@dataclass
class Table:
    """The draft's greedy tree at each position of one reference text."""
    prompt: list[int]
    reference: list[int]
    # per position i (after prompt + reference[:i]): tokens, q, parents, values
    trees: list[dict[str, list[Any]]] = field(default_factory=list)


def grow_tables(drafter: Any, prompts: list[list[int]], refs: list[list[int]], path: Path) -> list[Table]:
    """Every position's tree, read from `path` when a previous run of the same prompts left it."""
    from edge.drafters.tree import TreeShape
    from shared.config import SamplingConfig

    key = {"prompts": prompts, "refs": refs, "tree": TREE}
    if path.exists():
        data = json.loads(path.read_text())
        if data.get("key") == key:
            return [Table(**t) for t in data["tables"]]
    greedy, shape = SamplingConfig(temperature=0.0), TreeShape(**TREE)
    tables = []
    t0 = time.perf_counter()
    for p, ref in zip(prompts, refs, strict=True):
        table = Table(p, ref)
        for i in range(len(ref)):
            b = drafter.propose_tree(p + ref[:i], shape, greedy, 0)
            table.trees.append({"tokens": b.tokens, "q": b.q_probs, "parents": b.parents, "values": b.values})
        tables.append(table)
        print(f"capacity-curve: trees for prompt {len(tables)}/{len(prompts)} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    path.write_text(json.dumps({"key": key, "tables": [t.__dict__ for t in tables]}))
    return tables


def cut(tree: dict[str, list[Any]], policy: str, n: int) -> tuple[list[int], list[float], list[int] | None]:
    """The round a policy sends from a position's tree: a chain of n (the greedy path) or the n best nodes."""
    from edge.drafters.base import DraftBlock
    from edge.drafters.tree import prune

    tokens, q, parents, values = tree["tokens"], tree["q"], tree["parents"], tree["values"]
    if policy.startswith("chain"):
        path: list[int] = []
        at = -1
        while len(path) < n:
            kids = [j for j, par in enumerate(parents) if par == at]
            if not kids:
                break
            at = max(kids, key=lambda j: values[j])
            path.append(at)
        return [tokens[j] for j in path], [q[j] for j in path], None
    b = prune(DraftBlock(list(tokens), list(q), "sampled", parents=list(parents), values=list(values)), n)
    assert b.parents is not None
    return b.tokens, b.q_probs, b.parents


@dataclass
class SessionRun:
    tokens: int = 0
    # seconds per committed token, one entry per token (a round's time spread over its tokens)
    per_token_s: list[float] = field(default_factory=list)
    equal: bool = True
    error: str | None = None
    rows: int = 0
    # per verify round: (the budget it was sent under, 0: none said; nodes sent; tokens committed)
    rounds: list[tuple[int, int, int]] = field(default_factory=list)
    # the edge's tree controller at the session's end: the worker's next session starts from it, as one edge
    # client's sessions do (TreeControl.carry)
    ctl: Any = None


async def speculative(stub: Any, table: Table, policy: str, n_new: int, last: Any = None) -> SessionRun:
    """One replayed edge: open, rounds cut from the position's tree by `policy`, close; `last`: the same
    worker's previous session's tree controller."""
    from edge.drafters.base import DraftBlock
    from edge.policy.tree import TreeControl
    from shared.hashing import ctx_hash
    from shared.pb import verify_pb2 as pb

    ctl = TreeControl(max_nodes=TREE["nodes"], copy_branches=False).carry(last)
    run = SessionRun(ctl=ctl)
    cfg = pb.SamplingConfig(temperature=0.0)
    info = await stub.OpenSession(pb.OpenSessionRequest(prompt_ids=table.prompt, sampling_cfg=cfg, seed=1,
                                                        correction="strict", max_new_tokens=n_new + 1),
                                  timeout=CALL_TIMEOUT_S)
    pos, S, i, budget = 0, list(table.prompt), 0, info.node_budget
    if policy == "adaptive" and info.HasField("node_acceptance"):  # as the edge takes it with the budget on
        ctl.nodes.seed(list(info.node_acceptance.kept), list(info.node_acceptance.tried))
    try:
        while pos < n_new:
            tree = table.trees[pos]
            if policy in ("edge", "adaptive"):  # ranked by the session's acceptance by q, as the edge ranks
                tree = {**tree, "values": ctl.ranked(DraftBlock(tree["tokens"], tree["q"], "sampled",
                                                                 parents=tree["parents"]))}
                n = ctl.choose(tree["values"], cap=budget if policy == "adaptive" and budget else None)
            else:
                n = int(policy.split("-")[1])
            n = min(n, n_new - pos - 1) if n_new - pos > 1 else 0
            tokens, q, parents = cut(tree, "chain" if policy.startswith("chain") else "tree", n) if n else ([], [],
                                                                                                         None)
            req = pb.VerifyRequest(ctx_id=info.ctx_id, ctx_len=len(S), ctx_hash=ctx_hash(S), draft_tokens=tokens,
                                   q_token_probs=q, k=len(tokens), request_id=f"r{i}", tree=parents is not None,
                                   tree_parents=parents or [])
            t0 = time.perf_counter()
            a = await stub.Verify(req, timeout=CALL_TIMEOUT_S)
            wall = time.perf_counter() - t0
            kept = [tokens[j] for j in a.accepted_nodes] if parents is not None else tokens[:a.accepted_len]
            got = kept + ([a.correction] if a.HasField("correction") else [])
            run.equal &= got == table.reference[pos:pos + len(got)]
            if not run.equal or not got:
                break
            run.per_token_s += [wall / len(got)] * len(got)
            run.rows += len(tokens) + 1
            run.rounds.append((budget, len(tokens), len(got)))
            S, pos, i, budget = S + got, pos + len(got), i + 1, a.node_budget
            if parents is not None:
                ctl.observe(len(tokens), sum(sorted(tree["values"], reverse=True)[:len(tokens)]), a.accepted_len,
                            max((d for d in _depths(parents)), default=0), wall * 1000,
                            a.metrics.prefill_ms + a.metrics.queue_ms, a.metrics.row_ms)
                ctl.observe_nodes(DraftBlock(tokens, q, "sampled", parents=parents), list(a.accepted_nodes))
        run.tokens = pos
    finally:
        await stub.CloseSession(pb.CloseSessionRequest(ctx_id=info.ctx_id), timeout=CALL_TIMEOUT_S)
    return run


def _depths(parents: list[int]) -> list[int]:
    from shared.tree import depths

    return depths(parents)


async def cloud_only(http: Any, table: Table, n_new: int) -> SessionRun:
    """One stream of the target's own tokens (POST /v1/generate), checked against the reference."""
    body = {"prompt_ids": table.prompt, "sampling_cfg": {"temperature": 0.0}, "seed": 1, "max_new_tokens": n_new,
            "stream": True, "stop_at_eos": False}
    run, ids = SessionRun(), []
    last = time.perf_counter()
    async with http.stream("POST", "/v1/generate", json=body, timeout=CALL_TIMEOUT_S) as r:
        event = "message"
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "message":
                now = time.perf_counter()
                run.per_token_s.append(now - last)
                last = now
                ids.append(int(json.loads(line[5:])["token_id"]))
    run.tokens, run.rows, run.equal = len(ids), len(ids), ids == table.reference[:n_new]
    return run


async def one_case(cloud: CloudServer, tables: list[Table], policy: str, sessions: int, n_new: int,
                   run_id: str = "") -> dict[str, Any]:
    import grpc
    import httpx

    from shared.pb import verify_pb2_grpc as pb_grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{cloud.grpc_port}")
    http = httpx.AsyncClient(base_url=cloud.url, limits=httpx.Limits(max_connections=sessions + 4))
    stub = pb_grpc.VerifierStub(channel)

    # every level runs every prompt at least once: `sessions` workers take the generations in turn (one session
    # runs all of them one after another, sixteen run one each with prompts repeated)
    jobs = max(sessions, len(tables))
    todo = iter(range(jobs))

    async def one(s: int, last: Any) -> SessionRun:
        table = tables[s % len(tables)]
        try:
            if policy == "cloud_only":
                return await cloud_only(http, table, n_new)
            return await speculative(stub, table, policy, n_new, last)
        except Exception as e:  # noqa: BLE001 - counted in the row
            return SessionRun(error=f"{type(e).__name__}: {e}", equal=False, ctl=last)

    async def worker() -> list[SessionRun]:  # one device: its sessions one after another
        out: list[SessionRun] = []
        for s in todo:
            out.append(await one(s, out[-1].ctl if out else None))
        return out

    try:
        c0, t0 = cpu_seconds(cloud.pid), time.perf_counter()
        runs = [r for rs in await asyncio.gather(*(worker() for _ in range(sessions))) for r in rs]
        wall, cpu = time.perf_counter() - t0, cpu_seconds(cloud.pid) - c0
        # the cloud's fit and rate at the end of the case (what its budgets were read from)
        fit = (await http.get("/v1/model")).json().get("forward_cost")
    finally:
        await http.aclose()
        await channel.close()
    tokens = sum(r.tokens for r in runs)
    lat = sorted(x for r in runs for x in r.per_token_s)
    row = {"policy": policy, "sessions": sessions, "tokens": tokens, "cloud_cpu_s": cpu, "wall_s": wall,
           "tokens_per_cpu_s": tokens / max(cpu, 1e-9),
           "p50_ms": 1000 * statistics.median(lat) if lat else 0.0,
           "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else 0.0,
           "rows_per_token": sum(r.rows for r in runs) / max(tokens, 1),
           "generations": jobs, "equal": sum(r.equal for r in runs), "errors": sum(r.error is not None for r in runs),
           "forward_cost": fit, "run": run_id, **round_shape(runs)}
    print(f"capacity-curve: {sessions:3d} sessions {policy:10s} {row['tokens_per_cpu_s']:.3f} tokens/CPU-s, p50 "
          f"{row['p50_ms']:.0f} ms/token, rows/token {row['rows_per_token']:.2f}, texts equal "
          f"{row['equal']}/{jobs}, errors {row['errors']} ({wall:.0f} s); cloud's fit {fit}", flush=True)
    return row


def round_shape(runs: list[SessionRun]) -> dict[str, float]:
    """What the verify rounds looked like: their count, tokens and nodes a round, and the budgets they were
    sent under (the first rounds', from the open answers, apart)."""
    rounds = [x for r in runs for x in r.rounds]
    if not rounds:
        return {}
    firsts = [r.rounds[0][0] for r in runs if r.rounds]
    return {"verify_rounds": len(rounds), "tokens_per_round": statistics.fmean(x[2] for x in rounds),
            "nodes_per_round": statistics.fmean(x[1] for x in rounds),
            "budget_mean": statistics.fmean(x[0] for x in rounds), "first_budget_mean": statistics.fmean(firsts)}


def cached_references(path: Path, prompts: list[list[int]], n_new: int) -> list[list[int]] | None:
    """The reference texts a previous run of the same prompts and length kept beside its trees."""
    if not path.exists():
        return None
    key = json.loads(path.read_text()).get("key", {})
    refs = key.get("refs")
    if key.get("prompts") == prompts and key.get("tree") == TREE and refs and all(len(r) == n_new for r in refs):
        return [list(r) for r in refs]
    return None


def references(cloud: CloudServer, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    import httpx

    out = []
    for p in prompts:
        r = httpx.post(f"{cloud.url}/v1/generate", json={"prompt_ids": p, "sampling_cfg": {"temperature": 0.0},
                                                          "max_new_tokens": n_new, "stop_at_eos": False},
                       timeout=600)
        r.raise_for_status()
        out.append(r.json()["token_ids"])
    return out


def run(out: Path, command: str, prompts: int = 8, n_new: int = 32, sessions: tuple[int, ...] = SESSIONS,
        policies: tuple[str, ...] = POLICIES, again: bool = False) -> int:
    """The whole curve, resumable: each case's row is kept in bench/results/capacity_curve.json as it ends, and a
    rerun of the same token count skips the cases it holds (`again`: the asked cases are measured anew, their
    old rows replaced). The plot goes to bench/plots/capacity_curve.png."""
    import os

    import torch
    from transformers import AutoTokenizer

    from edge.settings import EdgeSettings, load_draft_model

    t0 = time.perf_counter()
    # which run measured a row: the commit and the start (a resumed curve mixes runs)
    run_id = f"{_commit()} {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
    torch.set_num_threads(1)
    machine = {**cpu_info(), "load_start": os.getloadavg(), "pinned": pin("self", 0)}
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    ids = [chat_ids(tokenizer, humaneval_message(p["prompt"])) for p in humaneval_prompts(prompts)]
    # the repository's report keeps its rows in bench/results; another --out keeps them (and the plot) beside it
    own = out.resolve() == (REPO / "BENCHMARKS.md").resolve()
    results = REPO / "bench" / "results" / "capacity_curve.json" if own else out.with_suffix(".json")
    results.parent.mkdir(parents=True, exist_ok=True)
    trees = REPO / "bench" / "results" / "capacity_curve_trees.json"
    done: dict[str, Any] = json.loads(results.read_text()) if results.exists() else {}
    rows: list[dict[str, Any]] = done.get("rows", []) if done.get("key") == [prompts, n_new] else []
    if again:
        rows = [r for r in rows if not (r["sessions"] in sessions and r["policy"] in policies)]
    with CloudServer(TARGET, torch_threads=1, extra_args=["--runner", "torch", "--max-tree-nodes", "64"],
                     startup_timeout_s=900.0) as cloud:
        machine["pinned"] = machine["pinned"] and pin(cloud.pid, 1)
        refs = cached_references(trees, ids, n_new) or references(cloud, ids, n_new)
        # warm-up: a fresh cloud's first forwards of each shape are slower, and every prompt's prefill is then in
        # the prefix cache for every case alike (the first case measured used to pay the prompts' prefill alone:
        # about 35 CPU-s of the 8 HumanEval prompts on the AVX2 EPYC)
        references(cloud, ids, 2)
        drafter = load_draft_model(EdgeSettings(draft=str(DRAFT), threads=1))
        tables = grow_tables(drafter, ids, refs, trees)
        del drafter
        # warm-up of the verify shapes: a fresh cloud's first forwards of each row count are slower, which the
        # first case measured used to pay alone
        asyncio.run(one_case(cloud, tables[:2], "tree-32", 2, 16))
        for n in sessions:
            for policy in policies:
                if any(r["sessions"] == n and r["policy"] == policy for r in rows):
                    continue  # measured by an earlier run that stopped
                rows.append(asyncio.run(one_case(cloud, tables, policy, n, n_new, run_id)))
                results.write_text(json.dumps({"key": [prompts, n_new], "rows": rows}, indent=1))
    plot_path = REPO / "bench" / "plots" / "capacity_curve.png" if own else out.with_suffix(".png")
    plot(rows, plot_path)
    res = {"rows": rows, "n_new": n_new, "prompts": prompts, "command": command,
           "plot": str(plot_path.relative_to(REPO)) if own else str(plot_path)}
    return finish(res, machine, t0, out, "capacity-curve", (START, END), render)


def _commit() -> str:
    import subprocess

    try:
        out = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted((r["sessions"], r["tokens_per_cpu_s"], r["p50_ms"]) for r in rows if r["policy"] == policy)
        style = {"linewidth": 2.5} if policy in ("adaptive", "cloud_only") else {"linewidth": 1, "alpha": 0.7}
        a.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy, **style)
        b.plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=policy, **style)
    for ax, label in ((a, "tokens per cloud CPU-second"), (b, "p50 time per token, ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sessions")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's aims, each met or not, from one run's rows."""
    cell = {(r["sessions"], r["policy"]): r for r in rows}
    out = []
    for n in sorted({r["sessions"] for r in rows}):
        if (n, "adaptive") not in cell or (n, "cloud_only") not in cell:
            continue
        a, c = cell[n, "adaptive"], cell[n, "cloud_only"]
        fixed = [r for (m, p), r in cell.items() if m == n and (p.startswith("chain") or p.startswith("tree"))]
        best = max(fixed, key=lambda r: r["tokens_per_cpu_s"]) if fixed else None
        ratio = a["tokens_per_cpu_s"] / max(c["tokens_per_cpu_s"], 1e-9)
        line = f"- {n} sessions: adaptive {ratio:.2f}x cloud_only's tokens per CPU-s"
        if n in AIM_RATIO:
            line += f" (aim >= {AIM_RATIO[n]}x: {_met(ratio >= AIM_RATIO[n])})"
        if best is not None:
            share = a["tokens_per_cpu_s"] / best["tokens_per_cpu_s"]
            line += f"; {share:.2f} of the best fixed shape ({best['policy']}; aim >= 0.95: {_met(share >= 0.95)})"
        line += (f"; p50 {a['p50_ms']:.0f} ms against cloud_only's {c['p50_ms']:.0f} (aim <=: "
                 f"{_met(a['p50_ms'] <= c['p50_ms'])}); texts equal {a['equal']}/{a.get('generations', n)}.")
        out.append(line)
    return out


def render(res: dict[str, Any]) -> str:
    rows, m = res["rows"], res["machine"]
    levels = sorted({r["sessions"] for r in rows})
    seen = {r["policy"] for r in rows}  # the policies' own order, whichever run measured which row
    policies = [p for p in POLICIES if p in seen] + sorted(seen - set(POLICIES))
    cell = {(r["sessions"], r["policy"]): r for r in rows}
    head = "| sessions | " + " | ".join(policies) + " |"
    rule = "|" + "---|" * (len(policies) + 1)

    def table(fmt: Any) -> list[str]:
        return [head, rule] + [f"| {n} | " + " | ".join(fmt(cell[n, p]) if (n, p) in cell else "-" for p in policies)
                               + " |" for n in levels]

    lines = [START, "## The capacity curve: the cloud's node budget under load", "",
             f"`{res['command']}` · {m['cpu']} (avx512_bf16 {'yes' if m['avx512_bf16'] else 'no'}, amx_bf16 "
             f"{'yes' if m['amx_bf16'] else 'no'}), load average {m['load_start'][0]:.2f} at the start and "
             f"{m['load_end'][0]:.2f} at the end; the coder target on one core (PyTorch runner, --dtype auto), the "
             f"load on the other (pinned: {m['pinned']}); {res['prompts']} HumanEval prompts, {res['n_new']} tokens a "
             f"session, greedy; {res['total_s'] / 60:.0f} min. GPU figures are unmeasured.", "",
             "Tokens per cloud CPU-second (higher is better):", ""]
    lines += table(lambda r: f"{r['tokens_per_cpu_s']:.3f}")
    lines += ["", "Time per token, p50 / p99 ms, over every token of every session:", ""]
    lines += table(lambda r: f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f}")
    lines += ["", "Target rows per token; texts equal to the target's greedy text; errors:", ""]
    lines += table(lambda r: f"{r['rows_per_token']:.2f}; {r['equal']}/{r.get('generations', r['sessions'])}; "
                             f"{r['errors']}")
    lines += ["", "Aims:", ""] + verdicts(rows)
    lines += ["", f"![capacity curve]({res['plot']})", "", END]
    return "\n".join(lines)
