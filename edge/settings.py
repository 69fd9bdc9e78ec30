"""The edge's one settings class (env prefix SPECSPLIT_EDGE_), validated when built.

Defaults follow the engineering guide: temperature 1.0, top-p 0.9, repetition penalty 1.1, gating
off, an adaptive verify deadline (edge/deadline.py) and every token verified: the lossy timeout
fallback is opt-in. k is chosen per round by the cost model (edge/kcontrol.py) within [0, 12],
starting at 6, and the model drafter drafts the next block while the cloud verifies
(edge/prefetch.py); k_policy "dynamic" is the older controller (+1 when la/k >= 0.8, -1 when
la/k <= 0.4, within [3, 12]).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.config import SamplingConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
Mode = Literal["speculative", "edge_only", "cloud_only"]


# Default tokens-only drafts in order of preference: the real pair's draft cut from the target, then its
# distilled draft (both with SmolLM2-135M-Instruct's tokenizer), then the toy demo pair's; with none, the
# n-gram drafter. The cut draft agrees with the target more often (BENCHMARKS.md, the real pair).
DEFAULT_DRAFTS = ("smollm2-135m-draft-from-target", "smollm2-135m-draft", "demo-draft")


# The real pair's head, used when the cloud offers features: the attention head (edge/drafters/attention_head.py,
# fed the target's state at every committed position); models/smollm2-135m-head, the one-state feature-fed head
# (edge/drafters/feature_head.py), stays loadable with --head.
DEFAULT_HEAD = "smollm2-135m-attention-head"


def default_head() -> str:
    """The real pair's head when the repository holds it, else "none" (the draft alone). The edge uses it
    only with a cloud whose features match it (hidden size and tokenizer fingerprint)."""
    return str(REPO_ROOT / "models" / DEFAULT_HEAD) if (REPO_ROOT / "models" / DEFAULT_HEAD).is_dir() else "none"


def default_draft() -> str:
    """The first of DEFAULT_DRAFTS the repository holds, else the n-gram drafter."""
    for name in DEFAULT_DRAFTS:
        if (REPO_ROOT / "models" / name).is_dir():
            return str(REPO_ROOT / "models" / name)
    return "ngram"


class EdgeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECSPLIT_EDGE_", extra="forbid")

    # REST base URL of the cloud (used unless grpc_target is set)
    cloud_url: str = "http://127.0.0.1:8000"
    # gRPC HOST:PORT; when set, verification goes over gRPC
    grpc_target: str | None = None
    # Bearer key sent to the cloud (REST Authorization header, gRPC metadata)
    api_key: SecretStr | None = None
    # TLS to the cloud: an https:// cloud_url is verified by httpx; grpc_tls opens the gRPC channel over TLS (a TLS
    # Ingress or nginx in front of the cloud, README "TLS in front of the cloud"); ca_cert is the PEM file of a
    # private CA that signed the cloud's certificate (default: the system's trust store, and gRPC's own roots), taken
    # only with a TLS connection (grpc_tls, or an https:// cloud_url without grpc_target): refused otherwise
    grpc_tls: bool = False
    ca_cert: str | None = None
    # routing key sent with every call (X-Specsplit-Route); unset = a fresh random key per generation.
    # Load balancers hash on it; a fixed key pins every generation of this client to one replica
    route_key: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._~-]{1,128}$")
    # a Hugging Face causal-LM directory, or "ngram" for the n-gram drafter
    draft: str = Field(default_factory=default_draft)
    # a feature-fed draft head directory, or "none": drafts from the target's hidden state whenever the cloud
    # offers it (GET /v1/model feature_size), with `draft` as its fallback for rounds without a feature
    head: str = Field(default_factory=default_head)
    # how the cloud sends the feature: "float16" (1,152 bytes a state for SmolLM2), "int8" (580: the heads draft
    # as well from it, models/README.md) or "auto": int8 when the cloud offers it, else float16
    feature_encoding: Literal["auto", "float16", "int8"] = "auto"
    # prompt positions whose states an open (or a reopen) asks for when the head attends over past states, at
    # most its window: 16 draft as well held out as its whole window of 64 for a quarter of the bytes
    # (models/README.md, "The open's states")
    open_states: int = Field(default=16, ge=1)
    # tokenizer directory; default: the draft directory, else the first default draft present
    tokenizer: str | None = None
    # torch device of the draft model
    device: str = "cpu"
    # dtype of the draft model's weights and KV: float32, bfloat16, or auto (bfloat16 where the CPU has AMX or
    # AVX512-BF16, shared/dtypes.py). Exact in any dtype: q is whatever the draft computed and the cloud's rule
    # reads it as sent. auto by default: on an AVX512-BF16 CPU the coder pair's 0.5B draft grows a tree of 32
    # nodes in two thirds of float32's time (BENCHMARKS.md, "The draft's cost and memory"; measured before its
    # bfloat16 forwards were made batch-invariant, edge/drafters/model.py, so a seed keeps one text)
    draft_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # what runs the draft model: "llamacpp" (a GGUF file, or a directory with model.gguf, run by llama.cpp as
    # devices do), "torch" (a Hugging Face directory in PyTorch), or "auto": llama.cpp where the draft has a GGUF
    # and llama-cpp-python is installed (one log line says why not otherwise), else PyTorch
    draft_runtime: Literal["auto", "llamacpp", "torch"] = "auto"
    # threads of the draft model: PyTorch's (torch.set_num_threads) or llama.cpp's; unset: torch's own count, and
    # half the cores (1 to 4) for llama.cpp
    threads: int | None = Field(default=None, ge=1)
    # speculative | edge_only | cloud_only
    mode: Mode = "speculative"

    # generation budget after the prompt
    max_new_tokens: int = Field(default=128, ge=0)
    # shared sampling settings (the session carries them; q and p are processed alike)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=0.9, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.1, gt=0)
    # keys every coin and sample: same seed, same settings -> same text. Sampled text also depends on
    # where rounds end, so it repeats exactly with a k that does not depend on timing (fixed_k, or
    # k_policy "dynamic"); the "cost" policy keeps the target's distribution but not the exact text
    seed: int = Field(default=0, ge=0)
    # "strict" (exact) or "shortcut" (corrections drawn from p; biased)
    correction: Literal["strict", "shortcut"] = "strict"
    # sampled sessions: draft one token more per round and have the cloud check it in place of a bonus
    # (same forward, same expected tokens per round): every position is decided by the same rule, so with
    # a draft whose q depends on the text alone (the model draft, the n-gram) the same seed gives the same
    # text for any k schedule, drafting ahead, reopen or failover. Greedy text never depends on rounds
    check_last: bool = True
    # send the draft's sparse q distributions (the cloud draws the residual itself)
    send_q_dists: bool = False
    # stop after an end-of-sequence token
    stop_at_eos: bool = True

    # round control: fixed_k set -> k never changes; else k_policy moves it within [k_min, k_max]:
    # "cost" (expected tokens per second from measured costs, kcontrol.py) or "dynamic" (la/k steps)
    fixed_k: int | None = Field(default=None, ge=0)
    k_policy: Literal["cost", "dynamic"] = "cost"
    k_start: int = Field(default=6, ge=0)
    # unset: 0 for the cost policy (k = 0 is plain target decoding), 3 for the dynamic one
    k_min: int | None = Field(default=None, ge=0)
    k_max: int = Field(default=12, ge=1)
    # la/k at or above k_up_at grows k by one; at or below k_down_at shrinks it by one
    k_up_at: float = 0.8
    k_down_at: float = 0.4
    # the model drafter drafts the next block while the cloud verifies (guessing all accepted)
    draft_ahead: bool = True
    # token trees (edge/treecontrol.py): "auto" sends trees whenever the cloud takes them (GET /v1/model
    # max_tree_nodes > 0) and k is not fixed, with the node count chosen per round from the draft's confidence
    # and the measured costs; "off" sends chains; a number sends trees of that many nodes
    tree: str = Field(default="auto", pattern=r"^(auto|off|[1-9][0-9]{0,2})$")
    # children per expanded node and nodes expanded per level; levels of the first tree; most nodes
    tree_width: int = Field(default=4, ge=1, le=16)
    tree_depth: int = Field(default=6, ge=1, le=32)
    tree_max_nodes: int = Field(default=32, ge=1, le=256)
    # copy branches (edge/drafters/lookup.py): what followed the context's last tokens earlier in it, grafted
    # into every tree (exact like any tree; only tokens per call move)
    tree_copy: bool = True
    # speculate or stream per session (edge/waycontrol.py): greedy and "strict" tree sessions let the cloud stream
    # target-only tokens on the session while that is cheaper by `objective` ("latency": the edge's wall
    # time per token; "cloud": the cloud's forward time per token); off: always speculate
    stream_switch: bool = True
    objective: Literal["latency", "cloud"] = "latency"
    # send at most the node budget of the cloud's last answer (the most draft nodes the cloud, sizing rounds for
    # its load, wants next; PROTOCOL.md "Node budget"); off: the edge sizes rounds for its own latency alone
    node_budget: bool = True

    # uncertainty gating (off by default): signals of the draft model's raw distribution
    gating: bool = False
    # NLL of the drafted token (nats) above this -> hard
    t_nll: float = 2.3
    # entropy (bits) above this -> hard
    t_entropy_bits: float = 2.5
    # top-1 minus top-2 probability below this -> hard
    t_margin: float = 0.2
    # MC-dropout passes (0 = off; only used when the draft model has dropout) and variance threshold
    mc_dropout_samples: int = Field(default=0, ge=0)
    t_mc_var: float = 0.01
    # a block with hard_ratio above this goes to the cloud, else it is committed locally
    r_hard: float = 0.3
    # digits, dates and amounts in the detokenized draft always go to the cloud
    rule_triggers: bool = True

    # a fixed verify deadline (ms) for every first attempt; unset = adaptive (edge/deadline.py)
    timeout_ms: float | None = Field(default=None, gt=0)
    # the adaptive deadline: the first round's, its bounds, and the multiple of the observed high percentile
    deadline_first_ms: float = Field(default=10_000.0, gt=0)
    deadline_floor_ms: float = Field(default=500.0, gt=0)
    deadline_ceiling_ms: float = Field(default=30_000.0, gt=0)
    deadline_multiplier: float = Field(default=4.0, ge=1)
    # on a missed deadline: commit the first draft token unverified (lossy, counted) instead of resending
    timeout_fallback: bool = False
    # timeout of session open / close / model info / cloud_only generation
    open_timeout_s: float = Field(default=30.0, gt=0)
    # attempts after 429 / 413 / 5xx / connection errors, exponential backoff between them
    max_retries: int = Field(default=6, ge=0)
    # past max_retries, keep waiting out the cloud's capacity answers (429, and sessions evicted again at
    # once) for this many seconds of backoff per call, at its Retry-After: a generation waits its turn
    capacity_wait_s: float = Field(default=300.0, ge=0)
    backoff_ms: float = Field(default=50.0, ge=0)
    backoff_max_ms: float = Field(default=2000.0, ge=0)

    # serve: Bearer keys the OpenAI server accepts on every /v1 route (its own, not the cloud's api_key); empty =
    # no auth, allowed only on a loopback --host (edge/server/server_auth.py)
    server_api_keys: list[SecretStr] = Field(default_factory=list)
    # serve: the largest request body (bytes) the OpenAI server reads; larger answer 413
    max_body_bytes: int = Field(default=4 * 1024**2, ge=1024)
    # serve: generations the OpenAI server runs at once; one more answers 429 (each holds its own draft state: with
    # llama.cpp a context of 8,192 KV cells and 128 logit rows, ~180 MB for the coder's 0.5B draft)
    max_generations: int = Field(default=8, ge=1)

    # n-gram drafter: longest context (tokens) and target top-k ids added per checked position
    ngram_order: int = Field(default=4, ge=1)
    filler_top_k: int = Field(default=0, ge=0)
    # with a draft model: take the n-gram's continuation while it comes from a context of at least
    # hybrid_min_level tokens, the model's for the rest of the block
    hybrid: bool = False
    hybrid_min_level: int = Field(default=2, ge=1)

    @field_validator("cloud_url")
    @classmethod
    def _url_has_a_scheme(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"the cloud URL must start with http:// or https:// (e.g. http://{v or 'HOST:8000'}), "
                             f"got {v!r}")
        return v

    @field_validator("grpc_target")
    @classmethod
    def _grpc_target_is_host_port(cls, v: str | None) -> str | None:
        if v is not None and "://" in v:
            raise ValueError(f"the gRPC target is HOST:PORT without a scheme (e.g. {v.split('://', 1)[1]}; TLS: "
                             f"add --grpc-tls), got {v!r}")
        if v is not None and v.count(":") > 1 and not v.startswith("["):
            host, _, port = v.rpartition(":")
            raise ValueError(f"an IPv6 address in the gRPC target goes in brackets (e.g. [{host}]:{port}), got {v!r}")
        return v

    @field_validator("ca_cert")
    @classmethod
    def _ca_cert_is_a_file(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"the CA certificate {v} is not a file (a PEM file of the CA that signed the cloud's "
                             "certificate)")
        return v

    @model_validator(mode="after")
    def _check(self) -> EdgeSettings:
        k_min = self.k_min_for(self.k_policy)
        if self.k_policy == "dynamic" and k_min == 0 and self.fixed_k is None:
            raise ValueError("k_policy dynamic needs k_min >= 1 (it learns nothing from k = 0 rounds)")
        if not k_min <= self.k_start <= self.k_max:
            raise ValueError(f"need k_min <= k_start <= k_max, got {k_min}, {self.k_start}, {self.k_max}")
        if self.deadline_floor_ms > self.deadline_ceiling_ms:
            raise ValueError("deadline_floor_ms must not exceed deadline_ceiling_ms")
        if self.k_down_at >= self.k_up_at:
            raise ValueError("k_down_at must be below k_up_at")
        if any(not k.get_secret_value() for k in self.server_api_keys):
            raise ValueError("server api keys must not be empty")
        self._check_ca_cert_has_tls()
        self.sampling()  # raises on a bad combination
        return self

    def _check_ca_cert_has_tls(self) -> None:
        """A CA certificate is for a TLS connection: given with a plaintext one it would check nothing, so it is
        refused, naming the flag that turns TLS on."""
        if self.ca_cert is None:
            return
        if self.grpc_target is not None and not self.grpc_tls:
            raise ValueError(f"--ca-cert is for TLS, but the gRPC channel to {self.grpc_target} is plaintext: add "
                             "--grpc-tls (the cloud's TLS port, e.g. nginx's 50443), or drop --ca-cert")
        if self.grpc_target is None and not self.cloud_url.startswith("https://"):
            raise ValueError(f"--ca-cert is for TLS, but the cloud URL {self.cloud_url} is plain http://: use "
                             f"https://{self.cloud_url.removeprefix('http://')} (TLS in front of the cloud), or "
                             "drop --ca-cert")

    def server_key_values(self) -> list[str]:
        return [k.get_secret_value() for k in self.server_api_keys]

    def k_min_for(self, policy: str) -> int:
        """k_min, or the policy's default when unset: 0 for "cost", 3 (at most k_start) for "dynamic"."""
        if self.k_min is not None:
            return self.k_min
        return 0 if policy == "cost" else max(1, min(3, self.k_start))

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              repetition_penalty=self.repetition_penalty)

    def tokenizer_dir(self) -> str:
        if self.tokenizer:
            return self.tokenizer
        if self.draft != "ngram":
            # a GGUF file's tokenizer is the one beside it (a prepared model directory holds both)
            return str(Path(self.draft).parent) if self.draft.endswith(".gguf") else self.draft
        for name in DEFAULT_DRAFTS:
            if (REPO_ROOT / "models" / name).is_dir():
                return str(REPO_ROOT / "models" / name)
        raise ValueError("the n-gram drafter needs --tokenizer DIR (no default draft under models/)")


