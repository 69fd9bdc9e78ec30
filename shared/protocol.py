"""Typed contracts between edge and cloud: the messages of PROTOCOL.md as plain dataclasses.

REST (pydantic) and gRPC (protobuf) each convert to and from these in one place; the engine and
the clients only ever see these. Field names are the wire names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.config import SamplingConfig


@dataclass
class SparseDist:
    # token ids of the support
    ids: list[int]
    # their probabilities, same length
    probs: list[float]


@dataclass
class TargetFeature:
    """The target's hidden state for feature-fed drafting (PROTOCOL.md, "Feature-fed drafting")."""
    # the state after reading S[:prefix_len]: the output layer's input whose logits give p of S[prefix_len]
    prefix_len: int
    # "float16" (little-endian) or "int8" (value = scale * int8)
    encoding: str
    # the vector's bytes
    data: bytes
    # int8 only: one scale for the whole vector
    scale: float = 0.0


@dataclass
class TargetStates:
    """The target's states at consecutive positions (PROTOCOL.md, "States for every committed position")."""
    # state i (0-based) is the one after reading S[:first + i]
    first: int
    # how many states
    count: int
    # "float16" (little-endian) or "int8" (value = scale * int8, one scale per state)
    encoding: str
    # count x width values, state after state
    data: bytes
    # int8 only: one scale per state
    scales: list[float] = field(default_factory=list)


@dataclass
class OpenSessionRequest:
    # the prompt's token ids (for a reopen: the whole committed context S)
    prompt_ids: list[int]
    # processing applied alike to p (cloud) and q (edge)
    sampling_cfg: SamplingConfig = field(default_factory=SamplingConfig)
    # keys the coins: same seed + same requests -> same text
    seed: int = 0
    # "strict" (exact) or "shortcut" (sample corrections from p; biased)
    correction: str = "strict"
    # generation budget the session allows after the prompt
    max_new_tokens: int = 256
    # "" (none), "float16" or "int8": send the target's feature with the open answer and every round
    feature_encoding: str = ""
    # > 0 (with feature_encoding): send the target's state at every committed position instead of one vector,
    # and the last feature_window prompt positions' states with the open answer
    feature_window: int = 0


@dataclass
class ForwardCostInfo:
    """The forward cost a cloud has fitted from its own forwards (cloud/node_budget.py; PROTOCOL.md "Model info"):
    a forward of r rows and p prefill tokens costs base_ms + row_ms x r + prefill_token_ms x p, in the process's
    CPU time (wall time on a GPU). gRPC message ForwardCost; REST a JSON object of the same names."""
    # ms of a forward whatever its rows
    base_ms: float = 0.0
    # ms a further row adds (per_bucket: the marginal cost between buckets of rows at the present load)
    row_ms: float = 0.0
    # ms a further prefill token adds
    prefill_token_ms: float = 0.0
    # forwards the fit has seen (an edge reads a fit of at least 8: edge/policy/stream.py MIN_FORWARDS)
    forwards: int = 0
    # committed tokens per second of forward cost, recently
    tokens_per_second: float = 0.0
    # row_ms x tokens_per_second / 1000: the least a further draft node must add, in expected tokens
    node_value: float = 0.0
    # the linear fit's slope per row (row_ms's own when not per_bucket)
    linear_row_ms: float = 0.0
    # row_ms is read between buckets of rows (a GPU), not the linear fit's slope
    per_bucket: bool = False

    @classmethod
    def from_mapping(cls, d: Mapping[str, Any]) -> ForwardCostInfo:
        """From a JSON object (or the cloud's own forward_cost() mapping): the names it knows, each absent one at
        its default, any other name ignored."""
        return cls(base_ms=float(d.get("base_ms") or 0.0), row_ms=float(d.get("row_ms") or 0.0),
                   prefill_token_ms=float(d.get("prefill_token_ms") or 0.0), forwards=int(d.get("forwards") or 0),
                   tokens_per_second=float(d.get("tokens_per_second") or 0.0),
                   node_value=float(d.get("node_value") or 0.0), linear_row_ms=float(d.get("linear_row_ms") or 0.0),
                   per_bucket=d.get("per_bucket") is True)


