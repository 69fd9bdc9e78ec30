"""One session over a slow link: the edge's defaults (speculate or stream) against the cloud's own streaming.

    python -m bench.slow_link [--rtts 0,50,100] [--tokens 64] [--prompts 3] [--out BENCHMARKS.md]

The real pair (SmolLM2-135M-Instruct, the edge's default drafts), greedy, the first chat prompts of
bench/real_pair.py, through our delay proxy (bench/delay_proxy.py: half the round trip each way). Per round
trip, one client per way, its drafts loaded and the cloud's model info read before the first prompt:
- cloud_only: the cloud's own streamed `/v1/generate` (one request for the whole text);
- defaults: speculation with the switch to streaming on the session (edge/policy/stream.py, objective latency);
- `--objective cloud`: the switch minimising the cloud's forward time per token;
- `--no-stream-switch`: speculation alone (what the defaults were before the switch).
Decode tokens/s: the tokens after the first over the time after the first, summed over the prompts (the first
token is the prompt's prefill, which the prefix cache may share between ways). Cloud CPU-ms per token: the
cloud process's CPU time (/proc) over the way's run, per generated token (one session: no batching). Every
way's texts are checked against cloud_only's. The section is spliced between the slow-link markers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from bench.cloud_proc import REPO, CloudServer
from bench.collectors import cpu_seconds
from bench.delay_proxy import DelayProxy

TARGET = REPO / "models" / "smollm2-135m-instruct"
START, END = "<!-- slow-link:start -->", "<!-- slow-link:end -->"
WAYS: dict[str, dict[str, Any]] = {"cloud_only": {"mode": "cloud_only"}, "defaults": {},
                                   "objective cloud": {"objective": "cloud"},
                                   "no stream switch": {"stream_switch": False}}


def one_way(url: str, cloud_pid: int, tokenizer: Any, prompts: list[str], n_new: int, way: dict[str, Any]) -> dict[str, Any]:
    from bench.real_pair import chat_ids
    from edge.client import EdgeClient
    from edge.settings import EdgeSettings

    s = EdgeSettings(cloud_url=url, temperature=0, max_new_tokens=n_new, seed=1, timeout_ms=120_000,
                     stop_at_eos=False, **way)
    client = EdgeClient(s, tokenizer=tokenizer)
    client.model_info()
    if s.mode != "cloud_only":
        _ = client.drafter
    toks = ms = calls = emitted = streamed = switches = 0.0
    texts = []
    cpu0 = cpu_seconds(cloud_pid)
    for text in prompts:
        r = client.generate(chat_ids(tokenizer, text))
        texts.append(r.token_ids)
        toks += len(r.token_ids) - 1
        ms += r.metrics.wall_ms - r.metrics.ttft_ms
        emitted += len(r.token_ids)
        calls += r.metrics.cloud_calls
        streamed += r.metrics.streamed
        switches += r.metrics.switches
    cpu = cpu_seconds(cloud_pid) - cpu0
    client.close()
    return {"tokens_per_s": toks / ms * 1000, "tokens_per_call": emitted / max(calls, 1), "streamed": int(streamed),
            "emitted": int(emitted), "switches": int(switches), "cloud_cpu_ms_per_token": cpu * 1000 / emitted,
            "texts": texts}


def run(rtts: list[int], n_new: int, n_prompts: int) -> list[dict[str, Any]]:
    from transformers import AutoTokenizer

    from bench.real_pair import PROMPTS

    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    rows = []
    with CloudServer(TARGET, torch_threads=1, extra_args=["--runner", "torch"]) as cloud:
        for rtt in rtts:
            with DelayProxy("127.0.0.1", cloud.http_port, rtt_ms=rtt) as proxy:
                base: dict[str, Any] | None = None
                for name, way in WAYS.items():
                    r = one_way(proxy.url, cloud.pid, tokenizer, PROMPTS[:n_prompts], n_new, way)
                    base = base or r
                    r.update(rtt_ms=rtt, way=name, same_text=r["texts"] == base["texts"])
                    rows.append(r)
                    print(f"slow-link: rtt {rtt} ms, {name}: {r['tokens_per_s']:.2f} decode tok/s, "
                          f"{r['streamed']}/{r['emitted']} streamed, {r['switches']} switches, "
                          f"{r['cloud_cpu_ms_per_token']:.1f} cloud CPU-ms/token", flush=True)
    return rows


def render(rows: list[dict[str, Any]], command: str, load: str, n_new: int, n_prompts: int) -> str:
    lines = [START, "### One session over a slow link: speculate or stream (real pair, greedy)", "",
             f"Command: `{command}` ({load}). {n_prompts} chat prompts of `bench/real_pair.py`, {n_new} tokens each, "
             "cloud and edge one torch thread each on this 2-core CPU, our delay proxy between them. Decode "
             "tokens/s over the tokens after the first; cloud CPU-ms per token of the cloud process over the "
             "way's run (one session).", "",
             "| RTT | way | decode tok/s | / cloud_only (aim >= 0.95x at 50 and 100 ms) | tokens streamed / all | "
             "switches | tokens per cloud call | cloud CPU-ms per token | text = cloud_only's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(b for b in rows if b["rtt_ms"] == r["rtt_ms"] and b["way"] == "cloud_only")
        lines.append(f"| {r['rtt_ms']} ms | {r['way']} | {r['tokens_per_s']:.2f} | "
                     f"**{r['tokens_per_s'] / base['tokens_per_s']:.2f}x** | {r['streamed']} / {r['emitted']} | "
                     f"{r['switches']} | {r['tokens_per_call']:.2f} | {r['cloud_cpu_ms_per_token']:.1f} | "
                     f"{'yes' if r['same_text'] else 'NO'} |")
    return "\n".join(lines + ["", END])


def splice(section: str, out: Path) -> None:
    text = out.read_text() if out.exists() else ""
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    out.write_text(text)


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtts", default="0,50,100", help="round trips in ms, comma-separated")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--out", type=Path, default=REPO / "BENCHMARKS.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if not (TARGET / "model.safetensors").is_file():
        print(f"{TARGET} is missing: run `specsplit-models prepare smollm2` (scripts/setup.sh does it)")
        return 2
    load = f"load average {os.getloadavg()[0]:.2f} at the start"
    rows = run([int(x) for x in args.rtts.split(",")], args.tokens, args.prompts)
    load += f", {os.getloadavg()[0]:.2f} at the end"
    command = "python -m bench.slow_link " + " ".join(argv if argv is not None else sys.argv[1:])
    splice(render(rows, command.strip(), load, args.tokens, args.prompts), args.out)
    print(f"wrote the slow-link section into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
