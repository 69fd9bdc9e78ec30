"""The Triton kernels (cloud/runners/paged_kernel.py, fused_kernels.py) against their plain-PyTorch definitions and,
inside the graph executor, against transformers' own modules; on a CPU under Triton's interpreter (the kernel's
program as written, run by numpy), on a GPU compiled.

- chains, decode steps, a token tree with branches and padding tokens, float32 and bfloat16, keys in shuffled blocks:
  every output within 1e-5 (float32) / 2e-2 (bfloat16) of `attend_reference`;
- a token's output has the same bits alone and beside other rows (each program walks only its own row's blocks);
- the fused residual add + RMSNorm, RoPE and SiLU x up: the sum's bits, and the rest within 1e-5 in float32 (2e-2 in
  bfloat16: the interpreter rounds float32 to bfloat16 by truncation, a GPU to nearest), a row's bits alone and
  beside others;
- the executor with --attention triton and --fused-kernels gives the transformers path's logits (1e-4, the same
  argmax) for the script of tests/cloud/test_graph_executor.py: prefix sharing, decode beside verify, a token tree.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from cloud.runners.fused_kernels import (  # the interpreter without CUDA: tests/conftest.py
    add_rms_norm,
    add_rms_norm_reference,
    rope,
    rope_reference,
    silu_mul,
    silu_mul_reference,
)
from cloud.runners.paged_kernel import attend, attend_reference
from cloud.runners.torch_runner import TargetModel
from tests.cloud.test_graph_executor import _qwen2, _rounds
from tests.tiny_models import WINDOW

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BS = 16


def _case(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """A pool of 20 shuffled blocks and 13 tokens: a chain of 3 after 20, a decode step after 50, a 5-node tree
    after 30 (two branches), a chain of 2 after 7 in a one-block row, two padding tokens."""
    g = torch.Generator().manual_seed(seed)
    Hk, Hq, D = 2, 6, 32
    keys = torch.randn(Hk, 20 * BS, D, generator=g).to(dtype)
    values = torch.randn(Hk, 20 * BS, D, generator=g).to(dtype)
    perm = list(range(19))
    random.Random(seed).shuffle(perm)
    tables = torch.tensor([perm[0:4], perm[4:8], perm[8:12], perm[12:13] + [19] * 3, [19] * 4], dtype=torch.int32)
    toks = [(0, 21, 0, 0), (0, 22, 0, 0), (0, 23, 0, 0), (1, 51, 0, 0)]
    parents = [-1, -1, 0, 1, 2]
    for j in range(5):
        bits, x = 0, j
        while x != -1:
            bits, x = bits | 1 << x, parents[x]
        toks.append((2, 30, 5, bits))
    toks += [(3, 8, 0, 0), (3, 9, 0, 0), (4, 1, 0, 0), (4, 1, 0, 0)]
    q = torch.randn(len(toks), Hq, D, generator=g).to(dtype)
    cols = [torch.tensor([t[i] for t in toks], dtype=torch.int64 if i == 3 else torch.int32) for i in range(4)]
    return q, keys, values, tables, *cols


def test_kernel_matches_its_definition() -> None:
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q, keys, values, tables, row, lim, tree_n, anc = _case(dtype)
        args = [x.to(DEV) for x in (q, keys, values, tables, row, lim, tree_n, anc)]
        got = attend(*args, 32 ** -0.5, BS).cpu().float()
        want = attend_reference(q, keys, values, tables, row, lim, tree_n, anc, 32 ** -0.5, BS).float()
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_a_sliding_window_matches_its_definition() -> None:
    """Windows of 2 and 20 positions: the tree's nodes see only the ancestors within reach (the window of 2 cuts
    inside the tree), chains start at the window's first block; a window wider than every context gives the full
    attention's bits; and a window that is ignored fails the comparison."""
    q, keys, values, tables, row, lim, tree_n, anc = _case(torch.float32, seed=2)
    args = [x.to(DEV) for x in (q, keys, values, tables, row, lim, tree_n, anc)]
    full = attend(*args, 0.2, BS).cpu()
    for window in (2, 20):
        got = attend(*args, 0.2, BS, window).cpu()
        want = attend_reference(q, keys, values, tables, row, lim, tree_n, anc, 0.2, BS, window)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(full, want, atol=1e-3)  # the window changes what the tokens see
    assert torch.equal(attend(*args, 0.2, BS, 1000).cpu(), full)


