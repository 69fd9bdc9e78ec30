"""The edge's attention-head drafter (research/heads/attention_drafter.py) against a cache-free reference.

A random attention head for the tiny target (window 8): the drafter is fed the target's real states the way
rounds feed them (an open's window, then each round's committed positions, with a rewritten tail in between),
and its greedy chain must equal the reference: the head run once, without any cache, over the real pairs in
the window and the drafted pairs, unrolled one token at a time. Every node of its tree must carry the head's
q given its path (the same reference, forced along the path). Tolerance 1e-4 on q (float32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge.drafters.tree import TreeShape
from research.heads.attention_drafter import AttentionDrafter
from research.heads.attention_head import AttentionHead, config_for_target, initial_head, window_mask
from shared.config import SamplingConfig
from shared.tree import paths

WINDOW = 8
GREEDY = SamplingConfig(temperature=0)


def build_head(target: Path, seed: int = 0) -> AttentionHead:
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(target).vocab_size
    cfg = config_for_target(target, vocab, embed_dim=16, width=32, heads=4, kv_heads=2, head_dim=8, ffn_size=64,
                            window=WINDOW)
    head = initial_head(target, torch.arange(vocab), cfg, seed=seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad and p.dim() == 2:
                p.mul_(10.0)  # sharper than the initial head, so drafts depend on their inputs
    return head.eval()


@pytest.fixture(scope="module")
def head(tiny_pair: tuple[Path, Path]) -> AttentionHead:
    return build_head(tiny_pair[0])


@pytest.fixture(scope="module")
def target_states(tiny_pair: tuple[Path, Path]) -> tuple[list[int], torch.Tensor]:
    """A 30-token text and the tiny target's state at each position ([30, d])."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_pair[0]).eval()
    ids = torch.randint(5, 4000, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        h = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    return ids, h


@torch.no_grad()
def reference_next(head: AttentionHead, states: list[torch.Tensor], tokens: list[int], positions: list[int]) -> torch.Tensor:
    """The head's prediction after the last of these pairs, from one cache-free forward ([d])."""
    pos = torch.tensor([positions])
    pred, _, _ = head(torch.stack(states)[None], torch.tensor([tokens]), pos, mask=window_mask(pos, pos, WINDOW))
    return pred[0, -1]


def reference_q(head: AttentionHead, ids: list[int], h: torch.Tensor, n: int, path: list[int]) -> torch.Tensor:
    """The head's distribution after context ids[:n] and drafted `path`, real states up to position n - 2."""
    lo = max(0, n - 1 - WINDOW)
    states = [h[t] for t in range(lo, n - 1)]
    tokens = [ids[t + 1] for t in range(lo, n - 1)]
    positions = list(range(lo, n - 1))
    s = reference_next(head, states, tokens, positions)  # the state at position n - 1
    for i, y in enumerate(path):
        states, tokens, positions = states + [s], tokens + [y], positions + [n - 1 + i]
        s = reference_next(head, states, tokens, positions)
    return torch.softmax(head.logits(s).float(), -1)


def fed_drafter(head: AttentionHead, ids: list[int], h: torch.Tensor, n: int) -> AttentionDrafter:
    """A drafter fed as a session would be: an open of ids[:12] with its last 8 states, a first round that
    committed up to 18 (states from position 11), a round whose tail was rewritten, then up to n."""
    d = AttentionDrafter(head, None)
    d.vocab_size = 4096
    d.set_states(ids[:12], 5, h[4:12])  # the open: positions 4..11
    d.set_states(ids[:18], 12, h[11:17])  # a round: positions 11..16 (the token at 17 is its correction)
    other = ids[:18] + [7]
    d.set_states(other[:19], 18, h[17:18] * 0 + 1)  # a round on another text: replaced below
    d.set_states(ids[:n], 18, h[17:n - 1])  # back on the text: positions 17..n - 2
    return d


def test_chain_equals_the_cache_free_reference(head: AttentionHead, target_states: tuple[list[int], torch.Tensor]) -> None:
    ids, h = target_states
    n = 24
    d = fed_drafter(head, ids, h, n)
    block = d.propose(ids[:n], 5, GREEDY, 0)
    assert d.last_from_head and len(block.tokens) == 5
    for i in range(5):
        q = reference_q(head, ids, h, n, block.tokens[:i])
        assert int(q.argmax()) == block.tokens[i], f"draft {i}"


def test_tree_nodes_carry_the_heads_q_given_their_path(head: AttentionHead,
                                                       target_states: tuple[list[int], torch.Tensor]) -> None:
    ids, h = target_states
    n = 26
    d = fed_drafter(head, ids, h, n)
    cfg = SamplingConfig(temperature=1.0)
    block = d.propose_tree(ids[:n], TreeShape(nodes=14, depth=4, width=3), cfg, 0)
    assert block is not None and block.parents is not None and block.k == 14
    for j, path in enumerate(paths(block.parents)):
        q = reference_q(head, ids, h, n, [block.tokens[a] for a in path[:-1]])
        assert abs(float(q[block.tokens[j]]) - block.q_probs[j]) < 1e-4, f"node {j}"


def test_an_open_drafts_its_first_token_from_the_targets_own_state(
        head: AttentionHead, target_states: tuple[list[int], torch.Tensor]) -> None:
    ids, h = target_states
    d = AttentionDrafter(head, None)
    d.vocab_size = 4096
    d.set_states(ids[:12], 5, h[4:12])  # the prompt's last state is pending: its logits are the target's
    block = d.propose(ids[:12], 1, GREEDY, 0)
    assert block.tokens == [int(head.logits(h[11]).argmax())]
    assert not d.usable(ids[:5] + [9, 9, 9])


def test_states_of_another_width_leave_the_drafter_on_its_fallback(
        head: AttentionHead, target_states: tuple[list[int], torch.Tensor]) -> None:
    from edge.drafters.ngram import NGramDrafter
    ids, h = target_states
    d = AttentionDrafter(head, NGramDrafter(order=3))
    d.vocab_size = 4096
    d.set_states(ids[:12], 5, torch.zeros(8, h.shape[1] + 16))  # a cloud serving a wider target
    assert not d.usable(ids[:12])
    d.propose(ids[:12], 3, GREEDY, 0)
    assert d.last_from_head is False
