"""Exactness over a slow link: the edge's default (adaptive deadline, no fallback) against the old
fixed 400 ms deadline with the lossy fallback, behind a proxy that adds a round trip.

For each setting: greedy text of `--new` tokens after each prompt, compared with the cloud's own
target-only greedy text (POST /v1/generate, no link delay), the share of tokens committed unverified,
verify timeouts, and wall time. Starts specsplit-cloud with the bundled demo target.

    .venv/bin/specsplit-bench slow-link --rtt-ms 600
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from bench.cloud_proc import REPO, CloudServer
from bench.delay_proxy import DelayProxy

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def push(self, x):\n"]


def run(url: str, cloud: str, drafter: Any, new: int, **kw: Any) -> dict[str, Any]:
    from edge.client import EdgeClient
    from edge.settings import EdgeSettings

    exact = unverified = emitted = timeouts = 0
    t0 = time.perf_counter()
    for prompt in PROMPTS:
        base: dict[str, Any] = dict(temperature=0, repetition_penalty=1.0, max_new_tokens=new, stop_at_eos=False,
                    draft=str(REPO / "models" / "demo-draft"))
        target = EdgeClient(EdgeSettings(cloud_url=cloud, mode="cloud_only", **base)).generate(prompt).token_ids
        try:
            r = EdgeClient(EdgeSettings(cloud_url=url, **base, **kw), drafter=drafter).generate(prompt)
        except Exception as e:  # the old setting may give up: that is part of the measurement
            return {"error": f"{type(e).__name__}: {e}"}
        exact += r.token_ids == target
        unverified += r.metrics.local_commits
        emitted += r.metrics.emitted
        timeouts += r.metrics.timeouts
    return {"texts_equal_to_target": f"{exact}/{len(PROMPTS)}", "unverified_share": round(unverified / emitted, 3),
            "verify_timeouts": timeouts, "wall_s": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specsplit-bench slow-link", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt-ms", type=float, default=600)
    ap.add_argument("--new", type=int, default=24)
    args = ap.parse_args(argv)
    from edge.drafters import ModelDrafter  # here: the edge (and torch under it) loads after `--help`

    drafter = ModelDrafter(REPO / "models" / "demo-draft")
    # one torch thread, the PyTorch runner in float32: the cloud the test suite starts by default
    with CloudServer(REPO / "models" / "demo-target", torch_threads=1,
                     extra_args=["--runner", "torch", "--dtype", "float32"]) as cloud:
        proxy = DelayProxy("127.0.0.1", cloud.http_port, args.rtt_ms).start()
        try:
            out = {"rtt_ms": args.rtt_ms,
                   "default": run(proxy.url, cloud.url, drafter, args.new),
                   "old: 400 ms + fallback": run(proxy.url, cloud.url, drafter, args.new, timeout_ms=400,
                                                 timeout_fallback=True)}
        finally:
            proxy.stop()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
