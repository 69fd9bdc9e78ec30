"""`specsplit-bench`: measure edge_only, cloud_only and speculative decoding on this machine and
write BENCHMARKS.md plus its PNG figures.

    specsplit-bench                      # the full run (about 10 minutes on 2 CPU cores, then the capacity section)
    specsplit-bench --quick --out /tmp/B.md --plots /tmp/plots   # seconds-scale smoke run
    specsplit-bench --from-json bench/plots/results.json          # re-render from raw results
    specsplit-bench --only capacity      # the cloud capacity section alone (a few minutes)
    specsplit-bench --only network       # speculation over 0-100 ms round trips alone (about 15 minutes)
    specsplit-bench --only real-pair     # SmolLM2-135M-Instruct and its drafts (about 15 minutes)
    specsplit-bench --only tp            # the target over 1, 2, 3 tensor-parallel ranks (--target; a few minutes)
    specsplit-bench --only coder-pair    # Qwen2.5-Coder-1.5B/0.5B-Instruct on HumanEval (about 20 minutes)
    specsplit-bench --only draft-runtime # the coder pair's draft on llama.cpp against PyTorch
    specsplit-bench --only cloud-runner  # the coder target on llama.cpp and PyTorch against llama.cpp's own decode
    specsplit-bench --only capacity-curve  # the coder target at 1..64 sessions, one line per round policy
    specsplit-bench --only forward-cost  # one cloud forward by dtype and batch shape, both targets (~10 minutes)
    specsplit-bench --only gpu           # the cloud on a CUDA host: forward by shape, graphs, server (~5 minutes)
    specsplit-bench --only gpu-capacity  # tokens per GPU-second, replayed coder-pair drafts against alone (<6 min)

One-off measurements print their tables instead of writing the report (bench/measures; NAME --help for each):

    specsplit-bench acceptance --rtt-ms 50      # acceptance and speed of each drafter against cloud_only
    specsplit-bench block-size                  # forward cost and unused KV positions by paged-pool block size
    specsplit-bench cloud-down --requests 6     # how long requests to the OpenAI server take to fail, cloud down
    specsplit-bench failover                    # replicas behind nginx: SIGKILL to next token, 1 vs 3 replicas
    specsplit-bench overhead                    # the verifier's own overhead per round, REST and gRPC
    specsplit-bench slow-link --rtt-ms 600      # exactness over a slow link, default deadline against a fixed one
    specsplit-bench stream-switch 6 96 llamacpp # the coder pair with and without speculate-or-stream
    specsplit-bench profile-rounds --transport grpc   # where a verify round's CPU goes in the cloud (py-spy)
    specsplit-bench peer-loop --prompts 3       # cloud_only's stream against llama.cpp's own decode loop
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.capacity import BATCHED_FLAGS, UNBATCHED_FLAGS, CapacityPlan, CapacityResults, quick_capacity_plan
from bench.cloud_proc import REPO
from bench.plan import full_plan, quick_plan, with_repeats
from bench.traces import TRACES_DIR

# subcommand -> module with a main(argv) -> int; each loads its heavy dependencies only after parsing
MEASURES = {
    "acceptance": "bench.measures.acceptance",
    "block-size": "bench.measures.block_size",
    "cloud-down": "bench.measures.cloud_down",
    "failover": "bench.measures.failover",
    "overhead": "bench.measures.overhead",
    "slow-link": "bench.measures.slow_link",
    "stream-switch": "bench.measures.stream_switch",
    "profile-rounds": "bench.measures.profile_rounds",
    "peer-loop": "bench.measures.peer_loop",
}


def build_parser() -> argparse.ArgumentParser:
    # the epilog is the docstring's last two paragraphs: the MEASURES subcommands, one a line
    p = argparse.ArgumentParser(prog="specsplit-bench", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[-2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny plan (1 prompt per set, 8 tokens, 1 repeat)")
    p.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md", help="report path (default BENCHMARKS.md)")
    p.add_argument("--plots", type=Path, default=None,
                   help="figure folder (default bench/plots next to the report's repository, or OUT's folder/plots)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the cloud's torch device")
    p.add_argument("--target", type=Path, default=None,
                   help="target model directory (default models/demo-target; --only tp: models/smollm2-135m-instruct)")
    p.add_argument("--draft", type=Path, default=REPO / "models" / "demo-draft", help="draft model directory")
    p.add_argument("--repeats", type=int, default=None, help="repeat every case this many times")
    p.add_argument("--edge-threads", type=int, default=1, help="torch threads of each edge worker (default 1)")
    p.add_argument("--cloud-threads", type=int, default=1, help="torch threads of the cloud model worker (default 1)")
    p.add_argument("--shared-edge-worker", action="store_true",
                   help="one edge process for every case (faster start; edge RSS then mixes drafters)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="skip later repeats that would end the run after this many seconds "
                        "(default 570 for the full run, none with --quick; 0 = no budget)")
    p.add_argument("--from-json", type=Path, default=None, help="re-render the report from a results.json")
    p.add_argument("--gpu-shapes", default="coder-1.5b,qwen2.5-7b",
                   help="gpu: model shapes timed with random weights (bench/gpu.py SHAPES; 'tiny' for a CPU dry run)")
    p.add_argument("--gpu-paths",
                   default="transformers,graphs,graphs-invariant,graphs-triton-invariant,graphs-fused-invariant",
                   help="gpu: forward paths timed (transformers, graphs, graphs-invariant, graphs-triton-invariant: "
                        "--attention triton, graphs-fused-invariant: --fused-kernels; transformers' own baselines run "
                        "with the transformers path)")
    p.add_argument("--gpu-server", default="coder-1.5b",
                   help="gpu: the shape served for the server part ('none' skips it)")
    p.add_argument("--only", choices=["gpu", "capacity", "network", "real-pair", "tp", "coder-pair", "forward-cost",
                                        "draft-runtime", "cloud-runner", "capacity-curve", "gpu-capacity"],
                   default=None,
                   help="run only this section and splice it into OUT and the results JSON")
    p.add_argument("--gpu-capacity-sessions", default="1,8,32,64,128,256",
                   help="gpu-capacity: session counts, comma-separated")
    p.add_argument("--gpu-capacity-tokens", type=int, default=64, help="gpu-capacity: tokens each session gets")
    p.add_argument("--gpu-capacity-k", type=int, default=8, help="gpu-capacity: draft tokens a speculation round")
    p.add_argument("--real-pair-drafts", default="",
                   help="real-pair: the drafts of the fixed-shape table, comma-separated (default: every one present: "
                        "attention head, feature-fed head, distilled draft, draft from the target, n-gram)")
    p.add_argument("--real-pair-head", default="",
                   help="real-pair: the head the Spec-Bench and end-to-end sections use (default: the edge's default head)")
    p.add_argument("--forward-models", default="smollm2,coder",
                   help="forward-cost: the targets, comma-separated (smollm2, coder; default both)")
    p.add_argument("--forward-threads", type=int, default=1, help="forward-cost: torch threads (default 1)")
    p.add_argument("--forward-variants", default="",
                   help="forward-cost: DTYPE-invariant|plain-eager|transformers, comma-separated (default: float32 "
                        "invariant eager and transformers, float32 plain eager, bfloat16 invariant and plain eager)")
    p.add_argument("--coder-prompts", type=int, default=6, help="coder-pair: HumanEval prompts (default 6, at most 20)")
    p.add_argument("--coder-new-tokens", type=int, default=96, help="coder-pair: new tokens per prompt (default 96)")
    p.add_argument("--coder-dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                   help="coder-pair: the cloud's --dtype (default auto)")
    p.add_argument("--coder-sessions", default="1,4,16",
                   help="coder-pair: concurrent replayed sessions of the cloud CPU-time measure, comma-separated (default 1,4,16)")
    p.add_argument("--coder-specbench", type=int, default=1,
                   help="coder-pair: Spec-Bench questions per category (default 1; 0 = none)")
    p.add_argument("--curve-sessions", default="1,2,4,8,16,32,64",
                   help="capacity-curve: concurrent sessions, comma-separated (default 1,2,4,8,16,32,64)")
    p.add_argument("--curve-policies", default="cloud_only,chain-2,chain-4,chain-8,tree-8,tree-16,tree-32,edge,adaptive",
                   help="capacity-curve: round policies, comma-separated (default all: cloud_only, chain-2/4/8, "
                        "tree-8/16/32, edge, adaptive)")
    p.add_argument("--curve-tokens", type=int, default=32, help="capacity-curve: tokens a session (default 32)")
    p.add_argument("--curve-again", action="store_true",
                   help="capacity-curve: measure the asked cases again (a resumed run skips the cases it holds)")
    p.add_argument("--skip-capacity", action="store_true", help="full run without the cloud capacity section")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="the cloud's dtype in the capacity section")
    p.add_argument("--capacity-levels", default=None,
                   help="concurrent sessions of the capacity cases, comma-separated (default 1,4,16,64)")
    p.add_argument("--capacity-tokens", type=int, default=None, help="tokens per capacity text (default 128)")
    p.add_argument("--capacity-batched-flags", default=None,
                   help=f"specsplit-cloud flags of the batching arm (default '{BATCHED_FLAGS}'; '' = none)")
    p.add_argument("--capacity-unbatched-flags", default=None,
                   help=f"specsplit-cloud flags of the one-at-a-time arm (default '{UNBATCHED_FLAGS}'; '' = none)")
    p.add_argument("--traces", type=Path, default=TRACES_DIR, help="recorded traces (default bench/traces)")
    return p


def capacity_plan(args: argparse.Namespace) -> CapacityPlan:
    plan = quick_capacity_plan(args.device, args.dtype) if args.quick else CapacityPlan(device=args.device,
                                                                                         dtype=args.dtype)
    if args.capacity_levels:
        levels = tuple(int(x) for x in args.capacity_levels.split(","))
        plan = replace(plan, levels=levels, ref_level=plan.ref_level if plan.ref_level in levels else max(levels))
    if args.capacity_tokens:
        plan = replace(plan, max_tokens=args.capacity_tokens)
    (batched, b_flags), (single, s_flags) = plan.arms
    if args.capacity_batched_flags is not None:
        b_flags = args.capacity_batched_flags
    if args.capacity_unbatched_flags is not None:
        s_flags = args.capacity_unbatched_flags
    return replace(plan, arms=((batched, b_flags), (single, s_flags)))


def run_capacity(args: argparse.Namespace, command: str, out: Path, plots_dir: Path) -> int:
    """The capacity section: measured, spliced into OUT, stored under "capacity" in results.json."""
    from bench.capacity import CapacityRunner
    from bench.capacity_report import console_lines, store_raw, write_into

    plan = capacity_plan(args)
    say(f"capacity: sessions {', '.join(map(str, plan.levels))}; {plan.max_tokens} tokens per text; "
        f"device {plan.device}, dtype {plan.dtype}")
    try:
        res = CapacityRunner(plan, args.target, args.draft, args.traces, progress=say).run(command)
    except RuntimeError as e:  # a cloud that would not start, e.g. a flag this specsplit-cloud lacks
        print(f"specsplit-bench: capacity section failed: {e}\n(arm flags: "
              + "; ".join(f"{name}: {flags!r}" for name, flags in plan.arms)
              + "; --capacity-batched-flags / --capacity-unbatched-flags change them)", file=sys.stderr)
        return 1
    path = write_into(res, out)
    raw = store_raw(res, plots_dir / "results.json")
    say("")
    say("\n".join(console_lines(res)))
    say(f"\nwrote the capacity section into {path} and its raw data into {raw} ({res.total_s:.1f} s)")
    return 0


def run_network(args: argparse.Namespace, command: str, out: Path, plots_dir: Path) -> int:
    """The network section: measured, spliced into OUT, raw data in plots_dir/results_network.json."""
    from bench import net_report
    from bench.plan import network_plan
    from bench.runner import Runner, RunResults
    from bench.stats import analyse

    if args.from_json:  # re-render the section from a stored run
        results = RunResults.from_json(json.loads(args.from_json.read_text()))
        an = analyse(results)
        path = net_report.write_into(an, out, results.notes.get("command", command), results.total_s)
        say(f"wrote the network section into {path}")
        return 0
    t0 = time.perf_counter()
    plan = network_plan(args.quick)
    if args.repeats:
        plan = with_repeats(plan, args.repeats)
    say(f"network: {len(plan.cases)} cases, {plan.prompts_per_set} prompts per set, {plan.max_new_tokens} new tokens")
    runner = Runner(plan, args.target, args.draft, args.device, args.edge_threads, args.cloud_threads,
                    shared_worker=args.shared_edge_worker or args.quick, budget_s=args.budget_s or 0.0, progress=say)
    results = runner.run(n_ping=5)
    results.total_s = time.perf_counter() - t0
    results.notes["command"] = command
    an = analyse(results)
    raw = net_report.store_raw(an, plots_dir / "results_network.json")
    path = net_report.write_into(an, out, command, results.total_s)
    say("")
    say("\n".join(net_report.section(an, command, results.total_s)))
    say(f"\nwrote the network section into {path} and its raw data into {raw} ({results.total_s:.1f} s)")
    return 0


def keep_network(out: Path, plots_dir: Path) -> None:
    """Splice the stored network section (plots_dir/results_network.json, if any) back into a rewritten report."""
    from bench import net_report
    from bench.runner import RunResults
    from bench.stats import analyse

    raw = plots_dir / "results_network.json"
    if not raw.is_file():
        return
    try:
        results = RunResults.from_json(json.loads(raw.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        say(f"kept no network section: {raw} unreadable ({e})")
        return
    net_report.write_into(analyse(results), out, results.notes.get("command", "specsplit-bench --only network"),
                          results.total_s)


def default_plots(out: Path) -> Path:
    return REPO / "bench" / "plots" if out.resolve().parent == REPO else out.resolve().parent / "plots"


def say(msg: str) -> None:
    print(msg, flush=True)


def rerender_capacity(raw: dict[str, Any], out: Path, plots_dir: Path) -> int:
    """Splice every capacity run of the results JSON `raw` into `out` and store it in plots_dir/results.json."""
    from bench.capacity_report import load_raw, store_raw, write_into

    for res in load_raw(raw):
        write_into(res, out)
        store_raw(res, plots_dir / "results.json")
    return 0


def other_capacity_runs(raw: Path, section_id: str) -> list[CapacityResults]:
    """Capacity runs stored in `raw` for another device kind than `section_id` ("" = all; none if unreadable)."""
    from bench.capacity_report import load_raw

    try:
        return [r for r in load_raw(json.loads(raw.read_text())) if r.plan.section_id != section_id]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given and given[0] in MEASURES:  # a one-off measurement: its own parser reads the rest
        measure: int = importlib.import_module(MEASURES[given[0]]).main(list(given[1:]))
        return measure
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    command = "specsplit-bench" + ("" if argv is None and len(sys.argv) <= 1 else
                                   " " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])))
    plots_dir = args.plots or default_plots(args.out)

    from bench import plots, report
    from bench.collectors import machine_info
    from bench.runner import Runner, RunResults
    from bench.stats import analyse

    if args.only == "real-pair":  # SmolLM2-135M-Instruct and its drafts (bench/real_pair.py)
        from bench.real_pair import run as run_real_pair

        only = tuple(d.strip() for d in args.real_pair_drafts.split(",") if d.strip())
        return run_real_pair(args.out, command, only=only, head=args.real_pair_head)
    if args.only == "gpu":  # the cloud on a CUDA host (bench/gpu.py)
        from bench.gpu import run as run_gpu

        shapes = tuple(x.strip() for x in args.gpu_shapes.split(",") if x.strip())
        paths = tuple(x.strip() for x in args.gpu_paths.split(",") if x.strip())
        return run_gpu(args.out, command, shapes, None if args.gpu_server == "none" else args.gpu_server, paths)
    if args.only == "forward-cost":  # one cloud forward by dtype and batch shape (bench/forward_cost.py)
        from bench.forward_cost import run as run_forward_cost

        models = tuple(m.strip() for m in args.forward_models.split(",") if m.strip())
        from bench.forward_cost import DEFAULT_VARIANTS

        variants = tuple(v.strip() for v in args.forward_variants.split(",") if v.strip()) or DEFAULT_VARIANTS
        return run_forward_cost(args.out, command, models, args.forward_threads, variants)
    if args.only == "coder-pair":  # Qwen2.5-Coder-1.5B-Instruct and its 0.5B draft (bench/coder_pair.py)
        from bench.coder_pair import run as run_coder_pair

        sessions = tuple(int(x) for x in args.coder_sessions.split(",") if x.strip())
        return run_coder_pair(args.out, command, prompts=args.coder_prompts, n_new=args.coder_new_tokens,
                              dtype=args.coder_dtype, sessions=sessions or (1,), specbench_per_category=args.coder_specbench)
    if args.only == "draft-runtime":  # the coder pair's draft on llama.cpp against PyTorch (bench/draft_runtime.py)
        from bench.draft_runtime import run as run_draft_runtime

        return run_draft_runtime(args.out, command, prompts=args.coder_prompts, n_new=args.coder_new_tokens,
                                 per_category=args.coder_specbench)
    if args.only == "cloud-runner":  # the coder target on llama.cpp and PyTorch (bench/cloud_runner.py)
        from bench.cloud_runner import run as run_cloud_runner

        sessions = tuple(int(x) for x in args.coder_sessions.split(",") if x.strip())
        return run_cloud_runner(args.out, command, prompts=args.coder_prompts, n_new=args.coder_new_tokens,
                                sessions=sessions or (1,))
    if args.only == "gpu-capacity":  # tokens per GPU-second with replayed drafts against alone (bench/gpu_capacity.py)
        from bench.gpu_capacity import run as run_gpu_capacity

        shape = args.gpu_shapes.split(",")[0].strip()
        levels = tuple(int(x) for x in args.gpu_capacity_sessions.split(",") if x.strip())
        run_gpu_capacity(args.out, command, shape, levels, args.gpu_capacity_tokens, args.gpu_capacity_k)
        return 0
    if args.only == "capacity-curve":  # the coder target under 1..64 sessions by round policy (bench/capacity_curve.py)
        from bench.capacity_curve import run as run_curve

        levels = tuple(int(x) for x in args.curve_sessions.split(",") if x.strip())
        policies = tuple(x.strip() for x in args.curve_policies.split(",") if x.strip())
        return run_curve(args.out, command, prompts=args.coder_prompts, n_new=args.curve_tokens, sessions=levels,
                         policies=policies, again=args.curve_again)
    if args.only == "tp":  # the target split over 1, 2, 3 tensor-parallel ranks (bench/tensor_parallel.py)
        from bench.tensor_parallel import TARGET as TP_TARGET
        from bench.tensor_parallel import run as run_tp

        return run_tp(args.out, command, args.target or TP_TARGET, n_new=8 if args.quick else 64)
    args.target = args.target or REPO / "models" / "demo-target"
    if not args.from_json:
        for name in ("target", "draft"):
            if not (getattr(args, name) / "config.json").is_file():
                print(f"specsplit-bench: {getattr(args, name)} is not a model directory", file=sys.stderr)
                return 2
    if args.only == "capacity":
        return run_capacity(args, command, args.out, plots_dir)
    if args.only == "network":
        return run_network(args, command, args.out, plots_dir)
    raw: dict[str, Any] = json.loads(args.from_json.read_text()) if args.from_json else {}
    if args.from_json:
        if "machine" not in raw:  # a results file holding capacity runs only
            return rerender_capacity(raw, args.out, plots_dir)
        results = RunResults.from_json(raw)
        total_s = results.total_s
    else:
        info = machine_info(args.edge_threads, args.cloud_threads)
        say(f"machine: {info.cpu_model}, {info.cpus} CPUs ({info.cpus_usable} usable), load {info.load_avg_1m:.2f}; "
            f"torch threads edge {args.edge_threads} / cloud {args.cloud_threads}; "
            + ", ".join(f"{k} {v}" for k, v in info.versions.items()))
        plan = quick_plan() if args.quick else full_plan()
        if args.repeats:
            plan = with_repeats(plan, args.repeats)
        say(f"plan: {len(plan.cases)} cases, {plan.prompts_per_set} prompts per set, {plan.max_new_tokens} new tokens")
        runner = Runner(plan, args.target, args.draft, args.device, args.edge_threads, args.cloud_threads,
                        shared_worker=args.shared_edge_worker or args.quick,
                        budget_s=args.budget_s if args.budget_s is not None else (0.0 if args.quick else 570.0),
                        progress=say)
        results = runner.run(n_ping=5 if args.quick else 20)
        total_s = time.perf_counter() - t0
        results.total_s = total_s
        results.notes["command"] = command
    measure_capacity = not (args.from_json or args.quick or args.skip_capacity)
    # capacity sections this run does not measure again (the GPU table, or all with --skip-capacity) are kept
    kept = [] if args.from_json else other_capacity_runs(plots_dir / "results.json",
                                                         capacity_plan(args).section_id if measure_capacity else "")
    an = analyse(results)
    plots_dir.mkdir(parents=True, exist_ok=True)
    plots.write_all(an, plots_dir)
    report.write_raw(an, plots_dir)
    total_s = results.total_s if args.from_json else time.perf_counter() - t0
    path = report.write(an, args.out, plots_dir, command, total_s)
    keep_network(path, plots_dir)
    if args.from_json:
        rerender_capacity(raw, path, plots_dir)
    else:
        rerender_capacity({"capacity": {r.plan.section_id: r.to_json() for r in kept}}, path, plots_dir)
        if measure_capacity and run_capacity(args, command, path, plots_dir) != 0:
            return 1
    say("")
    say("\n".join(report.latency_table(report.main_rows(an))))
    say("\nnoisy numbers: timing metrics whose min-max over repeats exceeds 10 % of the median")
    for metric, items in an.spreads().items():
        worst = max(items)
        say(f"  {metric}: {sum(sp > 0.10 for sp, _ in items)} of {len(items)} cases; largest "
            f"{100 * worst[0]:.0f} % ({worst[1]})")
    say(f"\nwrote {path} and {plots_dir}/*.png in {total_s:.1f} s total")
    return 0


if __name__ == "__main__":
    sys.exit(main())
