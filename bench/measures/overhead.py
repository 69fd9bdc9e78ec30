"""The verifier's own overhead per round, over REST and over gRPC, on loopback.

overhead = round latency seen by the client - prefill_ms (the target forward the server reports).
It is everything else a round costs: client and server (de)serialisation, HTTP/2 or HTTP/1.1 on
loopback, validation, the hand-off to the model thread, the shared processing and the verify rule.

Every round resends the same context (no request_id, so it is recomputed by crop-then-append),
so each forward covers the same 1 + k positions and rounds are comparable.

    .venv/bin/specsplit-bench overhead                       # starts specsplit-cloud itself
    .venv/bin/specsplit-bench overhead --cloud http://127.0.0.1:8000 --grpc 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import httpx

from bench.cloud_proc import REPO
from shared.hashing import ctx_hash
from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def local_cloud(model: Path, threads: int) -> Iterator[tuple[str, str, int]]:
    """specsplit-cloud on free loopback ports until the block ends: (REST URL, gRPC target, pid)."""
    http, grpc_port = _free_port(), _free_port()
    exe = Path(sys.executable).parent / "specsplit-cloud"
    cmd = [str(exe) if exe.exists() else sys.executable, *([] if exe.exists() else ["-m", "cloud.cli"]),
           "--model", str(model), "--http-port", str(http), "--grpc-port", str(grpc_port),
           "--torch-threads", str(threads), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{http}"
    try:
        for _ in range(1200):
            if proc.poll() is not None:
                raise SystemExit(f"specsplit-cloud exited: {proc.stderr.read().decode() if proc.stderr else ''}")
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield url, f"127.0.0.1:{grpc_port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def rest_round(url: str, prompt: list[int], draft: list[int]) -> Callable[[], float]:
    client = httpx.Client(base_url=url, timeout=30)
    ctx_id = client.post("/v1/sessions", json={"prompt_ids": prompt, "seed": 1}).json()["ctx_id"]
    body = {"ctx_id": ctx_id, "ctx_len": len(prompt), "ctx_hash": ctx_hash(prompt), "append_ids": [],
            "draft_tokens": draft, "q_token_probs": [1.0] * len(draft), "draft_kind": "deterministic",
            "k": len(draft)}

    def once() -> float:
        r = client.post("/v1/verify", json=body)
        r.raise_for_status()
        return float(r.json()["metrics"]["prefill_ms"])

    return once


def grpc_round(target: str, prompt: list[int], draft: list[int]) -> Callable[[], float]:
    stub = pb_grpc.VerifierStub(grpc.insecure_channel(target))
    info = stub.OpenSession(pb.OpenSessionRequest(prompt_ids=prompt, seed=1))
    req = pb.VerifyRequest(ctx_id=info.ctx_id, ctx_len=len(prompt), ctx_hash=ctx_hash(prompt), draft_tokens=draft,
                           q_token_probs=[1.0] * len(draft), draft_kind="deterministic", k=len(draft))

    def once() -> float:
        return float(stub.Verify(req, timeout=30).metrics.prefill_ms)

    return once


def healthz(url: str) -> Callable[[], float]:
    """GET /healthz on a kept-alive connection: no forward, so its latency is all transport."""
    client = httpx.Client(base_url=url, timeout=30)

    def once() -> float:
        client.get("/healthz").raise_for_status()
        return 0.0

    return once


def measure(once: Callable[[], float], rounds: int, warmup: int) -> dict[str, list[float]]:
    for _ in range(warmup):
        once()
    lat, pre = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        p = once()
        lat.append((time.perf_counter() - t0) * 1000.0)
        pre.append(p)
    return {"latency_ms": lat, "prefill_ms": pre, "overhead_ms": [a - b for a, b in zip(lat, pre, strict=True)]}


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specsplit-bench overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "demo-target")
    ap.add_argument("--cloud", help="REST URL of a running server (default: start one)")
    ap.add_argument("--grpc", help="gRPC HOST:PORT of the same running server")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of a started server")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer  # here, so `--help` answers at once

    ids = list(AutoTokenizer.from_pretrained(args.model).encode(PROMPT))
    draft = (ids * args.k)[: args.k]

    def run(url: str, target: str) -> dict[str, dict[str, list[float]]]:
        return {"healthz": measure(healthz(url), args.rounds, args.warmup),
                "rest": measure(rest_round(url, ids, draft), args.rounds, args.warmup),
                "grpc": measure(grpc_round(target, ids, draft), args.rounds, args.warmup)}

    if args.cloud and args.grpc:
        res = run(args.cloud, args.grpc)
    else:
        with local_cloud(args.model, args.threads) as (url, target, _):
            res = run(url, target)

    summary = {t: {m: {"p50": round(pct(v, 50), 3), "p95": round(pct(v, 95), 3)} for m, v in r.items()}
               for t, r in res.items()}
    if args.json:
        print(json.dumps({"rounds": args.rounds, "k": args.k, "prompt_len": len(ids), **summary}))
        return 0
    print(f"loopback, {args.rounds} rounds each, k = {args.k}, context {len(ids)} tokens, model {args.model.name}")
    print(f"{'transport':<10}{'latency p50/p95 ms':>22}{'prefill p50/p95 ms':>22}{'overhead p50/p95 ms':>23}")
    for t, s in summary.items():
        cells = [f"{s[m]['p50']:.2f} / {s[m]['p95']:.2f}" for m in ("latency_ms", "prefill_ms", "overhead_ms")]
        print(f"{t:<10}{cells[0]:>22}{cells[1]:>22}{cells[2]:>23}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
