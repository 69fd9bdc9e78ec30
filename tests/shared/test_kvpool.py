"""The paged KV pool: a row's logits in a flattened batch equal the same row run alone, and the
model's own forward.

Tiny random models (tests/tiny_models.py): GPT-2 (absolute positions), Llama (GQA, RoPE), Mistral
(sliding window 8), Gemma2 (softcapped scores) and Gemma3 (sliding and global layers). Blocks of 4
positions, so rows cross block boundaries and crops land inside blocks. Tolerance: 1e-4 absolute on
logits of magnitude ~2 in float32 (observed differences ~1e-6: the batch only changes summation order).
"""

from __future__ import annotations

import pytest
import torch

from shared.blocks import OutOfBlocks
from shared.hf_model import load_causal_lm
from shared.kvpool import KVPool, Row, attention_layout
from tests.tiny_models import build

TOL = 1e-4


@pytest.fixture(scope="module", params=["gpt2", "llama", "mistral", "gemma2", "gemma3"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    d = build(request.param, tmp_path_factory.mktemp(request.param))
    torch.set_num_threads(1)
    return load_causal_lm(d, "cpu", torch.float32)  # sdpa, or eager where the model has no sdpa (Gemma2)


def new_pool(model: torch.nn.Module, **kw: object) -> KVPool:
    pool = KVPool(attention_layout(model.config), 256, "cpu", torch.float32, block_size=4, **kw)  # type: ignore[arg-type]
    pool.prepare(model)
    return pool


def seqs(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4096, (length,), generator=g).tolist() for _ in range(n)]


@torch.inference_mode()
def test_batched_rows_equal_rows_run_alone_and_the_plain_forward(model: torch.nn.Module) -> None:
    """Five sequences with different cached lengths (3..27, past the window) and different new
    lengths (1..6), one forward; then each alone in a fresh pool; then the uncached forward."""
    ids = seqs(5, 34)
    past = [3, 27, 10, 0, 16]
    new = [5, 1, 6, 4, 2]
    batched = new_pool(model)
    slots = [batched.allocate() for _ in ids]
    batched.forward(model, [Row(s, 0, x[:c], 0) for s, x, c in zip(slots, ids, past, strict=True) if c])
    rows = [Row(s, c, x[c: c + n], n) for s, x, c, n in zip(slots, ids, past, new, strict=True)]
    together = batched.forward(model, rows)
    for x, c, n, got in zip(ids, past, new, together, strict=True):
        alone = new_pool(model)
        s = alone.allocate()
        if c:
            alone.forward(model, [Row(s, 0, x[:c], 0)])
        (single,) = alone.forward(model, [Row(s, c, x[c: c + n], n)])
        plain = model(input_ids=torch.tensor([x[: c + n]])).logits[0, c: c + n].float()
        assert got.shape == (n, model.config.vocab_size)
        assert (got - single).abs().max() < TOL
        assert (got - plain).abs().max() < TOL


@torch.inference_mode()
def test_crop_then_rewrite_gives_the_uncropped_answer(model: torch.nn.Module) -> None:
    """Write 20 positions, crop to 12, feed other tokens, crop back, feed the originals: as if never cropped."""
    (x,) = seqs(1, 24, seed=1)
    pool = new_pool(model)
    s = pool.allocate()
    pool.forward(model, [Row(s, 0, x[:20], 0)])
    pool.crop(s, 13)  # the middle of a block
    pool.forward(model, [Row(s, 13, [7, 8, 9, 10, 11], 0)])  # a rejected continuation
    assert pool.length(s) == 18
    pool.crop(s, 13)
    (got,) = pool.forward(model, [Row(s, 13, x[13:24], 11)])
    plain = model(input_ids=torch.tensor([x])).logits[0, 13:24].float()
    assert (got - plain).abs().max() < TOL
    assert pool.manager.seqs[s].table.__len__() == 6  # 24 positions in blocks of 4


@torch.inference_mode()
def test_prefix_from_the_cache_gives_the_same_logits(model: torch.nn.Module) -> None:
    """A sequence whose first full blocks come from the prefix cache answers like one that computed
    them, including after a crop into a shared block (copy-on-write); another salt shares nothing."""
    (x,) = seqs(1, 30, seed=3)
    pool = new_pool(model, prefix_cache=True)
    a = pool.allocate(b"k1")
    pool.forward(model, [Row(a, 0, x[:22], 0)])
    pool.set_length(a, 22)  # 5 full blocks enter the cache
    b = pool.allocate(b"k1")
    assert pool.match_prefix(b, x, 21) == 20
    shared = pool.manager.seqs[b].table[:5]
    assert shared == pool.manager.seqs[a].table[:5]
    (got,) = pool.forward(model, [Row(b, 20, x[20:30], 10)])
    plain = model(input_ids=torch.tensor([x])).logits[0, 20:30].float()
    assert (got - plain).abs().max() < TOL
    pool.crop(b, 18)  # into the middle of a shared block: the next write copies it first
    (again,) = pool.forward(model, [Row(b, 18, x[18:30], 12)])
    assert (again - model(input_ids=torch.tensor([x])).logits[0, 18:30].float()).abs().max() < TOL
    assert pool.manager.seqs[b].table[4] != shared[4] and pool.manager.seqs[a].table[4] == shared[4]
    (first,) = pool.forward(model, [Row(a, 22, x[22:30], 8)])  # a's blocks were not touched by b
    assert (first - plain[2:]).abs().max() < TOL
    other = pool.allocate(b"k2")
    assert pool.match_prefix(other, x, 21) == 0
    for s in (a, b, other):
        pool.release(s)
    pool.manager.check()
    assert pool.manager.used == 0


@torch.inference_mode()
def test_non_adjacent_slots_are_gathered_with_the_same_result(model: torch.nn.Module) -> None:
    ids = seqs(4, 12, seed=2)
    pool = new_pool(model)
    slots = [pool.allocate() for _ in ids]
    pool.forward(model, [Row(s, 0, x[:8], 0) for s, x in zip(slots, ids, strict=True)])
    a, b = pool.forward(model, [Row(slots[0], 8, ids[0][8:], 4), Row(slots[3], 8, ids[3][8:], 4)])  # slots 0 and 3
    for got, x in ((a, ids[0]), (b, ids[3])):
        plain = model(input_ids=torch.tensor([x])).logits[0, 8:].float()
        assert (got - plain).abs().max() < TOL


@torch.inference_mode()
def test_pool_sized_from_the_budget_never_grows_past_it(model: torch.nn.Module) -> None:
    """A budget of 10 blocks: the tensors never hold more, and a forward that needs more is refused
    before anything is written."""
    probe = new_pool(model)
    budget = 10 * 4 * probe.bytes_per_position
    pool = new_pool(model, budget_bytes=budget)
    s = pool.allocate()
    pool.forward(model, [Row(s, 0, seqs(1, 40)[0], 0)])
    assert pool.allocated_bytes <= budget and pool.manager.available() == 0
    t = pool.allocate()
    with pytest.raises(OutOfBlocks):
        pool.forward(model, [Row(t, 0, [1, 2], 1)])
    assert pool.length(t) == 0 and pool.length(s) == 40


@torch.inference_mode()
def test_a_preallocated_pool_holds_its_budget_from_the_start_and_never_grows(model: torch.nn.Module) -> None:
    """--kv-preallocate: a budget of 40 blocks is allocated when the pool is sized; filling it moves no tensor
    (no growth copies under load), and the logits equal a growing pool's."""
    probe = new_pool(model)
    budget = 40 * 4 * probe.bytes_per_position
    pre, grows = new_pool(model, budget_bytes=budget, preallocate=True), new_pool(model, budget_bytes=budget)
    assert pre.keys[0].shape[1] == 40 * 4 and grows.keys[0].shape[1] < 40 * 4
    first = pre.keys[0].data_ptr()
    x = seqs(1, 150)[0]
    outs = []
    for pool in (pre, grows):
        s = pool.allocate()
        outs.append(pool.forward(model, [Row(s, 0, x, 8)])[0])
    assert pre.keys[0].data_ptr() == first and pre.keys[0].shape[1] == 40 * 4
    assert torch.equal(outs[0], outs[1])


def test_auto_preallocates_a_budget_that_fits_in_half_the_free_memory(model: torch.nn.Module,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The default ("auto"): a budget of at most half the free memory is allocated whole at start (no growth
    stalls under load); a larger one grows by doubling, as does any budget when the free memory is unknown."""
    import shared.kvpool as kvpool

    probe = new_pool(model)
    budget = 40 * 4 * probe.bytes_per_position
    for free, whole in ((2 * budget, True), (2 * budget - 1, False), (None, False)):
        monkeypatch.setattr(kvpool, "free_memory_bytes", lambda device, free=free: free)
        pool = new_pool(model, budget_bytes=budget, preallocate="auto")
        assert (pool.keys[0].shape[1] == 40 * 4) is whole, free
    monkeypatch.undo()
    free = kvpool.free_memory_bytes(torch.device("cpu"))
    assert free is not None and free > 0


@torch.inference_mode()
def test_forwards_of_one_model_from_two_threads_do_not_overlap_and_stay_exact(model: torch.nn.Module) -> None:
    """Two threads run one set of weights through two pools (drafters forked from one model, as in
    the OpenAI server). The attention implementation lives on the shared config: a forward of thread A
    ending while B's is half-way used to switch B's remaining layers back to the plain implementation,
    a wrong q. Driven deterministically: A's forward waits at its second layer until B's forward has
    either reached its own second layer (overlap: the defect) or 0.5 s have passed; then A ends. No
    overlap, and both logits equal each forward run alone."""
    import threading

    a_ids, b_ids = seqs(2, 12, seed=3)

    def alone(ids: list[int]) -> torch.Tensor:
        pool = new_pool(model)
        (out,) = pool.forward(model, [Row(pool.allocate(), 0, ids, 4)])
        return out

    ref_a, ref_b = alone(a_ids), alone(b_ids)
    pool_a, pool_b = new_pool(model), new_pool(model)
    a_half, b_half = threading.Event(), threading.Event()
    overlapped: list[bool] = []
    got: dict[str, torch.Tensor] = {}

    def at_second_layer(*_: object) -> None:
        if threading.current_thread() is main:
            a_half.set()
            overlapped.append(b_half.wait(0.5))
        else:
            b_half.set()

    def thread_b() -> None:
        with torch.inference_mode():
            (got["b"],) = pool_b.forward(model, [Row(pool_b.allocate(), 0, b_ids, 4)])

    main = threading.current_thread()
    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    hook = layers[1].register_forward_pre_hook(at_second_layer)
    t = threading.Thread(target=thread_b)
    try:
        def start_b(*_: object) -> None:
            if not t.is_alive() and not b_half.is_set():
                t.start()
        first = layers[0].register_forward_pre_hook(start_b)  # B starts once A's forward is under way
        try:
            (got["a"],) = pool_a.forward(model, [Row(pool_a.allocate(), 0, a_ids, 4)])
        finally:
            first.remove()
        t.join(30)
    finally:
        hook.remove()
    assert overlapped == [False]
    assert (got["a"] - ref_a).abs().max() < TOL
    assert (got["b"] - ref_b).abs().max() < TOL