def load_draft_model(settings: EdgeSettings) -> Any:
    """The draft model `settings.draft` names, on the runtime `draft_runtime` picks (edge/drafters)."""
    from shared.kvpool import UnsupportedModel
    from shared.llama_runtime import find_gguf, unavailable

    gguf = find_gguf(settings.draft)
    runtime = settings.draft_runtime
    if runtime != "torch" and gguf is not None:
        why = unavailable()
        if why is None:
            from .drafters.llamacpp import LlamaCppDrafter

            return LlamaCppDrafter(gguf, threads=settings.threads)
        if runtime == "llamacpp" or not has_torch_weights(Path(settings.draft)):
            # a GGUF alone (a file, or a directory `specsplit-models convert` left without --safetensors)
            raise UnsupportedModel(why)
        logging.getLogger(__name__).warning("drafting in PyTorch, not llama.cpp: %s", why)
    elif runtime == "llamacpp":
        raise UnsupportedModel(f"--draft-runtime llamacpp needs a GGUF draft: {settings.draft} is no .gguf file "
                               "and holds no model.gguf")
    from .drafters import ModelDrafter

    return ModelDrafter(settings.draft, device=settings.device, mc_dropout_samples=settings.mc_dropout_samples,
                        dtype=draft_torch_dtype(settings))


def has_torch_weights(model_dir: Path) -> bool:
    """Whether `model_dir` is a Hugging Face directory PyTorch loads: a config and weights (safetensors or .bin)."""
    return (model_dir / "config.json").is_file() and (any(model_dir.glob("*.safetensors"))
                                                       or any(model_dir.glob("pytorch_model*.bin")))


def draft_torch_dtype(settings: EdgeSettings) -> Any:
    """The torch dtype of the draft model (`draft_dtype`, auto resolved for the settings' device)."""
    import torch

    from shared.dtypes import resolve_dtype

    return getattr(torch, resolve_dtype(settings.draft_dtype, settings.device)[0])
