"""`specsplit-bench --only real-pair`: the real default pair on this machine, in one run.

    specsplit-bench --only real-pair [--out BENCHMARKS.md]

The target is SmolLM2-135M-Instruct (models/smollm2-135m-instruct, made by scripts/setup.sh); the drafts
are the attention head (research/models/smollm2-135m-attention-head, fed the target's states at every committed
position) when present, the feature-fed head (research/models/smollm2-135m-head, fed one state a round), the distilled
tokens-only draft (models/smollm2-135m-draft), the tokens-only draft cut from the target when present
(models/smollm2-135m-draft-from-target) and the n-gram drafter. All measured in this run, cloud and
edge one torch thread each, on chat prompts no draft saw in training:
1. costs: the target's forward time by new tokens per forward (1..17, KV cache, context ~200), and each
   draft's time per drafted token (its `propose` over 8 tokens, output layer included), against the
   target's per-token time at batch 1.
2. speculation at a fixed shape (no drafting ahead, the real cloud over REST): tokens per verify call for
   chains of k = 2, 4, 6, 8 and token trees of 4 to 32 nodes (greedy), acceptance by draft position (by
   depth for trees), chains and trees at T = 0.7, uplink and downlink bytes per round.
3. Spec-Bench (bench/specbench/questions.jsonl, 5 questions in each of 6 categories): tokens per verify
   call by category, the head's chain of k = 6 against its trees (the edge's automatic node count), greedy.
4. end to end: one session, the edge's defaults against cloud_only (the cloud's own streamed
   /v1/generate), greedy, at 0 / 10 / 50 ms round trip (a delay proxy).
The section is spliced into OUT between the real-pair markers.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.cloud_proc import REPO, CloudServer
from bench.delay_proxy import DelayProxy

TARGET = REPO / "models" / "smollm2-135m-instruct"
DRAFT = REPO / "models" / "smollm2-135m-draft"
# the tokens-only draft cut from the target (research/scripts/train_heads.py draft-export), measured when present
CUT = REPO / "models" / "smollm2-135m-draft-from-target"
# the heads fed the target's states (research/heads/, research/README.md), measured when present: the one-state
# feature-fed head, and the head that attends over the target's past states
HEAD = REPO / "research" / "models" / "smollm2-135m-head"
ATTN = REPO / "research" / "models" / "smollm2-135m-attention-head"
KS = (2, 4, 6, 8)
START, END = "<!-- real-pair:start -->", "<!-- real-pair:end -->"
# Chat prompts outside the distillation's templates and topics (scripts/distill_draft.py).
PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "What should I pack for a three-day hiking trip?",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "How does a refrigerator keep food cold?",
    "Write a SQL query that finds the ten best-selling products.",
    "Give me advice for my first job interview.",
    "Write a Python function that checks whether a list is sorted.",
    "Why do leaves change colour in autumn?",
]
NEW_TOKENS = (1, 2, 3, 5, 9, 17, 25, 33)
# token trees measured at a fixed node count (greedy), and at T = 0.7
TREES = (4, 8, 16, 32)
TREE_T07 = 16
SPECBENCH = REPO / "bench" / "specbench" / "questions.jsonl"
RTTS_MS = (0, 10, 50, 100)


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def forward_ms(model: Any, ctx: list[int], n_new: int, repeats: int = 7) -> float:
    """Median ms of one forward over n_new tokens after ctx is cached (the cache is cropped back each time)."""
    from transformers import DynamicCache

    from shared.kvpool import cache_kwarg

    with torch.no_grad():
        cache = DynamicCache()
        model(input_ids=torch.tensor([ctx]), use_cache=True, **{cache_kwarg(model): cache})
        new = torch.tensor([ctx[-n_new:]])  # [1, n_new]: any ids; the cost depends on the count only
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(input_ids=new, use_cache=True, **{cache_kwarg(model): cache})
            times.append((time.perf_counter() - t0) * 1000)
            cache.crop(-n_new)  # remove the n_new tokens just added
    return statistics.median(times)


def draft_ms_per_token(drafter: Any, ctx: list[int], k: int = 8, repeats: int = 5) -> float:
    """Median ms per drafted token of `drafter.propose(ctx, k)` (greedy), after a first call that syncs its state."""
    from shared.config import SamplingConfig

    cfg = SamplingConfig(temperature=0)
    drafter.propose(ctx, k, cfg, 0)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        drafter.propose(ctx, k, cfg, 0)
        times.append((time.perf_counter() - t0) * 1000 / k)
    return statistics.median(times)


def costs(target: Any, ctx: list[int]) -> dict[str, Any]:
    from edge.drafters import ModelDrafter
    from research.heads.feature_head import FeatureDrafter, FeatureHead
    from shared.cpu_weights import pack_weights

    plain = {n: forward_ms(target, ctx, n) for n in NEW_TOKENS}  # plain weights: torch's Linear calls MKL
    pack_weights(target)  # the form the cloud and the edge keep them in on the CPU (shared/cpu_weights.py)
    rows = {n: forward_ms(target, ctx, n) for n in NEW_TOKENS}
    model = ModelDrafter(DRAFT)
    drafts = {"distilled draft": draft_ms_per_token(model, ctx)}
    if CUT.is_dir():
        drafts["draft from the target"] = draft_ms_per_token(ModelDrafter(CUT), ctx)
    with torch.no_grad():
        hidden = target.model(input_ids=torch.tensor([ctx])).last_hidden_state[0]  # [n, d]: state i after ctx[:i + 1]
    if HEAD.is_dir():
        head = FeatureDrafter(FeatureHead.load(HEAD), None)
        head.set_feature(ctx, hidden[-1])
        drafts["feature-fed head"] = draft_ms_per_token(head, ctx)
    if ATTN.is_dir():
        from research.heads.attention_drafter import AttentionDrafter
        from research.heads.attention_head import AttentionHead

        attn = AttentionDrafter(AttentionHead.load(ATTN), None)
        w = min(attn.states_window, len(ctx))
        attn.set_states(ctx, len(ctx) - w + 1, hidden[-w:])
        drafts["attention head"] = draft_ms_per_token(attn, ctx)
    return {"target_ms": rows, "target_ms_plain": plain, "draft_ms": drafts}


def default_head() -> str:
    """The attention head when the repository holds it, else "" (no head)."""
    return str(ATTN) if ATTN.is_dir() else ""


def head_choice(head: str) -> Any:
    """The edge's states hook for the head directory `head` (research.heads.HeadChoice), None for "" or "none"."""
    if head in ("", "none"):
        return None
    from research.heads import HeadChoice

    return HeadChoice(head)


