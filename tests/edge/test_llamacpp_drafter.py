"""The llama.cpp drafter (edge/drafters/llamacpp.py) on tiny GGUF files written from tiny random models.

What must hold whatever llama.cpp's numerics: the GGUF runs the same network as its Hugging Face weights (logits
within float error), q of every drafted token is the shared processing of the draft's own logits, a cropped
cache drafts as a fresh encode does, a tree of width 1 is the chain, tree nodes see their own path only, and the
edge picks llama.cpp for a directory holding a GGUF. Greedy text and the chi-square of sampled chains and trees
through the real cloud with this drafter are in tests/e2e (test_edge_greedy.py, test_edge_sampling.py).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from edge.drafters.llamacpp import LlamaCppDrafter
from edge.drafters.tree import TreeShape
from edge.settings import EdgeSettings, load_draft_model
from shared.config import SamplingConfig
from shared.sampling import process_logits
from tests.tiny_gguf import build_qwen2, write_gguf

SAMPLED = SamplingConfig(temperature=0.8, top_p=0.95, top_k=0, repetition_penalty=1.1)
GREEDY = SamplingConfig(temperature=0.0)
CONTEXT = [5, 17, 300, 42, 9, 1000, 77, 3]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = build_qwen2(tmp_path_factory.mktemp("qwen2") / "draft", seed=3)
    write_gguf(d, d / "model.gguf")
    return d


@pytest.fixture(scope="module")
def gpt2_dir(tiny_pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the session's tiny draft with its GGUF beside it (the session's directory stays GGUF-free, so tests
    that load it by directory keep the PyTorch runtime)."""
    d = tmp_path_factory.mktemp("gpt2") / "draft"
    shutil.copytree(tiny_pair[1], d)
    write_gguf(d, d / "model.gguf")
    return d


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_the_gguf_runs_the_same_network_as_its_weights(arch: str, qwen2_dir: Path, gpt2_dir: Path) -> None:
    """Every position's logits from llama.cpp within 5e-3 of transformers' float32 forward (float32 weights; llama.cpp
    keeps K and V in float16, ~1e-3 here; a wrong tensor layout moves logits by O(1)), and the same argmax."""
    from transformers import AutoModelForCausalLM

    d = qwen2_dir if arch == "qwen2" else gpt2_dir
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([CONTEXT])).logits[0]  # [n, vocab]
    drafter = LlamaCppDrafter(d)
    got = torch.stack([drafter.logits_after(CONTEXT[: i + 1]) for i in range(len(CONTEXT))])  # [n, vocab]
    assert (got - want).abs().max() < 5e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert drafter.vocab_size == want.shape[-1]


@pytest.mark.parametrize("cfg", [SAMPLED, GREEDY], ids=["sampled", "greedy"])
def test_q_of_each_drafted_token_is_its_own_processed_logits(cfg: SamplingConfig, qwen2_dir: Path) -> None:
    drafter = LlamaCppDrafter(qwen2_dir)
    block = drafter.propose(CONTEXT, 5, cfg, seed=11)
    fresh = LlamaCppDrafter(qwen2_dir)
    for i, y in enumerate(block.tokens):
        ctx = CONTEXT + block.tokens[:i]
        seen = torch.zeros(drafter.vocab_size, dtype=torch.bool)
        seen[torch.tensor(ctx)] = True
        q = process_logits(fresh.logits_after(ctx)[None], cfg, seen[None])[0].double()  # [vocab]
        assert abs(block.q_probs[i] - float(q[y])) < 1e-5
        assert (block.q_full[i] - q).abs().max() < 1e-5


def test_a_cropped_cache_drafts_what_a_fresh_encode_drafts(qwen2_dir: Path) -> None:
    """A round rejected after two tokens: the drafter crops to the committed text and feeds the correction;
    its next block equals a fresh drafter's on the same text (tokens, q within 1e-5)."""
    drafter = LlamaCppDrafter(qwen2_dir)
    first = drafter.propose(CONTEXT, 6, SAMPLED, seed=1)
    committed = CONTEXT + first.tokens[:2] + [123]
    again = drafter.propose(committed, 4, SAMPLED, seed=2)
    assert drafter.kv_len == len(committed) + 3  # cropped, not re-encoded: the held prefix plus the new tokens
    fresh = LlamaCppDrafter(qwen2_dir).propose(committed, 4, SAMPLED, seed=2)
    assert again.tokens == fresh.tokens
    assert max(abs(a - b) for a, b in zip(again.q_probs, fresh.q_probs, strict=True)) < 1e-5


def test_a_tree_of_width_one_is_the_chain(qwen2_dir: Path) -> None:
    drafter = LlamaCppDrafter(qwen2_dir)
    chain = drafter.propose(CONTEXT, 5, GREEDY, seed=0)
    tree = drafter.propose_tree(CONTEXT, TreeShape(nodes=5, depth=5, width=1), GREEDY, seed=0)
    assert tree.tokens == chain.tokens and tree.parents == [-1, 0, 1, 2, 3]
    assert drafter.kv_len == len(CONTEXT)  # the tree's nodes are dropped


