"""The graph executor (cloud/runners/graphs.py) against transformers' own modules over the same paged pool.

On a CPU the executor runs eagerly, with exact shapes or padded to the graphs' buckets (the same static inputs,
spare-row padding and block tables a CUDA graph replays); its logits must match the transformers path's for
chains, decode steps beside other sessions, prefix sharing and token trees. CUDA-only checks (capture, replay)
skip with their reason where no GPU is present.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers as tf

from cloud.runners.graph_inputs import bucket
from cloud.runners.graphs import PagedForward
from cloud.runners.invariance import paged_invariance
from cloud.runners.model_forward import support
from cloud.runners.torch_runner import TargetModel
from shared.kvpool import UnsupportedModel
from shared.rows import Row
from tests.tiny_models import _ATTN, WINDOW, build

CUDA = torch.cuda.is_available()


def _qwen2(out: Path, window: int | None = None) -> Path:
    """A tiny Qwen2 (q/k/v biases, GQA): the coder pair's architecture; with `window`, its second layer slides
    (full and sliding-window layers in one model)."""
    extra = dict(use_sliding_window=True, sliding_window=window, max_window_layers=1) if window else {}
    cfg = tf.Qwen2Config(**_ATTN, num_key_value_heads=2, **extra)
    cfg.eos_token_id = 0
    torch.manual_seed(3)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0) if p.dim() >= 2 else p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    build("llama", out.parent / (out.name + "-tok"))
    for f in (out.parent / (out.name + "-tok")).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


@pytest.fixture(scope="module", params=["qwen2", "llama", "qwen3", "mistral", "qwen2-window"])
def arch_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Each family the executor runs; Mistral slides on every layer (window 8), "qwen2-window" on its second only.
    `_rounds` reaches 60 positions, so the windows cut what a token sees."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param.startswith("qwen2"):
        return _qwen2(root / "m", WINDOW if request.param == "qwen2-window" else None)
    return build(request.param, root / "m", seed=4)


def _rounds(target: TargetModel) -> list[list[torch.Tensor]]:
    """One script of forwards on `target`'s pool: two prompts (one sharing the other's first block through the
    prefix cache), decode steps side by side, a verify chain beside a decode step, a token tree; each forward's
    logits."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 4000, (60,), generator=g).tolist()
    pool = target.pool
    a, b = pool.allocate(), pool.allocate()
    out = [target.forward([Row(a, 0, ids[:40], 1)])]
    pool.set_length(a, 40)
    have = pool.match_prefix(b, ids[:16] + ids[40:60], 16)
    out.append(target.forward([Row(b, have, (ids[:16] + ids[40:60])[have:], 2)]))
    pool.set_length(b, 36)
    out.append(target.forward([Row(a, 40, [7], 1), Row(b, 36, [9], 1)]))
    out.append(target.forward([Row(a, 41, [11, 12, 13, 14, 15], 5), Row(b, 37, [21], 1)]))
    pool.crop(a, 43)
    pool.set_length(b, 38)
    tree = (-1, -1, 0, 1, 2)
    out.append(target.forward([Row(b, 38, [5, 6, 7, 8, 9], 5, tree=tree, tree_base=38), Row(a, 43, [3, 4], 2)]))
    pool.release(a)
    pool.release(b)
    return out


@pytest.mark.parametrize("buckets,invariant", [(False, False), (True, False), (True, True)],
                         ids=["exact", "bucketed", "bucketed-tiled"])
