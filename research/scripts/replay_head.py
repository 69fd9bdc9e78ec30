"""Replay the edge's feature-fed drafting over the target's own greedy answers, without a cloud.

For each prompt the target (SmolLM2-135M-Instruct, in process) writes its greedy answer under the
given repetition penalty, keeping its normed state at every position. Rounds of fixed k then run as
they do live: the head (`FeatureDrafter`, the class the edge runs) gets the feature the cloud would
send (the state after the last accepted draft, or after the prompt for the first round), steps through
the correction and drafts k tokens, which are checked against the answer. Prints tokens per verify
call and the first-position acceptance; with --breakdown also, teacher-forced at every answer position
(the head steps from the state before it), how often the head's raw argmax is the target's, and how often
the repetition penalty, applied alike to both, turns a match into a miss or a miss into a match.

    .venv/bin/python research/scripts/replay_head.py                          # six bench prompts, penalty 1.1
    .venv/bin/python research/scripts/replay_head.py --penalty 1.0 --prompts eval --work /work/runs/heads
    .venv/bin/python research/scripts/replay_head.py --breakdown                # what the penalty does to a match
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.real_pair import PROMPTS  # noqa: E402
from edge.drafters.tree import TreeShape  # noqa: E402
from research.heads.feature_head import FeatureDrafter, FeatureHead  # noqa: E402
from shared.config import SamplingConfig  # noqa: E402
from shared.sampling import processed_probs  # noqa: E402

TARGET = REPO / "models" / "smollm2-135m-instruct"


@torch.inference_mode()
def answer(model: object, ids: list[int], n: int, cfg: SamplingConfig) -> tuple[list[int], list[torch.Tensor]]:
    """The target's greedy continuation and its states: states[j] follows ids + answer[:j]."""
    captured: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_pre_hook(lambda _m, a: captured.append(a[0]))  # type: ignore[attr-defined]
    seq, states = list(ids), []
    try:
        for _ in range(n):
            captured.clear()
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1:]  # type: ignore[operator]
            states.append(captured[-1][0, -1].clone())
            seq.append(int(processed_probs(logits, cfg, seq)[0].argmax()))
    finally:
        hook.remove()
    return seq[len(ids):], states


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", type=Path, default=REPO / "research" / "models" / "smollm2-135m-head")
    ap.add_argument("--penalty", type=float, default=1.1)
    ap.add_argument("--prompts", choices=["bench", "eval"], default="bench")
    ap.add_argument("--work", type=Path, help="train_heads.py's work directory (for --prompts eval)")
    ap.add_argument("--n", type=int, default=6, help="prompts")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=6)
    ap.add_argument("--breakdown", action="store_true", help="also the penalty's effect on first positions")
    ap.add_argument("--tree", type=int, default=0, help="draft token trees of this many nodes instead of chains")
    ap.add_argument("--width", type=int, default=4, help="tree width (children per expanded node)")
    ap.add_argument("--depth", type=int, default=6, help="tree depth")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    if args.prompts == "eval":
        if args.work is None:
            raise SystemExit("replay_head: --prompts eval needs --work DIR (train_heads.py's prompts.json)")
        prompts = json.loads((args.work / "prompts.json").read_text())["eval"][: args.n]
    else:
        prompts = PROMPTS[: args.n]
    cfg = SamplingConfig(0.0, repetition_penalty=args.penalty)
    drafter = FeatureDrafter(FeatureHead.load(args.head), None)
    drafter.vocab_size = model.config.vocab_size
    calls = tokens = first = 0
    split = {"raw match": 0, "match -> miss": 0, "miss -> match": 0, "positions": 0}
    for prompt in prompts:
        enc: Any = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=True)
        ids = [int(t) for t in (enc["input_ids"] if hasattr(enc, "keys") else enc)]
        ans, states = answer(model, ids, args.tokens, cfg)
        if args.breakdown:
            penalty_split(drafter.head, model.lm_head.weight, ids, ans, states, cfg, split)
        done = anchor = 0  # committed answer tokens; the feature follows ids + ans[:anchor]
        while done + args.k + 1 < len(ans):
            drafter.set_feature(ids + ans[:anchor], states[anchor])
            if args.tree:
                tree = drafter.propose_tree(ids + ans[:done], TreeShape(args.tree, args.depth, args.width), cfg, 0)
                assert tree is not None and tree.parents is not None
                la, node = 0, -1
                while True:  # greedy draw and match: follow the child carrying the target's token
                    kids = [j for j, par in enumerate(tree.parents) if par == node and tree.tokens[j] == ans[done + la]]
                    if not kids or done + la + 1 >= len(ans):
                        break
                    node, la = kids[0], la + 1
            else:
                block = drafter.propose(ids + ans[:done], args.k, cfg, 0)
                la = 0
                while la < args.k and block.tokens[la] == ans[done + la]:
                    la += 1
            calls, tokens, first = calls + 1, tokens + la + 1, first + (la > 0)
            anchor = done + la  # the state after the accepted drafts decides the correction
            done += la + 1
    shape = f"trees of {args.tree} nodes (width {args.width}, depth {args.depth})" if args.tree else f"k = {args.k}"
    print(f"{args.prompts} prompts x {len(prompts)}, penalty {args.penalty}, {shape}: {calls} verify calls, "
          f"{tokens / calls:.2f} tokens per call, first-position acceptance {first / calls:.2f}")
    if args.breakdown:
        n = max(split.pop("positions"), 1)
        print("teacher-forced over the answers (" + str(n) + " positions): "
              + ", ".join(f"{name} {count / n:.3f}" for name, count in split.items()))
    return 0


@torch.inference_mode()
def penalty_split(head: FeatureHead, out_weight: torch.Tensor, ids: list[int], ans: list[int],
                  states: list[torch.Tensor], cfg: SamplingConfig, split: dict[str, int]) -> None:
    """At each answer position i + 1: the head steps from the target's state before it through ans[i];
    counts raw-argmax agreement with the target, and the matches the penalty breaks or makes."""
    for i in range(len(ans) - 1):
        s = head.step(states[i].float(), torch.tensor(ans[i]))
        head_raw = torch.full((out_weight.shape[0],), float("-inf"))  # [vocab]
        head_raw[head.out_ids] = head.logits(s).float()
        target_raw = states[i + 1].float() @ out_weight.T  # [vocab]
        seen = ids + ans[: i + 1]
        raw_match = int(head_raw.argmax()) == int(target_raw.argmax())
        pen_match = int(processed_probs(head_raw[None], cfg, seen)[0].argmax()) == ans[i + 1]
        split["positions"] += 1
        split["raw match"] += raw_match
        split["match -> miss"] += raw_match and not pen_match
        split["miss -> match"] += pen_match and not raw_match


if __name__ == "__main__":
    raise SystemExit(main())
