"""Distil a small draft from SmolLM2-135M-Instruct on this CPU; resumable, phase by phase.

    python scripts/distill_draft.py --work runs/distill --out models/smollm2-135m-draft \
        --train-minutes 90 --threads 1

Phases (each skipped when its output exists, so a stopped run resumes where it was):
1. prompts   a varied set of chat and code prompts built from templates x topics (fixed seed); whole
             topics are held out, so the evaluation prompts are unseen in wording and subject.
2. answers   the target's own answers (greedy for two thirds, T = 0.8 samples for the rest), generated
             in batches; the target's log-probabilities at every answer position are kept as soft labels
             (top `--topk`, float16), i.e. sequence-level knowledge distillation.
3. stdlib    extra text that ships with Python (the standard library's source), scored by the target;
   docs      and chat-shaped extra text: "What does `module.name` do in Python?" answered by that
             function's or class's docstring, scored by the target at the answer positions.
4. train     (may run alongside phases 2-3 in a second process: it picks up new shards at each checkpoint)
             the draft: a Llama of `--layers` x `--width` with tied embeddings, its embedding table
             initialised from the target's projected onto its top principal directions (so the output
             layer starts as a good unigram/bigram model); loss = cross-entropy of the draft against the
             target's top-k distribution renormalised (forward KL up to a constant). Time-budgeted,
             checkpointed every few minutes (`ckpt.pt`), resumed by rerunning the same command.
5. export    the draft in Hugging Face format (weights stored as bfloat16 to fit the repository; the
             loader upcasts to float32), the target's tokenizer files beside it, and `report.json` with
             greedy agreement and beta = sum min(p, q) at T = 1 on the held-out prompts' target answers,
             computed against the live target (exact, not from the top-k labels).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

TARGET = "models/smollm2-135m-instruct"

CODE_TASKS = [
    "reverse a string", "check whether a number is prime", "return the n-th Fibonacci number",
    "merge two sorted lists", "count the words in a text", "find the largest element of a list",
    "remove duplicates from a list while keeping order", "compute the factorial of n",
    "check whether a string is a palindrome", "flatten a nested list", "read a CSV file and print each row",
    "sort a list of dictionaries by a key", "compute the greatest common divisor of two numbers",
    "convert Celsius to Fahrenheit", "find the second smallest number in a list", "binary search a sorted list",
    "count vowels in a string", "transpose a matrix", "compute the mean and median of a list",
    "validate an email address with a regular expression", "return the intersection of two lists",
    "capitalize the first letter of every word", "compute the sum of the digits of a number",
    "find all anagrams of a word in a list", "implement a stack class", "implement a queue with two stacks",
    "parse a JSON string and print its keys", "check whether brackets in a string are balanced",
    "rotate a list by k positions", "compute the power set of a list", "convert a decimal number to binary",
    "find the longest common prefix of a list of strings", "count the frequency of each character",
    "generate the first n prime numbers", "compute the area of a circle", "download nothing but parse a URL",
    "chunk a list into pieces of size n", "compute a running average", "merge two dictionaries",
    "find the missing number in a list from 1 to n", "check whether two strings are anagrams",
    "implement bubble sort", "implement quicksort", "implement a linked list", "compute n choose k",
    "write a decorator that times a function", "read a text file and count its lines",
    "remove whitespace from both ends of every line", "compute the Levenshtein distance",
    "return the most common element of a list", "group words by their first letter",
    "simulate rolling two dice", "convert a Roman numeral to an integer", "compute compound interest",
    "find the depth of a binary tree", "implement depth-first search on a graph",
    "implement breadth-first search on a graph", "format a number with thousands separators",
    "check whether a year is a leap year", "split a sentence into words and sort them",
]
CODE_TEMPLATES = [
    "Write a Python function to {t}.", "Write a Python function that can {t}. Include a docstring.",
    "How do I {t} in Python? Show an example.", "Explain how to {t} in Python, step by step.",
    "Write a JavaScript function to {t}.", "Can you write code to {t}?",
    "Write a short Python program to {t} and explain how it works.",
]
TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "how vaccines work", "the French Revolution",
    "climate change", "the stock market", "machine learning", "the human heart", "volcanoes",
    "the Roman Empire", "electric cars", "the internet", "DNA", "renewable energy", "the moon landing",
    "honey bees", "earthquakes", "the immune system", "inflation", "the printing press", "rainbows",
    "gravity", "the solar system", "recycling", "sleep", "coffee", "the Great Wall of China",
    "democracy", "antibiotics", "plate tectonics", "the Renaissance", "cloud computing", "tides",
    "the human brain", "dinosaurs", "electricity", "the ocean", "bread baking", "the Olympic Games",
    "meditation", "compound interest", "rain forests", "the speed of light", "World War I", "jazz music",
    "photography", "the periodic table", "nutrition", "bicycles", "chess", "the Amazon river",
    "public speaking", "time management", "gardening", "the theory of evolution", "airplanes",
    "the Industrial Revolution", "batteries", "glaciers", "the Silk Road", "smartphones",
]
CHAT_TEMPLATES = [
    "Explain {t} in simple terms.", "What is {t}?", "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t}.", "Why is {t} important?", "Explain {t} to a ten-year-old.",
    "What are the main ideas behind {t}?", "Write a haiku about {t}.", "Summarize the history of {t}.",
    "What are common misconceptions about {t}?",
]
EVAL_FRACTION = 0.12  # share of topics and tasks held out entirely for evaluation


def build_prompts(seed: int = 0) -> tuple[list[str], list[str]]:
    """(train prompts, eval prompts); eval prompts use held-out topics and tasks only."""
    rng = random.Random(seed)
    tasks, topics = CODE_TASKS[:], TOPICS[:]
    rng.shuffle(tasks)
    rng.shuffle(topics)
    n_task_eval, n_topic_eval = int(len(tasks) * EVAL_FRACTION), int(len(topics) * EVAL_FRACTION)
    split = {"eval": (tasks[:n_task_eval], topics[:n_topic_eval]),
             "train": (tasks[n_task_eval:], topics[n_topic_eval:])}
    out: dict[str, list[str]] = {}
    for name, (ts, ps) in split.items():
        prompts = [tpl.format(t=t) for t in ts for tpl in CODE_TEMPLATES]
        prompts += [tpl.format(t=t) for t in ps for tpl in CHAT_TEMPLATES]
        rng.shuffle(prompts)
        out[name] = prompts
    return out["train"], out["eval"][:40]


def load_target(threads: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    return tok, model


def chat_ids(tok, prompt: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def generate_answers(work: Path, prompts: list[str], name: str, args, sample_every: int) -> None:
    """Target answers for `prompts`, with top-k teacher log-probs at answer positions, in shards."""
    tok, model = load_target(args.threads)
    eos = tok.eos_token_id
    items = [(i, chat_ids(tok, p)) for i, p in enumerate(prompts)]
    items.sort(key=lambda x: len(x[1]))
    bs = args.gen_batch
    for b0 in range(0, len(items), bs):
        shard = work / f"{name}-{b0:05d}.pt"
        if shard.exists():
            continue
        t0 = time.time()
        batch = items[b0:b0 + bs]
        width = max(len(ids) for _, ids in batch)
        input_ids = torch.full((len(batch), width), eos, dtype=torch.long)  # [B, W] left-padded
        mask = torch.zeros_like(input_ids)
        for r, (_, ids) in enumerate(batch):
            input_ids[r, width - len(ids):] = torch.tensor(ids)
            mask[r, width - len(ids):] = 1
        do_sample = sample_every > 0 and (b0 // bs) % sample_every == sample_every - 1
        torch.manual_seed(b0)
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=args.max_new,
                                 do_sample=do_sample, temperature=0.8 if do_sample else None, top_p=None,
                                 top_k=None, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=eos, eos_token_id=eos)
        gen = out.sequences[:, width:]  # [B, N]
        logits = torch.stack(out.logits, dim=1)  # [B, N, vocab]
        records = []
        for r, (idx, ids) in enumerate(batch):
            toks = gen[r].tolist()
            n = toks.index(eos) + 1 if eos in toks else len(toks)
            lp = torch.log_softmax(logits[r, :n].float(), dim=-1)  # [n, vocab]
            val, ind = lp.topk(args.topk, dim=-1)  # [n, K]
            records.append({"prompt": prompts[idx], "ids": ids + toks[:n], "start": len(ids),
                            "top_lp": val.half(), "top_ix": ind.int(), "sampled": do_sample})
        torch.save(records, shard)
        print(f"[{name}] shard {b0}: {len(batch)} answers, {sum(len(x['ids']) - x['start'] for x in records)}"
              f" tokens, {time.time() - t0:.0f} s, sampled={do_sample}", flush=True)


def stdlib_text(work: Path, args) -> None:
    """Teacher top-k log-probs over chunks of the standard library's source."""
    tok, model = load_target(args.threads)
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    rng = random.Random(1)
    rng.shuffle(files)
    chunks: list[list[int]] = []
    for path in files:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tok(text).input_ids
        for s in range(0, len(ids) - args.chunk, args.chunk * 4):
            chunks.append(ids[s:s + args.chunk])
        if len(chunks) >= args.stdlib_chunks:
            break
    chunks = chunks[:args.stdlib_chunks]
    bs = 8
    for b0 in range(0, len(chunks), bs):
        shard = work / f"stdlib-{b0:05d}.pt"
        if shard.exists():
            continue
        x = torch.tensor(chunks[b0:b0 + bs])  # [B, chunk]
        with torch.no_grad():
            lp = torch.log_softmax(model(x).logits.float(), dim=-1)  # [B, chunk, vocab]
        val, ind = lp[:, :-1].topk(args.topk, dim=-1)  # labels for positions 1..chunk-1
        records = [{"prompt": None, "ids": x[r].tolist(), "start": 1, "top_lp": val[r].half(),
                    "top_ix": ind[r].int(), "sampled": False} for r in range(x.shape[0])]
        torch.save(records, shard)
        print(f"[stdlib] shard {b0}", flush=True)


