"""Train the drafts of SmolLM2-135M-Instruct on this CPU; resumable, phase by phase.

    nice -n 19 .venv/bin/python scripts/train_heads.py --work /work/runs/heads all

Phases (each skips what its output already holds, so a stopped run resumes where it was):
1. prompts  the training and held-out prompt sets (`scripts/head_prompts.py`).
2. answers  the target's own answers to the training prompts, generated in batches of `--gen-batch`
            rows per forward (left-padded, per-row positions), greedy for three batches in four and
            sampled at T = 0.7 for the fourth. Each shard keeps the token ids and the target's last
            hidden state after its final norm (the output layer's input, float16) at every position
            from the prompt's last to the answer's last, so the target's full distribution at any
            of those positions is `softmax(E h)` and needs no storage.
3. eval     the same for the held-out prompts (greedy only): what every agreement figure is measured on.
   doc-answers  the same for prompts about the standard library's documented functions (`docs` shards).
   text     the target teacher-forced over Python's own text (`text` shards, same layout).
4. freq     the token frequencies of the target's training answers (counts plus the target's expected
            counts): the frequency-ranked output rows (FR-Spec) and their coverage of the held-out answers.
            Counted once: every head and draft trained later keeps these rows.
5. labels   the target's top-32 ids over those rows and their log-probabilities at every stored position
            of the shard sets trained on (`--data`), recomputed when a set has gained shards.
6. train    the feature-fed head (`edge/drafters/feature_head.py`) with the target frozen (its output rows
            and a projection of its embeddings, frozen), by an unrolled loss: from every position's state
            the head steps `--unroll` times on the target's tokens, carrying its own states, and each step
            is scored by cross-entropy over every output row against the target's top-32, SmoothL1 to
            the target's state there, and SmoothL1 to the target's raw logits at its top-32 ids.
            Time-budgeted, checkpointed every 5 minutes (`head.pt`), resumed by rerunning the command.
7. export   the head into `--out` (bfloat16 weights), with `report.json`: greedy agreement by draft
            position and tokens per verify call at fixed k on the held-out answers.
8. draft-train, draft-export  the tokens-only draft cut from the target (`new_draft`), distilled the same
            way and exported as a compact directory (`edge/drafters/compact.py`) with its report.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

TARGET = REPO / "models" / "smollm2-135m-instruct"


def load_target(threads: int) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(TARGET)
    model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32, attn_implementation="sdpa").eval()
    return tok, model


def chat_ids(tok: Any, prompt: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@torch.inference_mode()
def generate_batch(model: Any, prompts: list[list[int]], max_new: int, eos: int, temperature: float,
                   gen: torch.Generator) -> list[dict[str, Any]]:
    """The target's answers to `prompts` in one batch, with its normed last hidden state per position."""
    from transformers import DynamicCache
    b, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((b, width), eos, dtype=torch.long)  # [B, W] left-padded
    mask = torch.zeros((b, width), dtype=torch.long)  # [B, W]
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)  # [B, W] per-row positions
    cache = DynamicCache(config=model.config)
    h = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                    use_cache=True).last_hidden_state[:, -1]  # [B, d]
    hs, toks = [h], []
    done = torch.zeros(b, dtype=torch.bool)  # [B]
    for _ in range(max_new):
        logits = model.lm_head(h).float()  # [B, V]
        if temperature > 0:
            tok = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]  # [B]
        else:
            tok = logits.argmax(-1)  # [B]
        tok = torch.where(done, torch.full_like(tok, eos), tok)
        toks.append(tok)
        done |= tok == eos
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((b, 1), dtype=torch.long)], 1)  # [B, W + t]
        pos = pos[:, -1:] + 1  # [B, 1]
        h = model.model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                        use_cache=True).last_hidden_state[:, -1]  # [B, d]
        hs.append(h)
    gen_ids = torch.stack(toks, 1)  # [B, N]
    hid = torch.stack(hs, 1)  # [B, N(+1), d]
    out = []
    for r, p in enumerate(prompts):
        row = gen_ids[r].tolist()
        n = row.index(eos) + 1 if eos in row else len(row)
        # hidden[i] is the state at position len(p) - 1 + i, whose next token is answer token i
        out.append({"ids": p + row[:n], "start": len(p), "hidden": hid[r, :n].half().clone(),
                    "temperature": temperature})
    return out