def run_session(settings: Any, tokenizer: Any, text: str, states_drafting: Any = None) -> Any:
    from edge.client import EdgeClient

    client = EdgeClient(settings, tokenizer=tokenizer, states_drafting=states_drafting)
    return client.generate(chat_ids(tokenizer, text))


def drafts(only: tuple[str, ...] = ()) -> dict[str, tuple[dict[str, Any], str]]:
    """The settings and head directory ("": none) of each draft measured (those present, and of `only` when
    given); a head falls back on the edge's default tokens-only draft."""
    from edge.settings import default_draft

    every = {"attention head": ({"draft": default_draft()}, str(ATTN), ATTN.is_dir()),
             "feature-fed head": ({"draft": default_draft()}, str(HEAD), HEAD.is_dir()),
             "distilled draft": ({"draft": str(DRAFT)}, "", True),
             "draft from the target": ({"draft": str(CUT)}, "", CUT.is_dir()),
             "n-gram": ({"draft": "ngram", "tokenizer": str(DRAFT)}, "", True)}
    return {name: (where, head) for name, (where, head, present) in every.items()
            if present and (not only or name in only)}


def fixed_k(cloud_url: str, tokenizer: Any, n_new: int, prompts: list[str],
            only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Per draft, a fixed shape, no drafting ahead: greedy chains at k in KS and trees of TREES nodes under the
    edge's default repetition penalty, greedy at k = 6 without a penalty (pure greedy: the target's own
    argmax), and T = 0.7 at k = 6 and with trees of TREE_T07 nodes. Shapes: ("chain", k) or ("tree", n)."""
    from edge.settings import EdgeSettings

    penalty = EdgeSettings.model_fields["repetition_penalty"].default
    cases = ([(0.0, penalty, "chain", k) for k in KS] + [(0.0, penalty, "tree", n) for n in TREES]
             + [(0.0, 1.0, "chain", 6), (0.7, penalty, "chain", 6), (0.7, penalty, "tree", TREE_T07)])
    rows = []
    for name, (where, head) in drafts(only).items():
        hook = head_choice(head)
        for temp, rep, shape, k in cases:
            if shape == "tree" and name == "n-gram":  # the n-gram drafter grows no trees
                continue
            # k drafts and a bonus (the standard round; the checked last draft is off here), or a tree of k nodes
            fixed: dict[str, Any] = {"fixed_k": k, "tree": "off"} if shape == "chain" else {"tree": str(k), "tree_max_nodes": k}
            s = EdgeSettings(cloud_url=cloud_url, temperature=temp, max_new_tokens=n_new, seed=1,
                             draft_ahead=False, timeout_ms=120_000, stop_at_eos=False, check_last=False,
                             repetition_penalty=rep, stream_switch=False, **fixed, **where)
            rows.append(measure(s, tokenizer, prompts, {"draft": name, "temperature": temp, "penalty": rep,
                                                        "shape": shape, "k": k}, hook))
            r = rows[-1]
            print(f"real-pair: {name}, T={temp}, penalty {rep}, {shape} {k}: {r['tokens_per_call']:.2f} tokens/call, "
                  f"acceptance {r['acceptance']:.3f}", flush=True)
    return rows


def measure(s: Any, tokenizer: Any, prompts: list[str], row: dict[str, Any], states_drafting: Any = None) -> dict[str, Any]:
    """Totals of one setting over the prompts: tokens per verify call, acceptance, by position (depth), bytes."""
    tot: dict[str, Any] = {"emitted": 0, "verify": 0, "drafted": 0, "accepted": 0, "down": 0, "up": 0,
                           "pos_d": [], "pos_a": [], "feature": 0, "nodes": 0, "copy": 0, "copy_acc": 0,
                           "open_down": 0, "opens": 0}
    for text in prompts:
        m = run_session(s, tokenizer, text, states_drafting).metrics
        for key, v in (("emitted", m.emitted), ("verify", m.verify_calls), ("drafted", m.drafted),
                       ("accepted", m.accepted), ("down", m.bytes_down), ("up", m.bytes_up),
                       ("feature", m.feature_bytes), ("nodes", m.tree_nodes), ("copy", m.copy_nodes),
                       ("copy_acc", m.copy_accepted), ("open_down", m.open_bytes_down), ("opens", 1 + m.reopens)):
            tot[key] += v
        for i, (d, a) in enumerate(zip(m.position_drafted, m.position_accepted, strict=True)):
            if i == len(tot["pos_d"]):
                tot["pos_d"].append(0)
                tot["pos_a"].append(0)
            tot["pos_d"][i] += d
            tot["pos_a"][i] += a
    calls = max(tot["verify"], 1)
    return {**row, "tokens_per_call": tot["emitted"] / calls,
            "acceptance": tot["accepted"] / max(tot["drafted"], 1),
            "by_position": [a / d if d else 0.0 for a, d in zip(tot["pos_a"], tot["pos_d"], strict=True)][:8],
            "down_bytes_per_round": (tot["down"] - tot["open_down"]) / calls, "up_bytes_per_round": tot["up"] / calls,
            "open_down_bytes": tot["open_down"] / max(tot["opens"], 1),
            "feature_bytes_per_round": tot["feature"] / calls, "nodes_per_round": tot["nodes"] / calls,
            "copy_nodes_per_round": tot["copy"] / calls, "copy_accepted_per_round": tot["copy_acc"] / calls}


def specbench(cloud_url: str, tokenizer: Any, n_new: int, head: str = "") -> list[dict[str, Any]]:
    """Tokens per verify call on the Spec-Bench subset by category: the head's (`head`, default the edge's
    default head) chain of k = 6 against its automatic trees, with copy branches (the default) and without
    (greedy, the edge's default penalty, no drafting ahead)."""
    import json

    from edge.settings import EdgeSettings, default_draft

    hook = head_choice(head or default_head())
    questions = [json.loads(line) for line in SPECBENCH.read_text().splitlines() if line.strip()]
    by_cat: dict[str, list[str]] = {}
    for q in questions:
        by_cat.setdefault(q["category"], []).append(q["turns"][0])
    rows = []
    shapes: list[tuple[str, dict[str, Any]]] = [("chain", {"fixed_k": 6, "tree": "off"}),
                                                ("tree, no copy", {"tree": "auto", "tree_copy": False}),
                                                ("tree", {"tree": "auto"})]
    for shape, fixed in shapes:
        s = EdgeSettings(cloud_url=cloud_url, temperature=0, max_new_tokens=n_new, seed=1, draft_ahead=False,
                         timeout_ms=120_000, stop_at_eos=False, check_last=False, draft=default_draft(), stream_switch=False,
                         **fixed)
        for cat, texts in by_cat.items():
            rows.append(measure(s, tokenizer, texts, {"category": cat, "shape": shape, "prompts": len(texts)}, hook))
            print(f"real-pair: spec-bench {cat}, {shape}: {rows[-1]['tokens_per_call']:.2f} tokens/call", flush=True)
    return rows


def one_client(url: str, tokenizer: Any, mode: Any, texts: list[str], n_new: int, head: str = "") -> dict[str, Any]:
    """One greedy client of `mode` over the chat `texts`, its drafts loaded and the cloud's model info read before
    the first prompt, as a server or a CLI run holds them: sums over the prompts of decode tokens and ms (the
    tokens after the first over the time after the first: a generation's own clock, `metrics.wall_ms -
    metrics.ttft_ms`), tokens, cloud and verify calls, tokens streamed, switches; and the texts."""
    from edge.client import EdgeClient
    from edge.settings import EdgeSettings

    s = EdgeSettings(cloud_url=url, temperature=0, max_new_tokens=n_new, seed=1, mode=mode, timeout_ms=120_000,
                     stop_at_eos=False)
    hook = head_choice(head or default_head())
    client = EdgeClient(s, tokenizer=tokenizer, states_drafting=hook)
    client.model_info()
    if mode != "cloud_only":
        _ = client.drafter, hook.head() if hook is not None else None
    t: dict[str, Any] = {"decode_tokens": 0, "decode_ms": 0.0, "emitted": 0, "calls": 0, "verify": 0, "streamed": 0,
                         "switches": 0, "texts": []}
    for text in texts:
        r = client.generate(chat_ids(tokenizer, text))
        m = r.metrics
        for key, v in (("decode_tokens", len(r.token_ids) - 1), ("decode_ms", m.wall_ms - m.ttft_ms),
                       ("emitted", len(r.token_ids)), ("calls", m.cloud_calls), ("verify", m.verify_calls),
                       ("streamed", m.streamed), ("switches", m.switches)):
            t[key] += v
        t["texts"].append(list(r.token_ids))
    client.close()
    t["tokens_per_s"] = t["decode_tokens"] / t["decode_ms"] * 1000
    return t


def end_to_end(cloud: Any, tokenizer: Any, n_new: int, prompts: list[str], head: str = "") -> list[dict[str, Any]]:
    """The edge's defaults (its default head when present, or `head`; cost-model k, drafting ahead) against cloud_only
    (`one_client`), one client per mode and RTT; the first token (the prompt's prefill) is left out of both modes,
    since the cloud may keep a prompt's prefix from the other mode's run of it."""
    rows = []
    for rtt in RTTS_MS:
        with DelayProxy("127.0.0.1", cloud.http_port, rtt_ms=rtt) as proxy:
            for mode in ("cloud_only", "speculative"):
                t = one_client(proxy.url, tokenizer, mode, prompts, n_new, head)
                rows.append({"rtt_ms": rtt, "mode": mode, "tokens_per_s": t["tokens_per_s"],
                             "tokens_per_call": t["emitted"] / t["calls"], "streamed": t["streamed"],
                             "switches": t["switches"]})
                print(f"real-pair: rtt {rtt} ms, {mode}: {t['tokens_per_s']:.2f} decode tok/s", flush=True)
    return rows


def render(c: dict[str, Any], fk: list[dict[str, Any]], e2e: list[dict[str, Any]], command: str, n_new: int,
           prompts: int, load: str, sb: list[dict[str, Any]] | None = None, head: str = "", dtype: str = "float32") -> str:
    t1, plain = c["target_ms"][1], c["target_ms_plain"]
    lines = [START, "## The real pair: SmolLM2-135M-Instruct and its drafts", "",
             f"Command: `{command}` (cloud and edge on this 2-core CPU, one torch thread each, the cloud in {dtype}; {load}). "
             f"{prompts} unseen chat prompts (`bench/real_pair.py` PROMPTS), {n_new} tokens each, through the chat "
             "template. GPU figures are unmeasured.", "",
             f"### What a forward costs (target, KV cache, context {c['ctx']} tokens)", "",
             "| new tokens per forward | " + " | ".join(str(n) for n in NEW_TOKENS) + " |",
             "|---" * (len(NEW_TOKENS) + 1) + "|",
             "| target ms, packed weights (oneDNN; what the cloud runs) | " + " | ".join(f"{c['target_ms'][n]:.0f}" for n in NEW_TOKENS) + " |",
             "| target ms, plain weights (MKL) | " + " | ".join(f"{plain[n]:.0f}" for n in NEW_TOKENS) + " |",
             "| plain / packed | " + " | ".join(f"**{plain[n] / c['target_ms'][n]:.2f}x**" for n in NEW_TOKENS) + " |",
             "", "| draft | ms per drafted token | target / draft per token (aim >= 8x) |", "|---|---|---|"]
    for name, ms in c["draft_ms"].items():
        lines.append(f"| {name} | {ms:.2f} | **{t1 / ms:.1f}x** |")
    lines += ["", "### Speculation at a fixed shape: chains of k drafts, token trees of n nodes (no drafting ahead; "
              "the real cloud over REST)", "",
              "T = 0 is greedy; the repetition penalty is applied alike to the draft's and the target's logits "
              "(1.1 is the edge's default, 1.0 is none: the target's own argmax). A chain's acceptance is accepted "
              "over drafted tokens; a tree's is accepted over nodes sent. By position: the share of rounds that "
              "reached a draft position (a tree depth) and accepted it.", "",
              "| draft | shape | T | repetition penalty | tokens per verify call | acceptance | by position (depth) | "
              "uplink bytes per round | downlink bytes per round, opens apart (of which the target's states) | "
              "downlink bytes per open |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in fk:
        pos = " / ".join(f"{a:.2f}" for a in r["by_position"])
        shape = f"chain k = {r['k']}" if r.get("shape", "chain") == "chain" else f"tree of {r['k']}"
        lines.append(f"| {r['draft']} | {shape} | {r['temperature']:g} | {r.get('penalty', 1.1):g} | "
                     f"**{r['tokens_per_call']:.2f}** | "
                     f"{r['acceptance']:.3f} | {pos} | {r.get('up_bytes_per_round', 0):.0f} | "
                     f"{r['down_bytes_per_round']:.0f} ({r['feature_bytes_per_round']:.0f}) | "
                     f"{r.get('open_down_bytes', 0):.0f} |")
    if sb:
        cats = list(dict.fromkeys(r["category"] for r in sb))
        sb_cell = {(r["category"], r["shape"]): r for r in sb}
        lines += ["", f"### Spec-Bench subset by category (the head `{Path(head or default_head()).name}`, greedy, "
                  "5 questions each, `bench/specbench/`)", "",
                  "| category | chain k = 6: tokens per verify call | trees (automatic size) without copy branches | "
                  "trees with copy branches (the default): tokens per verify call (aim >= 2.0) | nodes per round "
                  "(copy-branch nodes, accepted) |", "|---|---|---|---|---|"]
        for cat in cats:
            ch, nc, tr = (sb_cell[(cat, s)] for s in ("chain", "tree, no copy", "tree"))
            lines.append(f"| {cat} | {ch['tokens_per_call']:.2f} | {nc['tokens_per_call']:.2f} ({nc['nodes_per_round']:.1f}) | "
                         f"**{tr['tokens_per_call']:.2f}** | {tr['nodes_per_round']:.1f} ({tr['copy_nodes_per_round']:.1f}, "
                         f"{tr['copy_accepted_per_round']:.2f}) |")
    with_head = f" with the head `{Path(head).name}`" if head else ""
    lines += ["", f"### One session end to end: the edge's defaults{with_head} against cloud_only (greedy)", "",
              "Decode tokens/s: the tokens after the first over the time after the first, summed over the prompts "
              "(`end_to_end` in `bench/real_pair.py`); one client per mode and RTT with its drafts loaded before "
              "the first prompt.", "",
              "| RTT | cloud_only decode tok/s | defaults decode tok/s | speedup (aim >= 1.3x at 0 ms, >= 0.95x at "
              "50 and 100 ms) | tokens per cloud call | tokens streamed / switches |", "|---|---|---|---|---|---|"]
    for rtt in RTTS_MS:
        cell = {r["mode"]: r for r in e2e if r["rtt_ms"] == rtt}
        base, spec = cell["cloud_only"]["tokens_per_s"], cell["speculative"]
        lines.append(f"| {rtt} ms | {base:.2f} | {spec['tokens_per_s']:.2f} | **{spec['tokens_per_s'] / base:.2f}x** | "
                     f"{spec['tokens_per_call']:.2f} | {spec.get('streamed', 0)} / {spec.get('switches', 0)} |")
    lines += ["", END]
    return "\n".join(lines)


def met(ok: bool) -> str:
    """An aim's verdict in a section's table."""
    return "met" if ok else "**missed**"


def finish(res: dict[str, Any], machine: dict[str, Any], t0: float, out: Path, name: str,
           markers: tuple[str, str], render: Callable[[dict[str, Any]], str]) -> int:
    """A section's last step: the load at the end and the run's time kept, the section rendered, printed and
    spliced into `out` between its markers."""
    res["machine"] = {**machine, "load_end": os.getloadavg()}
    res["total_s"] = time.perf_counter() - t0
    section = render(res)
    print("\n" + section, flush=True)
    print(f"wrote the {name} section into {splice(section, out, *markers)} ({res['total_s']:.0f} s)")
    return 0


def splice(section: str, out: Path, start: str = START, end: str = END) -> Path:
    """`section` (which begins with `start` and ends with `end`) in place of OUT's, else appended."""
    text = out.read_text() if out.exists() else ""
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    out.write_text(text)
    return out


def run(out: Path, command: str, n_new: int = 64, prompts: int = 4, only: tuple[str, ...] = (), head: str = "") -> int:
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    if not (TARGET / "model.safetensors").is_file():
        print(f"{TARGET} is missing: run `specsplit-models prepare smollm2` (scripts/setup.sh does it)")
        return 2
    load = f"load average {os.getloadavg()[0]:.2f} at the start"
    tokenizer = AutoTokenizer.from_pretrained(TARGET)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    ctx = chat_ids(tokenizer, PROMPTS[0] + " " + PROMPTS[2] + " Explain every line.") * 4
    c = {**costs(target, ctx), "ctx": len(ctx)}
    print(f"real-pair costs: {c}", flush=True)
    del target
    chosen = PROMPTS[:prompts]
    with CloudServer(TARGET, torch_threads=1, extra_args=["--runner", "torch"]) as cloud:
        import httpx

        dtype = str(httpx.get(f"{cloud.url}/v1/model", timeout=30).json().get("dtype", "float32"))
        fk = fixed_k(cloud.url, tokenizer, n_new, chosen, only)
        sb = specbench(cloud.url, tokenizer, n_new, head)
        e2e = end_to_end(cloud, tokenizer, n_new, chosen, head)
    load += f", {os.getloadavg()[0]:.2f} at the end"
    path = splice(render(c, fk, e2e, command, n_new, len(chosen), load, sb, head, dtype), out)
    print(f"wrote the real-pair section into {path}")
    return 0
