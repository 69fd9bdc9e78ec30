"""A draft head that attends over the target's past states (EAGLE, arXiv 2401.15077): the module and its files.

The cloud sends the edge the target's state f_t for every committed position: its output-layer input
(the last hidden state, after the final norm) after reading x_0..x_t, so `softmax(E f_t)` is the
target's distribution of x_{t+1}. The head's input at position t is the pair (f_t, x_{t+1}); one
Llama-style decoder layer over the sequence of such pairs predicts the state one position later:

    x_t = fc([rmsnorm(f_t), embed(x_{t+1})])                 embed: the target's table, projected, frozen
    h_t = x_t + attn(norm(x_t))  (RoPE at t, GQA, keys of the last `window` positions only)
    h_t = h_t + mlp(norm(h_t))   (gated, as Llama's)
    g_t = out_proj(norm(h_t))    ~ f_{t+1}
    q(. | g_t) = softmax(out g_t) over `out_ids`             out: the target's own output rows, frozen

To draft, the head feeds (g_t, its drafted token) at position t + 1 and goes on; its keys and values
are the caller's to cache (`forward` returns them), so rollback is cropping that cache by position.
The output layer keeps the `n_out` most frequent ids of the target's answers (FR-Spec, arXiv
2502.14856): q is 0 elsewhere, which the verify rule's residual covers exactly.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from shared.cpu_weights import linear, pack_weights, packed_parameter

CONFIG_NAME = "attention_head.json"
WEIGHTS_NAME = "attention_head.safetensors"


@dataclass
class AttentionHeadConfig:
    # width d of the target's state (its output layer's input)
    hidden_size: int
    # ids of the target's tokenizer: rows of the input embedding
    vocab_size: int
    # rows of the output layer (the most frequent ids of the target's answers)
    n_out: int
    # width of the frozen input embedding (the target's table on its top principal directions; d: all of it)
    embed_dim: int = 256
    # width of the decoder layer
    width: int = 576
    # query heads
    heads: int = 9
    # key/value heads (grouped-query attention: heads is a multiple of it)
    kv_heads: int = 3
    # width of one head
    head_dim: int = 64
    # inner width of the gated MLP
    ffn_size: int = 1536
    # positions a query sees: its own and the window - 1 before it
    window: int = 64
    # RoPE base (the target's)
    rope_theta: float = 100000.0
    # RMSNorm epsilon
    rms_norm_eps: float = 1e-5
    # the target it was trained on and its tokenizer's fingerprint (shared/tokenizer_id.py)
    target_model_id: str = ""
    tokenizer_fingerprint: str = ""


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x ([B, H, T, Dh]) rotated by its positions ([B, T]) as Llama does (halves, not interleaved pairs)."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)  # [Dh / 2]
    ang = positions[:, None, :, None].float() * inv  # [B, 1, T, Dh / 2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)  # [B, 1, T, Dh]
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)  # [B, H, T, Dh]
    return (x * cos + rot * sin).to(x.dtype)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Which keys each query sees ([B, T, S] bool): keys at positions k_pos ([B, S]) no later than the
    query's position q_pos ([B, T]) and fewer than `window` before it."""
    gap = q_pos[:, :, None] - k_pos[:, None, :]  # [B, T, S]
    return (gap >= 0) & (gap < window)


