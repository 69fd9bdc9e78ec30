"""Batch-invariant llama.cpp forwards: the micro-batch size at which a token's logits do not depend on its batch.

llama.cpp's CPU matrix kernels take one path for a micro-batch of few tokens and another, blocked one for more
(and, with repacked weights, yet another split by rows of 4 and 8): below some micro-batch size every token gets
the bits of a one-token step, above it other bits (BENCHMARKS.md, "llama.cpp's kernel paths by micro-batch"). So a
context whose micro-batches never pass the last size
of the first path (`n_ubatch`) computes every token through one kernel path whatever the batch around it:
a decode step, a verify row, a tree level, a prefill chunk. What decides the path is the build and the CPU, so
it is measured here at start-up (`invariant_ubatch`), never assumed, and `check_invariance` then proves the whole
claim on the context's real layout (batch mates, cells another sequence's crop freed below a sequence's own and
taken by its next tokens: attention sums a sequence's keys in cell order) before anyone says it. The small
micro-batch makes long prefills slower and mid-sized verifies faster (the same section).
"""

from __future__ import annotations

import logging

import torch

from shared.llama_runtime import GGUFContext, GGUFModel, Token

log = logging.getLogger(__name__)

# the probe: a prefix, then tokens decoded alone and in chunks (ids spread over the vocabulary, fixed)
PREFIX = 8


def _probe_ids(model: GGUFModel, n: int) -> list[int]:
    vocab = max(model.n_vocab, 2)
    return [(7919 * (i + 1)) % (vocab - 1) + 1 for i in range(n)]


def _alone(model: GGUFModel, threads: int, ids: list[int]) -> torch.Tensor:
    """Logits of ids[PREFIX:] decoded one token a step after the prefix ([n, vocab])."""
    ctx = GGUFContext(model, len(ids) + 8, 1, threads, n_batch=len(ids), n_ubatch=1)
    return torch.cat([ctx.decode([Token(t, i, (0,), i >= PREFIX)]) for i, t in enumerate(ids)])


def invariant_ubatch(model: GGUFModel, threads: int, most: int = 16) -> int:
    """The largest micro-batch (1 .. most) whose every chunk size up to it gives each token its one-token bits."""
    ids = _probe_ids(model, PREFIX + most)
    alone = _alone(model, threads, ids)  # [most, vocab]
    ctx = GGUFContext(model, len(ids) + 8, 1, threads, n_batch=most, n_ubatch=most)
    for i, t in enumerate(ids[:PREFIX]):  # the prefix's KV as the one-token steps wrote it
        ctx.decode([Token(t, i, (0,), False)])
    for n in range(2, most + 1):
        ctx.seq_rm(0, PREFIX, -1)
        got = ctx.decode([Token(ids[PREFIX + j], PREFIX + j, (0,), True) for j in range(n)])
        if not torch.equal(got, alone[:n]):
            return n - 1
    return most


def check_invariance(model: GGUFModel, threads: int, n_ubatch: int, n: int = 24) -> bool:
    """Whether a context of micro-batches of `n_ubatch` gives n tokens decoded in one batch, beside another
    sequence's tokens and in cells that sequence's crop freed below their own, the bits of one-token steps."""
    ids = _probe_ids(model, PREFIX + n)
    alone = _alone(model, threads, ids)  # [n, vocab]
    ctx = GGUFContext(model, 2 * len(ids) + 16, 2, threads, n_batch=2 * n, n_ubatch=n_ubatch)
    mate = _probe_ids(model, 2 * PREFIX)[PREFIX:]
    ctx.decode([Token(t, i, (1,), False) for i, t in enumerate(mate)])
    ctx.decode([Token(t, i, (0,), False) for i, t in enumerate(ids[:PREFIX])])
    ctx.seq_rm(1, 3, -1)  # holes among the cells: the batch below takes some of them
    batch = []
    for j in range(n):
        batch.append(Token(ids[PREFIX + j], PREFIX + j, (0,), True))
        if j < PREFIX - 3:
            batch.append(Token(mate[3 + j], 3 + j, (1,), True))  # a batch mate between the rows
    out = ctx.decode(batch)
    mine = torch.stack([row for row, t in zip(out, batch, strict=True) if t.seqs == (0,)])  # [n, vocab]
    return torch.equal(mine, alone)


def measure(model: GGUFModel, threads: int) -> tuple[int, bool]:
    """The invariant micro-batch and whether the whole claim holds with it; logged either way."""
    ubatch = invariant_ubatch(model, threads)
    ok = check_invariance(model, threads, ubatch)
    if ok:
        log.info("llama.cpp forwards are batch-invariant in micro-batches of %d tokens (%s, %d threads)",
                 ubatch, model.path.name, threads)
    else:
        log.warning("llama.cpp forwards are not batch-invariant even in micro-batches of %d tokens (%s): a token's "
                    "logits move with the batch around it, so greedy text may part at near-ties", ubatch,
                    model.path.name)
    return ubatch, ok
