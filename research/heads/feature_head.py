"""A draft head fed by the target's hidden state: the module, its files, and the drafter around it.

After every round the cloud sends one vector (PROTOCOL.md, "Feature-fed drafting"): the target's
output-layer input `h` after reading `S[:prefix_len]`, whose logits `E h` are the target's own
distribution of `S[prefix_len]`. The head carries that state forward by itself, one token at a
time, recurrently (the one-vector-per-round design of ReDrafter, arXiv 2403.09919, with EAGLE's
idea of predicting the next feature, arXiv 2401.15077):

    s_0 = h
    s_j = s_{j-1} + Block(s_{j-1}, embed(x_j))       x_j: the token s_{j-1} predicted (known or drafted)
    q(. | s_j) = softmax(W s_j) over `out_ids`        W: the target's own output rows for those ids

so `s_j` is trained to be the target's next hidden state (`h` one position later) and its logits to
be the target's. The output layer keeps only the `n_out` most frequent ids of the target's answers
(FR-Spec, arXiv 2502.14856): q is 0 elsewhere, which the verify rule's residual covers exactly.
The input embedding covers every id (the cloud's correction may be any token): the target's table
projected onto its top principal directions, frozen.

`q` is the head's own probability of its token, so the verify rule, the residual and every
exactness test are those of any other draft.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from edge.drafters.base import DraftBlock
from edge.drafters.causal import DRAFT_STREAM
from edge.drafters.tree import TreeShape, grow_tree
from shared.config import SamplingConfig
from shared.cpu_weights import linear, pack_weights, packed_parameter
from shared.rng import position_uniform, sample_index
from shared.sampling import process_logits

from .head_drafter import HeadDrafter

CONFIG_NAME = "feature_head.json"
WEIGHTS_NAME = "feature_head.safetensors"


@dataclass
class FeatureHeadConfig:
    # width of the target's hidden state (its output layer's input)
    hidden_size: int
    # ids of the target's tokenizer: rows of the input embedding
    vocab_size: int
    # rows of the output layer (the most frequent ids of the target's answers)
    n_out: int
    # width of the frozen input embedding (principal directions of the target's table)
    embed_dim: int = 128
    # inner width of each block's gated MLP
    ffn_size: int = 1536
    # blocks per step
    blocks: int = 2
    # RMSNorm epsilon
    rms_norm_eps: float = 1e-5
    # the target it was trained on and its tokenizer's fingerprint (shared/tokenizer_id.py)
    target_model_id: str = ""
    tokenizer_fingerprint: str = ""


class Block(nn.Module):
    """s -> s + down(silu(gate(x)) * up(x)),  x = [rmsnorm(s), e] (e only in the first block)."""

    def __init__(self, d: int, e: int, f: int, eps: float) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=eps)
        self.gate = nn.Linear(d + e, f, bias=False)
        self.up = nn.Linear(d + e, f, bias=False)
        self.down = nn.Linear(f, d, bias=False)
        nn.init.zeros_(self.down.weight)  # a new head starts as the identity: s_j = s_{j-1}

    def forward(self, s: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        x = self.norm(s)  # [..., d]
        if e is not None:
            x = torch.cat([x, e], -1)  # [..., d + e]
        return s + self.down(nn.functional.silu(self.gate(x)) * self.up(x))  # [..., d]


class FeatureHead(nn.Module):
    out_ids: torch.Tensor  # [n_out] the vocabulary ids of the output rows (a buffer)

    def __init__(self, cfg: FeatureHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.embed_dim)  # frozen
        self.embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(cfg.hidden_size, cfg.embed_dim if i == 0 else 0, cfg.ffn_size,
                                          cfg.rms_norm_eps) for i in range(cfg.blocks))
        # the target's output rows of `out_ids` (frozen): logits of a state are the target's own logits
        self.out = nn.Parameter(torch.zeros(cfg.n_out, cfg.hidden_size), requires_grad=False)
        self.register_buffer("out_ids", torch.zeros(cfg.n_out, dtype=torch.long))

    def step(self, s: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The state one position later ([..., d]) from a state ([..., d]) and the token after it ([...])."""
        e = self.embed(x)  # [..., embed_dim]
        for i, b in enumerate(self.blocks):
            s = b(s, e if i == 0 else None)
        return s

    def logits(self, s: torch.Tensor) -> torch.Tensor:
        """Logits over `out_ids` ([..., n_out])."""
        return linear(s, self.out)

    def save(self, out_dir: Path) -> None:
        from safetensors.torch import save_file
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / CONFIG_NAME).write_text(json.dumps(asdict(self.cfg), indent=1) + "\n")
        tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
                   for k, v in self.state_dict().items()}
        save_file(tensors, str(out_dir / WEIGHTS_NAME))

    @classmethod
    def load(cls, head_dir: Path, device: str = "cpu") -> FeatureHead:
        from safetensors.torch import load_file
        head_dir = Path(head_dir)
        cfg = FeatureHeadConfig(**json.loads((head_dir / CONFIG_NAME).read_text()))
        head = cls(cfg)
        state = {k: (v.float() if v.is_floating_point() else v) for k, v in load_file(str(head_dir / WEIGHTS_NAME)).items()}
        head.load_state_dict(state)
        head = head.to(device).eval()
        pack_weights(head)
        head.out = packed_parameter(head.out)
        return head


