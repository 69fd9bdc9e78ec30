"""The edge's one settings class (env prefix SPECSPLIT_EDGE_), validated when built.

Defaults follow the engineering guide: temperature 1.0, top-p 0.9, repetition penalty 1.1, gating
off, an adaptive verify deadline (edge/policy/deadline.py) and every token verified: the lossy timeout
fallback is opt-in. k is chosen per round by the cost model (edge/policy/k.py) within [0, 12],
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


def default_draft() -> str:
    """The first of DEFAULT_DRAFTS the repository holds, else the n-gram drafter."""
    for name in DEFAULT_DRAFTS:
        if (REPO_ROOT / "models" / name).is_dir():
            return str(REPO_ROOT / "models" / name)
    return "ngram"


# serve takes sampling per request, at OpenAI's value where a request leaves a field out (server/openai_bodies.py)
_OPENAI_SAMPLING = ("serve's requests take OpenAI's 1.0 when they leave it out, as an app written against "
                    "OpenAI's API expects")


class EdgeSettings(BaseSettings):
    """A field with a description is a flag of specsplit-edge (edge/cli.py): the description is its help, and
    json_schema_extra's "flag" its name where that is not the field's. The others are set by environment alone."""

    model_config = SettingsConfigDict(env_prefix="SPECSPLIT_EDGE_", extra="forbid")

    cloud_url: str = Field(default="http://127.0.0.1:8000", json_schema_extra={"flag": "cloud"},
        description="REST base URL of the cloud (used unless --grpc is given; TLS with an https:// URL)")
    grpc_target: str | None = Field(default=None, json_schema_extra={"flag": "grpc"},
        description="the cloud's gRPC HOST:PORT: verification over gRPC instead of REST; unset: REST")
    api_key: SecretStr | None = Field(default=None,
        description="Bearer key sent to the cloud (REST Authorization header, gRPC metadata); unset: none sent")
    # TLS to the cloud: an https:// cloud_url is verified by httpx, grpc_tls opens the gRPC channel over TLS; ca_cert
    # is taken only with a TLS connection (grpc_tls, or an https:// cloud_url without grpc_target): refused otherwise
    grpc_tls: bool = Field(default=False,
        description=("gRPC over TLS (a TLS Ingress or nginx in front of the cloud, README \"TLS in front of the "
                     "cloud\"); REST takes TLS from an https:// --cloud URL"))
    ca_cert: str | None = Field(default=None, json_schema_extra={"metavar": "PEM"},
        description=("the CA certificate that signed the cloud's TLS certificate (a private CA); unset: the system's "
                     "trust store, and gRPC's own roots. TLS only: with an https:// --cloud URL, or --grpc with "
                     "--grpc-tls (refused otherwise)"))
    route_key: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._~-]{1,128}$",
        description=("routing key sent as X-Specsplit-Route with every call: a load balancer hashing on it keeps a "
                     "session on one replica, and a fixed key pins every generation of this client to one; unset: "
                     "a fresh random key per generation"))
    draft: str = Field(default_factory=default_draft,
        description=("tokens-only draft: a .gguf file or a directory holding model.gguf (run by llama.cpp), a Hugging "
                     "Face causal-LM directory (PyTorch), or 'ngram' (the n-gram drafter); unset: the draft under "
                     "models/ that speaks the tokenizer the cloud names at first contact (edge/model_choice.py)"))
    tokenizer: str | None = Field(default=None,
        description=("tokenizer directory; unset: the draft's (with --draft ngram, the first bundled draft under "
                     "models/, e.g. models/smollm2-135m-draft-from-target: SmolLM2-135M-Instruct's tokenizer)"))
    device: str = Field(default="cpu", description="torch device of the draft model")
    # exact in any dtype: q is whatever the draft computed and the cloud's rule reads it as sent. auto by default:
    # bfloat16 drafts faster where the CPU multiplies it natively (BENCHMARKS.md, "The draft's cost and memory")
    draft_dtype: Literal["auto", "float32", "bfloat16"] = Field(default="auto",
        description=("dtype of the draft model's weights and KV: float32, bfloat16, or auto (bfloat16 where the CPU "
                     "has AMX or AVX512-BF16, else float32; shared/dtypes.py)"))
    draft_runtime: Literal["auto", "llamacpp", "torch"] = Field(default="auto",
        description=("what runs the draft: llamacpp (a .gguf file or a directory with model.gguf, run by llama.cpp "
                     "as devices do), torch (a Hugging Face directory in PyTorch), or auto: llama.cpp where the draft "
                     "has a GGUF and llama-cpp-python is installed (one log line says why not otherwise), else "
                     "PyTorch"))
    threads: int | None = Field(default=None, ge=1,
        description=("threads of the draft model, PyTorch's or llama.cpp's; unset: torch's own count in PyTorch, "
                     "half the cores (1 to 4) in llama.cpp"))
    mode: Mode = Field(default="speculative",
        description=("speculative (the draft proposes, the cloud verifies), edge_only (the draft alone, every token "
                     "unverified) or cloud_only (the cloud decodes alone)"))

    max_new_tokens: int = Field(default=128, ge=0,
        description="tokens generated after the prompt at most (serve: a chat request's without max_tokens)")
    # shared sampling settings (the session carries them; q and p are processed alike)
    temperature: float = Field(default=1.0, ge=0, description="sampling temperature; 0 = greedy")
    top_p: float = Field(default=0.9, gt=0, le=1,
        description=f"nucleus sampling: the most likely tokens up to this much probability ({_OPENAI_SAMPLING})")
    top_k: int = Field(default=0, ge=0, description="sample among the K most likely tokens; 0 = off")
    repetition_penalty: float = Field(default=1.1, gt=0,
        description=f"penalty on tokens already in the context; 1 = off ({_OPENAI_SAMPLING})")
    # Sampled text also depends on where rounds end, so it repeats exactly with a k that does not depend on
    # timing (fixed_k, or k_policy "dynamic"); the "cost" policy keeps the target's distribution but not the
    # exact text
    seed: int = Field(default=0, ge=0,
        description="keys every coin and sample: same seed, same settings -> same text")
    correction: Literal["strict", "shortcut"] = Field(default="strict",
        description="strict (exact) or shortcut (corrections drawn from p; biased)")
    # same forward, same expected tokens per round: every position is decided by the same rule, so with a draft
    # whose q depends on the text alone (the model draft, the n-gram) the same seed gives the same text for any k
    # schedule, drafting ahead, reopen or failover. Greedy text never depends on rounds
    check_last: bool = Field(default=True,
        description=("sampled sessions: one more draft token a round, checked by the cloud in place of a bonus, so a "
                     "seed gives one text whatever the rounds"))
    send_q_dists: bool = Field(default=False,
        description="send the draft's sparse q distributions (the cloud draws the residual itself)")
    # stop after an end-of-sequence token
    stop_at_eos: bool = True

    # round control: fixed_k set -> k never changes; else k_policy moves it within [k_min, k_max]
    fixed_k: int | None = Field(default=None, ge=0, json_schema_extra={"flag": "k"},
        description=("a chain of K drafts every round; unset: k chosen per round by --k-policy, and trees whenever "
                     "the cloud takes them"))
    k_policy: Literal["cost", "dynamic"] = Field(default="cost",
        description=("cost: the k with the most tokens per second from measured costs (edge/policy/k.py); dynamic: "
                     "+1 / -1 on the last round's la/k"))
    k_start: int = Field(default=6, ge=0, description="k of the first round")
    k_min: int | None = Field(default=None, ge=0,
        description="smallest k; unset: 0 for the cost policy (k = 0 is plain target decoding), 3 for the dynamic one")
    k_max: int = Field(default=12, ge=1, description="largest k")
    # la/k at or above k_up_at grows k by one; at or below k_down_at shrinks it by one
    k_up_at: float = 0.8
    k_down_at: float = 0.4
    draft_ahead: bool = Field(default=True,
        description="draft the next block while the cloud verifies, guessing all accepted (model drafter)")
    tree: str = Field(default="auto", pattern=r"^(auto|off|[1-9][0-9]{0,2})$",
        description=("token trees (edge/policy/tree.py): auto (whenever the cloud takes them, GET /v1/model "
                     "max_tree_nodes > 0, and --k is not given; nodes chosen per round from the draft's confidence "
                     "and the measured costs), off (chains), or a fixed node count"))
    tree_width: int = Field(default=4, ge=1, le=16,
        description="children per expanded node and nodes expanded per level")
    tree_depth: int = Field(default=6, ge=1, le=32, description="levels of the first tree (then adapted)")
    tree_max_nodes: int = Field(default=32, ge=1, le=256, description="most nodes a tree sends")
    tree_copy: bool = Field(default=True,
        description=("graft into every tree what followed the context's last tokens earlier in it (copy branches, "
                     "edge/drafters/lookup.py; exact like any tree, only tokens per call move)"))
    stream_switch: bool = Field(default=True,
        description=("let the cloud stream target-only tokens on the session whenever that is cheaper than "
                     "speculating by --objective, and speculate again when that pays (greedy and strict tree "
                     "sessions; edge/policy/stream.py)"))
    objective: Literal["latency", "cloud"] = Field(default="latency",
        description=("what the switch minimises: latency (the edge's wall time per token) or cloud (the cloud's "
                     "forward time per token)"))
    node_budget: bool = Field(default=True,
        description=("send at most the node budget of the cloud's last answer, the draft nodes the cloud wants per "
                     "round for its load (PROTOCOL.md \"Node budget\"), and value a new session's nodes by the key's "
                     "pooled acceptance the open answer gives; off: rounds sized for the edge's latency and its own "
                     "evidence alone"))

    # uncertainty gating: signals of the draft model's raw distribution (edge/policy/gating.py)
    gating: bool = Field(default=False,
        description="uncertainty gating: a block the draft model is sure of is committed locally, unverified (lossy)")
    # NLL of the drafted token (nats) above this -> hard
    t_nll: float = 2.3
    # entropy (bits) above this -> hard
    t_entropy_bits: float = 2.5
    # top-1 minus top-2 probability below this -> hard
    t_margin: float = 0.2
    # MC-dropout passes (0 = off; only used when the draft model has dropout) and variance threshold
    mc_dropout_samples: int = Field(default=0, ge=0)
    t_mc_var: float = 0.01
    r_hard: float = Field(default=0.3,
        description="gating: a block with a larger share of hard tokens goes to the cloud, else it is committed locally")
    # digits, dates and amounts in the detokenized draft always go to the cloud
    rule_triggers: bool = True

    timeout_ms: float | None = Field(default=None, gt=0,
        description="a fixed verify deadline (ms) for every first attempt; unset: adaptive (edge/policy/deadline.py)")
    deadline_first_ms: float = Field(default=10_000.0, gt=0, description="the adaptive deadline (ms) before any round")
    deadline_floor_ms: float = Field(default=500.0, gt=0, description="lowest adaptive deadline (ms)")
    deadline_ceiling_ms: float = Field(default=30_000.0, gt=0, description="highest adaptive deadline (ms)")
    # the adaptive deadline's multiple of the observed high percentile
    deadline_multiplier: float = Field(default=4.0, ge=1)
    timeout_fallback: bool = Field(default=False,
        description="lossy: on a missed deadline commit the first draft token unverified (counted), not resend")
    # timeout of session open / close / model info / cloud_only generation
    open_timeout_s: float = Field(default=30.0, gt=0)
    max_retries: int = Field(default=6, ge=0,
        description=("resends of a call after 429 / 413 / 5xx / a missed deadline / a connection error, with "
                     "exponential backoff"))
    capacity_wait_s: float = Field(default=300.0, ge=0,
        description=("past its retries, keep waiting out the cloud's capacity answers (429, and sessions evicted "
                     "again at once) for this many seconds of backoff per call, at its Retry-After"))
    backoff_ms: float = Field(default=50.0, ge=0)
    backoff_max_ms: float = Field(default=2000.0, ge=0)

    # serve: the OpenAI server's own keys, request bodies and generations at once (edge/server)
    server_api_keys: list[SecretStr] = Field(default_factory=list,
        json_schema_extra={"flag": "server-api-key", "metavar": "KEY"},
        description=("serve: a Bearer key this server accepts on every /v1 route (its own, not the cloud's "
                     "--api-key); unset: no auth, allowed only on a loopback --host (edge/server/server_auth.py)"))
    max_body_bytes: int = Field(default=4 * 1024**2, ge=1024,
        description="serve: the largest request body (bytes); larger answer 413")
    max_generations: int = Field(default=8, ge=1,
        description=("serve: generations run at once; one more answers 429 rate_limit_error, code server_busy, with "
                     "Retry-After (each holds its own draft state: with llama.cpp a context of 8,192 KV cells and "
                     "128 logit rows, ~180 MB for the coder's 0.5B draft)"))

    ngram_order: int = Field(default=4, ge=1, description="n-gram drafter: longest context (tokens) matched")
    filler_top_k: int = Field(default=0, ge=0,
        description="n-gram drafter: the target's top-k ids added per checked position")
    hybrid: bool = Field(default=False,
        description=("with a draft model: the n-gram's continuation while it comes from a context of at least "
                     "hybrid_min_level tokens, the model's for the rest of the block"))
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
    from shared.attention_layout import UnsupportedModel
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
