"""A token tree in one forward of the paged pool: every node's logits equal the model's own forward over
the context and that node's path, and after `keep_path` the sequence continues as if the path had been
fed as a chain.

Tiny random models (tests/tiny_models.py): GPT-2 (absolute positions), Llama (RoPE, GQA), Mistral
(sliding window 8, so the tree's keys cross the window), Gemma3 (sliding and global layers). Blocks of 4
positions, so nodes span blocks. Tolerance 1e-4 absolute on logits of magnitude ~2 (float32; observed ~1e-6).
"""

from __future__ import annotations

import pytest
import torch

from shared.hf_model import load_causal_lm
from shared.kvpool import KVPool, Row, attention_layout
from shared.tree import depths, paths
from tests.tiny_models import build

TOL = 1e-4
# a tree of 9 nodes: three children of the root, a chain under the first, two under the second
PARENTS = [-1, -1, -1, 0, 0, 1, 3, 6, 1]
# a tree whose nodes come level by level, as a draft grows it
LEVELS = [-1, -1, -1, 0, 0, 1, 2, 3, 5, 7]


@pytest.fixture(scope="module", params=["gpt2", "llama", "mistral", "gemma3"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    d = build(request.param, tmp_path_factory.mktemp(request.param))
    torch.set_num_threads(1)
    return load_causal_lm(d, "cpu", torch.float32)


def new_pool(model: torch.nn.Module) -> KVPool:
    pool = KVPool(attention_layout(model.config), 256, "cpu", torch.float32, block_size=4)
    pool.prepare(model)
    return pool


def reference(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()  # [vocab]


def tree_tokens(seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 4096, (len(PARENTS),), generator=g).tolist()


@torch.no_grad()
def test_every_node_sees_its_path_only(model: torch.nn.Module) -> None:
    pool = new_pool(model)
    ctx = torch.randint(5, 4096, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    toks = tree_tokens(2)
    seq_id = pool.allocate()
    pool.forward(model, [Row(seq_id, 0, ctx[:-1], num_logits=0)])
    # the row carries the context's last token, then the tree under it
    logits = pool.forward(model, [Row(seq_id, len(ctx) - 1, ctx[-1:] + toks, num_logits=len(toks) + 1, tree=tuple(PARENTS),
                                      tree_base=len(ctx))])[0]
    assert torch.allclose(logits[0], reference(model, ctx), atol=TOL)
    for j, path in enumerate(paths(PARENTS)):
        want = reference(model, ctx + [toks[a] for a in path])
        assert torch.allclose(logits[j + 1], want, atol=TOL), f"node {j} (path {path})"


@torch.no_grad()
def test_a_tree_grown_level_by_level_matches(model: torch.nn.Module) -> None:
    """The way a draft grows a tree: one row per level, each node seeing the context and the ancestors
    written by earlier rows (not their siblings)."""
    pool = new_pool(model)
    ctx = torch.randint(5, 4096, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    toks = tree_tokens(6) + [99]
    seq_id = pool.allocate()
    pool.forward(model, [Row(seq_id, 0, ctx, num_logits=0)])
    by_depth: dict[int, list[int]] = {}
    for j, d in enumerate(depths(LEVELS)):
        by_depth.setdefault(d, []).append(j)
    order = [j for d in sorted(by_depth) for j in by_depth[d]]  # level order is topological here
    assert order == sorted(order)
    for d in sorted(by_depth):
        level = by_depth[d]
        row = Row(seq_id, len(ctx) + level[0], [toks[j] for j in level], num_logits=len(level),
                  tree=tuple(LEVELS[: level[-1] + 1]), tree_base=len(ctx))
        out = pool.forward(model, [row])[0]
        for i, j in enumerate(level):
            want = reference(model, ctx + [toks[a] for a in paths(LEVELS)[j]])
            assert torch.allclose(out[i], want, atol=TOL), f"node {j}"


@torch.no_grad()
def test_kept_path_continues_like_a_chain(model: torch.nn.Module) -> None:
    """After the walk keeps the path 1 -> 5 (offsets moved, other nodes cropped), a next forward, batched
    with another sequence, gives the logits of the context + path + one more token."""
    pool = new_pool(model)
    ctx = torch.randint(5, 4096, (10,), generator=torch.Generator().manual_seed(3)).tolist()
    toks = tree_tokens(4)
    seq_id, other = pool.allocate(), pool.allocate()
    pool.forward(model, [Row(seq_id, 0, ctx[:-1], num_logits=0)])
    pool.forward(model, [Row(seq_id, len(ctx) - 1, ctx[-1:] + toks, num_logits=1, tree=tuple(PARENTS), tree_base=len(ctx))])
    path = [1, 5]
    pool.keep_path(seq_id, len(ctx), path, [toks[j] for j in path])
    pool.set_length(seq_id, len(ctx) + len(path))
    nxt = 77
    out = pool.forward(model, [Row(other, 0, ctx[:5], num_logits=1),
                               Row(seq_id, len(ctx) + len(path), [nxt], num_logits=1)])
    want = reference(model, ctx + [toks[j] for j in path] + [nxt])
    assert torch.allclose(out[1][0], want, atol=TOL)
    assert torch.allclose(out[0][0], reference(model, ctx[:5]), atol=TOL)
    pool.manager.check()