def stdlib_docstrings(limit: int) -> list[tuple[str, str]]:
    """(qualified name, docstring) of the standard library's documented classes and functions."""
    import ast
    out: list[tuple[str, str]] = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        try:
            tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        mod = Path(path).stem
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    out.append((f"{mod}.{node.name}", doc))
    random.Random(2).shuffle(out)
    return out[:limit]


def docstring_answers(work: Path, args) -> None:
    """Chat-shaped extra text: "What does `mod.name` do?" answered by its standard-library docstring,
    scored by the target at the answer positions (a prefill, far cheaper per token than generating)."""
    tok, model = load_target(args.threads)
    eos = tok.eos_token_id
    docs = stdlib_docstrings(args.doc_answers)
    bs = 8
    for b0 in range(0, len(docs), bs):
        shard = work / f"docs-{b0:05d}.pt"
        if shard.exists():
            continue
        seqs = []
        for name, doc in docs[b0:b0 + bs]:
            prompt = chat_ids(tok, f"What does `{name}` do in Python?")
            answer = tok(doc, add_special_tokens=False).input_ids[:args.chunk] + [eos]
            seqs.append((prompt, answer))
        width = max(len(p) + len(a) for p, a in seqs)
        x = torch.full((len(seqs), width), eos, dtype=torch.long)  # [B, W] right-padded
        att = torch.zeros_like(x)
        for r, (p, a) in enumerate(seqs):
            x[r, :len(p) + len(a)] = torch.tensor(p + a)
            att[r, :len(p) + len(a)] = 1
        with torch.no_grad():
            logits = model(input_ids=x, attention_mask=att).logits  # [B, W, vocab]
        records = []
        for r, (p, a) in enumerate(seqs):
            lp = torch.log_softmax(logits[r, len(p) - 1:len(p) + len(a) - 1].float(), dim=-1)  # [len(a), vocab]
            val, ind = lp.topk(args.topk, dim=-1)
            records.append({"prompt": None, "ids": p + a, "start": len(p), "top_lp": val.half(),
                            "top_ix": ind.int(), "sampled": False})
        torch.save(records, shard)
        print(f"[docs] shard {b0}", flush=True)