@dataclass
class ModelInfo:
    # the target's name (its directory's name, or the config's name_or_path)
    model_id: str
    # rows of the target's logits (its output embedding)
    vocab_size: int
    # end-of-sequence token ids
    eos_ids: list[int] = field(default_factory=list)
    # positions the target attends over, prompt + generated (0 = unknown)
    max_context: int = 0
    # "float32" | "bfloat16" | "float16": what the target runs in (after --dtype auto chose)
    dtype: str = ""
    # why that dtype ("asked for", or what auto saw: e.g. "auto: the CPU has avx512_bf16")
    dtype_reason: str = ""
    # every forward is batch-invariant: a token's logits do not depend on what shares its forward, so greedy
    # text is one text in every mode (False: the plain kernels, or an older cloud)
    batch_invariant: bool = False
    # what the batch_invariant claim was measured on, where the graph executor's start-up probe made it: the cases
    # in which the probed token got its decode-alone bits ("" : the transformers path's calibration, or an older
    # cloud)
    batch_invariant_probe: str = ""
    # torch device string
    device: str = ""
    # shared/tokenizer_id.py: the edge's draft must speak the tokenizer with this fingerprint
    tokenizer_fingerprint: str = ""
    # largest k a verify round may carry
    max_k: int = 0
    # ids the tokenizer defines (len(tokenizer), at most vocab_size): the id range accepted on the wire and
    # the support of p and q; logit rows past it are padding, never a token (0 = an older cloud: vocab_size)
    tokenizer_size: int = 0
    # width of the target feature a session may ask for (0: this cloud does not offer feature-fed drafting)
    feature_size: int = 0
    # the encodings it offers ("float16", "int8")
    feature_encodings: list[str] = field(default_factory=list)
    # ranks the target is split over by tensor parallelism (1: one process; 0 = an older cloud)
    tensor_parallel: int = 1
    # most nodes a token tree may have (0: this cloud verifies chains only)
    max_tree_nodes: int = 0
    # largest feature_window a session may ask for (0: one feature per answer only)
    max_feature_window: int = 0
    # the cloud streams the target's own tokens on an open session (PROTOCOL.md, "Streaming on a session");
    # False: an older cloud, which lacks the call
    session_stream: bool = False
    # largest max_new_tokens of a /v1/generate and longest stream chunk (`n`) on a session: --max-generate-tokens
    # (0 = unknown: an older cloud, which answers 422 past its limit)
    max_generate_tokens: int = 0
    # what runs the target's forward: "pytorch" (cloud/runners/torch_runner.py) or "llama.cpp" (cloud/runners/llamacpp.py; a GGUF
    # file); "" = an older cloud (PyTorch)
    runner: str = ""
    # what decides the bits of the target's logits (cloud/numerics.py): runner, dtype, invariance, tensor-parallel
    # size, matrix units and weights; replicas that give one text for a seed share it ("" = an older cloud)
    numerics: str = ""
    # how the PyTorch runner runs a forward: "cuda-graphs" (cloud/runners/graphs.py, replayed per bucket),
    # "paged-eager" (the same forward without graphs), "transformers" (the model's own modules over the paged
    # pool); "" = an older cloud or another runner
    forward_path: str = ""
    # the cloud's fitted forward cost as of the call (None: not kept, or an older cloud); the edge's transports
    # fill it from GET /v1/model and GetModel, the cloud says it apart from its own ModelInfo
    forward_cost: ForwardCostInfo | None = None


@dataclass
class NodeAcceptance:
    """An API key's draft nodes of its recent rounds, per tenth of their q: how many (decayed by round) were tried
    (their parent accepted) and accepted (shared/node_value.py)."""
    kept: list[float]
    tried: list[float]


@dataclass
class SessionInfo:
    # unguessable session id
    ctx_id: str
    # committed length |S| on the cloud
    ctx_len: int
    # FNV-1a hash of S (shared.hashing)
    ctx_hash: str
    # the target's vocabulary size: the ids accepted on the wire (ModelInfo.tokenizer_size)
    vocab_size: int
    # optional counters (GET /v1/sessions/{ctx_id})
    counters: dict[str, Any] = field(default_factory=dict)
    # the open answer's ModelInfo.numerics: the numerics the session runs under ("" = an older cloud)
    numerics: str = ""
    # the open answer: the most draft nodes the first round should send (as a verify answer's); 0: none said
    node_budget: int = 0
    # the open answer's ModelInfo.tokenizer_fingerprint: what the session's ids mean ("" = an older cloud)
    tokenizer_fingerprint: str = ""
    # the open answer: the acceptance of the owner's (API key's) recent draft nodes, a new session's prior for the
    # value of its nodes (None: none said)
    node_acceptance: NodeAcceptance | None = None
    # the open answer of a session that asked for features: the state after the whole prompt
    feature: TargetFeature | None = None
    # the open answer of a session with a feature_window: the last prompt positions' states
    states: TargetStates | None = None
    # the open answer: the cloud's fitted forward cost as of the open, fresher than the model info's (None: none
    # said, an older cloud, or GET /v1/sessions/{ctx_id})
    forward_cost: ForwardCostInfo | None = None


