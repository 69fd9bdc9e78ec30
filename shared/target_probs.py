"""The processed target distributions p of a forward's rows, read by the verify rule where they were computed.

The verify rule (shared/verify.py, shared/tree.py) asks p six things, and nothing else:
- `argmax(i)`: the greedy token after row i;
- `at(i, tok)`: p[i, tok], the probability the rule scores a draft token by;
- `draw(i, u)`: `sample_index(p[i], u)`, the target's own draw with uniform u (a correction, a bonus, a tree's walk);
- `draw_without(i, tok, u)`: a draw from p[i] with `tok` zeroed (a deterministic draft's residual);
- `draw_residual(i, q, u)`: a draw from max(0, p[i] - q) (a draft that sent its whole q);
- `support(i)`: the ids and probabilities where p[i] > 0 (the edge draws the residual).

`TargetProbs.dense(p)` answers them from a dense [n, vocab] tensor on the CPU: the reference, each answer read off p
directly. `shared.sampling.process_rows` builds one per row of a forward with p left where the logits are (the
verify rule on the device): greedy rows keep only their argmax, so no vocabulary-sized tensor is made anywhere;
sampled rows keep p ([n, vocab] float32) on the device, and on a device other than the CPU one batched pass over
every row of the forward computes each row's draw at its own position's uniform and p at the tokens the rule will
score. Those scalars cross to the host in one copy per forward. What a rarer path asks beyond them (a deterministic
draft's residual, a draft's q_dists, the support of a residual answer) runs on the device for that row and crosses
its answer alone.

Bit for bit. Every answer is the reference's. argmax and p[i, tok] are the same reads of the same p. A draw is
`sample_index`'s inverse CDF: float64 prefix sums of p[i], the first index whose sum exceeds u x total. On the
CPU the prefix sums are the same sequential sums the reference makes. A GPU's parallel scan may round them
differently, by at most (vocab - 1) x 2^-53 of the total each (the error bound of any order of summation, which
holds for the reference's too); a draw whose target u x total lies more than twice that from both sums around it
lands where the reference's lands, and one that does not (a chance near 1e-10 a draw) is drawn by the reference
itself from its row copied to the host. The same margin decides a residual's "no mass left" test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shared.rng import sample_index

# below this total mass a residual is float noise: the rule falls back to p (shared/verify.py)
RESIDUAL_EPS = 1e-12
# rows of float64 prefix sums one batched draw makes at once (bounds its temporary memory to ~64 MB)
_DRAW_BYTES = 64 << 20


@dataclass
class Transfers:
    """Values the verify rule read from device tensors to the host (on a CPU: what would cross on a device)."""
    # tensor elements turned into host numbers
    values: int = 0
    # reads (each a synchronisation with the device)
    reads: int = 0
    # answers the batched pass had computed ahead
    ahead: int = 0


TRANSFERS = Transfers()


def host_values(t: torch.Tensor) -> list[float]:
    """t's values on the host, counted."""
    TRANSFERS.values += t.numel()
    TRANSFERS.reads += 1
    return t.tolist()  # type: ignore[no-any-return]


def host_scalar(t: torch.Tensor) -> float:
    """A one-element tensor's value on the host, counted."""
    TRANSFERS.values += 1
    TRANSFERS.reads += 1
    return float(t.item())


def _margin(total: torch.Tensor, vocab: int) -> torch.Tensor:
    """Twice the most two float64 summations of `vocab` non-negative terms can differ by, as a share of their sum."""
    return total * (4.0 * (vocab + 1) * 2.0 ** -53)


