"""The llama.cpp runner's pool (cloud/runners/llamacpp.py) on a tiny GGUF target, in process.

What the serving core relies on: a row's logits are the target's after its context (within 3e-3 of transformers'
float32 forward of the same weights: llama.cpp keeps K and V in float16); a tree row's node sees the context and
its own path only; the accepted path kept by `keep_path` (up to its first node out of row order; the next row feeds
the rest) serves the next round as if it had been fed as a chain;
crops and releases give sequences and blocks back; several sessions in one batch do not see each other.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cloud.runners.llamacpp import SESSION_SEQS, LlamaTarget, leaves_of
from shared.errors import ResourceExhausted
from shared.kvpool import Row
from tests.tiny_gguf import build_qwen2, write_gguf

CTX = [5, 17, 300, 42, 9, 1000, 77, 3, 64, 11]
TOL = 3e-3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = build_qwen2(tmp_path_factory.mktemp("llama_target") / "t", seed=5)
    write_gguf(d, d / "model.gguf")
    return d


@pytest.fixture()
def runner(target_dir: Path) -> LlamaTarget:
    t = LlamaTarget(target_dir, threads=1, max_batch_tokens=256)
    t.use_pool(64 * 1024**2, 16)
    return t


@pytest.fixture(scope="module")
def reference(target_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def logits_after(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(input_ids=torch.tensor([ids])).logits[0, -1]  # [vocab]
    return logits_after


def test_a_chain_row_gives_the_targets_logits(runner: LlamaTarget, reference) -> None:  # type: ignore[no-untyped-def]
    assert runner.pool is not None
    seq_id = runner.pool.allocate()
    (out,) = runner.forward([Row(seq_id, 0, CTX, num_logits=3)])  # [3, vocab]
    for i in range(3):
        assert (out[i] - reference(CTX[: len(CTX) - 2 + i])).abs().max() < TOL
    assert runner.pool.length(seq_id) == len(CTX)


def test_tree_nodes_see_their_path_and_the_kept_path_serves_the_next_round(
        runner: LlamaTarget, reference) -> None:  # type: ignore[no-untyped-def]
    pool = runner.pool
    assert pool is not None
    seq_id = pool.allocate()
    runner.forward([Row(seq_id, 0, CTX[:-1], num_logits=0)])
    L = len(CTX)
    parents = (-1, 0, 0, 1, 1, 2, 3)
    nodes = [11, 12, 13, 14, 15, 16, 17]
    assert leaves_of(parents) == [4, 5, 6]
    (out,) = runner.forward([Row(seq_id, L - 1, [CTX[-1]] + nodes, num_logits=len(nodes) + 1, tree=parents, tree_base=L)])
    assert (out[0] - reference(CTX)).abs().max() < TOL
    for j in range(len(nodes)):
        path: list[int] = []
        at = j
        while at >= 0:
            path.insert(0, nodes[at])
            at = parents[at]
        assert (out[1 + j] - reference(CTX + path)).abs().max() < TOL
    free = pool.tree_seqs_free
    kept = runner.keep_path(seq_id, L, [0, 1, 3], [11, 12, 14])  # the path 11 -> 12 -> 14
    assert kept == 2  # node 3 is not the third in row order: its position is fed again
    pool.set_length(seq_id, L + kept)
    assert pool.tree_seqs_free == free + 3  # the leaves went back
    (nxt,) = runner.forward([Row(seq_id, L + kept, [14, 99], num_logits=1)])
    assert (nxt[0] - reference(CTX + [11, 12, 14, 99])).abs().max() < TOL


def test_sessions_in_one_batch_do_not_see_each_other(runner: LlamaTarget, reference) -> None:  # type: ignore[no-untyped-def]
    assert runner.pool is not None
    a, b = runner.pool.allocate(), runner.pool.allocate()
    other = [7, 8, 9, 10, 11]
    out_a, out_b = runner.forward([Row(a, 0, CTX, num_logits=1), Row(b, 0, other, num_logits=1)])
    assert (out_a[0] - reference(CTX)).abs().max() < TOL
    assert (out_b[0] - reference(other)).abs().max() < TOL


def test_crop_then_refeed_equals_a_fresh_encode(runner: LlamaTarget, reference) -> None:  # type: ignore[no-untyped-def]
    assert runner.pool is not None
    seq_id = runner.pool.allocate()
    runner.forward([Row(seq_id, 0, CTX, num_logits=1)])
    runner.pool.crop(seq_id, 4)
    assert runner.pool.length(seq_id) == 4
    (out,) = runner.forward([Row(seq_id, 4, [500, 501], num_logits=1)])
    assert (out[0] - reference(CTX[:4] + [500, 501])).abs().max() < TOL


def test_sequences_run_out_with_a_clear_error_and_come_back(runner: LlamaTarget) -> None:
    pool = runner.pool
    assert pool is not None
    slots = [pool.allocate() for _ in range(SESSION_SEQS)]
    with pytest.raises(ResourceExhausted, match="sequences"):
        pool.allocate()
    pool.release(slots[0])
    pool.allocate()
    blocks = pool.manager.available()
    (out,) = runner.forward([Row(slots[1], 0, CTX, num_logits=1)])
    assert pool.manager.available() == blocks - 1 and out.shape[0] == 1
    pool.release(slots[1])
    assert pool.manager.available() == blocks


def test_a_kept_path_past_dropped_nodes_serves_the_next_round_with_a_chains_bits(runner: LlamaTarget) -> None:
    """Attention sums a sequence's keys in cell order: the path 0 -> 2 -> 5 leaves the cells of nodes 1, 3, 4
    between its own, so only node 0 is kept and the next row feeds 13 and 16 before its own tokens (bit equality
    with the same tokens fed as a chain)."""
    pool = runner.pool
    assert pool is not None
    L = len(CTX)
    parents = (-1, 0, 0, 1, 1, 2, 3)
    nodes = [11, 12, 13, 14, 15, 16, 17]
    chain = pool.allocate()
    runner.forward([Row(chain, 0, CTX[:-1], num_logits=0)])
    runner.forward([Row(chain, L - 1, [CTX[-1], 11, 13, 16], num_logits=0)])
    (want,) = runner.forward([Row(chain, L + 3, [99, 98], num_logits=2)])  # [2, vocab]
    seq_id = pool.allocate()
    runner.forward([Row(seq_id, 0, CTX[:-1], num_logits=0)])
    runner.forward([Row(seq_id, L - 1, [CTX[-1]] + nodes, num_logits=len(nodes) + 1, tree=parents, tree_base=L)])
    kept = runner.keep_path(seq_id, L, [0, 2, 5], [11, 13, 16])
    assert kept == 1
    pool.set_length(seq_id, L + kept)
    (got,) = runner.forward([Row(seq_id, L + kept, [13, 16, 99, 98], num_logits=2)])  # [2, vocab]
    assert torch.equal(got, want)


def test_a_one_branch_tree_run_as_a_chain_keeps_its_path_in_place(runner: LlamaTarget) -> None:
    """The engine forwards a tree of one branch as a chain row (cloud/engine.py) and then keeps its accepted path
    as a tree's: the path is the sequence's own cells already, and the next round has a chain's bits."""
    pool = runner.pool
    assert pool is not None
    L = len(CTX)
    chain = pool.allocate()
    runner.forward([Row(chain, 0, CTX[:-1], num_logits=0)])
    runner.forward([Row(chain, L - 1, [CTX[-1], 11, 12], num_logits=0)])
    (want,) = runner.forward([Row(chain, L + 2, [99, 98], num_logits=2)])  # [2, vocab]
    seq_id = pool.allocate()
    runner.forward([Row(seq_id, 0, CTX[:-1], num_logits=0)])
    runner.forward([Row(seq_id, L - 1, [CTX[-1], 11, 12, 13], num_logits=4)])  # nodes 0 -> 1 -> 2, node 2 rejected
    assert runner.keep_path(seq_id, L, [0, 1], [11, 12]) == 2
    pool.set_length(seq_id, L + 2)
    (got,) = runner.forward([Row(seq_id, L + 2, [99, 98], num_logits=2)])
    assert torch.equal(got, want)