@dataclass
class DraftProposal:
    # y_1..y_k
    draft_tokens: list[int]
    # q_i = q(y_i | S, y_<i) after the shared processing; 1.0 for a deterministic drafter
    q_token_probs: list[float]
    # "sampled" or "deterministic"
    draft_kind: str = "sampled"
    # optional: the draft's whole processed distribution per position
    q_dists: list[SparseDist] | None = None
    # optional gating signal per draft token (logged)
    hard_mask: list[int] | None = None
    # a token tree (shared/tree.py): per draft token, its parent's index (-1: the committed context);
    # None: a chain. A tree is verified by draw-and-match and needs no q_dists.
    tree_parents: list[int] | None = None


@dataclass
class VerifyRequest:
    ctx_id: str
    # |S| the edge holds, after append_ids
    ctx_len: int
    # hash of S[:ctx_len]
    ctx_hash: str
    # the last len(append_ids) tokens of S, which the cloud may not have yet
    append_ids: list[int]
    draft: DraftProposal
    # > 0: also return the target's top ids per checked position (n-gram filler)
    return_top_k: int = 0
    # client-chosen id, echoed in logs
    request_id: str = ""
    # the last draft token is not run: it is checked against p after the others, and no bonus is drawn
    check_last: bool = False

    @property
    def k(self) -> int:
        return len(self.draft.draft_tokens)


@dataclass
class StreamSessionRequest:
    """Stream the target's own tokens on an open session: each one is a k = 0 verify round's draw."""
    ctx_id: str
    # |S| the client holds: the cloud keeps S[:ctx_len] (it may hold more, from a stream the client left)
    ctx_len: int
    # hash of S[:ctx_len]
    ctx_hash: str
    # tokens to stream at most (1 .. the cloud's --max-generate-tokens)
    max_new_tokens: int = 64
    # stop after an end-of-sequence token (it is included)
    stop_at_eos: bool = True


@dataclass
class StreamedToken:
    """One token of a session stream."""
    # the k = 0 round's bonus: the target's own draw at its position
    token_id: int
    # the session's committed length with this token
    ctx_len: int
    # a session opened with feature_encoding: the state that chose this token (as a verify answer's)
    feature: TargetFeature | None = None
    # a session with a feature_window: the states the round committed (as a verify answer's)
    states: TargetStates | None = None
    # as a verify answer's: the most draft nodes the next round should send (0: no budget said)
    node_budget: int = 0


@dataclass
class StreamDone:
    """The end of a session stream."""
    # tokens streamed
    tokens: int
    # the session's committed context after the stream
    ctx_len: int
    ctx_hash: str
    # {"decode_ms", "queue_ms", "total_ms", "stop_reason"}; stop_reason "length" | "eos" | "context"
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class RoundMetrics:
    # mean of min(1, p_i / q_i) over the k draft positions
    alpha_mean: float = 0.0
    # accepted_len / k (0 when k = 0); for a token tree k is its number of nodes
    la_over_k: float = 0.0
    # wall time of the target forward for this round
    prefill_ms: float = 0.0
    # time the request waited for the model
    queue_ms: float = 0.0
    # a token tree: accepted_len / its depth, the longest path it could accept (0 for a chain)
    la_over_depth: float = 0.0
    # what a further row costs the cloud's forward at the present load, ms (0: not measured yet)
    row_ms: float = 0.0


@dataclass
class VerifyResponse:
    # La, 0..k
    accepted_len: int
    # the next token for "correction" / "bonus"; None for "residual" and "none"
    correction: int | None
    # "correction", "bonus", "residual", or "none" (check_last, every draft kept: nothing follows)
    next_kind: str
    # for "residual": processed p at the rejected position
    target_dist: SparseDist | None
    # the cloud's committed context after this round
    ctx_len: int
    ctx_hash: str
    # the target's top ids per checked position when return_top_k > 0
    top_k_ids: list[list[int]] = field(default_factory=list)
    metrics: RoundMetrics = field(default_factory=RoundMetrics)
    # for a session that asked for features: the state at the position that decides the next token
    feature: TargetFeature | None = None
    # a tree round: the accepted nodes, root to leaf (accepted_len of them); None for a chain
    accepted_nodes: list[int] | None = None
    # a session with a feature_window: the states at every position this round committed (in place of `feature`)
    states: TargetStates | None = None
    # the most draft nodes (chain tokens or tree nodes) the next round should send, chosen by the cloud for its
    # load (cloud/node_budget.py); 0: no budget said. Never changes the text: any count is verified exactly
    node_budget: int = 0

