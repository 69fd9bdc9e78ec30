"""The coder pair, one session at 0 ms: cloud_only against the edge's defaults and against the defaults without
speculate-or-stream, on the coder-pair bench's HumanEval prompts: decode tokens/s, tokens per verify call,
tokens streamed and the cloud's CPU-seconds per token, in one run (edge and cloud one core each); then each session's
first speculate-or-stream decision and the edge's reading behind it (edge/policy/stream.py). Before its timed
prompts, each mode generates once, untimed, from the next HumanEval prompt with a client of its own: the draft's
and the cloud's first forwards of a shape are paid there, not by whichever mode runs first.

    nice -n 19 .venv/bin/specsplit-bench stream-switch [PROMPTS] [NEW_TOKENS] [RUNNER]

RUNNER is the cloud's `--runner` (auto, the default: llama.cpp where its GGUF and llama-cpp-python are at hand;
torch; llamacpp).
"""

from __future__ import annotations

import argparse
import os


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specsplit-bench stream-switch", description=__doc__.split("\n\n")[0])
    ap.add_argument("prompts", nargs="?", type=int, default=6, metavar="PROMPTS",
                    help="HumanEval prompts (default 6)")
    ap.add_argument("new_tokens", nargs="?", type=int, default=96, metavar="NEW_TOKENS",
                    help="new tokens per prompt (default 96)")
    ap.add_argument("runner", nargs="?", default="auto", metavar="RUNNER",
                    help="the cloud's --runner: auto, torch or llamacpp (default auto)")
    args = ap.parse_args(argv)
    prompts, n_new, runner = args.prompts, args.new_tokens, args.runner
    # torch, the coder pair and the edge load here, so `--help` answers at once
    import torch
    from transformers import AutoTokenizer

    from bench.cloud_proc import CloudServer
    from bench.coder_pair import (
        TARGET,
        client_for,
        cpu_info,
        cpu_seconds,
        humaneval_message,
        humaneval_prompts,
        pin,
        settings,
        summary,
        tally,
    )
    from bench.real_pair import chat_ids
    from edge.client import EdgeClient

    torch.set_num_threads(1)
    pin("self", 0)
    tok = AutoTokenizer.from_pretrained(TARGET)
    *ids, warm = [chat_ids(tok, humaneval_message(p["prompt"])) for p in humaneval_prompts(prompts + 1)]
    drafter = EdgeClient(settings("http://127.0.0.1:1", n_new)).drafter
    print(f"{cpu_info()}; load average {os.getloadavg()[0]:.2f} at the start; the cloud's --runner {runner}")
    with CloudServer(TARGET, torch_threads=1, extra_args=["--runner", runner], startup_timeout_s=600.0) as cloud:
        pin(cloud.pid, 1)
        base: dict[str, float] = {}
        for name, kw in (("cloud_only", {"mode": "cloud_only"}), ("defaults", {}),
                         ("defaults without streaming", {"stream_switch": False})):
            cfg = settings(cloud.url, n_new, temperature=0.0, **kw)
            w = client_for(cfg, tok, drafter)  # untimed: the first forwards of this mode's shapes
            w.generate(warm)
            w.close()
            c = client_for(cfg, tok, drafter)
            c0 = cpu_seconds(cloud.pid)
            t = tally(c, ids)
            s = summary(t)
            cpu = cpu_seconds(cloud.pid) - c0
            c.close()
            base = base or {"rate": s["tokens_per_s"], "ttft": s["ttft_ms"]}
            per_verify = f"{s['tokens_per_verify']:.2f}" if s["tokens_per_verify"] else "-"
            print(f"{name}: {s['tokens_per_s']:.2f} decode tok/s ({s['tokens_per_s'] / base['rate']:.3f}x cloud_only), "
                  f"first token {s['ttft_ms']:.0f} ms median ({s['ttft_ms'] / base['ttft']:.3f}x), {per_verify} tokens "
                  f"per verify call, {s['streamed']} streamed ({s['switches']} switches), "
                  f"{cpu / s['tokens']:.3f} cloud CPU-s per token; first tokens "
                  f"{', '.join(f'{ms:.0f}' for ms in t['ttft_ms'])} ms", flush=True)
            if name != "cloud_only":  # each session's first decision, as the edge reasoned it
                for i, (way, note) in enumerate(t["starts"]):
                    print(f"  prompt {i}: started {way or '-'}: {note or '-'}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
