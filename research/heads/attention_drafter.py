"""The edge's drafter around the attention head (research/heads/attention_head.py).

A session that asks for states at every committed position (PROTOCOL.md, feature_window) gets, with each
answer, the target's state f_t at each position t it committed; `set_states` turns each into the head's pair
(f_t, x_{t+1}) as soon as the token after it is known, runs the new pairs through the head once (their keys
and values stay in this drafter's cache, the last `window` positions' worth of it), and keeps the head's
prediction of the state after the last pair. A state whose next token is not known yet (the prompt's last at
an open) is kept as it is: the target's own state, whose logits are the target's own distribution.

Drafting starts from the latest state (pending, or predicted; committed tokens with no state of their own are
stepped through on the head's predictions) and unrolls the head on its own predicted states: a chain of k
(`propose`) or a token tree grown level by level (`propose_tree`, edge/drafters/tree.py), each tree node
attending to the cached pairs in its window and to its own ancestors. Drafted pairs never enter the cache.
Without usable states (none yet, or a context they do not fit) the tokens-only `fallback` drafts.
q is the head's own processed probability, so every verify rule and exactness test holds as for any draft.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from edge.drafters.base import DraftBlock
from edge.drafters.causal import DRAFT_STREAM
from edge.drafters.tree import TreeShape, grow_tree
from shared.config import SamplingConfig
from shared.rng import position_uniform, sample_index
from shared.sampling import process_logits
from shared.tree import depths

from .attention_head import AttentionHead
from .head_drafter import HeadDrafter


class AttentionDrafter(HeadDrafter[AttentionHead]):
    def __init__(self, head: AttentionHead, fallback: object | None) -> None:
        super().__init__(head, fallback)
        self.reset()

    @property
    def states_window(self) -> int:
        """Prompt positions whose states the open should send (the head's attention window)."""
        return self.head.cfg.window

    def fork(self) -> AttentionDrafter:
        return AttentionDrafter(self.head, self._forked_fallback())

    def reset(self) -> None:
        cfg = self.head.cfg
        self._k = torch.zeros(1, cfg.kv_heads, 0, cfg.head_dim)  # [1, Hkv, P, Dh] the pairs' keys (RoPE applied)
        self._v = torch.zeros(1, cfg.kv_heads, 0, cfg.head_dim)
        self._pos: list[int] = []  # position of each cached pair
        self._ids: list[int] = []  # the committed tokens the cache was built on
        self._pred: tuple[int, torch.Tensor] | None = None  # (position, the head's state there) after the last pair
        self._pending: tuple[int, torch.Tensor] | None = None  # (position, a real state whose next token is unknown)
        self._reset_fallback()

    # -- states from the cloud ---------------------------------------------------------------------

    def set_feature(self, anchor: Sequence[int], vector: torch.Tensor) -> None:
        """One state (a cloud that sends one feature per answer): the state after `anchor`."""
        self.set_states(list(anchor), len(anchor), vector.reshape(1, -1))

    @torch.no_grad()
    def set_states(self, context: Sequence[int], first: int, vectors: torch.Tensor) -> None:
        """States [n, d]: state i follows context[:first + i], i.e. sits at position first + i - 1. States of
        another width than the head's (a cloud serving another target) are dropped with what the drafter held,
        and rounds draft with the fallback."""
        if vectors.dim() != 2 or vectors.shape[1] != self.head.cfg.hidden_size:
            self.reset()
            return
        self._sync(context)
        pairs = [(first + i - 1, vectors[i]) for i in range(vectors.shape[0])]
        last = self._pos[-1] if self._pos else -1
        new = [(t, f) for t, f in pairs if t > last and t + 1 < len(context)]
        top = pairs[-1]
        self._pending = top if top[0] == len(context) - 1 else None
        if new:
            self._feed_real([t for t, _ in new], torch.stack([f for _, f in new]), [context[t + 1] for t, _ in new])
        self._ids = list(context)

    def _sync(self, context: Sequence[int]) -> None:
        """Drop the cached pairs whose next token the context no longer has."""
        n = 0
        while n < min(len(self._ids), len(context)) and self._ids[n] == context[n]:
            n += 1
        keep = sum(1 for t in self._pos if t + 1 < n)
        if keep < len(self._pos):
            self._k, self._v, self._pos = self._k[:, :, :keep], self._v[:, :, :keep], self._pos[:keep]
            self._pred = None
        if self._pending is not None and self._pending[0] >= n:
            self._pending = None
        self._ids = list(context[:n])

    def _feed_real(self, positions: list[int], states: torch.Tensor, tokens: list[int]) -> None:
        pred, k, v = self._run(states, tokens, positions, [None] * len(positions), {})
        self._k, self._v = torch.cat([self._k, k], 2), torch.cat([self._v, v], 2)
        self._pos += positions
        self._pred = (positions[-1] + 1, pred[-1])
        w = self.head.cfg.window
        old = sum(1 for t in self._pos if t < self._pos[-1] - w)  # never visible again
        if old:
            self._k, self._v, self._pos = self._k[:, :, old:], self._v[:, :, old:], self._pos[old:]

    def _run(self, states: torch.Tensor, tokens: list[int], positions: list[int], nodes: list[int | None],
             extra: dict[str, object]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head over T pairs after the cache (and `extra`'s drafted keys): (pred [T, d], k, v). A pair that is
        a tree node (`nodes`: its index, else None) sees only its own ancestors among the drafted keys."""
        dk: torch.Tensor = extra.get("k", self._k[:, :, :0])  # type: ignore[assignment]  # [1, Hkv, D, Dh]
        dv: torch.Tensor = extra.get("v", self._v[:, :, :0])  # type: ignore[assignment]
        dpos: list[int] = extra.get("pos", [])  # type: ignore[assignment]
        dnode: list[int | None] = extra.get("node", [])  # type: ignore[assignment]
        anc: dict[int, set[int]] = extra.get("anc", {})  # type: ignore[assignment]
        w = self.head.cfg.window
        k_pos = torch.tensor(self._pos + dpos + positions)  # [P + D + T]
        q_pos = torch.tensor(positions)  # [T]
        gap = q_pos[:, None] - k_pos[None, :]  # [T, P + D + T]
        mask = (gap >= 0) & (gap < w)
        owners = [None] * len(self._pos) + dnode + nodes
        for i, node in enumerate(nodes):  # tree nodes: drafted keys of other branches are hidden
            if node is None:
                continue
            for j, owner in enumerate(owners):
                if owner is not None and owner not in anc[node]:
                    mask[i, j] = False
        dev = self.head.out.device
        pred, k, v = self.head(states[None].to(dev), torch.tensor([tokens], device=dev),
                               q_pos[None].to(dev), torch.cat([self._k, dk], 2).to(dev),
                               torch.cat([self._v, dv], 2).to(dev), mask[None].to(dev))
        return pred[0].cpu(), k.cpu(), v.cpu()

    def _run_drafted(self, states: torch.Tensor, tokens: list[int], positions: list[int], nodes: list[int | None],
                     extra: dict[str, object]) -> torch.Tensor:
        """`_run` over pairs that never enter the cache: their keys and values join `extra`'s drafted keys (so the
        pairs after them see them); the predicted states ([T, d])."""
        pred, k, v = self._run(states, tokens, positions, nodes, extra)
        extra["k"] = torch.cat([extra.get("k", self._k[:, :, :0]), k], 2)  # type: ignore[list-item]
        extra["v"] = torch.cat([extra.get("v", self._v[:, :, :0]), v], 2)  # type: ignore[list-item]
        extra["pos"] = [*extra.get("pos", []), *positions]  # type: ignore[misc]
        extra["node"] = [*extra.get("node", []), *nodes]  # type: ignore[misc]
        return pred

    # -- drafting -------------------------------------------------------------------------------

    def usable(self, context: Sequence[int]) -> bool:
        n = len(self._ids)
        if n == 0 or n > len(context) or list(context[:n]) != self._ids:
            return False
        return self._pending is not None or self._pred is not None

    def _start(self, context: Sequence[int], extra: dict[str, object]) -> tuple[int, torch.Tensor]:
        """(position, state) from which the token at position len(context) is drafted; committed tokens after
        the latest state are stepped through on the head's predictions (their keys go into `extra`)."""
        if self._pending is not None and self._pending[0] == len(context) - 1:
            return self._pending
        pos, s = self._pending if self._pending is not None else self._pred  # type: ignore[misc]
        while pos < len(context) - 1:
            pos, s = pos + 1, self._run_drafted(s[None], [context[pos + 1]], [pos], [None], extra)[0]
        return pos, s

    def _head_chain(self, context: Sequence[int], k: int, cfg: SamplingConfig, seed: int) -> DraftBlock:
        extra: dict[str, object] = {}
        pos, s = self._start(context, extra)
        block = DraftBlock(tokens=[], q_probs=[], kind=self.kind)
        seen = torch.zeros(self.vocab_size, dtype=torch.bool)  # [vocab]
        seen[torch.as_tensor(list(context), dtype=torch.long)] = True
        for i in range(k):
            q = process_logits(self._full_logits(s[None]), cfg, seen[None])[0].to(torch.float64)  # [vocab]
            y = int(q.argmax()) if cfg.greedy else sample_index(q, position_uniform(seed, len(context) + i + 1,
                                                                                     DRAFT_STREAM))
            block.tokens.append(y)
            block.q_probs.append(float(q[y]))
            block.q_full.append(q)
            seen[y] = True
            if i + 1 < k:
                pos, s = pos + 1, self._run_drafted(s[None], [y], [pos], [None], extra)[0]
        return block

    def _head_tree(self, context: Sequence[int], shape: TreeShape, cfg: SamplingConfig) -> DraftBlock:
        """One batched head step per level; node j sits at the position its depth gives it and attends to the
        cached pairs in its window and to its own ancestors."""
        extra: dict[str, object] = {"anc": {}}
        pos0, s0 = self._start(context, extra)
        states: dict[int, torch.Tensor] = {}
        anc: dict[int, set[int]] = extra["anc"]  # type: ignore[assignment]
        run: dict[int, int] = {}  # grown node -> its index among the nodes run so far
        tree: list[int] = []  # parents of the nodes run so far, by that index

        def expand(nodes: list[int], tokens: list[int], parents: list[int]) -> torch.Tensor:
            for j, par in zip(nodes, parents, strict=True):
                anc[j] = (anc[par] if par >= 0 else set()) | {j}
                run[j] = len(tree)
                tree.append(-1 if par < 0 else run[par])
            depth = depths(tree)
            before = torch.stack([states[p] if p >= 0 else s0 for p in parents])  # [w, d]
            pred = self._run_drafted(before, tokens, [pos0 + depth[run[j]] - 1 for j in nodes], list(nodes), extra)
            for j, p in zip(nodes, pred, strict=True):
                states[j] = p
            return self._full_logits(pred)  # [w, vocab]

        return grow_tree(self._full_logits(s0[None])[0], expand, shape, cfg, context, self.vocab_size)
