"""`specsplit-bench`: measure edge_only, cloud_only and speculative decoding on this machine and
write BENCHMARKS.md plus its PNG figures.

    specsplit-bench                      # the full run (about 10 minutes on 2 CPU cores)
    specsplit-bench --quick --out /tmp/B.md --plots /tmp/plots   # seconds-scale smoke run
    specsplit-bench --from-json bench/plots/results.json          # re-render from raw results
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from bench.cloud_proc import REPO
from bench.plan import full_plan, quick_plan, with_repeats


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specsplit-bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny plan (1 prompt per set, 8 tokens, 1 repeat)")
    p.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md", help="report path (default BENCHMARKS.md)")
    p.add_argument("--plots", type=Path, default=None,
                   help="figure folder (default bench/plots next to the report's repository, or OUT's folder/plots)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="the cloud's torch device")
    p.add_argument("--target", type=Path, default=REPO / "models" / "demo-target", help="target model directory")
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
    return p


def default_plots(out: Path) -> Path:
    return REPO / "bench" / "plots" if out.resolve().parent == REPO else out.resolve().parent / "plots"


def say(msg: str) -> None:
    print(msg, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.perf_counter()
    command = "specsplit-bench" + ("" if argv is None and len(sys.argv) <= 1 else
                                   " " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])))
    plots_dir = args.plots or default_plots(args.out)

    from bench import plots, report
    from bench.collectors import machine_info
    from bench.runner import Runner, RunResults
    from bench.stats import analyse

    if args.from_json:
        results = RunResults.from_json(json.loads(args.from_json.read_text()))
        total_s = results.total_s
    else:
        for name in ("target", "draft"):
            if not (getattr(args, name) / "config.json").is_file():
                print(f"specsplit-bench: {getattr(args, name)} is not a model directory", file=sys.stderr)
                return 2
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
    an = analyse(results)
    plots_dir.mkdir(parents=True, exist_ok=True)
    plots.write_all(an, plots_dir)
    report.write_raw(an, plots_dir)
    total_s = results.total_s if args.from_json else time.perf_counter() - t0
    path = report.write(an, args.out, plots_dir, command, total_s)
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
