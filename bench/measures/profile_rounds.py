"""Where a verify round's time goes inside the cloud: py-spy samples of a live `specsplit-cloud`.

One server (the demo target by default, one torch thread), `--sessions` clients each sending the
same k = `--k` greedy round again and again (as `specsplit-bench overhead`) over REST or gRPC for
`--seconds`, while py-spy samples every thread of the server (`--nonblocking`, so the server is not
paused). Each sample is charged to the first category its stack matches, innermost frame first:

    forward      the target's forward (shared/kvpool.py KVPool.forward)
    processing   the sampling processing (shared/sampling.py)
    verify       the verify rule and residuals (shared/verify.py)
    round        the rest of the round on the model thread (cloud/engine.py, scheduler.py, session)
    rest         the REST boundary (cloud/rest.py, starlette, uvicorn, h11, pydantic, json)
    grpc         the gRPC boundary (cloud/grpc_server.py, grpc, protobuf)
    loop         the event loop itself (asyncio) and the hand-off to the model thread
    other        anything else

and printed as milliseconds of CPU per round (samples / rate / rounds). Needs py-spy
(`.venv/bin/pip install py-spy`; it reads the server's memory by ptrace).

    .venv/bin/specsplit-bench profile-rounds --transport grpc --sessions 1
    .venv/bin/specsplit-bench profile-rounds --transport rest --sessions 16 --top 15
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from bench.cloud_proc import REPO
from bench.measures.overhead import PROMPT, grpc_round, local_cloud, rest_round

# innermost match wins: (category, pattern over "function (file:line)")
CATEGORIES = [
    ("forward", re.compile(r"forward \(.*shared/kvpool\.py")),
    ("processing", re.compile(r"shared/sampling\.py")),
    ("verify", re.compile(r"shared/verify\.py|shared/rng\.py")),
    ("round", re.compile(r"cloud/(engine|scheduler|session|store)\.py|shared/(kvpool|blocks|hashing)\.py")),
    ("rest", re.compile(r"cloud/rest|starlette|uvicorn|h11|pydantic|json|httptools|fastapi")),
    ("grpc", re.compile(r"cloud/grpc_server|grpc|protobuf|_pb2")),
    ("loop", re.compile(r"asyncio|selectors|concurrent/futures|threading\.py")),
]
ORDER = [c for c, _ in CATEGORIES] + ["other"]


def category(frames: list[str]) -> str:
    """The category of one stack (outermost first): the first pattern, in CATEGORIES order, that any
    frame matches, scanning frames innermost first within each pattern."""
    for name, pat in CATEGORIES:
        if any(pat.search(f) for f in reversed(frames)):
            return name
    return "other"


def read_raw(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw (collapsed) output: 'frame;frame;... count' per line."""
    out = []
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if stack:
            out.append((stack.split(";"), int(n)))
    return out


class Load:
    """`sessions` threads sending rounds until `stop`; counts the rounds answered."""

    def __init__(self, rounds_of: Callable[[], Callable[[], float]], sessions: int) -> None:
        self.done, self.halt = 0, threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(rounds_of,)) for _ in range(sessions)]
        for t in self.threads:
            t.start()

    def _run(self, rounds_of: Callable[[], Callable[[], float]]) -> None:
        once = rounds_of()
        while not self.halt.is_set():
            once()
            with self.lock:
                self.done += 1

    def stop(self) -> None:
        self.halt.set()
        for t in self.threads:
            t.join()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specsplit-bench profile-rounds", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "demo-target")
    ap.add_argument("--transport", choices=["rest", "grpc"], default="grpc")
    ap.add_argument("--sessions", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=0, help="also print the N costliest innermost frames")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer  # here, so `--help` answers at once

    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        raise SystemExit("specsplit-bench profile-rounds: py-spy not found: .venv/bin/pip install py-spy")
    tok = AutoTokenizer.from_pretrained(args.model)
    prompt = tok(PROMPT)["input_ids"]
    draft = tok(" fibonacci(n - 1) + fibonacci(n - 2)")["input_ids"][: args.k]
    with local_cloud(args.model, 1) as (url, target, pid), tempfile.TemporaryDirectory() as tmp:
        make = (lambda: rest_round(url, prompt, draft)) if args.transport == "rest" else (
            lambda: grpc_round(target, prompt, draft))
        load = Load(make, args.sessions)
        time.sleep(3)  # warm-up
        raw = Path(tmp) / "raw.txt"
        n0, t0 = load.done, time.perf_counter()
        rec = subprocess.run([spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--nonblocking",
                              "--format", "raw", "--output", str(raw), "--duration", str(int(args.seconds))],
                             capture_output=True, timeout=args.seconds + 60)
        rate = (load.done - n0) / (time.perf_counter() - t0)  # rounds per second, steady
        load.stop()
        if rec.returncode != 0:
            raise SystemExit(f"py-spy failed: {rec.stderr.decode()}")
        stacks = read_raw(raw)
        rounds = rate * int(args.seconds)  # rounds answered while py-spy sampled
    per = Counter[str]()
    inner = Counter[str]()
    for frames, n in stacks:
        per[category(frames)] += n
        inner[frames[-1]] += n
    total = sum(per.values())
    ms = 1000.0 / args.rate / max(rounds, 1)
    print(f"{args.transport}, {args.sessions} session(s), k = {args.k}: {rate:.0f} rounds/s, {total} samples "
          f"at {args.rate} Hz (CPU ms per round, share of the server's busy samples)")
    for c in ORDER:
        print(f"  {c:<11} {per[c] * ms:7.3f} ms  {100.0 * per[c] / max(total, 1):5.1f} %")
    print(f"  {'total':<11} {total * ms:7.3f} ms")
    if args.top:
        print("costliest innermost frames:")
        for f, n in inner.most_common(args.top):
            print(f"  {n * ms:7.3f} ms  {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