class AttentionHead(nn.Module):
    out_ids: torch.Tensor  # [n_out] the vocabulary ids of the output rows (a buffer)

    def __init__(self, cfg: AttentionHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, w, eps = cfg.hidden_size, cfg.width, cfg.rms_norm_eps
        self.embed = nn.Embedding(cfg.vocab_size, cfg.embed_dim)  # frozen
        self.embed.weight.requires_grad_(False)
        self.in_norm = nn.RMSNorm(d, eps=eps)
        self.fc = nn.Linear(d + cfg.embed_dim, w, bias=False)
        self.attn_norm = nn.RMSNorm(w, eps=eps)
        self.q = nn.Linear(w, cfg.heads * cfg.head_dim, bias=False)
        self.k = nn.Linear(w, cfg.kv_heads * cfg.head_dim, bias=False)
        self.v = nn.Linear(w, cfg.kv_heads * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * cfg.head_dim, w, bias=False)
        self.mlp_norm = nn.RMSNorm(w, eps=eps)
        self.gate = nn.Linear(w, cfg.ffn_size, bias=False)
        self.up = nn.Linear(w, cfg.ffn_size, bias=False)
        self.down = nn.Linear(cfg.ffn_size, w, bias=False)
        self.norm = nn.RMSNorm(w, eps=eps)
        self.out_proj = nn.Linear(w, d, bias=False)
        # the target's output rows of `out_ids` (frozen): logits of a state are the target's own logits
        self.out = nn.Parameter(torch.zeros(cfg.n_out, d), requires_grad=False)
        self.register_buffer("out_ids", torch.zeros(cfg.n_out, dtype=torch.long))

    def forward(self, states: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                past_k: torch.Tensor | None = None, past_v: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Predicted next states for T new pairs (states [B, T, d], the tokens after them [B, T], at
        `positions` [B, T]) after P cached ones (past_k, past_v [B, Hkv, P, Dh] with RoPE applied, or None).

        `mask` ([B, T, P + T] bool, True: seen) says which of the cached then new keys each query sees;
        None: the keys are taken as one run of consecutive positions ending at the new ones, each query
        seeing those at or before it within the window (all the cache when P < window - T + 1).
        Returns (pred [B, T, d], k [B, Hkv, T, Dh], v [B, Hkv, T, Dh]): the new keys and values, for the
        caller to append to its cache.
        """
        cfg = self.cfg
        b, t, _ = states.shape
        x = self.fc(torch.cat([self.in_norm(states), self.embed(tokens)], -1))  # [B, T, w]
        a = self.attn_norm(x)  # [B, T, w]
        q = rope(self.q(a).view(b, t, cfg.heads, cfg.head_dim).transpose(1, 2), positions, cfg.rope_theta)  # [B, H, T, Dh]
        k = rope(self.k(a).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2), positions, cfg.rope_theta)  # [B, Hkv, T, Dh]
        v = self.v(a).view(b, t, cfg.kv_heads, cfg.head_dim).transpose(1, 2)  # [B, Hkv, T, Dh]
        keys = k if past_k is None else torch.cat([past_k, k], 2)  # [B, Hkv, P + T, Dh]
        values = v if past_v is None else torch.cat([past_v, v], 2)  # [B, Hkv, P + T, Dh]
        if mask is None:
            p = keys.shape[2] - t
            idx = torch.arange(p + t, device=states.device).expand(b, -1)  # [B, P + T]
            mask = window_mask(idx[:, p:], idx, cfg.window)  # [B, T, P + T]
        att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None],
                                             enable_gqa=cfg.heads != cfg.kv_heads)  # [B, H, T, Dh]
        h = x + self.o(att.transpose(1, 2).reshape(b, t, cfg.heads * cfg.head_dim))  # [B, T, w]
        m = self.mlp_norm(h)  # [B, T, w]
        h = h + self.down(F.silu(self.gate(m)) * self.up(m))  # [B, T, w]
        return self.out_proj(self.norm(h)), k, v  # [B, T, d], [B, Hkv, T, Dh] x 2

    def logits(self, s: torch.Tensor) -> torch.Tensor:
        """Logits over `out_ids` ([..., n_out]) of states ([..., d])."""
        return linear(s, self.out)

    def save(self, out_dir: Path) -> None:
        from safetensors.torch import save_file
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / CONFIG_NAME).write_text(json.dumps(asdict(self.cfg), indent=1) + "\n")
        tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
                   for k, v in self.state_dict().items()}
        save_file(tensors, str(out_dir / WEIGHTS_NAME))

    @classmethod
    def load(cls, head_dir: Path, device: str = "cpu", pack: bool = True) -> AttentionHead:
        """The head in `head_dir` in float32 for inference; `pack`: Linear weights packed for the CPU
        (shared/cpu_weights.py; no gradient then)."""
        from safetensors.torch import load_file
        head_dir = Path(head_dir)
        cfg = AttentionHeadConfig(**json.loads((head_dir / CONFIG_NAME).read_text()))
        head = cls(cfg)
        state = {k: (v.float() if v.is_floating_point() else v)
                 for k, v in load_file(str(head_dir / WEIGHTS_NAME)).items()}
        head.load_state_dict(state)
        head = head.to(device).eval()
        if pack:
            pack_weights(head)
            head.out = packed_parameter(head.out)
        return head


def is_attention_head(path: str | Path) -> bool:
    return (Path(path) / CONFIG_NAME).is_file()


def config_for_target(target_dir: Path, n_out: int, **knobs: object) -> AttentionHeadConfig:
    """A head's config for the target in `target_dir`: its width, vocabulary, RoPE base and tokenizer;
    `knobs` set the head's own fields (embed_dim, width, window, ...)."""
    from transformers import AutoConfig

    from shared.tokenizer_id import load_tokenizer, tokenizer_fingerprint
    tc = AutoConfig.from_pretrained(target_dir)
    rope_params = getattr(tc, "rope_parameters", None) or {}
    theta = float(rope_params.get("rope_theta", getattr(tc, "rope_theta", 10000.0)))
    base = dict(hidden_size=tc.hidden_size, vocab_size=tc.vocab_size, n_out=n_out, rope_theta=theta,
                rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-5)), target_model_id=Path(target_dir).name,
                tokenizer_fingerprint=tokenizer_fingerprint(load_tokenizer(target_dir)))
    return AttentionHeadConfig(**{**base, **knobs})  # type: ignore[arg-type]


def initial_head(target_dir: Path, out_ids: torch.Tensor, cfg: AttentionHeadConfig, seed: int = 0) -> AttentionHead:
    """A new head for the target in `target_dir`: the output rows of `out_ids` ([n_out]) and the input
    embedding (the target's table, centred, on its top `embed_dim` principal directions, unit variance)
    from the target, frozen; every trained weight drawn from N(0, 0.02), norms at 1."""
    from transformers import AutoModelForCausalLM
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    table = target.get_input_embeddings().weight.detach().float()  # type: ignore[operator]  # [V, d]
    rows = target.get_output_embeddings().weight.detach().float()[out_ids]  # [n_out, d]
    assert rows.shape == (cfg.n_out, cfg.hidden_size) and table.shape[0] == cfg.vocab_size
    torch.manual_seed(seed)
    head = AttentionHead(cfg)
    with torch.no_grad():
        for m in head.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(std=0.02)
        centred = table - table.mean(0)  # [V, d]
        _, _, vt = torch.linalg.svd(centred, full_matrices=False)  # vt [d, d]
        proj = centred @ vt[: cfg.embed_dim].T  # [V, embed_dim]
        head.embed.weight.copy_(proj / proj.std())
        head.out.copy_(rows)
        head.out_ids.copy_(out_ids)
    return head