def test_a_token_gets_the_same_bits_whatever_shares_its_forward() -> None:
    q, keys, values, tables, row, lim, tree_n, anc = (x.to(DEV) for x in _case(torch.bfloat16, seed=1))
    every = attend(q, keys, values, tables, row, lim, tree_n, anc, 0.2, BS)
    for t in (3, 6, 9):
        alone = attend(q[t: t + 1], keys, values, tables, row[t: t + 1], lim[t: t + 1], tree_n[t: t + 1],
                       anc[t: t + 1], 0.2, BS)
        assert torch.equal(alone[0], every[t])


def test_fused_add_norm_and_silu_match_their_definitions() -> None:
    g = torch.Generator().manual_seed(3)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        x, r = (torch.randn(7, 96, generator=g).to(dtype).to(DEV) for _ in range(2))
        w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype).to(DEV)
        s, out = add_rms_norm(x, r, w, 1e-6)
        s_ref, out_ref = add_rms_norm_reference(x.cpu(), r.cpu(), w.cpu(), 1e-6)
        torch.testing.assert_close(s.cpu(), s_ref, atol=tol, rtol=tol)
        torch.testing.assert_close(out.cpu(), out_ref, atol=tol, rtol=tol)
        qkv = torch.randn(7, 3 * 4 * 32, generator=g).to(dtype).to(DEV)  # rope reads the heads as strided views
        heads = qkv[:, 4 * 32: 8 * 32].view(7, 4, 32)
        cos, sin = torch.randn(64, 32, generator=g).to(dtype).to(DEV), torch.randn(64, 32, generator=g).to(dtype).to(DEV)
        pos = torch.tensor([0, 5, 6, 7, 63, 1, 2], device=DEV)
        torch.testing.assert_close(rope(heads, cos, sin, pos).cpu(), rope_reference(heads, cos, sin, pos).cpu(),
                                   atol=tol, rtol=tol)
        gu = torch.randn(7, 2 * 300, generator=g).to(dtype).to(DEV)  # 300: past one block of the kernel's columns
        torch.testing.assert_close(silu_mul(gu).cpu(), silu_mul_reference(gu.cpu()), atol=tol, rtol=tol)
        if dtype == torch.float32:
            assert torch.equal(s.cpu(), s_ref)
        for t in (0, 4):  # a row alone: the bits it gets beside the others
            assert torch.equal(add_rms_norm(x[t: t + 1], r[t: t + 1], w, 1e-6)[1][0], out[t])
            assert torch.equal(silu_mul(gu[t: t + 1])[0], silu_mul(gu)[t])


def test_executor_with_the_kernel_matches_the_transformers_path(tmp_path: Path) -> None:
    """The coder pair's architecture (Qwen2: q/k/v biases, grouped-query attention), its second layer sliding
    (window 8, so the script's contexts reach past it)."""
    arch_dir = _qwen2(tmp_path / "m", WINDOW)
    ref = _rounds(TargetModel(arch_dir, DEV, "float32", invariant=False, executor="transformers"))
    target = TargetModel(arch_dir, DEV, "float32", invariant=False, executor="eager", attention="triton",
                         fused_kernels=True)
    assert target.paged is not None and target.paged.kernel and target.paged.fused_rope
    for bucketed in (False, True):
        target.paged.buckets = bucketed
        for fw_ref, fw in zip(ref, _rounds(target), strict=True):
            for r, x in zip(fw_ref, fw, strict=True):
                torch.testing.assert_close(x.cpu(), r.cpu(), atol=1e-4, rtol=1e-4)
                assert torch.equal(x.argmax(-1).cpu(), r.argmax(-1).cpu())