def test_executor_matches_the_transformers_path(arch_dir: Path, buckets: bool, invariant: bool) -> None:
    """float32 on the CPU: every kept logit within 1e-4 of the transformers path's, the same argmax (the two paths
    sum in other orders, so bits may differ); tiled: the tokens padded to whole row tiles."""
    ref = _rounds(TargetModel(arch_dir, "cpu", "float32", invariant=False, executor="transformers"))
    target = TargetModel(arch_dir, "cpu", "float32", invariant=invariant, executor="eager")
    assert target.info.forward_path == "paged-eager" and target.paged is not None
    target.paged.buckets = buckets
    target.calibrate(64)  # the invariance probe's own forwards run first
    before = target.paged.eager
    got = _rounds(target)
    assert target.paged.eager - before == len(got)
    for fw_ref, fw in zip(ref, got, strict=True):
        for r, x in zip(fw_ref, fw, strict=True):
            assert x.shape == r.shape
            torch.testing.assert_close(x, r, atol=1e-4, rtol=1e-4)
            assert torch.equal(x.argmax(-1), r.argmax(-1))


def test_bucketed_forward_pads_to_thebucket(arch_dir: Path) -> None:
    target = TargetModel(arch_dir, "cpu", "float32", invariant=False, executor="eager")
    assert target.paged is not None
    target.paged.buckets = True
    rows = [Row(0, 0, [1] * 5, 1), Row(1, 130, [1] * 9, 9), Row(2, 3, [2], 1)]
    assert target.paged.shape_of(rows) == (4, 12, 256)
    assert bucket(65, (1, 64)) is None
    assert target.paged.shape_of([Row(0, 0, [1] * 40, 1)]) == (1, 48, 128)  # a prefill chunk in its own bucket
    assert target.paged.shape_of([Row(0, 0, [1] * 600, 1)]) is None  # longer than any bucket: eager, exact shapes
    mixed = [Row(0, 0, [1] * 100, 1)] + [Row(i, 5, [1], 1) for i in range(1, 32)]
    assert target.paged.shape_of(mixed) is None  # 32 rows x 128 queries: past MAX_GRAPH_TOKENS


def test_on_a_cpu_the_linear_tile_is_measured_and_whole_tiles_give_the_same_logits(arch_dir: Path) -> None:
    """An invariant eager executor on a CPU runs its linear layers in the mode the start-up measurement picks
    (shared/invariant_calibration.py `linear_mode`: a small tile in one call where the kernels allow it), not in
    calls of ROW_TILE rows, and a chain's logits are the same as with one call per tile of that size."""
    from shared.invariant_calibration import linear_mode

    target = TargetModel(arch_dir, "cpu", "float32", invariant=True, executor="eager")
    assert target.paged is not None
    target.calibrate(64)
    assert (target.paged.tile, target.paged.calls) == linear_mode(target.model, 64)[0] == \
        (target.row_tile, target.paged.calls)
    s = target.pool.allocate()
    target.forward([Row(s, 0, list(range(1, 20)), 0)])
    chain = [Row(s, 19, [5, 6, 7, 8, 9], 5)]
    one_call = target.forward(chain)[0]
    target.pool.crop(s, 19)
    target.paged.calls = True
    assert torch.equal(target.forward(chain)[0], one_call) or not target.info.batch_invariant


