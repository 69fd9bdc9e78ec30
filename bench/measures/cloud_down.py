"""The OpenAI server with its cloud down: how long each of N concurrent requests takes to fail.

Runs `specsplit-edge serve`'s app in process (n-gram drafter, the demo tokenizer) against a port
nobody listens on, with the default retries, and prints each request's status and seconds.

    .venv/bin/specsplit-bench cloud-down --requests 6
"""

from __future__ import annotations

import argparse
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

from bench.cloud_proc import REPO


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specsplit-bench cloud-down", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=6)
    args = ap.parse_args(argv)
    # the edge (and torch under it) loads here, so `--help` answers at once
    from fastapi.testclient import TestClient

    from edge.server.openai_api import ServeOptions, create_app
    from edge.server.serve import build_engine
    from edge.settings import EdgeSettings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = EdgeSettings(cloud_url=f"http://127.0.0.1:{port}", draft="ngram",
                            tokenizer=str(REPO / "models" / "demo-target"))
    with TestClient(create_app(build_engine(settings), ServeOptions())) as client:
        def one(_: int) -> tuple[int, float]:
            t0 = time.perf_counter()
            r = client.post("/v1/completions", json={"model": "any", "prompt": "def f(x):", "max_tokens": 4})
            return r.status_code, round(time.perf_counter() - t0, 2)

        with ThreadPoolExecutor(args.requests) as pool:
            out = list(pool.map(one, range(args.requests)))
    print(json.dumps({"status_and_seconds": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