def is_feature_head(path: str | Path) -> bool:
    return (Path(path) / CONFIG_NAME).is_file()


@dataclass
class Feature:
    """The target's state the cloud sent: it follows `anchor` (= S[:prefix_len])."""
    # the tokens it was computed after
    anchor: list[int]
    # [d] float32
    vector: torch.Tensor


class FeatureDrafter(HeadDrafter[FeatureHead]):
    """Drafts from the cloud's latest feature; without a usable one, the tokens-only `fallback`.

    A feature is usable when the committed S still starts with its anchor: the head then steps
    through the tokens of S after the anchor (the round's correction or bonus, locally committed
    tokens) and drafts from there. A reopen, a resync and a failover send a new feature; a cloud
    that sends none leaves every round on the fallback.
    """

    def __init__(self, head: FeatureHead, fallback: object | None) -> None:
        super().__init__(head, fallback)
        self.feature: Feature | None = None

    @classmethod
    def from_dir(cls, head_dir: str | Path, fallback: object | None, device: str = "cpu") -> FeatureDrafter:
        return cls(FeatureHead.load(Path(head_dir), device), fallback)

    def fork(self) -> FeatureDrafter:
        return FeatureDrafter(self.head, self._forked_fallback())

    def reset(self) -> None:
        self.feature = None
        self._reset_fallback()

    def set_feature(self, anchor: Sequence[int], vector: torch.Tensor) -> None:
        """The cloud's state after `anchor`; one of another width than the head's (a cloud serving another
        target) is dropped, and rounds draft with the fallback."""
        v = vector.float().reshape(-1)
        self.feature = Feature(list(anchor), v) if v.numel() == self.head.cfg.hidden_size else None

    def usable(self, context: Sequence[int]) -> bool:
        f = self.feature
        if f is None or len(f.anchor) > len(context):
            return False
        n = len(f.anchor)
        return n == 0 or (context[n - 1] == f.anchor[-1] and list(context[:n]) == f.anchor)

    def _head_tree(self, context: Sequence[int], shape: TreeShape, cfg: SamplingConfig) -> DraftBlock:
        """One batched head step per level from the feature (edge/drafters/tree.py)."""
        head = self.head
        s0 = self._state_after(context)  # [d]
        states: dict[int, torch.Tensor] = {}

        def expand(nodes: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
            before = torch.stack([states[p] if p >= 0 else s0 for p in parents])  # [w, d]
            after = head.step(before, torch.tensor(tokens, device=before.device))  # [w, d]
            for j, s in zip(nodes, after, strict=True):
                states[j] = s
            return self._full_logits(after)  # [w, vocab]

        return grow_tree(self._full_logits(s0[None])[0], expand, shape, cfg, context, self.vocab_size)

    def _state_after(self, context: Sequence[int]) -> torch.Tensor:
        """The head's state after `context`: the feature stepped through the tokens committed after its anchor
        (the round's correction or bonus, local commits)."""
        assert self.feature is not None
        head = self.head
        dev = head.out.device
        s = self.feature.vector.to(dev)  # [d]
        for t in context[len(self.feature.anchor):]:
            s = head.step(s, torch.tensor(t, device=dev))
        return s

    def _head_chain(self, context: Sequence[int], k: int, cfg: SamplingConfig, seed: int) -> DraftBlock:
        head = self.head
        dev = head.out.device
        s = self._state_after(context)  # [d]
        block = DraftBlock(tokens=[], q_probs=[], kind=self.kind)
        seen = torch.zeros(self.vocab_size, dtype=torch.bool)  # [vocab]
        seen[torch.as_tensor(list(context), dtype=torch.long)] = True
        full = torch.full((self.vocab_size,), float("-inf"))  # [vocab]
        rows = head.out_ids < self.vocab_size  # [n_out] ids the tokenizer defines
        ids = head.out_ids[rows].cpu()
        for i in range(k):
            full[ids] = head.logits(s)[rows].float().cpu()  # [vocab]: -inf outside out_ids
            q = process_logits(full[None], cfg, seen[None])[0].to(torch.float64)  # [vocab]
            pos = len(context) + i + 1
            y = int(q.argmax()) if cfg.greedy else sample_index(q, position_uniform(seed, pos, DRAFT_STREAM))
            block.tokens.append(y)
            block.q_probs.append(float(q[y]))
            block.q_full.append(q)
            seen[y] = True
            if i + 1 < k:
                s = head.step(s, torch.tensor(y, device=dev))
        return block