def test_invariance_probe_names_a_difference(arch_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up probe finds a row whose bits depend on its forward's size (a known-biased forward: noise
    scaled by the row count) and names the case; the executor's own forwards in float32 with row tiles are
    reported as measured, whatever the answer."""
    target = TargetModel(arch_dir, "cpu", "float32", invariant=True, executor="eager")
    assert target.paged is not None
    target.paged.buckets = True
    measured = target.calibrate(64)
    assert target.info.batch_invariant is measured
    # the claim names what it was measured on (GET /v1/model batch_invariant_probe), and only when it holds
    probe = target.info.batch_invariant_probe
    assert ("beside 7 decode steps" in probe and "token tree" in probe and "prefill chunk" in probe) if measured \
        else probe == ""
    real = target.paged.run

    def biased(inp, keys, values):  # type: ignore[no-untyped-def]
        return real(inp, keys, values) + 1e-3 * inp.ids.shape[0]  # final hidden states [P, d]

    monkeypatch.setattr(target.paged, "run", biased)
    failure, probed = paged_invariance(target, 64)
    assert "differ from a decode step alone" in failure and probed == ""
    assert target.pool.manager.used == 0  # the probe's sequences are released


def test_unsupported_models_keep_the_transformers_path(tmp_path: Path) -> None:
    gpt2 = build("gpt2", tmp_path / "g")
    auto = TargetModel(gpt2, "cpu", "float32", invariant=False)
    assert auto.paged is None and auto.info.forward_path == "transformers"
    with pytest.raises(UnsupportedModel, match="--executor transformers"):
        TargetModel(gpt2, "cpu", "float32", invariant=False, executor="eager")
    assert "gpt2 is not one of" in (support(auto.model) or "")



@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device (bench gpu measures them on a GPU host)")
def test_graph_replay_matches_eager_on_cuda(arch_dir: Path) -> None:
    eager = _rounds(TargetModel(arch_dir, "cuda", "float32", invariant=False, executor="eager"))
    target = TargetModel(arch_dir, "cuda", "float32", invariant=False, executor="graphs")
    assert isinstance(target.paged, PagedForward) and target.paged.graphs
    got = _rounds(target)
    assert target.paged.captured > 0 and target.paged.replayed > 0
    for fw_ref, fw in zip(eager, got, strict=True):
        for r, x in zip(fw_ref, fw, strict=True):
            torch.testing.assert_close(x, r, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device (bench gpu measures them on a GPU host)")
def test_graphs_survive_the_pool_growing_under_them(tmp_path: Path) -> None:
    """The pool grows (new storage) after graphs were captured: they are dropped with their memory pool and
    captured anew, and the forwards still match eager ones."""
    d = build("llama", tmp_path / "m", seed=5)
    target = TargetModel(d, "cuda", "float32", invariant=False, executor="graphs")
    eager = TargetModel(d, "cuda", "float32", invariant=False, executor="eager")
    assert target.paged is not None
    g = torch.Generator().manual_seed(1)
    slots = []
    for _ in range(40):  # 40 sequences of 30 tokens: past the pool's first 16 blocks, growing it twice
        ids = torch.randint(1, 4000, (30,), generator=g).tolist()
        outs = []
        for t in (target, eager):
            s = t.pool.allocate()
            outs.append(t.forward([Row(s, 0, ids, 2)])[0])
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
        slots.append(s)
    assert target.paged.captured >= 2 and target.paged.replayed > 0


def test_fused_projections_are_views_of_one_weight(arch_dir: Path) -> None:
    """q/k/v and gate/up run as one GEMM each over one weight; the modules' own weights are views of it, so the
    model's bytes are what they were and transformers' forward (the tests' reference) reads the same numbers. (In
    float32 on a CPU the weights are packed for oneDNN instead, shared/cpu_weights.py, and keep their GEMMs.)"""
    target = TargetModel(arch_dir, "cpu", "bfloat16", invariant=False, executor="eager")
    assert target.paged is not None
    layer = target.paged.layers[0]
    a, m = layer.self_attn, layer.mlp
    assert id(a) in target.paged.fused and id(m) in target.paged.fused
    q, k, v = a.q_proj.weight, a.k_proj.weight, a.v_proj.weight
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()
    assert m.gate_proj.weight.untyped_storage().data_ptr() == m.up_proj.weight.untyped_storage().data_ptr()
    h = torch.randn(3, q.shape[1], dtype=torch.bfloat16)
    fused = target.paged.fused[id(a)](h)
    plain = torch.cat([a.q_proj(h), a.k_proj(h), a.v_proj(h)], -1)
    torch.testing.assert_close(fused, plain, atol=2e-2, rtol=2e-2)
    packed = TargetModel(arch_dir, "cpu", "float32", invariant=False, executor="eager")
    assert packed.paged is not None and not packed.paged.fused


def test_start_up_buckets_and_their_blank_inputs(arch_dir: Path) -> None:
    """The deployment's lists make buckets of the executor's (R x N capped); a bucket's blank inputs (what a start-up
    capture records) have exactly the shapes of real inputs in that bucket, which a replay copies in."""
    from cloud.runners.graph_inputs import MAX_GRAPH_TOKENS, blank, graph_shapes

    shapes = graph_shapes([1, 3, 64, 256], [1, 9], [500, 4096])
    assert (4, 12, 512) in shapes and (1, 1, 4096) in shapes
    assert all(R * N <= MAX_GRAPH_TOKENS for R, N, _ in shapes)
    assert not any(R == 256 for R, _, _ in shapes)  # past ROW_BUCKETS: eager
    target = TargetModel(arch_dir, "cpu", "float32", invariant=True, executor="eager")
    assert target.paged is not None
    target.paged.buckets = True
    target.paged.chunked = False  # the SDPA groups a graph bucket replays (a CPU's eager forward builds none)
    pool = target.pool
    a, b = pool.allocate(), pool.allocate()
    rows = [Row(a, 0, [5] * 9, 9), Row(b, 0, [6], 1), Row(pool.allocate(), 0, [7, 8], 2)]
    for r in rows:
        pool.manager.prepare_write(r.seq_id, r.num_cached_tokens, len(r.ids))
    shape = target.paged.shape_of(rows)
    assert shape is not None
    real = target.paged.inputs(pool, rows, pool.spare_row, shape)
    blank = blank(shape, pool.spare_row, target.paged.tile)
    for x, y in ((real.ids, blank.ids), (real.positions, blank.positions), (real.write, blank.write),
                 (real.logits_indices, blank.logits_indices)):
        assert x.shape == y.shape and x.dtype == y.dtype
    for g, h in zip(real.groups, blank.groups, strict=True):
        assert (g.queries.shape, g.keys.shape, g.mask.shape, g.shape) == (h.queries.shape, h.keys.shape,
                                                                           h.mask.shape, h.shape)


def test_graph_lists_are_validated(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from cloud.settings import CloudSettings

    (tmp_path / "config.json").write_text("{}")
    s = CloudSettings(model=tmp_path, graph_rows=" 1, 8,64", graph_memory_bytes=0)
    assert s.graph_lists()[0] == [1, 8, 64]
    with pytest.raises(ValidationError, match="comma-separated list of positive counts"):
        CloudSettings(model=tmp_path, graph_keys="512,x")


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a CUDA device (bench gpu measures them on a GPU host)")
def test_start_up_capture_replays_within_its_bytes_and_counts_the_rest(arch_dir: Path) -> None:
    """bfloat16, tiled (the shipped default): graphs captured at start-up for the deployment's buckets replay with
    the eager forward's bits; nothing is captured while serving; a forward outside every bucket runs eagerly and is
    counted; a bound of 0 bytes captures nothing."""
    from cloud.runners.graph_inputs import graph_shapes

    eager = TargetModel(arch_dir, "cuda", "bfloat16", invariant=True, executor="eager")
    target = TargetModel(arch_dir, "cuda", "bfloat16", invariant=True, executor="graphs")
    assert target.paged is not None
    eager.paged.buckets = True  # type: ignore[union-attr]
    target.capture_graphs([1, 2, 4], [1, 2, 4, 8], [128, 256], 1 << 30)
    held = target.paged.captured
    assert held == len(graph_shapes([1, 2, 4], [1, 2, 4, 8], [128, 256])) and target.paged.graph_bytes <= 1 << 30
    ref, got = _rounds(eager), _rounds(target)
    assert target.paged.captured == held and target.paged.replayed > 0 and target.paged.eager > 0
    target.calibrate(64)  # the probe covers every captured key bucket past 512 (none here), in graphs
    assert target.info.batch_invariant and "beside 7 decode steps" in target.info.batch_invariant_probe
    for fw_ref, fw in zip(ref, got, strict=True):
        for r, x in zip(fw_ref, fw, strict=True):
            assert torch.equal(x, r)
    none = TargetModel(arch_dir, "cuda", "bfloat16", invariant=True, executor="graphs")
    none.capture_graphs([1], [1], [128], 0)
    assert none.paged is not None and none.paged.captured - none.paged.graph_bytes >= 0 and not none.paged._graphs
