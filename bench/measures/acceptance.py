"""Acceptance and speed of the edge's drafters against a cloud on loopback, vs the cloud_only baseline.

For each configuration (cloud_only; speculative with the draft model; the hybrid of n-gram and model;
the n-gram drafter, with and without the top-k filler) and every prompt, one generation; the table gives
  mean La          accepted draft tokens per verify round
  accept rate      accepted / drafted
  tok/call         emitted tokens per cloud request (every attempt counted; open/close included)
  wall s           summed wall-clock time of the generations
  vs cloud_only    cloud_only wall / this wall (> 1: faster than the target alone)
on the demo pair by default (whatever models/demo-target and models/demo-draft hold now).
`--rtt-ms` puts a delay proxy (bench/delay_proxy.py) between edge and cloud to emulate a network.

    .venv/bin/specsplit-bench acceptance                           # starts specsplit-cloud
    .venv/bin/specsplit-bench acceptance --temperature 0 --max-new-tokens 64 --rtt-ms 50
    .venv/bin/specsplit-bench acceptance --cloud http://127.0.0.1:8000   # a running cloud
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.cloud_proc import REPO

if TYPE_CHECKING:  # the edge (and torch under it) loads in run(), so `--help` answers at once
    from edge.metrics import EdgeMetrics

FALLBACK_PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "The lighthouse keeper had not spoken to another person in eleven days. Each morning he",
    "To bake a simple loaf of bread, you need only flour, water, salt and yeast.",
]


@dataclass
class Row:
    # configuration name
    name: str
    # totals over the prompts
    drafted: int = 0
    accepted: int = 0
    verify_calls: int = 0
    emitted: int = 0
    cloud_calls: int = 0
    local_commits: int = 0
    wall_s: float = 0.0
    bytes_up: int = 0
    bytes_down: int = 0
    per_prompt: list[dict[str, Any]] = field(default_factory=list)

    def add(self, m: EdgeMetrics) -> None:
        self.drafted += m.drafted
        self.accepted += m.accepted
        self.verify_calls += m.verify_calls
        self.emitted += m.emitted
        self.cloud_calls += m.cloud_calls
        self.local_commits += m.local_commits
        self.wall_s += m.wall_ms / 1000
        self.bytes_up += m.bytes_up
        self.bytes_down += m.bytes_down
        self.per_prompt.append({"emitted": m.emitted, "accepted": m.accepted, "drafted": m.drafted,
                                "wall_ms": round(m.wall_ms, 1)})

    def summary(self, baseline_wall: float | None) -> dict[str, Any]:
        return {
            "config": self.name,
            "mean_La": self.accepted / self.verify_calls if self.drafted else None,
            "accept_rate": self.accepted / self.drafted if self.drafted else None,
            "tok_per_call": self.emitted / self.cloud_calls if self.cloud_calls else None,
            "emitted": self.emitted, "cloud_calls": self.cloud_calls, "wall_s": round(self.wall_s, 2),
            "speedup_vs_cloud_only": baseline_wall / self.wall_s if baseline_wall and self.wall_s else None,
            "bytes_up": self.bytes_up, "bytes_down": self.bytes_down, "local_commits": self.local_commits,
        }


def load_prompts(n: int, max_chars: int) -> list[str]:
    """The benchmark prompts (bench/prompts/*.jsonl) when present, cut to their last max_chars characters."""
    texts = []
    for f in sorted((REPO / "bench" / "prompts").glob("*.jsonl")):
        texts += [json.loads(line)["text"] for line in f.read_text().splitlines() if line.strip()]
    texts = texts or FALLBACK_PROMPTS
    step = max(1, len(texts) // n)
    return [t[-max_chars:] for t in texts[::step][:n]]


@contextlib.contextmanager
def cloud_endpoints(args: argparse.Namespace) -> Iterator[tuple[str, str | None]]:
    """(REST URL, gRPC target) of the cloud: the given one, or a specsplit-cloud started here."""
    if args.cloud:
        yield args.cloud, args.grpc
        return
    from bench.cloud_proc import CloudServer

    # one torch thread, the PyTorch runner in float32: the cloud the test suite starts by default
    with CloudServer(args.target, torch_threads=1, extra_args=["--runner", "torch", "--dtype", "float32"]) as cloud:
        yield cloud.url, f"127.0.0.1:{cloud.grpc_port}"


@contextlib.contextmanager
def maybe_delayed(url: str, rtt_ms: float) -> Iterator[str]:
    if rtt_ms <= 0:
        yield url
        return
    from urllib.parse import urlparse

    from bench.delay_proxy import DelayProxy

    u = urlparse(url)
    with DelayProxy(u.hostname or "127.0.0.1", u.port or 80, rtt_ms) as proxy:
        yield proxy.url


def configs(args: argparse.Namespace) -> list[tuple[str, dict[str, Any], Any]]:
    """(name, settings overrides, drafter factory)."""
    from edge.drafters import HybridDrafter, ModelDrafter, NGramDrafter

    draft = ModelDrafter(args.draft) if args.draft else None
    out: list[tuple[str, dict[str, Any], Any]] = [("cloud_only", {"mode": "cloud_only"}, None)]
    if draft is not None:
        out.append(("model drafter", {}, lambda: draft))
        out.append(("hybrid n-gram/model", {"hybrid": True},
                    lambda: HybridDrafter(draft, NGramDrafter(order=args.ngram_order), min_level=2)))
    out.append(("n-gram", {"draft": "ngram"}, lambda: NGramDrafter(order=args.ngram_order)))
    out.append((f"n-gram + filler top-{args.filler_top_k}", {"draft": "ngram", "filler_top_k": args.filler_top_k},
                lambda: NGramDrafter(order=args.ngram_order, filler_top_k=args.filler_top_k)))
    return out


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from edge.client import EdgeClient
    from edge.settings import EdgeSettings

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = load_prompts(args.n_prompts, args.prompt_chars)
    rows: list[Row] = []
    with cloud_endpoints(args) as (url, grpc), maybe_delayed(url, args.rtt_ms) as edge_url:
        for name, overrides, make_drafter in configs(args):
            values: dict[str, Any] = {
                "cloud_url": edge_url, "grpc_target": grpc if args.transport == "grpc" else None,
                "draft": str(args.draft) if args.draft else "ngram", "tokenizer": str(args.target),
                "temperature": args.temperature, "top_p": args.top_p, "repetition_penalty": args.repetition_penalty,
                "max_new_tokens": args.max_new_tokens, "timeout_ms": args.timeout_ms, "timeout_fallback": False,
                **overrides}
            s = EdgeSettings(**values)
            row = Row(name)
            for i, prompt in enumerate(prompts):
                client = EdgeClient(s, drafter=make_drafter() if make_drafter else None, tokenizer=tokenizer)
                t0 = time.perf_counter()
                result = client.generate(prompt, seed=args.seed + i)
                result.metrics.wall_ms = (time.perf_counter() - t0) * 1000
                row.add(result.metrics)
                client.close()
            rows.append(row)
    base = rows[0].wall_s
    return [r.summary(base) for r in rows]


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(summaries: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"target {args.target}  draft {args.draft or '-'}  transport {args.transport}  rtt {args.rtt_ms:g} ms  "
          f"T={args.temperature} top_p={args.top_p} rep={args.repetition_penalty}  "
          f"{args.n_prompts} prompts x {args.max_new_tokens} tokens")
    head = f"{'config':<24}{'mean La':>9}{'accept':>9}{'tok/call':>10}{'calls':>7}{'wall s':>9}{'vs cloud_only':>15}"
    print(head)
    print("-" * len(head))
    for s in summaries:
        print(f"{s['config']:<24}{fmt(s['mean_La'], '.2f'):>9}{fmt(s['accept_rate'], '.3f'):>9}"
              f"{fmt(s['tok_per_call'], '.2f'):>10}{s['cloud_calls']:>7}{s['wall_s']:>9.2f}"
              f"{fmt(s['speedup_vs_cloud_only'], '.2f'):>15}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specsplit-bench acceptance", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, default=REPO / "models" / "demo-target")
    p.add_argument("--draft", type=Path, default=REPO / "models" / "demo-draft",
                   help="draft model directory ('' to measure the n-gram drafter only)")
    p.add_argument("--cloud", help="REST URL of a running cloud (default: start one with --target)")
    p.add_argument("--grpc", help="gRPC target of that cloud")
    p.add_argument("--transport", choices=["rest", "grpc"], default="rest")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="emulated round-trip time (REST only)")
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--prompt-chars", type=int, default=600, help="keep the last N characters of each prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--repetition-penalty", type=float, default=1.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ngram-order", type=int, default=4)
    p.add_argument("--filler-top-k", type=int, default=4)
    p.add_argument("--timeout-ms", type=float, default=30_000)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the edge process")
    p.add_argument("--json", action="store_true", help="also print the summaries as JSON")
    args = p.parse_args(argv)
    if args.draft is not None and str(args.draft) in ("", "."):
        args.draft = None
    if args.transport == "grpc" and args.rtt_ms > 0:
        p.error("--rtt-ms works with the REST transport only")
    if args.transport == "grpc" and args.cloud and not args.grpc:
        p.error("--transport grpc with --cloud needs --grpc HOST:PORT")
    import torch

    torch.set_num_threads(args.threads)
    summaries = run(args)
    print_table(summaries, args)
    if args.json:
        print(json.dumps(summaries, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
