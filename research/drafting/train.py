"""Training the attention head (research/heads/attention_head.py) as it drafts: the training-time test.

Drafting feeds the head its own predictions: from the real pairs (f_s, x_{s+1}) for s <= t, step 1
predicts g_1 ~ f_{t+1}; step j > 1 feeds (g_{j-1}, x_{t+j}) at position t + j - 1 and predicts
g_j ~ f_{t+j}. Training unrolls exactly that for `unroll` steps at every position t of a window at once
(EAGLE-3's training-time test, arXiv 2503.01840; HASS, arXiv 2408.15766): step j's queries see the real
pairs' keys at positions <= t (step 1's, within the window) and their own chain's keys of steps 2..j
(`ttt_mask`), the teacher's tokens as inputs. Step j's loss at t is the soft cross-entropy between the
head's distribution softmax(out g_j) and the target's own softmax(out f_{t+j}), both over the `n_out`
output rows (the target's restricted to them and renormalised, from the stored states), weighted
`decay ** (j - 1)`, counted only where the token it predicts (x_{t+j+1}) lies in the answer. A SmoothL1
to f_{t+j} (`feat_weight`) is off by default, as in EAGLE-3: it has not been measured to help here.
Gradients flow through the whole chain.

The loop is `drafting.loop.fit` (nanoGPT's): AdamW, warm-up then cosine to a floor, a budget in steps or
in minutes of steps (a step stopped with SIGSTOP counts at most `pause_cap` seconds), a checkpoint (head,
optimizer, step, generator) in the work directory every `checkpoint_minutes` and at the end; SIGTERM or
SIGINT checkpoint and stop; rerunning the same command resumes. Run it under `nice -n 19` (research/scripts/train_attention_head.py).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

from research.drafting.loop import Budget, fit, save_checkpoint, warmup_cosine
from research.drafting.shards import DATA
from research.drafting.states import is_heldout, load_states, output_ids
from research.drafting.target import TARGET_DIR
from research.heads.attention_head import (
    AttentionHead,
    AttentionHeadConfig,
    config_for_target,
    initial_head,
    window_mask,
)

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    # work directory outside the git tree: states/, freq.json, ckpt.pt
    work: str = "/work/runs/head2"
    # answer shards (drafting/shards.py layout)
    data: str = str(DATA)
    # the target model's directory
    target: str = str(TARGET_DIR)
    # answers shards with index % heldout_every == 0 are held out (evaluation only)
    heldout_every: int = 20
    # output rows: the most frequent ids of the training answers (FR-Spec)
    n_out: int = 8192
    # the head's shape (AttentionHeadConfig): frozen embedding width, layer width, heads, MLP, window
    embed_dim: int = 256
    width: int = 576
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    ffn_size: int = 1536
    window: int = 64
    # budget: steps when > 0, else minutes of steps
    steps: int = 0
    minutes: float = 60.0
    # windows per step
    batch: int = 8
    # positions per window (every one starts a chain)
    seq: int = 128
    # steps each chain is unrolled on the head's own predictions (k)
    unroll: int = 6
    # peak learning rate, linear warm-up steps, cosine floor (a share of lr), AdamW weight decay
    lr: float = 5e-4
    warmup: int = 100
    floor: float = 0.1
    weight_decay: float = 0.01
    # weight of unrolled step j: decay ** (j - 1)
    decay: float = 0.8
    # input states get uniform noise of this half-width, in units of each state's RMS (EAGLE's noise)
    noise: float = 0.1
    # weight of SmoothL1 between g_j and f_{t+j} (0: soft cross-entropy only)
    feat_weight: float = 0.0
    # gradient norm clip
    grad_clip: float = 1.0
    # minutes between checkpoints
    checkpoint_minutes: float = 5.0
    # most seconds one step counts toward the budget (a SIGSTOP inside a step)
    pause_cap: float = 30.0
    # steps between log lines
    log_every: int = 10
    # seed of the initial weights, the windows drawn and the noise
    seed: int = 0
    # torch threads
    threads: int = 2
    # evaluation: held-out greedy rows scored (the first ones), drafts per start
    eval_rows: int = 400
    eval_k: int = 8

    def head_config(self) -> AttentionHeadConfig:
        return config_for_target(Path(self.target), self.n_out, embed_dim=self.embed_dim, width=self.width,
                                 heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim,
                                 ffn_size=self.ffn_size, window=self.window)


def train_shards(cfg: TrainConfig) -> list[int]:
    """The indices of the states files present that are not held out."""
    d = Path(cfg.work) / "states"
    idx = sorted(int(p.stem) for p in d.glob("*.pt")) if d.is_dir() else []
    return [i for i in idx if not is_heldout(i, cfg.heldout_every)]


@dataclass
class Windows:
    """Windows of `seq` consecutive stored positions of the rows, rows drawn by their length."""
    # rows of states files (drafting/states.py)
    rows: list[dict[str, Any]]
    # positions per window
    seq: int
    sizes: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.rows = [r for r in self.rows if r["states"].shape[0] >= 2]
        self.sizes = torch.tensor([float(r["states"].shape[0]) for r in self.rows])

    def batch(self, b: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
        """S [B, T, d] the states f_t; X [B, T] the tokens x_{t+1}; P [B, T] the positions t (pads go on
        counting); valid [B, T]; scored [B, T]: a real position whose next token is an answer token."""
        d, t = self.rows[0]["states"].shape[1], self.seq
        out = {"S": torch.zeros(b, t, d), "X": torch.zeros(b, t, dtype=torch.long),
               "P": torch.zeros(b, t, dtype=torch.long), "valid": torch.zeros(b, t, dtype=torch.bool),
               "scored": torch.zeros(b, t, dtype=torch.bool)}
        for r, i in enumerate(torch.multinomial(self.sizes, b, replacement=True, generator=gen).tolist()):
            row = self.rows[i]
            n = row["states"].shape[0]
            o = int(torch.randint(0, max(1, n - t + 1), (1,), generator=gen))
            m, first = min(t, n - o), row["start"] + o
            out["S"][r, :m] = row["states"][o:o + m].float()
            out["X"][r, :m] = row["ids"][first + 1:first + 1 + m].long()
            out["P"][r] = first + torch.arange(t)
            out["valid"][r, :m] = True
            out["scored"][r, :m] = out["P"][r, :m] + 1 >= row["prompt_len"]
        return out


def ttt_mask(positions: torch.Tensor, j: int, window: int) -> torch.Tensor:
    """Step j's mask ([B, T, j * T] bool) over the keys [step 1 | step 2 | ... | step j], each T chains
    at positions ([B, T]) t, t + 1, ..., t + j - 1: chain t's query (at t + j - 1) sees the real keys at
    positions s <= t with t + j - 1 - s < window, and its own chain's keys of steps 2..j."""
    b, t = positions.shape
    real = window_mask(positions, positions, window - j + 1)  # [B, T, T]
    own = torch.eye(t, dtype=torch.bool, device=positions.device).expand(b, t, t)  # [B, T, T]
    return torch.cat([real] + [own & (j - i < window) for i in range(2, j + 1)], -1)  # [B, T, j * T]