def phase_answers(work: Path, prompts: list[str], name: str, args: argparse.Namespace, sample_every: int) -> None:
    tok, model = load_target(args.threads)
    eos = int(tok.eos_token_id)
    items = sorted(((chat_ids(tok, p), i) for i, p in enumerate(prompts)), key=lambda x: len(x[0]))
    bs = args.gen_batch
    for b0 in range(0, min(len(items), args.answer_shards * bs), bs):
        shard = work / f"{name}-{b0:05d}.pt"
        if shard.exists():
            continue
        t0 = time.time()
        batch = items[b0:b0 + bs]
        sampled = sample_every > 0 and (b0 // bs) % sample_every == sample_every - 1
        gen = torch.Generator().manual_seed(b0)
        recs = generate_batch(model, [ids for ids, _ in batch], args.max_new, eos, 0.7 if sampled else 0.0, gen)
        for rec, (_, i) in zip(recs, batch, strict=True):
            rec["prompt"] = prompts[i]
        tmp = shard.with_suffix(".tmp")
        torch.save(recs, tmp)
        tmp.rename(shard)
        n = sum(len(r["ids"]) - r["start"] for r in recs)
        print(f"[{name}] {b0}: {len(batch)} answers, {n} tokens, {time.time() - t0:.0f} s "
              f"({n / (time.time() - t0):.0f} tok/s), T={0.7 if sampled else 0}", flush=True)


def held_out_sources() -> set[str]:
    """Standard-library files whose text the benchmarks evaluate on (bench/prompts/code.jsonl)."""
    held = set()
    for line in (REPO / "bench" / "prompts" / "code.jsonl").read_text().splitlines():
        src = json.loads(line).get("source", "")
        if src.startswith("stdlib/"):
            held.add(src.split()[0].removeprefix("stdlib/"))
    return held


@torch.inference_mode()
def phase_text(work: Path, args: argparse.Namespace) -> None:
    """The target teacher-forced over text that ships with Python (the standard library's source, whose
    `pydoc_data/topics.py` holds its documentation), in chunks of `--text-chunk` tokens, 8 per forward:
    each shard keeps the ids and the target's normed state at every position but the last, as the
    answers' shards do (start = 1: hidden[i] sits at position i and predicts ids[i + 1]). Test
    suites and the files the benchmarks evaluate on are left out."""
    import os
    import random
    tok, model = load_target(args.threads)
    root = Path(os.__file__).parent
    held = held_out_sources()
    files = sorted(f for f in root.rglob("*.py") if "test" not in f.relative_to(root).parts[0]
                   and "site-packages" not in f.parts and str(f.relative_to(root)) not in held)
    random.Random(7).shuffle(files)
    chunks: list[list[int]] = []
    w = args.text_chunk
    for f in files:
        try:
            ids = tok(f.read_text(encoding="utf-8")).input_ids
        except (UnicodeDecodeError, OSError):
            continue
        chunks.extend(ids[o:o + w] for o in range(0, len(ids) - w + 1, w))
        if len(chunks) * w >= args.text_tokens:
            break
    bs = 8
    for b0 in range(0, len(chunks), bs):
        shard = work / f"text-{b0:05d}.pt"
        if shard.exists():
            continue
        t0 = time.time()
        x = torch.tensor(chunks[b0:b0 + bs])  # [B, w]
        h = model.model(input_ids=x).last_hidden_state  # [B, w, d]: the output layer's input
        recs = [{"ids": x[r].tolist(), "start": 1, "hidden": h[r, :-1].half().clone(), "temperature": -1.0,
                 "prompt": None} for r in range(x.shape[0])]
        tmp = shard.with_suffix(".tmp")
        torch.save(recs, tmp)
        tmp.rename(shard)
        print(f"[text] {b0}: {x.numel()} tokens, {time.time() - t0:.1f} s", flush=True)


def load_shards(work: Path, name: str, names: list[str] | None = None) -> list[dict[str, Any]]:
    """The records of every shard of `name` (or of the shard files `names`), in shard order."""
    recs: list[dict[str, Any]] = []
    for f in names if names is not None else shard_names(work, name):
        recs.extend(torch.load(work / f))
    return recs


def target_tables() -> tuple[torch.Tensor, int]:
    """The target's (tied) output embedding [V, d] and its tokenizer's size."""
    from safetensors.torch import load_file
    w = load_file(str(TARGET / "model.safetensors"))
    table = w.get("lm_head.weight", w["model.embed_tokens.weight"]).float()
    return table, table.shape[0]


def shard_names(work: Path, name: str) -> list[str]:
    return sorted(f.name for f in work.glob(f"{name}-*.pt"))


def phase_freq(work: Path) -> dict[str, Any]:
    """Token counts of the target's training answers, and how much of the held-out answers the top N cover.
    Counted once (the shards it counted are recorded): the ranking decides every head's and draft's
    output rows, so checkpoints stay valid when the answers phase adds shards; delete freq.json to
    count again (and train afresh)."""
    out = work / "freq.json"
    if out.exists():
        return dict(json.loads(out.read_text()))
    table, vocab = target_tables()
    counts = torch.zeros(vocab, dtype=torch.float64)
    for r in load_shards(work, "chat"):
        counts += torch.bincount(torch.tensor(r["ids"][r["start"]:]), minlength=vocab).double()
        # plus the target's expected counts (its distribution at every 4th position): ranks the tokens
        # the answers happen not to contain by how likely the target makes them
        h = r["hidden"][::4].float()  # [n / 4, d]
        counts += 4 * torch.softmax(h @ table.T, -1).sum(0).double()
    order = torch.argsort(counts, descending=True, stable=True)
    ev = torch.cat([torch.tensor(r["ids"][r["start"]:]) for r in load_shards(work, "eval")])
    rank = torch.empty(vocab, dtype=torch.long)
    rank[order] = torch.arange(vocab)
    cover = {n: float((rank[ev] < n).float().mean()) for n in (2048, 4096, 8192, 12288, 16384, 24576, 32768)}
    res = {"train_tokens": int(counts.sum() / 2), "distinct": int((counts > 0).sum()), "eval_tokens": int(ev.numel()),
           "coverage": cover, "order": order.tolist(), "shards": shard_names(work, "chat")}
    out.write_text(json.dumps(res))
    return res


LABEL_K = 32  # the target's top ids kept per position (over out_ids)


def phase_labels(work: Path, name: str, n_out: int, threads: int, names: list[str] | None = None) -> None:
    """The target's top LABEL_K ids (indices into out_ids) and log-probabilities over out_ids at every
    stored position of the shards `names` (all of `name`'s by default): computed once per shard set, so
    training never runs the whole output layer for its targets."""
    out = work / f"labels-{name}-{n_out}.pt"
    freq = phase_freq(work)
    names = shard_names(work, name) if names is None else names
    made_from = {"shards": names, "order": freq["order"][:n_out]}
    if out.exists():
        held = torch.load(out)
        if isinstance(held, dict) and held.get("made_from") == made_from:
            return
    torch.set_num_threads(threads)
    table, _ = target_tables()
    rows = table[torch.tensor(freq["order"][:n_out])]  # [N, d]
    labels = []
    t0 = time.time()
    for r in load_shards(work, name, names):
        lp = torch.log_softmax(r["hidden"].float() @ rows.T, -1)  # [n, N]
        val, ix = lp.topk(LABEL_K, -1)  # [n, K]
        labels.append({"ix": ix.int(), "lp": val.half()})
    torch.save({"made_from": made_from, "labels": labels}, out)
    print(f"[labels] {name}: {len(labels)} answers, {time.time() - t0:.0f} s", flush=True)


def load_labels(work: Path, name: str, n_out: int) -> list[dict[str, torch.Tensor]]:
    return list(torch.load(work / f"labels-{name}-{n_out}.pt")["labels"])


def training_set(work: Path, args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, torch.Tensor]]]:
    """The records and labels of every shard set in --data (the target's answers, Python's text)."""
    recs: list[dict[str, Any]] = []
    labels: list[dict[str, torch.Tensor]] = []
    for name in args.data.split(","):
        names = shard_names(work, name)  # the answers phase may add shards meanwhile
        phase_labels(work, name, args.n_out, args.threads, names)
        recs += load_shards(work, name, names)
        labels += load_labels(work, name, args.n_out)
    assert len(recs) == len(labels)
    return recs, labels


