"""The graph executor's elementwise steps as Triton kernels (`--fused-kernels`): the residual add with the RMSNorm
that follows it, RoPE on the queries and keys, and SiLU(gate) x up. Each is one kernel where PyTorch runs three to
six (the add, the square, the mean, the rsqrt, the products, the casts), over the same bytes.

One program takes one token's row, so a token's result is the same computation whatever shares its forward (batch
invariance holds as for the plain ops). Sums and products are float32, rounded once to the activations' dtype as
transformers' RMSNorm rounds (the normalised row, then the weight's product); the sum of a row's squares is Triton's
reduction, not PyTorch's, so the bits are close to the plain ops', not equal (the tests hold them to 1e-5 in
float32). `add_rms_norm_reference`, `rope_reference` and `silu_mul_reference` are the plain-PyTorch definitions.

The kernels run on CUDA; on a CPU only under Triton's interpreter (TRITON_INTERPRET=1, set before this module is
imported), for tests. Opt-in until a GPU run measures them against the plain ops (`specsplit-bench --only gpu`, path
"graphs-fused-invariant").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm(X, R, W, SUM, OUT, eps, n, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(X + t * n + cols, mask=inside, other=0.0).to(tl.float32)
    r = tl.load(R + t * n + cols, mask=inside, other=0.0).to(tl.float32)
    s = (x + r).to(SUM.dtype.element_ty)  # the residual stream, in its own dtype (as `h + a`)
    tl.store(SUM + t * n + cols, s, mask=inside)
    f = s.to(tl.float32)
    var = tl.sum(f * f, axis=0) / n
    y = (f * (1.0 / tl.sqrt(var + eps))).to(SUM.dtype.element_ty)  # rounded to the input dtype, then the weight
    w = tl.load(W + cols, mask=inside, other=0.0)
    tl.store(OUT + t * n + cols, (w.to(tl.float32) * y.to(tl.float32)).to(OUT.dtype.element_ty), mask=inside)


@triton.jit
def _silu_mul(GU, OUT, n, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = c < n
    g = tl.load(GU + t * 2 * n + c, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(GU + t * 2 * n + n + c, mask=inside, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty)  # SiLU, rounded as the activation's own output
    tl.store(OUT + t * n + c, (a.to(tl.float32) * u).to(OUT.dtype.element_ty), mask=inside)


@triton.jit
def _rope(X, COS, SIN, POS, OUT, stride_t, stride_h, HALF: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(POS + t)
    i = tl.arange(0, HALF)
    base = X + t * stride_t + h * stride_h
    x1 = tl.load(base + i).to(tl.float32)
    x2 = tl.load(base + HALF + i).to(tl.float32)
    c1 = tl.load(COS + pos * 2 * HALF + i).to(tl.float32)
    c2 = tl.load(COS + pos * 2 * HALF + HALF + i).to(tl.float32)
    s1 = tl.load(SIN + pos * 2 * HALF + i).to(tl.float32)
    s2 = tl.load(SIN + pos * 2 * HALF + HALF + i).to(tl.float32)
    out = OUT + (t * tl.num_programs(1) + h) * 2 * HALF
    tl.store(out + i, (x1 * c1 - x2 * s1).to(OUT.dtype.element_ty))  # x cos + rotate_half(x) sin
    tl.store(out + HALF + i, (x2 * c2 + x1 * s2).to(OUT.dtype.element_ty))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE of x [T, H, D] (rows may be strided views) at `positions` [T], from the cos and sin tables
    [max_pos, D]; a new contiguous [T, H, D]."""
    T, H, D = x.shape
    out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T:
        _rope[(T, H)](x, cos.contiguous(), sin.contiguous(), positions, out, x.stride(0), x.stride(1), HALF=D // 2)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, RMSNorm of it) for x, residual [T, d]: the new residual stream and the next layer's input."""
    x, residual = x.contiguous(), residual.contiguous()
    T, d = x.shape
    s, out = torch.empty_like(x), torch.empty_like(x)
    if T:
        _add_rms_norm[(T,)](x, residual, weight, s, out, eps, d, BLOCK=triton.next_power_of_2(d))
    return s, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) x up for gate_up [T, 2I] (gate, then up, side by side: the fused gate/up GEMM's output); [T, I]."""
    gate_up = gate_up.contiguous()
    T, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(T, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    if T:
        _silu_mul[(T, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block)
    return out


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` as transformers' RMSNorm computes it after the add."""
    s = x + residual
    f = s.float()
    y = (f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype)
    return s, weight * y


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    c, s = cos[positions][:, None], sin[positions][:, None]  # [T, 1, D]
    h = x.shape[-1] // 2
    return x * c + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * s


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