def test_sixteen_sessions_of_trees_share_the_context_and_give_their_sequences_back(
        runner: LlamaTarget, reference) -> None:  # type: ignore[no-untyped-def]
    """16 sessions with a 24-node tree each per round: more leaves than the free leaf sequences (rows past them
    wait, as the scheduler leaves them), forwards longer than one llama.cpp batch, paths past dropped nodes;
    every forward runs, every leaf sequence comes back, and a session's next token sees its own kept path."""
    import random

    pool = runner.pool
    assert pool is not None
    rng = random.Random(0)
    texts = {pool.allocate(): [rng.randrange(1, 400) for _ in range(rng.randrange(20, 60))] for _ in range(16)}
    runner.forward([Row(seq_id, 0, ids, num_logits=1) for seq_id, ids in texts.items()])  # > one batch of n_batch
    free = pool.tree_seqs_free
    for _ in range(3):
        rows, left = [], pool.tree_seqs_free
        for seq_id, ids in texts.items():
            parents = (-1, *(rng.randrange(j) for j in range(1, 24)))
            row = Row(seq_id, len(ids) - 1, [ids[-1]] + [rng.randrange(1, 400) for _ in parents],
                      num_logits=len(parents) + 1, tree=parents, tree_base=len(ids))
            if pool.tree_seqs(row) <= left:
                rows.append(row)
                left -= pool.tree_seqs(row)
        assert 0 < len(rows) < len(texts)  # the leaves ran out before the sessions did
        runner.forward(rows)
        for r in rows:
            assert r.tree is not None
            path: list[int] = []
            at = rng.randrange(len(r.tree))
            while at >= 0:
                path.insert(0, at)
                at = r.tree[at]
            tokens = [r.ids[1 + j] for j in path]
            kept = runner.keep_path(r.seq_id, r.tree_base, path, tokens)
            pool.set_length(r.seq_id, r.tree_base + kept)
            texts[r.seq_id] += tokens
            if kept < len(tokens):  # the rest of the path, fed as the next round would
                runner.forward([Row(r.seq_id, r.tree_base + kept, tokens[kept:], num_logits=0)])
        assert pool.tree_seqs_free == free
    seq_id, ids = next(iter(texts.items()))
    (out,) = runner.forward([Row(seq_id, len(ids), [99], num_logits=1)])
    assert (out[0] - reference(ids + [99])).abs().max() < TOL