def shift(x: torch.Tensor, j: int) -> torch.Tensor:
    """x[:, i + j] at i ([B, T, ...]), zeros past the end."""
    return torch.cat([x[:, j:], torch.zeros_like(x[:, :j])], 1)


def unroll(head: AttentionHead, states: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, k: int,
           own_tokens: bool = False) -> list[torch.Tensor]:
    """[g_1, ..., g_k], each [B, T, d]: every position t of the window (states f_t [B, T, d], tokens
    x_{t+1} [B, T], positions [B, T]) drafting k steps on its own predicted states. Step j > 1 is fed
    x_{t+j} (the teacher's token) or, with `own_tokens`, the head's argmax after g_{j-1} (as greedy
    drafting does)."""
    preds: list[torch.Tensor] = []
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    s, x = states, tokens
    for j in range(1, k + 1):
        past_k, past_v = (torch.cat(ks, 2), torch.cat(vs, 2)) if ks else (None, None)  # [B, Hkv, (j-1) T, Dh]
        g, kk, vv = head(s, x, positions + j - 1, past_k, past_v, ttt_mask(positions, j, head.cfg.window))
        preds.append(g)
        ks.append(kk)
        vs.append(vv)
        s = g  # [B, T, d]
        x = head.out_ids[head.logits(g).argmax(-1)] if own_tokens else shift(tokens, j)  # [B, T]
    return preds


