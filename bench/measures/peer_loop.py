"""cloud_only against the peer a CPU user picks, per token: llama.cpp's own greedy decode loop of the coder
target's GGUF against the llama.cpp cloud's `/v1/generate` stream of the same prompts, one core each (the load on
core 0, the cloud on core 1). With `--profile` (py-spy installed), the cloud is sampled during a second pass
and the model thread's time is split: llama.cpp's decode, waiting for the next step, the rest. With
`--session-stream`, the same prompts are also streamed on open sessions (`POST /v1/sessions/{id}/stream`, the
target-only tokens an edge's speculate-or-stream asks for, one k = 0 verify round each) in turns with
`/v1/generate`, so the two per-token costs are compared in one run.

    specsplit-bench peer-loop [--prompts 3] [--tokens 64] [--profile] [--session-stream]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def stream(url: str, prompt: list[int], n_new: int) -> tuple[list[int], list[float]]:
    """One greedy /v1/generate stream: its tokens and the time each arrived."""
    import httpx

    body = {"prompt_ids": prompt, "sampling_cfg": {"temperature": 0.0}, "max_new_tokens": n_new, "stream": True,
            "stop_at_eos": False}
    out, times = [], []
    with httpx.stream("POST", f"{url}/v1/generate", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                d = json.loads(line[5:])
                if "token_id" in d:
                    out.append(int(d["token_id"]))
                    times.append(time.perf_counter())
    return out, times


def session_stream(url: str, prompt: list[int], n_new: int) -> tuple[list[int], list[float]]:
    """One greedy session: opened on the prompt, then one stream of n_new tokens on it; its tokens and the time
    each arrived (the open's prefill is not timed: the first token's time is the start)."""
    import httpx

    from shared.hashing import ctx_hash

    with httpx.Client(base_url=url, timeout=600) as c:
        sid = c.post("/v1/sessions", json={"prompt_ids": prompt, "sampling_cfg": {"temperature": 0.0}}).json()["ctx_id"]
        body = {"ctx_len": len(prompt), "ctx_hash": ctx_hash(prompt), "max_new_tokens": n_new, "stop_at_eos": False}
        out, times = [], []
        try:
            with c.stream("POST", f"/v1/sessions/{sid}/stream", json=body) as r:
                event = "message"
                for line in r.iter_lines():
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:") and event == "message":
                        out.append(int(json.loads(line[5:])["token_id"]))
                        times.append(time.perf_counter())
        finally:
            c.delete(f"/v1/sessions/{sid}")
    return out, times


def rate(runs: list[tuple[list[int], list[float]]]) -> float:
    """Tokens per second over runs, each from its first token's arrival to its last's."""
    tokens = sum(len(t) - 1 for _, t in runs)
    return tokens / sum(t[-1] - t[0] for _, t in runs)


def model_thread_split(raw: Path) -> dict[str, float]:
    """Shares of the model thread's samples (py-spy raw output): llama.cpp's decode, idle, the rest."""
    split: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack.split(";")[0].endswith(": model"):
            continue
        part = "decode" if "_decode_one" in stack else "waiting" if "Condition.wait" in stack else "python"
        split[part] += int(n)
    total = sum(split.values()) or 1
    return {k: split[k] / total for k in ("decode", "waiting", "python")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="specsplit-bench peer-loop", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--profile", action="store_true", help="sample the cloud with py-spy during a second pass")
    p.add_argument("--cloud-arg", action="append", default=[], metavar="ARG",
                   help="one more specsplit-cloud argument (repeat it), e.g. --cloud-arg=--no-batch-invariant")
    p.add_argument("--session-stream", action="store_true",
                   help="also stream the prompts on open sessions, in turns with /v1/generate")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from bench.cloud_proc import CloudServer
    from bench.cloud_runner import plain_decode
    from bench.coder_pair import TARGET, cpu_info, humaneval_message, humaneval_prompts, pin
    from bench.real_pair import chat_ids

    machine = {**cpu_info(), "load_start": os.getloadavg(), "pinned": pin("self", 0)}
    tok = AutoTokenizer.from_pretrained(TARGET)
    ids = [chat_ids(tok, humaneval_message(q["prompt"])) for q in humaneval_prompts(args.prompts)]
    peer = plain_decode(TARGET / "model.gguf", ids, args.tokens)
    res: dict[str, Any] = {"machine": machine, "cloud_args": args.cloud_arg, "peer_tokens_per_s": peer["tokens_per_s"]}
    with CloudServer(TARGET, torch_threads=1, extra_args=["--runner", "llamacpp", *args.cloud_arg],
                     startup_timeout_s=600.0) as cloud:
        machine["pinned"] = machine["pinned"] and pin(cloud.pid, 1)
        stream(cloud.url, ids[0][:20], 4)  # warm
        tokens, seconds, texts = 0, 0.0, []
        for prompt in ids:
            out, times = stream(cloud.url, prompt, args.tokens)
            texts.append(out)
            tokens, seconds = tokens + len(times) - 1, seconds + times[-1] - times[0]
        res["cloud_only_tokens_per_s"] = tokens / seconds
        res["equal"] = sum(a == b for a, b in zip(texts, peer["texts"], strict=True))
        if args.session_stream:  # in turns, three passes each: a drift of the machine falls on both alike
            gen: list[tuple[list[int], list[float]]] = []
            ses: list[tuple[list[int], list[float]]] = []
            for _ in range(3):
                for prompt in ids:
                    gen.append(stream(cloud.url, prompt, args.tokens))
                    ses.append(session_stream(cloud.url, prompt, args.tokens))
            res["generate_tokens_per_s"], res["session_stream_tokens_per_s"] = rate(gen), rate(ses)
            res["session_stream_over_generate"] = rate(ses) / rate(gen)
            res["session_stream_equal"] = sum(a[0] == b[0] for a, b in zip(ses, gen, strict=True))
        if args.profile and shutil.which("py-spy"):
            raw = Path(tempfile.mkdtemp()) / "cloud.txt"
            spy = subprocess.Popen(["py-spy", "record", "-p", str(cloud.pid), "-o", str(raw), "-f", "raw", "-r", "200",
                                    "--threads", "--idle", "-d", str(max(5, int(seconds * 0.9)))])
            time.sleep(1)
            for prompt in ids:
                stream(cloud.url, prompt, args.tokens)
            spy.wait()
            res["model_thread"] = model_thread_split(raw)
    res["ratio"] = res["cloud_only_tokens_per_s"] / res["peer_tokens_per_s"]
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