def make_draft(args):
    from transformers import AutoModelForCausalLM, LlamaConfig
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32)
    tc = target.config
    cfg = LlamaConfig(vocab_size=tc.vocab_size, hidden_size=args.width, intermediate_size=args.width * 3,
                      num_hidden_layers=args.layers, num_attention_heads=args.width // 64,
                      num_key_value_heads=max(1, args.width // 128), head_dim=64,
                      max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
                      rope_parameters=dict(tc.rope_parameters), tie_word_embeddings=True,
                      bos_token_id=tc.bos_token_id, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id)
    torch.manual_seed(0)
    draft = AutoModelForCausalLM.from_config(cfg)
    emb = target.get_input_embeddings().weight.detach()  # [vocab, 576]
    centered = emb - emb.mean(0, keepdim=True)
    _, _, vh = torch.linalg.svd(centered, full_matrices=False)  # vh: [576, 576]
    proj = vh[:args.width].T  # [576, width]
    small = emb @ proj  # [vocab, width]
    small = small * (1.0 / small.std())  # unit scale, as the draft's final norm expects
    draft.get_input_embeddings().weight.data.copy_(small * 0.5)
    return draft


def load_records(work: Path) -> tuple[list[dict], list[dict]]:
    train: list[dict] = []
    evals: list[dict] = []
    for shard in sorted(work.glob("*.pt")):
        if shard.name == "ckpt.pt":
            continue
        recs = torch.load(shard, weights_only=False)
        (evals if shard.name.startswith("eval-") else train).extend(recs)
    return train, evals


def batch_loss(draft, recs: list[dict]) -> tuple[torch.Tensor, int]:
    """Soft cross-entropy of the draft against the target's renormalised top-k at labelled positions."""
    width = max(len(r["ids"]) for r in recs)
    x = torch.zeros((len(recs), width), dtype=torch.long)  # [B, W] right-padded
    att = torch.zeros_like(x)
    for i, r in enumerate(recs):
        x[i, :len(r["ids"])] = torch.tensor(r["ids"])
        att[i, :len(r["ids"])] = 1
    hidden = draft.model(input_ids=x, attention_mask=att).last_hidden_state  # [B, W, width]
    total, count = hidden.new_zeros(()), 0
    for i, r in enumerate(recs):
        n = r["top_lp"].shape[0]
        # label j predicts ids[start + j] from the prefix ids[:start + j]: logits at position start + j - 1;
        # the output layer (most of the cost) runs only where there is a label
        pos = slice(r["start"] - 1, r["start"] - 1 + n)
        logq = torch.log_softmax(draft.lm_head(hidden[i, pos]), dim=-1)  # [n, vocab]
        p = torch.softmax(r["top_lp"].float(), dim=-1)  # [n, K] renormalised top-k
        total = total - (p * logq.gather(-1, r["top_ix"].long())).sum()
        count += n
    return total / max(count, 1), count


def train(work: Path, args) -> None:
    torch.set_num_threads(args.threads)
    records, _ = load_records(work)
    while not records:  # the data phase may still be running in another process: wait for its first shard
        time.sleep(30)
        records, _ = load_records(work)
    ckpt = work / "ckpt.pt"
    draft = make_draft(args)
    opt = torch.optim.AdamW(draft.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    state: dict[str, Any] = {"step": 0, "seconds": 0.0, "tokens": 0, "log": []}
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        draft.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        print(f"resumed at step {state['step']} ({state['seconds'] / 60:.1f} min trained)", flush=True)
    budget = args.train_minutes * 60.0
    rng = random.Random(state["step"])
    draft.train()
    last_save, t_mark, run_loss = time.time(), time.time(), []
    while state["seconds"] < budget:
        recs = rng.sample(records, min(args.batch, len(records)))
        frac = state["seconds"] / budget
        lr = args.lr * min(1.0, (state["step"] + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, n = batch_loss(draft, recs)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        now = time.time()
        state["seconds"] += now - t_mark
        t_mark = now
        state["step"] += 1
        state["tokens"] += n
        run_loss.append(loss.item())
        if state["step"] % 20 == 0:
            entry = {"step": state["step"], "minutes": round(state["seconds"] / 60, 2), "tokens": state["tokens"],
                     "loss": round(sum(run_loss) / len(run_loss), 4), "lr": lr}
            state["log"].append(entry)
            run_loss = []
            print(json.dumps(entry), flush=True)
        if now - last_save > args.save_every_s:
            torch.save({"model": draft.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)
            last_save = now
            records, _ = load_records(work)  # shards written since (a data phase running alongside)
            print(f"checkpoint at step {state['step']}; {len(records)} training sequences", flush=True)
    torch.save({"model": draft.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)


def export(work: Path, args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(args.threads)
    saved = torch.load(work / "ckpt.pt", weights_only=False)
    draft = make_draft(args)
    draft.load_state_dict(saved["model"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    draft.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(TARGET).save_pretrained(out)
    shipped = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    _, evals = load_records(work)
    greedy = [r for r in evals if not r["sampled"]]
    agree = beta = n = 0.0
    with torch.no_grad():
        for r in greedy:
            x = torch.tensor([r["ids"]])  # [1, T]
            s = r["start"] - 1
            p = torch.softmax(target(x).logits[0, s:-1].float(), dim=-1)  # [n, vocab]
            q = torch.softmax(shipped(x).logits[0, s:-1].float(), dim=-1)  # [n, vocab]
            agree += (p.argmax(-1) == q.argmax(-1)).sum().item()
            beta += torch.minimum(p, q).sum().item()
            n += p.shape[0]
    report = {"eval_prompts": len(greedy), "eval_tokens": int(n), "greedy_agreement": round(agree / n, 4),
              "beta_T1": round(beta / n, 4), "train_steps": saved["state"]["step"],
              "train_minutes": round(saved["state"]["seconds"] / 60, 1), "train_tokens": saved["state"]["tokens"],
              "shape": {"layers": args.layers, "width": args.width},
              "parameters_M": round(sum(p.numel() for p in shipped.parameters()) / 1e6, 2),
              "loss_log_tail": saved["state"]["log"][-5:]}
    (out / "distill_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("runs/distill"))
    ap.add_argument("--out", default="models/smollm2-135m-draft")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gen-batch", type=int, default=24)
    ap.add_argument("--max-new", type=int, default=160, help="answer tokens at most")
    ap.add_argument("--topk", type=int, default=32, help="teacher log-probs kept per position")
    ap.add_argument("--train-prompts", type=int, default=480)
    ap.add_argument("--stdlib-chunks", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--doc-answers", type=int, default=480, help="docstring answers (phase docs)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--train-minutes", type=float, default=90.0)
    ap.add_argument("--save-every-s", type=float, default=180.0)
    ap.add_argument("--phase", choices=["all", "data", "stdlib", "docs", "train", "export"], default="all")
    args = ap.parse_args(argv)
    if not Path(TARGET, "config.json").exists():
        print(f"{TARGET} is missing: run `specsplit-models prepare smollm2` first", file=sys.stderr)
        return 2
    args.work.mkdir(parents=True, exist_ok=True)
    if args.phase in ("all", "data"):
        train_prompts, eval_prompts = build_prompts()
        (args.work / "prompts.json").write_text(json.dumps({"train": train_prompts, "eval": eval_prompts}, indent=0))
        generate_answers(args.work, eval_prompts, "eval", args, sample_every=0)
        generate_answers(args.work, train_prompts[:args.train_prompts], "chat", args, sample_every=3)
    if args.phase in ("all", "data", "stdlib"):
        stdlib_text(args.work, args)
    if args.phase in ("all", "data", "docs"):
        docstring_answers(args.work, args)
    if args.phase in ("all", "train"):
        train(args.work, args)
    if args.phase in ("all", "export"):
        export(args.work, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