def draws(p: torch.Tensor, u: torch.Tensor, margin: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's inverse-CDF draw ([m] ids) from p ([m, vocab], any float dtype, on any device) with its uniform
    u ([m] float64), and whether it is certainly `sample_index`'s answer ([m] bool; see the module docstring).
    `margin`: also require the target's distance from both sums around it (default: off the CPU)."""
    m, vocab = p.shape
    idx = torch.empty(m, dtype=torch.long, device=p.device)
    sure = torch.empty(m, dtype=torch.bool, device=p.device)
    step = max(1, _DRAW_BYTES // (8 * vocab))
    for s in range(0, m, step):
        cdf = p[s: s + step].double().cumsum(-1)  # [c, vocab]
        total = cdf[:, -1:]  # [c, 1]
        target = u[s: s + step, None] * total  # [c, 1]
        j = torch.searchsorted(cdf, target, right=True)  # [c, 1]: the first sum above the target (vocab: none)
        ok = j < vocab  # past the end: the reference steps back over zero-mass entries; it decides those
        j = j.clamp(max=vocab - 1)
        if margin if margin is not None else p.device.type != "cpu":  # a parallel scan's sums: far enough from both neighbours, or the reference's
            gap = _margin(total, vocab)
            hi = cdf.gather(-1, j)
            lo = torch.where(j > 0, cdf.gather(-1, (j - 1).clamp(min=0)), torch.zeros_like(hi))
            ok &= (hi - target > gap) & (target - lo >= gap)
        idx[s: s + step], sure[s: s + step] = j[:, 0], ok[:, 0]
    return idx, sure


class TargetProbs:
    """The processed p of one row of a forward ([rows, vocab]), answering the verify rule's questions."""

    def __init__(self, rows: int, vocab: int, p: torch.Tensor | None, *, top: Sequence[int] | None = None,
                 drawn: dict[tuple[int, float], int] | None = None,
                 at: dict[tuple[int, int], float] | None = None) -> None:
        # rows and vocabulary size
        self.shape = (rows, vocab)
        # the probabilities (None: a greedy row kept only its argmax)
        self.p = p
        # answers computed ahead: each row's argmax, draws by (row, uniform), p by (row, token)
        self.top = list(top) if top is not None else None
        self.drawn = drawn or {}
        self.at_ = at or {}

    @classmethod
    def dense(cls, p: torch.Tensor) -> TargetProbs:
        """The reference: every answer read off p ([rows, vocab], float64 on the CPU)."""
        return cls(p.shape[0], p.shape[1], p.detach().to("cpu", torch.float64))

    @property
    def rows(self) -> int:
        return self.shape[0]

    def _row(self, i: int) -> torch.Tensor:
        if self.p is None:
            raise ValueError("a greedy row keeps its argmax only")
        return self.p[i]  # [vocab]

    def argmax(self, i: int) -> int:
        if self.top is not None:
            TRANSFERS.ahead += 1
            return self.top[i]
        return int(host_scalar(self._row(i).argmax())) if self._on_device else int(self._row(i).argmax())

    def at(self, i: int, tok: int) -> float:
        got = self.at_.get((i, tok))
        if got is not None:
            TRANSFERS.ahead += 1
            return got
        x = self._row(i)[tok]
        return host_scalar(x) if self._on_device else float(x)

    def draw(self, i: int, u: float) -> int:
        got = self.drawn.get((i, u))
        if got is not None:
            TRANSFERS.ahead += 1
            return got
        return self._draw(self._row(i), u)

    def draw_without(self, i: int, tok: int, u: float) -> int:
        """A draw from p[i] with `tok` zeroed (p[i] itself when that leaves no mass)."""
        r = self._row(i).to(torch.float64, copy=True)  # [vocab]
        r[tok] = 0.0
        return self._draw(r if self._has_mass(r) else self._row(i), u)

    def draw_residual(self, i: int, q: torch.Tensor, u: float) -> int:
        """A draw from max(0, p[i] - q) (q: [vocab], float64; p[i] itself when that leaves no mass)."""
        row = self._row(i)
        r = (row.double() - q.to(row.device, torch.float64)).clamp_min(0.0)  # [vocab]
        return self._draw(r if self._has_mass(r) else row, u)

    def support(self, i: int) -> tuple[list[int], list[float]]:
        """The ids where p[i] > 0 and their probabilities (float64)."""
        row = self._row(i)
        ids = torch.nonzero(row > 0).squeeze(-1)  # [m]
        probs = row[ids].double()  # [m]
        if not self._on_device:
            return ids.tolist(), probs.tolist()
        both = host_values(torch.cat([ids.double(), probs]))  # ids are exact in float64 (vocabularies < 2^53)
        m = ids.numel()
        return [int(x) for x in both[:m]], both[m:]

    def dense_probs(self) -> torch.Tensor:
        """p as a dense [rows, vocab] float64 CPU tensor (greedy: the one-hot of each argmax). For tests."""
        if self.p is not None:
            return self.p.detach().to("cpu", torch.float64)
        out = torch.zeros(self.shape, dtype=torch.float64)
        out[torch.arange(self.rows), torch.as_tensor(self.top)] = 1.0
        return out

    # --- the device's side ------------------------------------------------------------------------------------
    @property
    def _on_device(self) -> bool:
        return self.p is not None and self.p.device.type != "cpu"

    def _has_mass(self, r: torch.Tensor) -> bool:
        """Whether r's total exceeds RESIDUAL_EPS, as the reference's CPU sum decides it."""
        s = r.sum()
        if not self._on_device:
            return float(s) > RESIDUAL_EPS
        total, gap = host_values(torch.stack([s, _margin(s, r.numel())]))
        if abs(total - RESIDUAL_EPS) > gap:
            return total > RESIDUAL_EPS
        return float(r.cpu().sum()) > RESIDUAL_EPS  # too close to call on the device's sum: the reference's

    def _draw(self, r: torch.Tensor, u: float) -> int:
        """`sample_index(r, u)` computed where r is (r: [vocab])."""
        if not self._on_device:
            return sample_index(r, u)
        idx, sure = draws(r[None], torch.tensor([u], dtype=torch.float64, device=r.device))
        j, ok = host_values(torch.stack([idx[0].double(), sure[0].double()]))
        return int(j) if ok else sample_index(r.cpu(), u)