def _retokenize(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    import json
    import shutil

    shutil.copytree(src, dst)
    spec = json.loads((dst / "tokenizer.json").read_text())
    edit(spec)
    (dst / "tokenizer.json").write_text(json.dumps(spec))
    return dst


def test_a_tokenizer_that_is_not_the_ggufs_own_is_refused_at_load(target_dir: Path, tmp_path: Path) -> None:
    """The tokenizer beside the GGUF is checked against the GGUF's vocabulary: two token strings swapped at an id
    the check samples (the vocabulary's middle), or more ids than the GGUF has, and the load stops in one line."""
    from shared.kvpool import UnsupportedModel
    from shared.tokenizer_id import load_tokenizer

    n = len(load_tokenizer(target_dir))

    def swap(spec: dict) -> None:  # type: ignore[type-arg]
        vocab = spec["model"]["vocab"]
        a, b = (next(t for t, i in vocab.items() if i == j) for j in (n // 2, n // 2 + 1))
        vocab[a], vocab[b] = vocab[b], vocab[a]

    def grow(spec: dict) -> None:  # type: ignore[type-arg]
        spec["added_tokens"].append({"id": 100_000, "content": "<extra>", "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})

    for name, edit, said in (("swapped", swap, f"id {n // 2} is"), ("grown", grow, "ids and the GGUF")):
        d = _retokenize(target_dir, tmp_path / name, edit)
        with pytest.raises(UnsupportedModel, match="is not the GGUF's own") as err:
            LlamaTarget(d, threads=1)
        assert said in str(err.value) and "\n" not in str(err.value)
    LlamaTarget(target_dir, threads=1)  # its own tokenizer passes
