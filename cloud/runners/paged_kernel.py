"""Paged attention in one Triton kernel: each query token reads its keys from the KV pool through its row's block
table (no gathered copy of any key), under a mask of three numbers a token, with an online softmax over key blocks.

The mask. Token t of a forward sees storage offset o of its row's sequence iff o < lim[t], or o - lim[t] is in
[0, tree_n[t]) and bit o - lim[t] of anc[t] is set. A chain row's i-th new token after c cached ones
(`num_cached_tokens`) has lim = c + i + 1 and tree_n = 0 (causal); a token tree's node j (shared/tree.py; nodes
stored from the tree's base b) has lim = b (the prefix) and its path's nodes as bits of anc (at most 64 nodes). The
same rule as the masks of cloud/runners/model_forward.py's SDPA path, given as numbers instead of a [rows, queries,
keys] tensor built on the host.
On a sliding-window layer (`window` > 0) a key is seen only while the query's position minus its own is below the
window. Positions come from the same numbers: an offset below lim is its own position; tree node j sits at
lim - 1 + its depth, the count of its path's nodes (the set bits of its anc up to j: a node's ancestors have lower
indices). The program starts at the window's first block, and blocks that hold no key it sees add nothing.

Order and precision. A program takes one query token and one KV head (its g query heads together) and walks the
row's key blocks in storage order, so a token's output is the same computation whatever else shares the forward.
Scores, softmax and the weighted sum are float32 (bfloat16 keys and values widened exactly, IEEE products, no TF32):
a decode step reads every key once, so the GPU waits on memory, not on these products.

`attend_reference` is the plain-PyTorch definition the tests hold the kernel to. The kernel runs on CUDA; on a CPU
only under Triton's interpreter (TRITON_INTERPRET=1, set before this module is imported), for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_attention(Q, K, V, OUT, TABLES, TOK_ROW, LIM, TREE_N, ANC, scale,
                     stride_qt, stride_qh, stride_kh, stride_kr, stride_ot, stride_oh, stride_tr,
                     G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, WINDOW: tl.constexpr):
    t = tl.program_id(0)  # the query token
    kh = tl.program_id(1)  # the KV head
    row = tl.load(TOK_ROW + t)
    lim = tl.load(LIM + t)
    tree_n = tl.load(TREE_N + t)
    anc = tl.load(ANC + t)
    hs = tl.arange(0, GP)  # this KV head's query heads (padded to GP)
    dd = tl.arange(0, D)
    heads = hs < G
    q = tl.load(Q + t * stride_qt + (kh * G + hs)[:, None] * stride_qh + dd[None, :], mask=heads[:, None],
                other=0.0).to(tl.float32)  # [GP, D]
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    end = lim + tree_n  # offsets 0 .. end - 1 may be seen
    b = 0
    if WINDOW > 0:
        depth = anc * 0
        for i in tl.static_range(64):
            depth += (anc >> i) & 1
        qpos = lim - 1 + depth  # the query's position (a chain token: lim - 1)
        b = tl.maximum(qpos - WINDOW + 1, 0) // BS  # the first block holding a key of the window
    while b * BS < end:  # (a while loop: the block count is data, and Triton's interpreter takes this form)
        blk = tl.load(TABLES + row * stride_tr + b)
        offs = b * BS + tl.arange(0, BS)  # storage offsets of this block
        rows = blk * BS + tl.arange(0, BS)  # their pool rows
        k = tl.load(K + kh * stride_kh + rows[:, None] * stride_kr + dd[None, :]).to(tl.float32)  # [BS, D]
        v = tl.load(V + kh * stride_kh + rows[:, None] * stride_kr + dd[None, :]).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [GP, BS]
        rel = offs - lim
        bit = (anc >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)) & 1
        seen = (offs < lim) | ((rel >= 0) & (rel < tree_n) & (bit == 1))
        if WINDOW > 0:
            before = (offs * 0).to(tl.int64)  # a node's path nodes up to it: its depth
            for i in tl.static_range(64):
                before += ((anc >> i) & 1) * (rel >= i)
            kpos = tl.where(rel >= 0, lim - 1 + before, offs)
            seen = seen & (qpos - kpos < WINDOW)
        s = tl.where(seen[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing seen yet adds nothing
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
        b += 1
    out = acc / l_i[:, None]
    tl.store(OUT + t * stride_ot + (kh * G + hs)[:, None] * stride_oh + dd[None, :], out.to(OUT.dtype.element_ty),
             mask=heads[:, None])


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor, tok_row: torch.Tensor,
           lim: torch.Tensor, tree_n: torch.Tensor, anc: torch.Tensor, scale: float, block: int,
           window: int = 0) -> torch.Tensor:
    """Attention of every query token (q [T, Hq, D]) over its row's keys in the pool (keys, values [Hk, rows, D];
    tables [R, max blocks] block ids; tok_row [T] the row of each token; lim, tree_n, anc [T] its mask; `window`
    > 0: a sliding window); [T, Hq, D]."""
    T, Hq, D = q.shape
    Hk = keys.shape[0]
    G = Hq // Hk
    o = torch.empty_like(q)
    if T == 0:
        return o
    q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
    _paged_attention[(T, Hk)](q, keys, values, o, tables, tok_row, lim, tree_n, anc, scale,
                              q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), o.stride(0), o.stride(1),
                              tables.stride(0), G=G, GP=max(16, triton.next_power_of_2(G)), D=D, BS=block,
                              WINDOW=window)
    return o


def attend_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                     tok_row: torch.Tensor, lim: torch.Tensor, tree_n: torch.Tensor, anc: torch.Tensor, scale: float,
                     block: int, window: int = 0) -> torch.Tensor:
    """`attend`, one token at a time in float32, from the module docstring's rule."""
    T, Hq, D = q.shape
    Hk = keys.shape[0]
    out = torch.empty(T, Hq, D, dtype=torch.float32)
    for t in range(T):
        n = int(lim[t]) + int(tree_n[t])
        offs = torch.arange(n)
        table = tables[int(tok_row[t])].long().cpu()
        rows = table[offs // block] * block + offs % block  # [n] pool rows
        rel = offs - int(lim[t])
        bits = int(anc[t])
        seen = (offs < int(lim[t])) | ((rel >= 0) & ((bits >> rel.clamp(0, 63)) & 1).bool())
        if window > 0:
            kpos = torch.tensor([o if r < 0 else int(lim[t]) - 1 + bin(bits & ((2 << r) - 1)).count("1")
                                 for o, r in zip(offs.tolist(), rel.tolist(), strict=True)])
            seen &= (int(lim[t]) - 1 + bin(bits).count("1") - kpos) < window
        k = keys[:, rows].float().repeat_interleave(Hq // Hk, 0)  # [Hq, n, D]
        v = values[:, rows].float().repeat_interleave(Hq // Hk, 0)
        s = torch.einsum("hd,hnd->hn", q[t].float().cpu(), k.cpu()) * scale  # [Hq, n]
        s = s.masked_fill(~seen[None], float("-inf"))
        out[t] = torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v.cpu())
    return out.to(q.dtype)