def test_tree_nodes_see_the_context_and_their_own_path_only(qwen2_dir: Path) -> None:
    """Each grown node's children are ranked from the logits after context + its path: regrow each expanded
    node's logits by a chain on a fresh drafter and compare the children's q (within 1e-5)."""
    drafter = LlamaCppDrafter(qwen2_dir)
    tree = drafter.propose_tree(CONTEXT, TreeShape(nodes=24, depth=4, width=3), SAMPLED, seed=0)
    assert tree.parents is not None and len(set(tree.parents)) > 3  # branches, not a chain
    fresh = LlamaCppDrafter(qwen2_dir)
    for j, parent in enumerate(tree.parents):
        path: list[int] = []
        at = parent
        while at >= 0:
            path.insert(0, tree.tokens[at])
            at = tree.parents[at]
        ctx = CONTEXT + path
        seen = torch.zeros(fresh.vocab_size, dtype=torch.bool)
        seen[torch.tensor(ctx)] = True
        q = process_logits(fresh.logits_after(ctx)[None], SAMPLED, seen[None])[0]  # [vocab]
        assert abs(tree.q_probs[j] - float(q[tree.tokens[j]])) < 1e-5
    assert drafter.kv_len == len(CONTEXT)


def test_a_decode_that_fails_after_its_first_chunk_leaves_no_cells(qwen2_dir: Path) -> None:
    """A feed longer than one llama.cpp batch (256 tokens) whose second chunk fails: the first chunk's cells are
    cropped, so the cache holds what the drafter's ids record, and the next block equals a fresh drafter's."""
    drafter = LlamaCppDrafter(qwen2_dir)
    drafter.propose(CONTEXT, 2, GREEDY, seed=0)
    held = drafter.kv_len
    real, calls = drafter._ctx._decode_one, []

    def second_fails(tokens: list) -> list:
        calls.append(len(tokens))
        if len(calls) == 2:
            raise RuntimeError("llama_decode failed (1)")
        return real(tokens)

    drafter._ctx._decode_one = second_fails  # type: ignore[method-assign]
    long = CONTEXT + [(7 * i) % 400 + 1 for i in range(300)]
    with pytest.raises(RuntimeError, match="llama_decode failed"):
        drafter.propose(long, 2, GREEDY, seed=0)
    drafter._ctx._decode_one = real  # type: ignore[method-assign]
    assert len(calls) == 2 and calls[0] == 256  # the failure came after one whole chunk was decoded
    assert drafter._ctx.seq_len(0) == len(drafter._ids) <= held
    assert drafter.propose(CONTEXT, 4, GREEDY, seed=0).tokens == \
        LlamaCppDrafter(qwen2_dir).propose(CONTEXT, 4, GREEDY, seed=0).tokens


def test_forks_share_weights_and_keep_their_own_cache(qwen2_dir: Path) -> None:
    drafter = LlamaCppDrafter(qwen2_dir)
    twin = drafter.fork()
    a = drafter.propose(CONTEXT, 4, GREEDY, seed=0)
    twin.propose([9, 9, 9], 2, GREEDY, seed=0)
    assert twin.gguf is drafter.gguf and drafter.kv_len == len(CONTEXT) + 3
    assert drafter.propose(CONTEXT, 4, GREEDY, seed=0).tokens == a.tokens


def test_the_edge_drafts_with_llamacpp_where_the_draft_has_a_gguf(qwen2_dir: Path) -> None:
    """auto picks llama.cpp for a directory with model.gguf (and for the file), torch when told; a directory
    without a GGUF cannot be run by llama.cpp and says so in one line."""
    assert isinstance(load_draft_model(EdgeSettings(draft=str(qwen2_dir))), LlamaCppDrafter)
    assert isinstance(load_draft_model(EdgeSettings(draft=str(qwen2_dir / "model.gguf"))), LlamaCppDrafter)
    assert EdgeSettings(draft=str(qwen2_dir / "model.gguf")).tokenizer_dir() == str(qwen2_dir)
    torch_draft = load_draft_model(EdgeSettings(draft=str(qwen2_dir), draft_runtime="torch"))
    assert not isinstance(torch_draft, LlamaCppDrafter)
    assert torch_draft.tokenizer_fingerprint == LlamaCppDrafter(qwen2_dir).tokenizer_fingerprint
    bare = qwen2_dir.parent / "no_gguf"
    bare.mkdir(exist_ok=True)
    with pytest.raises(ValueError, match="needs a GGUF draft"):
        load_draft_model(EdgeSettings(draft=str(bare), draft_runtime="llamacpp"))




def _qs(drafter: LlamaCppDrafter, text: list[int], step: int) -> list[float]:
    """q of the first draft after CONTEXT + text[:n] for n = 0, step, 2 step, ...: the drafter feeds the text
    `step` tokens at a time, as rounds committing that many would make it."""
    drafter.reset()
    return [drafter.propose(CONTEXT + text[:n], 1, SAMPLED, seed=4).q_probs[0] for n in range(0, len(text) + 1, step)]


def test_q_is_the_same_bits_however_the_context_was_fed() -> None:
    """The draft's micro-batches are measured at load (shared/llama_invariance.py), so a token's q is a function of
    its context alone: a text fed 1, 4 or 12 tokens at a time (rounds that commit that many, a catch-up) gives the
    same q, bit for bit, at every position the feedings share. With one micro-batch for a whole decode (before the
    measure) the bits part with the feeding, so the test fails without it."""
    d = build_qwen2(Path(tempfile.mkdtemp()) / "draft", seed=5)
    drafter = LlamaCppDrafter(write_gguf(d, d / "model.gguf"))
    text = drafter.propose(CONTEXT, 12, GREEDY, seed=0).tokens
    one, four, twelve = (_qs(drafter, text, step) for step in (1, 4, 12))
    assert one[::4] == four and one[::12] == twelve
    drafter.ubatch = 256
    drafter = drafter.fork()  # a context made with it (reset clears the context it has)
    one, twelve = _qs(drafter, text, 1), _qs(drafter, text, 12)
    assert one[::12] != twelve
