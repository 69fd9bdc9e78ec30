"""Float32 weights on the CPU, kept in the form that multiplies a few rows fastest.

Decoding multiplies a few rows by every weight: one token of cloud_only, the k + 1 tokens of a verify,
one token of a draft step. torch's Linear calls MKL's sgemm on the CPU, which takes about as long per
row for 2 or 3 rows as for one. oneDNN, given a weight once in its own blocked order, multiplies 1 to 9
rows in not much more than the time of one, and a whole prompt faster too (SmolLM2-135M on one thread, a
forward of 1 / 3 / 9 new tokens: BENCHMARKS.md "The real pair", `specsplit-bench --only real-pair`, times
both in one run). `pack_weights` reorders each float32 Linear weight of a model once, at load, and has
the Linear call oneDNN with it. The values are the same; their sums are taken in another order (logits
within 1e-4 of the plain Linear's, tests/shared/test_cpu_weights.py), as between any two batch shapes. A
weight a Linear shares with another module (an output layer tied to the input embedding, whose lookups
need the plain rows) is packed as a copy: `pack_weights` returns those bytes. Without oneDNN, weights
are kept as the transpose of a contiguous [in, out] tensor instead, an order in which MKL multiplies one
to three rows faster than in the file's. Inference only: a packed weight has no gradient.
"""

from __future__ import annotations

import types

import torch


def packing_available() -> bool:
    """oneDNN is built in and has the two ops used here."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._reorder_linear_weight is not None
                    and torch.ops.mkldnn._linear_pointwise is not None)
    except (AttributeError, RuntimeError):
        return False


def _eligible(w: object) -> bool:
    return (isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
            and w.layout == torch.strided)


def pack(w: torch.Tensor) -> torch.Tensor:
    """w ([out, in] float32, CPU) in oneDNN's blocked order (an opaque tensor of the same shape)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T + bias, for a plain or a packed w."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return torch.nn.functional.linear(x, w, bias)


def packed_parameter(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """A weight used as `linear(x, p)`, packed when it can be (else as it was), without a gradient."""
    if _eligible(p) and packing_available():
        return torch.nn.Parameter(pack(p), requires_grad=False)
    return p


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = self.weight if self.weight.is_mkldnn else self.packed_weight  # packed_weight: a tied weight's copy
    return linear(x, w, self.bias)  # type: ignore[arg-type]


def pack_weights(module: torch.nn.Module) -> int:
    """Pack every eligible Linear weight of `module` (float32, CPU) for inference; returns the bytes of the
    copies made for weights shared with other modules (0 when none is). Without oneDNN, transposes them."""
    others = {id(p) for m in module.modules() if not isinstance(m, torch.nn.Linear)
              for p in m.parameters(recurse=False)}
    extra, can_pack = 0, packing_available()
    for m in module.modules():
        if not (isinstance(m, torch.nn.Linear) and _eligible(m.weight)):
            continue
        w = m.weight
        if not can_pack:
            w.data = w.data.t().contiguous().t()
            continue
        if id(w) in others:  # tied: the other module reads the plain rows
            m.packed_weight = pack(w)  # type: ignore[assignment]
            extra += w.numel() * w.element_size()
        else:
            m.weight = torch.nn.Parameter(pack(w), requires_grad=False)
        m.forward = types.MethodType(_packed_forward, m)  # type: ignore[method-assign]
    for p in module.parameters():
        p.requires_grad_(False)
    return extra
