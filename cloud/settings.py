"""The cloud verifier's one settings class (env prefix SPECSPLIT_CLOUD_), validated when built.

Command-line flags override the environment (cloud.cli); a bad value stops the process at start
with a message naming the setting. Limits that depend on the model (prompt length vs. the model's
context) are checked again once the model is loaded (`check_against_model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# tensor parallelism: seconds one op may run before its rank counts as hung (the default of tp_op_timeout_s),
# and the least it may be set to (a hung rank is lost cloud/runners/tensor_parallel.STALE_S, 10 s, later)
OP_STALE_S = 60.0
OP_STALE_FLOOR_S = 20.0


class CloudSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECSPLIT_CLOUD_", extra="forbid")

    model: Path = Field(
        description=("the target model: a Hugging Face causal-LM directory (config, weights, tokenizer; a prepared one "
                     "also holds model.gguf), or a .gguf file with the tokenizer files beside it; the default pair's target "
                     "is models/qwen2.5-coder-1.5b-instruct (specsplit-models prepare qwen-coder)"))
    runner: Literal["auto", "torch", "llamacpp"] = Field(default="auto",
        description=("what runs the target's forward: \"llamacpp\" (the model's GGUF file through llama.cpp, CPU: the "
                     'quantized weights as shipped), "torch" (the Hugging Face weights in PyTorch: GPUs, tensor '
                     'parallelism, feature-fed heads, batch-invariant forwards, prefix sharing), or "auto": llama.cpp on '
                     "a CPU when the model has a GGUF and llama-cpp-python is installed, PyTorch otherwise "
                     "(cloud/runners/llamacpp.py; BENCHMARKS.md compares them)"))
    host: str = Field(default="127.0.0.1", description="interface both servers bind to")
    http_port: int = Field(default=8000, ge=0, le=65535,
        description=("REST (FastAPI over uvicorn) port; 0 picks a free one"))
    grpc_port: int = Field(default=50051, ge=0, le=65535, description="gRPC port; 0 picks a free one")
    api_keys: list[SecretStr] = Field(default_factory=list,
        description=("accepted Bearer keys; empty = auth off (every caller is the same anonymous owner)"))
    allow_open_bind: bool = Field(default=False,
        description=("true: start without --api-key on a host beyond loopback (0.0.0.0, a LAN address), where anyone "
                     "who reaches the ports is served; false: such a start is refused (a container publishing its "
                     "ports on the host's loopback only, or a network of its own, may set it)"))
    metrics_auth: bool = Field(default=False,
        description=("true: GET /metrics needs a key too (when keys are configured); false: /metrics is open, as "
                     "/healthz and /readyz are (keep the port off the public network, or turn this on)"))
    device: str = Field(default="cpu", description='torch device of the target: "cpu" or "cuda" / "cuda:N"')
    dtype: Dtype = Field(default="auto",
        description=("weights and KV dtype; auto: bfloat16 where the CPU has AMX or AVX512-BF16 (or on a CUDA device "
                     "with bfloat16), float32 elsewhere (shared/dtypes.py); the choice and why are logged and in GET "
                     "/v1/model"))
    batch_invariant: bool = Field(default=True,
        description=("every forward batch-invariant (shared/invariant.py): a token's logits and KV are bit for bit the "
                     "same whatever else shares its forward (one session or 16, a decode step, a chain, a tree, a "
                     "prefill chunk), so greedy text is one text in every mode; false: the plain kernels (measured in "
                     "BENCHMARKS.md)"))
    executor: Literal["auto", "graphs", "eager", "transformers"] = Field(default="auto",
        description=("how the PyTorch runner runs a forward: \"graphs\" (cloud/runners/graphs.py: a forward of its own "
                     "for Llama / Qwen2 / Qwen3 / Mistral, replayed from CUDA graphs per bucket on a GPU), \"eager\" "
                     "(the same forward without graphs), \"transformers\" (the model's own modules over the paged "
                     "pool: every architecture); auto: graphs on a CUDA device and eager on a CPU "
                     "where the model allows, transformers elsewhere (docs/GPU.md)"))
    attention: Literal["sdpa", "triton"] = Field(default="sdpa",
        description=("the graph executor's attention: \"sdpa\" (scaled dot-product attention over each row's keys "
                     "gathered from the pool, masks built on the host) or \"triton\" (cloud/runners/paged_kernel.py: "
                     "one kernel reading keys through the block tables, causal and tree masks from three numbers a "
                     "token; CUDA only)"))
    fused_kernels: bool = Field(default=False,
        description=("the graph executor's residual add + RMSNorm, RoPE and SiLU x up as Triton kernels "
                     "(cloud/runners/fused_kernels.py) instead of PyTorch's separate ops; CUDA only, opt-in until a GPU "
                     "run measures them (specsplit-bench --only gpu)"))
    graph_rows: str = Field(default="1,2,4,8,16,32,64",
        description=("CUDA graphs: the row counts (sessions a forward) captured at start-up, comma-separated; a forward "
                     "outside every captured bucket runs eagerly (counted in specsplit_cloud_executor_forwards_total{path=\"eager\"})"))
    graph_queries: str = Field(default="1,2,4,8,12,16",
        description=("CUDA graphs: the tokens a row captured at start-up (1: decode steps; a chain of k verifies k + 1; "
                     "a tree its nodes + 1), comma-separated"))
    graph_keys: str = Field(default="512,1024,2048,4096",
        description=("CUDA graphs: the context lengths (keys a row) captured at start-up, comma-separated"))
    graph_memory_bytes: int = Field(default=2 * 1024**3, ge=0,
        description=("CUDA graphs: bytes their memory may take at most, beside kv_budget_bytes; buckets that do not "
                     "fit run eagerly (the start-up log and specsplit_cloud_graph_bytes say how many and how much)"))
    torch_threads: int = Field(default=0, ge=0,
        description=("torch intra-op threads for the model worker; 0 = torch's default"))

    max_sessions: int = Field(default=64, ge=1,
        description=("open sessions at most; opening one more answers 429 unless an expired one can go"))
    max_sessions_per_key: int = Field(default=0, ge=0,
        description=("open sessions one API key may hold; more answer 429 naming max_sessions_per_key. 0 = automatic: "
                     "max_sessions when fewer than two keys are configured, else half of max_sessions (at least 1), so "
                     "no single key can take every session"))
    session_ttl_s: float = Field(default=600.0, gt=0,
        description=("a session idle this long expires (404 afterwards)"))
    kv_budget_bytes: int = Field(default=2 * 1024**3, gt=0,
        description=("KV cache bytes at most: the paged pool grows up to it and never past it; when its blocks run out, "
                     "unreferenced cached prefix blocks, then least recently used idle sessions are evicted, else 429. "
                     "Under tensor parallelism (torchrun) it is per rank: each rank's pool holds its share of the KV "
                     "heads"))
    kv_preallocate: bool | Literal["auto"] = Field(default="auto",
        description=("allocate the KV pool's tensors for the whole budget at start (on a CPU its pages become resident as they are first "
                     "written, on a GPU all at once) "
                     "instead of doubling them as sessions come: each doubling copies the pool while every round waits "
                     '(a 200-450 ms stall under sustained opens, BENCHMARKS.md "The verifier under sustained load"); '
                     '"auto": when the budget takes at most half the memory free at start (the GPU\'s on a GPU), '
                     "else grow; false: always grow (memory as sessions come)"))
    eviction_grace_s: float = Field(default=5.0, ge=0,
        description=("a session opened (or reopened) less than this long ago that has not run a round yet is never "
                     "evicted for blocks: under overload new work waits or gets 429 rather than evicting sessions before "
                     "they start"))
    eviction_active_s: float = Field(default=1.0, ge=0,
        description=("a session used less than this long ago (mid-generation) is not evicted for the blocks another job "
                     "lacks, even the first of a forward (that job waits for a later forward, or answers 429): under a "
                     "tight budget a few sessions run to the end while the rest wait, rather than every edge reopening "
                     "in turn; 0 = no spare"))
    kv_block_size: int = Field(default=16, ge=1, le=1024, description="positions per KV block")
    prefix_cache: bool = Field(default=True,
        description=("reuse cached full KV blocks of a common prefix (system prompt, template) instead of recomputing "
                     "them"))
    share_prefix_across_keys: bool = Field(default=False,
        description=("share cached prefix blocks across API keys (off: a key never reuses, nor learns from its latency "
                     "whether another key sent, a prompt)"))
    features: bool = Field(default=True,
        description=("offer feature-fed drafting: sessions that ask get the target's hidden state with every answer"))
    max_k: int = Field(default=16, ge=0, le=256, description="largest k (draft tokens per round) accepted")
    max_tree_nodes: int = Field(default=64, ge=0, le=256,
        description=("most nodes of a token tree a round may carry (0: chains only; advertised in /v1/model)"))
    node_budget: bool = Field(default=True,
        description=("give each verify answer a node budget: the most draft nodes the next round should send, chosen "
                     "from the forward cost fitted online and the present load (cloud/node_budget.py); false: none"))
    max_feature_window: int = Field(default=256, ge=0, le=4096,
        description=("most prompt positions whose states an open sends to a session that asks for states at every "
                     "committed position (feature_window; 0: one feature per answer only)"))
    max_batch_size: int = Field(default=32, ge=1,
        description=("sessions (rows) in one batched forward at most; 1 = one session per forward (no batching)"))
    max_batch_tokens: int = Field(default=1024, ge=16,
        description=("real tokens in one forward at most (rounds and decode steps first, prefill chunks fill the rest)"))
    max_prefill_tokens_with_rounds: int = Field(default=64, ge=1,
        description=("prefill tokens at most in a forward that also carries rounds or decode steps, or that runs while a "
                     "session is active (see session_active_ms): a round waits behind at most this slice of prefill, "
                     "whenever it arrives, so its latency stays near one small forward during a burst of opens. Only "
                     "with no session active does a prefill-only forward take all max_batch_tokens"))
    prefill_share_with_rounds: float = Field(default=0.5, gt=0,
        description=("the slice by measured cost: prefill tokens in a forward that carries rounds (or runs while a "
                     "session is active) add at most this share of that forward's own cost, by the forward cost fitted "
                     "online (cloud/node_budget.py), and never more than max_prefill_tokens_with_rounds: a round under "
                     "others' opens then takes about 1 + share forwards' time plus its wait, near twice its idle time"))
    session_active_ms: float = Field(default=1000.0, ge=0,
        description=("a session answered (or a generate stream served) within this long (ms) is active: its next round "
                     "is expected (an edge sends it 10-30 ms after its answer, longer over a slow link); 0 = only "
                     "forwards that carry rounds or decode steps limit their prefill"))
    batch_wait_ms: float = Field(default=5.0, ge=0, le=1000,
        description=("before a forward, wait at most this long (ms; and at most half the last forward's time) for the "
                     "next rounds of sessions answered within the last three forwards, so they share one forward; 0 = "
                     "never"))
    max_queue_depth: int = Field(default=64, ge=1,
        description=("session opens and /v1/generate streams admitted at once (waiting for the model or running); more "
                     "answer 429 / RESOURCE_EXHAUSTED. Verify rounds of open sessions are not refused by them "
                     "(cloud/admission.py)"))
    max_queue_depth_per_key: int = Field(default=0, ge=0,
        description=("opens and generate streams one API key may have admitted at once; more answer 429 naming "
                     "max_queue_depth_per_key. 0 = automatic: max_queue_depth when fewer than two keys are configured, "
                     "else half of it (at least 1), so one key's burst leaves room for the others"))
    max_body_bytes: int = Field(default=4 * 1024**2, ge=1024,
        description=("largest request body (REST) / message (gRPC); larger answer 413 / RESOURCE_EXHAUSTED"))
    max_prompt_len: int = Field(default=0, ge=0,
        description=("longest prompt accepted at open; 0 = the model's context; must not exceed it"))
    max_return_top_k: int = Field(default=64, ge=0, description="largest return_top_k")
    replay_cache_size: int = Field(default=8, ge=0,
        description=("answers kept per session by request_id, so a late duplicate is answered without rollback"))
    replay_cache_bytes: int = Field(default=1024**2, ge=0,
        description=("bytes of residual distributions (12 per id) those answers keep per session; beyond it the oldest "
                     "answers lose theirs (a late duplicate of one answers 409, nothing changed); the newest always "
                     "keeps its own"))
    max_generate_tokens: int = Field(default=1024, ge=1,
        description=("largest max_new_tokens of POST /v1/generate"))
    max_connections: int = Field(default=512, ge=1,
        description=("REST connections and requests at once (uvicorn limit_concurrency); beyond it new requests get a "
                     "plain 503. Bounds what slow or idle connections can hold; put a proxy with header timeouts in "
                     "front"))
    keep_alive_s: int = Field(default=75, ge=1,
        description=("an idle REST keep-alive connection is closed after this long (seconds). Keep it above the idle "
                     "timeout of any proxy's pooled connections (nginx's upstream keepalive_timeout, 60 s): a backend "
                     "that closes first races the proxy's next request on that connection, which the proxy counts as the "
                     "replica failing"))
    tp_op_timeout_s: float = Field(default=OP_STALE_S, ge=OP_STALE_FLOOR_S,
        description=("tensor parallelism (torchrun): a rank inside one op (a forward, a KV move) for longer than this "
                     "(seconds) counts as hung, stops beating, and the group is restarted; keep it above the longest "
                     "forward (a max_batch_tokens prefill chunk of the target, on CPU over gloo that can take minutes "
                     "for a large one)"))
    shutdown_grace_s: float = Field(default=2.0, ge=0,
        description=("at SIGTERM, the drain waits at most this long (seconds) for open sessions to close and rounds to "
                     "finish"))
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info",
        description=("logging level of the process"))

    @field_validator("model")
    @classmethod
    def _model_dir_exists(cls, v: Path) -> Path:
        if v.suffix == ".gguf" and v.is_file():
            return v
        if not (v / "config.json").is_file():
            raise ValueError(f"{v} is not a model directory (no config.json) nor a .gguf file")
        return v

    @field_validator("graph_rows", "graph_queries", "graph_keys")
    @classmethod
    def _counts(cls, v: str) -> str:
        parts = [p.strip() for p in v.split(",") if p.strip()]
        if not parts or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"{v!r} is not a comma-separated list of positive counts (e.g. 1,2,4,8)")
        return ",".join(parts)

    def graph_lists(self) -> tuple[list[int], list[int], list[int]]:
        """(rows, queries, keys) of the CUDA graphs to capture at start-up."""
        return tuple([int(x) for x in v.split(",")]  # type: ignore[return-value]
                     for v in (self.graph_rows, self.graph_queries, self.graph_keys))

    @field_validator("device")
    @classmethod
    def _device_known(cls, v: str) -> str:
        if v != "cpu" and not (v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit())):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', not {v!r}")
        return v

    @model_validator(mode="after")
    def _ports_differ(self) -> CloudSettings:
        if self.http_port and self.http_port == self.grpc_port:
            raise ValueError(f"http_port and grpc_port are both {self.http_port}")
        if any(not k.get_secret_value() for k in self.api_keys):
            raise ValueError("api keys must not be empty")
        return self

    @model_validator(mode="after")
    def _dtype_is_torch_s(self) -> CloudSettings:
        if self.runner == "llamacpp" and self.dtype != "auto":
            raise ValueError(f"--dtype {self.dtype} is the PyTorch runner's: llama.cpp runs the GGUF's own types; "
                             "drop --dtype, or use --runner torch")
        return self

    def runner_choice(self) -> str:
        """"torch" or "llamacpp": `runner` with auto resolved (see the field)."""
        return self.runner_and_reason()[0]

    def runner_and_reason(self) -> tuple[str, str]:
        """The runner `auto` resolves to, and why (logged at start, so replicas that resolved differently show)."""
        from shared.llama_runtime import find_gguf, unavailable

        if self.runner != "auto":
            return self.runner, "asked for"
        if self.model.suffix == ".gguf":
            return "llamacpp", "auto: the model is a GGUF file"
        if self.dtype != "auto":
            return "torch", f"auto: --dtype {self.dtype} asks for the PyTorch weights"
        if self.device != "cpu":
            return "torch", f"auto: llama.cpp runs on the CPU here, the device is {self.device}"
        if find_gguf(self.model) is None:
            return "torch", "auto: the model directory holds no GGUF"
        why = unavailable()
        if why is not None:
            return "torch", f"auto: llama.cpp is not usable ({why}); pin --runner to keep replicas alike"
        return "llamacpp", "auto: a CPU, the model's GGUF and llama-cpp-python"

    def api_key_values(self) -> list[str]:
        return [k.get_secret_value() for k in self.api_keys]

    def sessions_per_key_limit(self) -> int:
        """The effective max_sessions_per_key (see the field)."""
        if self.max_sessions_per_key:
            return min(self.max_sessions_per_key, self.max_sessions)
        return self.max_sessions if len(self.api_keys) < 2 else max(1, self.max_sessions // 2)

    def queue_depth_per_key_limit(self) -> int:
        """The effective max_queue_depth_per_key (see the field)."""
        if self.max_queue_depth_per_key:
            return min(self.max_queue_depth_per_key, self.max_queue_depth)
        return self.max_queue_depth if len(self.api_keys) < 2 else max(1, self.max_queue_depth // 2)

    def prompt_limit(self, model_context: int) -> int:
        """The effective max prompt length for a model with `model_context` positions."""
        if self.max_prompt_len > model_context:
            raise ValueError(f"max_prompt_len = {self.max_prompt_len} exceeds the model's context "
                             f"({model_context} positions)")
        return self.max_prompt_len or model_context