def ttt_loss(head: AttentionHead, bt: dict[str, torch.Tensor], cfg: TrainConfig,
             gen: torch.Generator) -> tuple[torch.Tensor, list[float]]:
    """The unrolled loss of one batch (module docstring) and, per step, how often the head's argmax is the
    target's argmax over the output rows."""
    S, X, P, scored = bt["S"], bt["X"], bt["P"], bt["scored"]
    with torch.no_grad():
        target = torch.softmax(head.logits(S), -1)  # [B, T, n_out]
        rms = S.pow(2).mean(-1, keepdim=True).sqrt()  # [B, T, 1]
        noisy = S + cfg.noise * rms * (2 * torch.rand(S.shape, generator=gen) - 1)  # [B, T, d]
    best = target.argmax(-1)  # [B, T] the target's argmax over the output rows
    loss = S.new_zeros(())
    agree = []
    for j, g in enumerate(unroll(head, noisy, X, P, cfg.unroll), 1):
        ok = shift(scored, j).float()  # [B, T]
        p = shift(target, j)  # [B, T, n_out]
        logq = torch.log_softmax(head.logits(g), -1)  # [B, T, n_out]
        term = -(p * logq).sum(-1)  # [B, T]
        if cfg.feat_weight:
            term = term + cfg.feat_weight * F.smooth_l1_loss(g, shift(S, j), reduction="none").mean(-1)
        n = ok.sum().clamp(min=1)
        loss = loss + cfg.decay ** (j - 1) * (term * ok).sum() / n
        agree.append(float(((logq.detach().argmax(-1) == shift(best, j)).float() * ok).sum() / n))
    return loss, agree


def start(cfg: TrainConfig, command: str) -> tuple[AttentionHead, Windows, torch.optim.Optimizer, torch.Generator,
                                                  dict[str, Any]]:
    """The head, the training windows, the optimizer, the generator and the run's state: new, or resumed
    from the work directory's checkpoint (the training shards present now, which may be more than before)."""
    work = Path(cfg.work)
    hc = cfg.head_config()
    ids = torch.tensor(output_ids(work, Path(cfg.data), hc.vocab_size, cfg.n_out, cfg.heldout_every)["ids"])
    head = initial_head(Path(cfg.target), ids, hc, seed=cfg.seed)
    shards = train_shards(cfg)
    data = Windows([r for i in shards for r in load_states(work / "states" / f"{i:05d}.pt")], cfg.seq)
    matrices = [p for p in head.parameters() if p.requires_grad and p.dim() >= 2]
    vectors = [p for p in head.parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW([{"params": matrices, "weight_decay": cfg.weight_decay},
                             {"params": vectors, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(cfg.seed)
    state: dict[str, Any] = {"step": 0, "seconds": 0.0, "log": [], "shards": [], "positions": 0,
                             "answer_tokens": 0, "commands": []}
    if (work / "ckpt.pt").exists():
        saved = torch.load(work / "ckpt.pt", weights_only=False)
        head.load_state_dict(saved["head"])
        opt.load_state_dict(saved["opt"])
        state, _ = saved["state"], gen.set_state(saved["gen"])
    state["shards"] = sorted(set(state["shards"]) | set(shards))
    state["positions"] = max(state["positions"], int(data.sizes.sum()))
    state["answer_tokens"] = max(state["answer_tokens"], sum(len(r["ids"]) - r["prompt_len"] for r in data.rows))
    state["commands"].append({"command": command, "from_step": state["step"], "shards": len(shards)})
    state["config"] = asdict(cfg)
    log.info("%d rows, %d positions from %d shards; from step %d", len(data.rows), int(data.sizes.sum()),
             len(shards), state["step"])
    return head, data, opt, gen, state


def train(cfg: TrainConfig, command: str = "") -> dict[str, Any]:
    """Train (or resume) to the budget (drafting.loop.fit); returns the run's state (step, seconds, log,
    shards, commands)."""
    torch.set_num_threads(cfg.threads)
    head, data, opt, gen, state = start(cfg, command)
    params = [p for p in head.parameters() if p.requires_grad]

    def loss_of() -> tuple[torch.Tensor, dict[str, Any]]:
        loss, agree = ttt_loss(head, data.batch(cfg.batch, gen), cfg, gen)
        return loss, {"agree": [round(a, 3) for a in agree]}

    def save() -> None:
        save_checkpoint(Path(cfg.work) / "ckpt.pt", {"head": head.state_dict(), "head_config": asdict(head.cfg),
                                                     "opt": opt.state_dict(), "state": state, "gen": gen.get_state()})

    budget = Budget(steps=cfg.steps, minutes=0.0 if cfg.steps else cfg.minutes, pause_cap=cfg.pause_cap)
    return fit(params, opt, loss_of, warmup_cosine(cfg.lr, cfg.warmup, cfg.floor), budget, state,
               grad_clip=cfg.grad_clip, log_every=cfg.log_every, save=save, checkpoint_s=60 * cfg.checkpoint_minutes)


def trained_head(cfg: TrainConfig) -> tuple[AttentionHead, dict[str, Any]]:
    """The checkpoint's head (float32, trainable form) and its run state."""
    saved = torch.load(Path(cfg.work) / "ckpt.pt", weights_only=False)
    head = AttentionHead(AttentionHeadConfig(**saved["head_config"]))
    head.load_state_dict(saved["head"])
    return head.eval(), dict(saved["state"])
