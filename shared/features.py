"""The target feature on the wire: one hidden-state vector, float16 or int8 with one scale.

float16 keeps the target's own state to its precision (2 bytes a value: 1,152 bytes for a width of
576). int8 halves that (576 bytes and a 4-byte scale): value = scale * q, q = round(x / scale),
scale = max |x| / 127. Both sides call these, so what the edge's head sees is decided here alone.
"""

from __future__ import annotations

import torch

from shared.protocol import TargetFeature, TargetStates

ENCODINGS = ("float16", "int8")


def finite_states(h: torch.Tensor) -> torch.Tensor:
    """[n, ...] states as [n, d] float32 on the CPU; a state that is not finite (NaN, inf) is refused with
    ValueError, whatever the encoding: neither float16 nor int8 (whose scale it would poison) can carry it."""
    x = h.detach().float().cpu().reshape(h.shape[0], -1)  # [n, d]
    if not bool(torch.isfinite(x).all()):
        raise ValueError("a target state is not finite")
    return x


def int8_states(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Finite [n, d] states as (q [n, d] int8, scale [n]): each state by its own max |x| / 127, an all-zero
    state by 1."""
    scale = x.abs().amax(-1) / 127.0  # [n]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # [n]
    q = (x / scale[:, None]).round().clamp(-127, 127).to(torch.int8)  # [n, d]
    return q, scale


def encode_feature(h: torch.Tensor, encoding: str, prefix_len: int) -> TargetFeature:
    """A [d] state as a TargetFeature (a state that is not finite is refused: ValueError)."""
    x = finite_states(h.reshape(1, -1))  # [1, d]
    if encoding == "float16":
        return TargetFeature(prefix_len, encoding, x[0].half().numpy().astype("<f2").tobytes())
    if encoding == "int8":
        q, scale = int8_states(x)  # [1, d], [1]
        return TargetFeature(prefix_len, encoding, q[0].numpy().tobytes(), float(scale[0]))
    raise ValueError(f"unknown feature encoding {encoding!r}: one of {', '.join(ENCODINGS)}")


def decode_feature(f: TargetFeature) -> torch.Tensor:
    """The [d] float32 vector of a TargetFeature."""
    import numpy as np
    if f.encoding == "float16":
        return torch.from_numpy(np.frombuffer(f.data, dtype="<f2").astype(np.float32))
    if f.encoding == "int8":
        return torch.from_numpy(np.frombuffer(f.data, dtype=np.int8).astype(np.float32)) * f.scale
    raise ValueError(f"unknown feature encoding {f.encoding!r}")


def feature_bytes(f: TargetFeature | None) -> int:
    """Bytes of the vector and its scale (what the feature adds to an answer, before the transport's framing)."""
    if f is None:
        return 0
    return len(f.data) + (4 if f.encoding == "int8" else 0)


def feature_to_json(f: TargetFeature | None) -> dict[str, object] | None:
    """REST form: the bytes as base64."""
    import base64
    if f is None:
        return None
    return {"prefix_len": f.prefix_len, "encoding": f.encoding, "data": base64.b64encode(f.data).decode(),
            "scale": f.scale}


def feature_from_json(d: dict[str, object] | None) -> TargetFeature | None:
    """A REST answer's feature; None when absent or not of a known encoding (an edge then drafts without it)."""
    import base64
    if not d or d.get("encoding") not in ENCODINGS:
        return None
    return TargetFeature(int(d["prefix_len"]), str(d["encoding"]),  # type: ignore[call-overload]
                         base64.b64decode(str(d["data"])), float(d.get("scale") or 0.0))  # type: ignore[arg-type]


def encode_states(h: torch.Tensor, encoding: str, first: int) -> TargetStates:
    """[n, d] states at consecutive positions (state i after S[:first + i]) as one TargetStates; int8 scales
    each state by its own max |x| / 127 (a state that is not finite is refused: ValueError)."""
    x = finite_states(h)  # [n, d]
    if encoding == "float16":
        return TargetStates(first, x.shape[0], encoding, x.half().numpy().astype("<f2").tobytes())
    if encoding == "int8":
        q, scale = int8_states(x)  # [n, d], [n]
        return TargetStates(first, x.shape[0], encoding, q.numpy().tobytes(), scale.tolist())
    raise ValueError(f"unknown feature encoding {encoding!r}: one of {', '.join(ENCODINGS)}")


def decode_states(s: TargetStates) -> torch.Tensor:
    """The [count, d] float32 states of a TargetStates."""
    import numpy as np
    if s.encoding == "float16":
        x = torch.from_numpy(np.frombuffer(s.data, dtype="<f2").astype(np.float32))
        return x.reshape(s.count, -1)
    if s.encoding == "int8":
        x = torch.from_numpy(np.frombuffer(s.data, dtype=np.int8).astype(np.float32)).reshape(s.count, -1)
        return x * torch.tensor(s.scales, dtype=torch.float32)[:, None]
    raise ValueError(f"unknown feature encoding {s.encoding!r}")


def states_bytes(s: TargetStates | None) -> int:
    """Bytes of the states and their scales (before the transport's framing)."""
    return 0 if s is None else len(s.data) + 4 * len(s.scales)


def states_to_json(s: TargetStates | None) -> dict[str, object] | None:
    import base64
    if s is None:
        return None
    return {"first": s.first, "count": s.count, "encoding": s.encoding, "data": base64.b64encode(s.data).decode(),
            "scales": s.scales}


def states_from_json(d: dict[str, object] | None) -> TargetStates | None:
    """A REST answer's states; None when absent or not of a known encoding."""
    import base64
    if not d or d.get("encoding") not in ENCODINGS:
        return None
    return TargetStates(int(d["first"]), int(d["count"]), str(d["encoding"]),  # type: ignore[call-overload]
                        base64.b64decode(str(d["data"])), [float(x) for x in d.get("scales") or []])  # type: ignore[attr-defined]