class Windows:
    """Training windows over the answers: the target's states, the tokens they predict, their top labels."""

    def __init__(self, recs: list[dict[str, Any]], labels: list[dict[str, torch.Tensor]], width: int) -> None:
        self.width = width
        keep = [i for i, r in enumerate(recs) if r["hidden"].shape[0] > 8]
        self.hidden = [recs[i]["hidden"] for i in keep]
        self.tokens = [torch.tensor(recs[i]["ids"][recs[i]["start"]:]) for i in keep]
        self.ix = [labels[i]["ix"] for i in keep]
        self.lp = [labels[i]["lp"] for i in keep]
        self.sizes = torch.tensor([h.shape[0] for h in self.hidden], dtype=torch.float64)

    def batch(self, b: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """H [B, W, d]; A [B, W] (A[:, i] is the token H[:, i] predicts); IX, LP [B, W, K]; valid [B, W]."""
        d, w = self.hidden[0].shape[1], self.width
        out = {"H": torch.zeros(b, w, d), "A": torch.zeros(b, w, dtype=torch.long),
               "IX": torch.zeros(b, w, LABEL_K, dtype=torch.long), "LP": torch.zeros(b, w, LABEL_K),
               "valid": torch.zeros(b, w, dtype=torch.bool)}
        recs = torch.multinomial(self.sizes, b, replacement=True, generator=gen).tolist()
        for r, i in enumerate(recs):
            n = self.hidden[i].shape[0]
            o = int(torch.randint(0, max(1, n - w + 1), (1,), generator=gen))
            m = min(w, n - o)
            out["H"][r, :m] = self.hidden[i][o:o + m].float()
            out["A"][r, :m] = self.tokens[i][o:o + m]
            out["IX"][r, :m] = self.ix[i][o:o + m].long()
            out["LP"][r, :m] = self.lp[i][o:o + m].float()
            out["valid"][r, :m] = True
        return out


def unrolled_loss(head: Any, bt: dict[str, torch.Tensor], unroll: int, feat_weight: float, decay: float,
                  logit_weight: float = 0.0) -> tuple[torch.Tensor, list[float]]:
    """Every window position i starts from the target's state s_0 = H[:, i]; the head steps `unroll` times
    on the target's tokens (as when the drafts before are accepted; the head's own states, never the
    target's, are carried), and step j is scored against the target one position later: cross-entropy
    of the head's distribution over every output row against the target's top LABEL_K ids (renormalised),
    SmoothL1 to the target's state H[:, i + j], and (`logit_weight`) SmoothL1 between the head's and the
    target's raw logits at those ids: softmax forgets a shift of the logits, the repetition penalty does
    not (it divides positive logits and multiplies negative ones), so a head whose logits match only up
    to a shift drafts worse under the default penalty. Returns the loss and, per step, how often the
    head's argmax over every output row is the target's top id."""
    H, A, IX, LP, valid = bt["H"], bt["A"], bt["IX"], bt["LP"], bt["valid"]
    W = H.shape[1]
    n = W - unroll
    s = H[:, :n]  # [B, n, d]
    loss = H.new_zeros(())
    agree = []
    for j in range(1, unroll + 1):
        s = head.step(s, A[:, j - 1: n + j - 1])  # [B, n, d]
        ok = valid[:, j: n + j].float()  # [B, n]
        ix, lp = IX[:, j: n + j], LP[:, j: n + j]  # [B, n, K]
        raw = head.logits(s)  # [B, n, n_out]
        logq = torch.log_softmax(raw, -1)  # [B, n, n_out]
        ce = -(torch.softmax(lp, -1) * logq.gather(-1, ix)).sum(-1)  # [B, n]
        fl = torch.nn.functional.smooth_l1_loss(s, H[:, j: n + j], reduction="none").mean(-1)  # [B, n]
        term = ce + feat_weight * fl  # [B, n]
        if logit_weight:
            with torch.no_grad():
                target_raw = head.logits(H[:, j: n + j]).gather(-1, ix)  # [B, n, K]: E h at the target's top ids
            term = term + logit_weight * torch.nn.functional.smooth_l1_loss(
                raw.gather(-1, ix), target_raw, reduction="none").mean(-1)
        loss = loss + decay ** (j - 1) * (term * ok).sum() / ok.sum().clamp(min=1)
        with torch.no_grad():
            agree.append(float(((logq.argmax(-1) == ix[..., 0]).float() * ok).sum() / ok.sum().clamp(min=1)))
    return loss, agree


def new_head(work: Path, n_out: int) -> Any:
    from edge.drafters.feature_head import FeatureHead, FeatureHeadConfig
    from shared.tokenizer_id import load_tokenizer, tokenizer_fingerprint
    freq = phase_freq(work)
    table, vocab = target_tables()
    cfg = FeatureHeadConfig(hidden_size=table.shape[1], vocab_size=vocab, n_out=n_out, target_model_id=TARGET.name,
                            tokenizer_fingerprint=tokenizer_fingerprint(load_tokenizer(TARGET)))
    head = FeatureHead(cfg)
    ids = torch.tensor(freq["order"][:n_out])
    head.out_ids.copy_(ids)
    head.out.data.copy_(table[ids])
    centred = table - table.mean(0)
    _, _, v = torch.linalg.svd(centred, full_matrices=False)  # v [d, d]
    proj = centred @ v[: cfg.embed_dim].T  # [V, embed_dim]
    head.embed.weight.data.copy_(proj / proj.std())
    return head


def train_loop(tag: str, ck: Path, key: str, module: torch.nn.Module, lr: float, warmup: int,
               args: argparse.Namespace, describe: str, seed: int,
               loss_of: Callable[[torch.Generator], tuple[torch.Tensor, Any]]) -> None:
    """AdamW on `module`'s trainable parameters for --train-steps, or --train-minutes of steps (warm-up,
    then cosine to 10 %), checkpointed to `ck` (under `key`) every 5 minutes and at the end, resumed from
    it when it exists.
    `loss_of(gen)` draws a batch and returns its loss and what to log (agreement)."""
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    state: dict[str, Any] = {"step": 0, "seconds": 0.0, "log": []}
    if ck.exists():
        saved = torch.load(ck)
        module.load_state_dict(saved[key])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
    print(f"[{tag}] {describe}; from step {state['step']}", flush=True)
    gen = torch.Generator().manual_seed(seed + state["step"])
    budget = args.train_minutes * 60.0
    active, t_last = state["seconds"], time.time()  # seconds of steps; a paused one (SIGSTOP) counts 30 s at most

    def done() -> float:  # the share of the budget spent: --train-steps when given, else --train-minutes
        return state["step"] / args.train_steps if args.train_steps else active / budget

    while done() < 1.0:
        t_step = time.time()
        frac = done()
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, (state["step"] + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        loss, agree = loss_of(gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state["step"] += 1
        active += min(time.time() - t_step, 30.0)
        state["args"] = {k: v for k, v in vars(args).items() if k != "phase" and isinstance(v, (int, float, str))}
        if state["step"] % args.log_every == 0:
            state["log"].append({"step": state["step"], "loss": round(float(loss.detach()), 4), "agree": agree})
            print(f"[{tag}] step {state['step']} loss {float(loss.detach()):.3f} agree {agree} {active:.0f} s",
                  flush=True)
        if time.time() - t_last > 300 or done() >= 1.0:
            state["seconds"] = active
            torch.save({key: module.state_dict(), "opt": opt.state_dict(), "state": state}, ck.with_suffix(".tmp"))
            ck.with_suffix(".tmp").rename(ck)
            t_last = time.time()


def phase_train(work: Path, args: argparse.Namespace) -> None:
    """Time-budgeted; checkpoint every few minutes (`head.pt`), resumed by rerunning the same command."""
    torch.set_num_threads(args.threads)
    head = new_head(work, args.n_out)
    data = Windows(*training_set(work, args), args.window + args.unroll)

    def loss_of(gen: torch.Generator) -> tuple[torch.Tensor, Any]:
        loss, agree = unrolled_loss(head, data.batch(args.batch, gen), args.unroll, args.feat_weight, args.decay,
                                    args.logit_weight)
        return loss, [round(a, 3) for a in agree]

    train_loop("train", work / "head.pt", "head", head, args.lr, 100, args, f"{len(data.hidden)} answers, "
               f"{int(data.sizes.sum())} positions", 1000, loss_of)


@torch.no_grad()
def agreement_by_position(head: Any, recs: list[dict[str, Any]], k: int = 8) -> dict[str, Any]:
    """Greedy drafting on the held-out answers, from every start position i as a round would: s_0 is the
    target's state that chose answer token a_i (float16, as the cloud sends it), the head steps through a_i
    and drafts a_{i+1}, a_{i+2}, ... Returns the agreement at draft position j given the drafts before it
    agreed, and the mean tokens a greedy verify call at fixed k would commit (accepted + 1)."""
    hits = torch.zeros(k)
    tried = torch.zeros(k)
    run_len: list[torch.Tensor] = []
    for r in recs:
        H = r["hidden"].float()  # [n, d]
        A = torch.tensor(r["ids"][r["start"]:])  # [n]
        n = H.shape[0]
        if n <= 1:
            continue
        s = H[: n - 1]  # [m, d]: starts i = 0 .. n - 2
        alive = torch.ones(n - 1, dtype=torch.bool)
        run = torch.zeros(n - 1)
        for j in range(1, k + 1):
            idx = torch.arange(n - 1) + j  # the token drafted at position j from start i: a_{i+j}
            ok_pos = idx < n
            s = head.step(s, A[(idx - 1).clamp(max=n - 1)])
            pred = head.out_ids[head.logits(s).argmax(-1)]  # [m]
            good = (pred == A[idx.clamp(max=n - 1)]) & ok_pos
            tried[j - 1] += float((alive & ok_pos).sum())
            hits[j - 1] += float((alive & good).sum())
            alive &= good
            run += alive.float()
        run_len.append(run)
    runs = torch.cat(run_len)  # consecutive agreeing drafts from each start
    return {"by_position": (hits / tried.clamp(min=1)).tolist(), "starts": int(runs.numel()),
            "tokens_per_call": {kk: float(runs.clamp(max=kk).mean() + 1) for kk in (2, 4, 6, 8)}}


def phase_export(work: Path, args: argparse.Namespace) -> None:
    """The trained head into --out (bfloat16 weights, config) and report.json: agreement on the held-out answers."""
    from edge.drafters.feature_head import FeatureHead
    torch.set_num_threads(args.threads)
    saved = torch.load(work / "head.pt")
    head = new_head(work, args.n_out)
    head.load_state_dict(saved["head"])
    head.eval()
    head.save(args.out)
    head = FeatureHead.load(args.out)  # what the edge loads (bfloat16 weights, float32 compute)
    report = {"train_positions": {n: int(sum(r["hidden"].shape[0] for r in load_shards(work, n)))
                                  for n in args.data.split(",")},
              "eval_prompts": len(load_shards(work, "eval")), "steps": saved["state"]["step"],
              "train_minutes": round(saved["state"]["seconds"] / 60, 1), "n_out": args.n_out,
              "freq_coverage": phase_freq(work)["coverage"],
              "eval": agreement_by_position(head, load_shards(work, "eval")),
              "train_sample": agreement_by_position(head, load_shards(work, "chat")[:48]),
              "train_args": saved["state"].get("args", {})}  # what the training ran with
    (args.out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["eval"], indent=1))


def new_draft(work: Path, layers: int, n_out: int, rank: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """The tokens-only draft cut from the target: its embedding (as a rank-`rank` PCA, frozen), its first
    `layers` decoder layers and final norm, and its output rows for the `n_out` most frequent ids, all
    but the embedding trainable. Returns the model and its compact tables (edge/drafters/compact.py)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(TARGET)
    cfg.num_hidden_layers = layers
    cfg.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa")
    w = load_file(str(TARGET / "model.safetensors"))
    keep = {k: v.float() for k, v in w.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    table = keep.pop("lm_head.weight", keep["model.embed_tokens.weight"])  # [V, d] (tied)
    mean = table.mean(0)
    _, sv, vt = torch.linalg.svd(table - mean, full_matrices=False)
    lowrank = (table - mean) @ vt[:rank].T  # [V, r]
    up = vt[:rank]  # [r, d]
    keep["model.embed_tokens.weight"] = lowrank @ up + mean  # the embedding the edge rebuilds
    ids = torch.tensor(phase_freq(work)["order"][:n_out])
    model.load_state_dict(keep, strict=False)
    model.set_output_embeddings(torch.nn.Linear(table.shape[1], n_out, bias=False))
    with torch.no_grad():
        model.get_output_embeddings().weight.copy_(table[ids])
    model.get_input_embeddings().weight.requires_grad_(False)
    # the mean folds into the low-rank factors: one more rank-one term
    tables = {"lowrank": torch.cat([lowrank, torch.ones(lowrank.shape[0], 1)], 1), "up": torch.cat([up, mean[None]]),
              "out_ids": ids}
    return model, tables


class Sequences:
    """Training windows of whole texts (prompt and answer), scored at the answer's positions."""

    def __init__(self, recs: list[dict[str, Any]], labels: list[dict[str, torch.Tensor]], width: int) -> None:
        self.recs, self.labels, self.width = recs, labels, width
        self.sizes = torch.tensor([len(r["ids"]) - r["start"] for r in recs], dtype=torch.float64)

    def batch(self, b: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """ids [B, T]; H [B, T, d] (the target's state where scored); IX, LP [B, T, K]; scored [B, T]."""
        w = self.width
        d = self.recs[0]["hidden"].shape[1]
        out = {"ids": torch.zeros(b, w, dtype=torch.long), "H": torch.zeros(b, w, d),
               "IX": torch.zeros(b, w, LABEL_K, dtype=torch.long), "LP": torch.zeros(b, w, LABEL_K),
               "scored": torch.zeros(b, w, dtype=torch.bool)}
        for r, i in enumerate(torch.multinomial(self.sizes, b, replacement=True, generator=gen).tolist()):
            rec, lab = self.recs[i], self.labels[i]
            ids, first = rec["ids"], rec["start"] - 1  # position `first` + j predicts answer token j
            n = rec["hidden"].shape[0]
            # a window that ends inside the answer, with as much of the text before as fits
            end = min(len(ids), first + 1 + int(torch.randint(1, n + 1, (1,), generator=gen)))
            o = max(0, end - w)
            m = end - o
            out["ids"][r, :m] = torch.tensor(ids[o:end])
            j0 = max(first, o)  # the first scored position
            a, z = j0 - first, end - first  # answer rows a .. z - 1 sit at positions j0 .. end - 1
            z = min(z, n)
            out["H"][r, j0 - o: j0 - o + z - a] = rec["hidden"][a:z].float()
            out["IX"][r, j0 - o: j0 - o + z - a] = lab["ix"][a:z].long()
            out["LP"][r, j0 - o: j0 - o + z - a] = lab["lp"][a:z].float()
            out["scored"][r, j0 - o: j0 - o + z - a] = True
        return out


def draft_loss(model: Any, target_rows: torch.Tensor, bt: dict[str, torch.Tensor], logit_weight: float
               ) -> tuple[torch.Tensor, float]:
    """Cross-entropy of the draft's distribution over its output rows against the target's top LABEL_K
    (renormalised), plus SmoothL1 of its raw logits at those ids against the target's (E h); the draft's
    greedy agreement with the target's top id."""
    ok = bt["scored"]
    logits = model(input_ids=bt["ids"]).logits  # [B, T, n_out]
    lq = torch.log_softmax(logits, -1)
    ce = -(torch.softmax(bt["LP"], -1) * lq.gather(-1, bt["IX"])).sum(-1)  # [B, T]
    term = ce
    if logit_weight:
        with torch.no_grad():
            want = torch.einsum("btkd,btd->btk", target_rows[bt["IX"]], bt["H"])  # [B, T, K]
        term = term + logit_weight * torch.nn.functional.smooth_l1_loss(
            logits.gather(-1, bt["IX"]), want, reduction="none").mean(-1)
    okf = ok.float()
    loss = (term * okf).sum() / okf.sum().clamp(min=1)
    with torch.no_grad():
        agree = float(((logits.argmax(-1) == bt["IX"][..., 0]).float() * okf).sum() / okf.sum().clamp(min=1))
    return loss, agree


def phase_draft_train(work: Path, args: argparse.Namespace) -> None:
    """Time-budgeted like the head's; checkpoint `draft-L{layers}.pt`, resumed by rerunning the command."""
    torch.set_num_threads(args.threads)
    model, _ = new_draft(work, args.draft_layers, args.n_out, args.draft_rank)
    model.train()
    data = Sequences(*training_set(work, args), args.draft_window)
    table, _ = target_tables()
    target_rows = table[torch.tensor(phase_freq(work)["order"][:args.n_out])]  # [n_out, d]

    def loss_of(gen: torch.Generator) -> tuple[torch.Tensor, Any]:
        loss, agree = draft_loss(model, target_rows, data.batch(args.draft_batch, gen), args.logit_weight)
        return loss, round(agree, 3)

    train_loop("draft", work / f"draft-L{args.draft_layers}.pt", "model", model, args.draft_lr, 50, args,
               f"{args.draft_layers} layers, {len(data.recs)} answers, {int(data.sizes.sum())} positions", 2000,
               loss_of)


@torch.no_grad()
def draft_agreement(drafter: Any, recs: list[dict[str, Any]], k: int = 8) -> dict[str, Any]:
    """Greedy agreement of a tokens-only draft on the held-out answers, teacher-forced: while its greedy
    drafts agree with the target's tokens its context is the target's text, so the run of agreeing
    positions from a start is what a greedy verify call from there would accept. Returns the agreement
    at draft position j given the drafts before it agreed, and the mean tokens per call at fixed k."""
    hits, tried = torch.zeros(k), torch.zeros(k)
    runs: list[torch.Tensor] = []
    for r in recs:
        ids, first = r["ids"], r["start"] - 1
        if len(ids) - first < 2:
            continue
        logits = drafter.model(input_ids=torch.tensor([ids[:-1]])).logits[0, first:]  # [n, rows]
        pred = drafter.out_ids[logits.argmax(-1)] if drafter.out_ids is not None else logits.argmax(-1)
        good = (pred == torch.tensor(ids[first + 1:])).float()  # [n]
        run = torch.zeros_like(good)  # run[i]: agreeing positions from start i
        for i in range(good.numel() - 1, -1, -1):
            run[i] = good[i] * (1 + (run[i + 1] if i + 1 < good.numel() else 0))
        runs.append(run)
        for j in range(1, k + 1):  # position j from start i is position i + j - 1, reached when run[i] >= j - 1
            reach = run[: max(0, good.numel() - j + 1)] >= j - 1
            tried[j - 1] += float(reach.sum())
            hits[j - 1] += float((reach & (run[: reach.numel()] >= j)).sum())
    allruns = torch.cat(runs)
    return {"by_position": (hits / tried.clamp(min=1)).tolist(), "starts": int(allruns.numel()),
            "tokens_per_call": {kk: float(allruns.clamp(max=kk).mean() + 1) for kk in (2, 4, 6, 8)}}


def phase_draft_export(work: Path, args: argparse.Namespace) -> None:
    """The trained draft into --draft-out as a compact directory (bfloat16), with the target's tokenizer
    files and report.json (agreement on the held-out answers)."""
    import shutil

    from edge.drafters.compact import save_compact
    from edge.drafters.model import ModelDrafter
    torch.set_num_threads(args.threads)
    saved = torch.load(work / f"draft-L{args.draft_layers}.pt")
    model, tables = new_draft(work, args.draft_layers, args.n_out, args.draft_rank)
    model.load_state_dict(saved["model"])
    out = args.draft_out
    save_compact(model.eval(), tables["out_ids"], model.get_output_embeddings().weight, tables["lowrank"],
                 tables["up"], out)
    for f in TARGET.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    drafter = ModelDrafter(out)  # what the edge loads
    report = {"layers": args.draft_layers, "embed_rank": args.draft_rank, "n_out": args.n_out,
              "train_positions": {n: int(sum(r["hidden"].shape[0] for r in load_shards(work, n)))
                                  for n in args.data.split(",")},
              "steps": saved["state"]["step"], "train_minutes": round(saved["state"]["seconds"] / 60, 1),
              "eval": draft_agreement(drafter, load_shards(work, "eval")),
              "train_sample": draft_agreement(drafter, load_shards(work, "chat")[:48]),
              "train_args": saved["state"].get("args", {})}
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["eval"], indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("phase", choices=["prompts", "answers", "doc-answers", "eval", "text", "freq", "train", "export",
                                      "draft-train", "draft-export", "all"])
    ap.add_argument("--work", type=Path, required=True, help="data and checkpoints (outside the work tree)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=REPO / "models" / "smollm2-135m-head", help="where export writes")
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--train-prompts", type=int, default=4000)
    ap.add_argument("--answer-shards", type=int, default=1 << 30,
                    help="stop the answers phase after this many shards (the shortest prompts first)")
    ap.add_argument("--doc-prompts", type=int, default=1500, help="prompts about the standard library's docs")
    ap.add_argument("--text-tokens", type=int, default=800_000, help="teacher-forced tokens of Python's own text")
    ap.add_argument("--text-chunk", type=int, default=256)
    ap.add_argument("--data", default="chat", help="comma-separated shard sets to train on: chat, docs, text")
    ap.add_argument("--n-out", type=int, default=16384, help="rows of the frequency-ranked output layer")
    ap.add_argument("--train-minutes", type=float, default=60)
    ap.add_argument("--train-steps", type=int, default=0,
                    help="budget in steps instead of minutes (a machine shared with other work slows steps, not this)")
    ap.add_argument("--batch", type=int, default=32, help="windows per step")
    ap.add_argument("--window", type=int, default=48, help="start positions per window")
    ap.add_argument("--unroll", type=int, default=6, help="drafted positions scored per start")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--feat-weight", type=float, default=1.0)
    ap.add_argument("--logit-weight", type=float, default=0.1,
                    help="weight of SmoothL1 between the head's and the target's raw logits at the target's top ids")
    ap.add_argument("--decay", type=float, default=0.8, help="weight of unrolled step j: decay ** (j - 1)")
    ap.add_argument("--draft-layers", type=int, default=3, help="the target's first layers the tokens-only draft keeps")
    ap.add_argument("--draft-rank", type=int, default=128, help="rank of the tokens-only draft's input embedding")
    ap.add_argument("--draft-window", type=int, default=192, help="tokens per training window of the draft")
    ap.add_argument("--draft-batch", type=int, default=8)
    ap.add_argument("--draft-lr", type=float, default=3e-4)
    ap.add_argument("--draft-out", type=Path, default=REPO / "models" / "smollm2-135m-draft-from-target")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    from head_prompts import build_prompts
    train, evals = build_prompts()
    (args.work / "prompts.json").write_text(json.dumps({"train": train, "eval": evals}, indent=0))
    if args.phase in ("eval", "all"):
        phase_answers(args.work, evals, "eval", args, sample_every=0)
    if args.phase in ("answers", "all"):
        phase_answers(args.work, train[:args.train_prompts], "chat", args, sample_every=4)
    if args.phase in ("doc-answers", "all"):
        from head_prompts import doc_prompts
        phase_answers(args.work, doc_prompts(args.doc_prompts), "docs", args, sample_every=4)
    if args.phase in ("text", "all"):
        phase_text(args.work, args)
    if args.phase in ("freq", "train", "all"):
        for name in args.data.split(","):
            phase_labels(args.work, name, args.n_out, args.threads)
    if args.phase in ("train", "all"):
        phase_train(args.work, args)
    if args.phase in ("export", "all"):
        phase_export(args.work, args)
    if args.phase in ("draft-train", "all"):
        phase_draft_train(args.work, args)
    if args.phase in ("draft-export", "all"):
        phase_draft_export(args.work, args)
    if args.phase == "freq":
        res = phase_freq(args.work)
        print({k: v for k, v in res.items() if k != "order"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
