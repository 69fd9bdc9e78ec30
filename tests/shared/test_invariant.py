"""Batch invariance: a token's logits are the same bits whatever else shares its forward.

For each model and dtype, one sequence of random tokens is run three ways through a paged pool: one token
at a time (the reference: a decode step per position), and under schedules that cut it into rows of
1..64 tokens (whole prefills, chains, a prefill chunk beside decode rows) with up to three random batch
mates of random lengths, in random order, and as token trees whose path is the sequence (each path
node with a random sibling half the time, sometimes after a chain token or two, as a verify row carries them; its
prefix beyond a key chunk). Every position's logits must equal the reference bit for bit (torch.equal).
The linear layers run in the row tile shared/invariant_calibration.py measures on this machine (up to
MAX_ROWS tokens, at the test's torch threads), as the cloud does, and that calibration must claim invariance.
The same schedules through the plain (not invariant) path must differ somewhere for SmolLM2-135M in
bfloat16, so the test can fail: it does on the naive path (measured over SMOLLM2_LENGTH tokens: 141 of 144
positions differ).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from shared.hf_model import load_causal_lm
from shared.invariant import tile_linears
from shared.invariant_calibration import calibrate
from shared.kvpool import KVPool, Row, attention_layout
from tests.tiny_models import ATTENTION, build

REPO = Path(__file__).resolve().parents[2]
SMOLLM2 = REPO / "models" / "smollm2-135m-instruct"
LENGTH = 100
# SmolLM2's sequence: shorter, since one of its forwards costs what many of a tiny model's do on a CPU; its schedules
# still cut it into rows of every CHUNKS size up to the tokens left, beside mates of up to 40 tokens, and into trees
SMOLLM2_LENGTH = 48
CHUNKS = (1, 2, 3, 5, 7, 8, 13, 16, 17, 31, 33, 64)
# tokens of the largest forward calibrated for: above the schedules' (a 64-token row beside three of 40)
MAX_ROWS = 256


def load(model_dir: Path, dtype: torch.dtype, invariant: bool) -> tuple[Any, KVPool]:
    model = load_causal_lm(model_dir, "cpu", dtype)
    if invariant:
        tile_linears(model)
    pool = KVPool(attention_layout(model.config), 4096, "cpu", dtype, invariant=invariant)
    pool.prepare(model)
    if invariant:
        c = calibrate(model, MAX_ROWS, pool)  # the tile the cloud measures for itself (at most ROW_TILE)
        assert c.invariant, f"calibration: {c.failure}"
    return model, pool


def reference(model: Any, pool: KVPool, seq: list[int]) -> list[torch.Tensor]:
    """Each position's logits, one decode step per position."""
    a = pool.allocate()
    out = [pool.forward(model, [Row(a, i, [t], 1)])[0][0] for i, t in enumerate(seq)]
    pool.release(a)
    return out


def chained(model: Any, pool: KVPool, seq: list[int], g: random.Random, vocab: int) -> list[torch.Tensor]:
    """Rows of CHUNKS sizes beside random batch mates."""
    a, mates = pool.allocate(), [pool.allocate() for _ in range(3)]
    lengths = [0, 0, 0]
    out: list[torch.Tensor] = []
    while len(out) < len(seq):
        i = len(out)
        n = min(g.choice(CHUNKS), len(seq) - i)
        rows = [Row(a, i, seq[i: i + n], n)]
        for j, m in enumerate(mates):
            if g.random() < 0.6:
                size = g.choice((1, 4, 9, 20, 40))
                rows.append(Row(m, lengths[j], [g.randrange(vocab) for _ in range(size)], g.randint(0, size)))
                lengths[j] += size
        g.shuffle(rows)
        result = pool.forward(model, rows)
        out.extend(result[[r.seq_id for r in rows].index(a)])
    for s in (a, *mates):
        pool.release(s)
    return out


def treed(model: Any, pool: KVPool, seq: list[int], g: random.Random, vocab: int) -> list[torch.Tensor]:
    """A prefill of 9, then rows of 0-2 chain tokens followed by a tree whose path is the sequence's next
    tokens (siblings random), the path kept."""
    a, mate = pool.allocate(), pool.allocate()
    out = list(pool.forward(model, [Row(a, 0, seq[:9], 9)])[0])
    mate_len = 0
    while len(out) < len(seq):
        past = len(out)
        base = min(past + g.randint(0, 2), len(seq) - 1)
        depth = min(g.randint(1, 6), len(seq) - base)
        parents: list[int] = []
        ids: list[int] = list(seq[past:base])
        path: list[int] = []
        for d in range(depth):  # the path node at this depth, then a random sibling
            par = path[-1] if path else -1
            if g.random() < 0.5:
                parents.append(par)
                ids.append(g.randrange(vocab))
            path.append(len(parents))
            parents.append(par)
            ids.append(seq[base + d])
        rows = [Row(a, past, ids, len(ids), tree=tuple(parents), tree_base=base)]
        if g.random() < 0.7:
            rows.append(Row(mate, mate_len, [g.randrange(vocab) for _ in range(5)], 2))
            mate_len += 5
        g.shuffle(rows)
        logits = pool.forward(model, rows)[[r.seq_id for r in rows].index(a)]
        out.extend(logits[: base - past])
        out.extend(logits[base - past + j] for j in path)
        pool.keep_path(a, base, path, seq[base: base + depth])
        pool.set_length(a, base + depth)
    pool.release(a)
    pool.release(mate)
    return out


def differing(model_dir: Path, dtype: torch.dtype, invariant: bool, seed: int = 0,
              length: int = LENGTH) -> tuple[int, int]:
    """(positions whose logits differ from the reference in any bit, positions compared)."""
    return differing_in(*load(model_dir, dtype, invariant), seed, length)


def differing_in(model: Any, pool: KVPool, seed: int = 0, length: int = LENGTH) -> tuple[int, int]:
    """`differing` for a loaded model and its pool, over a sequence of `length` random tokens."""
    vocab = int(model.get_output_embeddings().weight.shape[0])
    g = random.Random(seed)
    seq = [g.randrange(vocab) for _ in range(length)]
    with torch.inference_mode():
        ref = reference(model, pool, seq)
        runs = [chained(model, pool, seq, g, vocab), chained(model, pool, seq, g, vocab),
                treed(model, pool, seq, g, vocab)]
    bad = sum(not torch.equal(x, r) for run in runs for x, r in zip(run, ref, strict=True))
    return bad, len(ref) * len(runs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("arch", ATTENTION)
def test_every_row_gets_the_same_bits_whatever_shares_its_forward(arch: str, dtype: torch.dtype,
                                                                   tmp_path: Path) -> None:
    bad, total = differing(build(arch, tmp_path / arch), dtype, invariant=True)
    assert bad == 0, f"{arch}: {bad} of {total} positions differ from one-token decoding"


@pytest.mark.skipif(not (SMOLLM2 / "model.safetensors").is_file(), reason="needs specsplit-models prepare smollm2")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_smollm2_rows_are_invariant_and_the_plain_path_is_not(dtype: torch.dtype) -> None:
    bad, total = differing(SMOLLM2, dtype, invariant=True, length=SMOLLM2_LENGTH)
    assert bad == 0, f"{bad} of {total} positions differ from one-token decoding"
    if dtype == torch.bfloat16:  # the test has power: the plain kernels change bits with the batch
        plain, total = differing(SMOLLM2, dtype, invariant=False, length=SMOLLM2_LENGTH)
        print(f"plain path: {plain} of {total} positions differ")
        assert plain > 0
