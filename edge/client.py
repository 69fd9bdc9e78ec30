"""The edge client: `generate(prompt)` and a streaming iterator of committed tokens, in three modes.

- speculative: the drafter proposes, the cloud verifies (see speculative.py);
- edge_only: the drafter alone, every token local and unverified;
- cloud_only: target-only generation by the cloud (REST /v1/generate; over gRPC, k = 0 verify rounds).
"""

from __future__ import annotations

import inspect
import logging
import secrets
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from shared.config import SamplingConfig
from shared.errors import InvalidArgument, SpecSplitError
from shared.request_id import check_request_id
from shared.verify import DraftKind

from .deadline import DeadlineConfig
from .drafters.base import DraftBlock, Drafter
from .gating import GateThresholds
from .kcontrol import CostModelK
from .metrics import CommittedToken, EdgeMetrics, Origin, RoundRecord
from .pairing import check_pairing, fit_drafter
from .round_control import KController
from .settings import EdgeSettings, Mode, default_head, draft_torch_dtype
from .speculative import RecoveryPolicy, SessionParams, SpeculativeRun
from .transport.base import ModelInfo, Transport, check_route_key, new_route_key
from .transport.errors import CloudTimeout, is_retryable, retry_delay
from .treecontrol import TreeControl
from .waycontrol import WayControl

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    # the decoded generated text (prompt excluded)
    text: str
    # generated ids (prompt excluded)
    token_ids: list[int]
    # the prompt's ids
    prompt_ids: list[int]
    # every generated token with its origin
    tokens: list[CommittedToken]
    # one record per round (empty for REST cloud_only)
    rounds: list[RoundRecord]
    metrics: EdgeMetrics
    mode: str = "speculative"
    # why it ended: "length" (max_new_tokens), "eos", or "context" (the model's context is full)
    stop_reason: str = ""
    # the routing key every cloud call of this generation carried (X-Specsplit-Route)
    route_key: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_ids": self.prompt_ids,
                "origins": [t.origin for t in self.tokens], "mode": self.mode, "stop_reason": self.stop_reason,
                "route_key": self.route_key,
                "rounds": [r.to_dict() for r in self.rounds], "metrics": self.metrics.to_dict()}


class NoDrafter:
    """Proposes nothing: every round is plain target decoding of one token (cloud_only over gRPC)."""

    kind: DraftKind = "deterministic"
    wants_top_k = 0
    max_context: int | None = None

    def reset(self) -> None:
        return None

    def propose(self, context: Sequence[int], k: int, cfg: SamplingConfig, seed: int) -> DraftBlock:
        return DraftBlock(tokens=[], q_probs=[], kind="deterministic")

    def observe(self, context: Sequence[int], draft: Sequence[int], top_k_ids: Sequence[Sequence[int]]) -> None:
        return None


class Generation:
    """A running generation: iterate for committed tokens; `result()` drains and summarises."""

    def __init__(self, tokens: Iterator[CommittedToken], finish: Callable[[list[CommittedToken]], GenerationResult]):
        self._tokens = tokens
        self._finish = finish
        self._seen: list[CommittedToken] = []
        self._result: GenerationResult | None = None

    def __iter__(self) -> Iterator[CommittedToken]:
        for tok in self._tokens:
            self._seen.append(tok)
            yield tok

    def close(self) -> None:
        """Stop early: ends the token source, which closes its cloud session; `result()` then
        summarises the tokens seen so far."""
        close = getattr(self._tokens, "close", None)
        if close is not None:
            close()

    def result(self) -> GenerationResult:
        if self._result is None:
            for _ in self:
                pass
            self._result = self._finish(self._seen)
        return self._result


def new_request_id() -> str:
    """A fresh request id (128 bits, URL-safe): one per generation."""
    return secrets.token_urlsafe(16)


def _takes_request_id(transport: Transport) -> bool:
    """Whether `transport.routed` accepts a request id (a custom transport's may take the routing key alone)."""
    params = inspect.signature(transport.routed).parameters
    return "request_id" in params or any(p.kind is p.VAR_POSITIONAL for p in params.values()) or len(params) >= 2


@dataclass
class _Job:
    prompt_ids: list[int]
    mode: Mode
    max_new_tokens: int
    params: SessionParams
    # routing key of the generation: the same on every call, across reopens and retries
    route_key: str
    # X-Request-Id sent on every cloud call of the generation
    request_id: str = ""
    # "cost" | "dynamic" (edge/kcontrol.py, edge/round_control.py)
    k_policy: str = "cost"
    # draft with the feature-fed head when the cloud offers features
    feature_fed: bool = True
    metrics: EdgeMetrics = field(default_factory=EdgeMetrics)
    rounds: list[RoundRecord] = field(default_factory=list)
    started: float = 0.0
    stop_reason: str = ""


def check_tokenizer_dir(settings: EdgeSettings) -> str:
    """The tokenizer directory; UnsupportedModel naming the flag when it does not exist (no hub download)."""
    from pathlib import Path

    from shared.kvpool import UnsupportedModel

    path = settings.tokenizer_dir()
    if not Path(path).is_dir():
        flag = "--tokenizer" if settings.tokenizer else "--draft"
        raise UnsupportedModel(f"{path} does not exist: pass {flag} DIR (a local Hugging Face model directory; "
                               "nothing is downloaded)" + ("" if settings.tokenizer else " or --draft ngram"))
    return path


def _draft_part(drafter: Any, name: str) -> Any:
    """Attribute `name` of a model drafter, also inside a hybrid (.model) or a server's wrapper (.inner)."""
    inner = getattr(drafter, "inner", None)
    fallback = getattr(drafter, "fallback", None)
    for part in (drafter, getattr(drafter, "model", None), inner, getattr(inner, "model", None), fallback,
                 getattr(fallback, "model", None)):
        value = getattr(part, name, None)
        if value is not None:
            return value
    return None


def _draft_fingerprint(drafter: Any) -> str | None:
    """The tokenizer fingerprint a model drafter (or a hybrid's model half) was stored with."""
    fp = _draft_part(drafter, "tokenizer_fingerprint")
    return fp if isinstance(fp, str) else None


class EdgeClient:
    """Owns a transport, a drafter and a tokenizer; each is built from the settings unless given."""

    def __init__(self, settings: EdgeSettings | None = None, *, transport: Transport | None = None,
                 drafter: Drafter | None = None, tokenizer: Any = None, model_info: ModelInfo | None = None,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
                 head: Any = None):
        self.settings = settings or EdgeSettings()
        self._transport = transport
        self._drafter = drafter
        self._tokenizer = tokenizer
        # the cloud's model (GET /v1/model), asked for once unless given
        self._model_info = model_info
        # the feature-fed head (a FeatureHead; read-only, so one may serve many clients), loaded once unless given
        self._head: Any = head
        self._head_warned = False
        # the last session's speculate-or-stream controller: the next one starts from its costs
        self._last_way: WayControl | None = None
        self.clock = clock
        self.sleep = sleep

    # -- lazily built parts ---------------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            from .transport import make_transport

            s = self.settings
            key = s.api_key.get_secret_value() if s.api_key else None
            self._transport = make_transport(s.cloud_url, s.grpc_target, key)
        return self._transport

    @property
    def drafter(self) -> Drafter:
        if self._drafter is None:
            from .drafters import HybridDrafter, ModelDrafter, NGramDrafter

            s = self.settings
            if s.draft == "ngram":
                self._drafter = NGramDrafter(order=s.ngram_order, filler_top_k=s.filler_top_k)
            else:
                model = ModelDrafter(s.draft, device=s.device, mc_dropout_samples=s.mc_dropout_samples,
                                     dtype=draft_torch_dtype(s))
                self._drafter = model
                if s.hybrid:
                    ngram = NGramDrafter(order=s.ngram_order, filler_top_k=s.filler_top_k)
                    self._drafter = HybridDrafter(model, ngram, s.hybrid_min_level)
        return self._drafter

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from shared.tokenizer_id import load_tokenizer

            self._tokenizer = load_tokenizer(check_tokenizer_dir(self.settings))
        return self._tokenizer

    def model_info(self) -> ModelInfo:
        if self._model_info is None:
            timeout = self._policy().open_timeout_s
            self._model_info = self._retrying(lambda: self.transport.get_model(timeout))
        return self._model_info

    def _retrying(self, fn: Callable[[], T]) -> T:
        """fn() with backoff on retryable errors and timeouts (calls that change nothing)."""
        policy, attempt, waited = self._policy(), 0, 0.0
        while True:
            try:
                return fn()
            except SpecSplitError as e:
                if not (is_retryable(e) or isinstance(e, CloudTimeout)) or policy.gives_up(attempt, e, waited):
                    raise
                attempt += 1
                delay = retry_delay(e, policy.backoff(attempt))
                waited += delay
                self.sleep(delay)

    def encode(self, prompt: str) -> list[int]:
        ids = list(self.tokenizer.encode(prompt))
        if not ids:  # an empty prompt starts from the end-of-text token, as GPT-2 does
            ids = [int(self.tokenizer.eos_token_id or 0)]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids)))

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # -- generation -----------------------------------------------------------------------------

    def stream(self, prompt: str | Sequence[int], *, max_new_tokens: int | None = None, seed: int | None = None,
               sampling: SamplingConfig | None = None, mode: Mode | None = None,
               route_key: str | None = None, k_policy: str | None = None,
               request_id: str | None = None, feature_fed: bool = True) -> Generation:
        """Start a generation. `route_key` (default: the settings', else a fresh random key) goes with
        every cloud call of it, so a load balancer hashing on it keeps the session on one replica.
        `k_policy` overrides the settings' for this generation ("cost" | "dynamic"). `request_id` (default: a
        fresh one) goes with every call as X-Request-Id: the cloud logs and echoes it, and joins a resent open
        to its first attempt. `feature_fed` False
        drafts without the feature-fed head (whose q depends on where rounds ended, so a sampled text
        of a seed would too)."""
        s = self.settings
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not prompt_ids:
            raise InvalidArgument("the prompt has no tokens")
        cfg = sampling or s.sampling()
        # greedy text is the target's argmax whatever the rounds: the checked last draft is for sampling
        params = SessionParams(sampling=cfg, seed=s.seed if seed is None else seed, correction=s.correction,
                               send_q_dists=s.send_q_dists, check_last=s.check_last and not cfg.greedy)
        n_new = s.max_new_tokens if max_new_tokens is None else max_new_tokens
        if k_policy not in (None, "cost", "dynamic"):
            raise InvalidArgument(f"k_policy must be 'cost' or 'dynamic', got {k_policy!r}")
        job = _Job(prompt_ids, mode or s.mode, n_new, params, check_route_key(route_key or s.route_key or new_route_key()),
                   request_id=new_request_id() if request_id is None else check_request_id(request_id),
                   k_policy=k_policy or s.k_policy, feature_fed=feature_fed)
        if job.mode != "cloud_only":  # load the draft model before the clock starts
            _ = self.drafter
        return Generation(self._run(job), lambda toks: self._finish(job, toks))

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult:
        return self.stream(prompt, **kwargs).result()

    def _run(self, job: _Job) -> Iterator[CommittedToken]:
        job.started = self.clock()
        eos = set(self._eos_ids(job.mode)) if self.settings.stop_at_eos else set()
        source = {"speculative": self._speculative, "edge_only": self._edge_only,
                  "cloud_only": self._cloud_only}[job.mode](job)
        try:
            for tok in source:
                if job.metrics.emitted == 0:
                    job.metrics.ttft_ms = (self.clock() - job.started) * 1000
                job.metrics.emitted += 1
                job.metrics.by_origin[tok.origin] += 1
                yield tok
                if job.metrics.emitted >= job.max_new_tokens or tok.token_id in eos:
                    job.stop_reason = "eos" if tok.token_id in eos else "length"
                    break
            else:  # the source ran dry before the budget: the context is full
                job.stop_reason = job.stop_reason or "context"
        finally:
            source.close()  # the speculative source closes its cloud session
            job.metrics.wall_ms = (self.clock() - job.started) * 1000

    def _finish(self, job: _Job, tokens: list[CommittedToken]) -> GenerationResult:
        ids = [t.token_id for t in tokens]
        return GenerationResult(text=self.decode(ids), token_ids=ids, prompt_ids=job.prompt_ids, tokens=tokens,
                                rounds=job.rounds, metrics=job.metrics, mode=job.mode, stop_reason=job.stop_reason,
                                route_key=job.route_key)

    def _routed(self, job: _Job) -> Transport:
        """The generation's view of the transport, carrying its request id (so a resent open joins the first
        attempt on the cloud: cloud/opens.py) unless the transport's routed() takes the routing key alone."""
        if not _takes_request_id(self.transport):
            return self.transport.routed(job.route_key)
        return self.transport.routed(job.route_key, job.request_id)

    def _eos_ids(self, mode: Mode) -> list[int]:
        """The target's end-of-sequence ids (the tokenizer's in edge_only mode)."""
        if mode != "edge_only":
            eos = self.model_info().eos_ids
            if eos:
                return eos
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        return [int(tok_eos)] if tok_eos is not None else []

    def _policy(self) -> RecoveryPolicy:
        s = self.settings
        deadline = DeadlineConfig(
            fixed_s=None if s.timeout_ms is None else s.timeout_ms / 1000, first_s=s.deadline_first_ms / 1000,
            floor_s=s.deadline_floor_ms / 1000, ceiling_s=s.deadline_ceiling_ms / 1000,
            multiplier=s.deadline_multiplier)
        return RecoveryPolicy(deadline=deadline, timeout_fallback=s.timeout_fallback,
                              open_timeout_s=s.open_timeout_s, max_retries=s.max_retries,
                              capacity_wait_s=s.capacity_wait_s,
                              backoff_s=s.backoff_ms / 1000, backoff_max_s=s.backoff_max_ms / 1000)

    def _k_controller(self, policy: str) -> KController | CostModelK:
        s = self.settings
        k_min = s.k_min_for(policy)
        if s.fixed_k is not None:
            return KController(k=s.fixed_k, k_min=s.fixed_k, k_max=max(s.fixed_k, 1), dynamic=False)
        if policy == "cost":
            return CostModelK(k=s.k_start, k_min=k_min, k_max=s.k_max)
        return KController(k=s.k_start, k_min=k_min, k_max=s.k_max, up_at=s.k_up_at, down_at=s.k_down_at)

    def _tree_control(self, info: ModelInfo) -> TreeControl | None:
        """The tree controller of the settings, or None for chains (off, a fixed k under auto, gating, or a
        cloud that takes no trees)."""
        s = self.settings
        if s.tree == "off" or info.max_tree_nodes <= 0 or s.gating or (s.tree == "auto" and s.fixed_k is not None):
            return None
        most = min(s.tree_max_nodes, info.max_tree_nodes)
        fixed = None if s.tree == "auto" else min(int(s.tree), info.max_tree_nodes)
        return TreeControl(max_nodes=most, width=s.tree_width, depth=s.tree_depth, fixed_nodes=fixed,
                           copy_branches=s.tree_copy)

    def _way_control(self, info: ModelInfo, transport: Transport) -> WayControl | None:
        """The speculate-or-stream controller, when the settings allow it and the cloud streams on a session."""
        s = self.settings
        if not s.stream_switch or not info.session_stream or not getattr(transport, "supports_session_stream", False):
            return None
        # chunks within the cloud's --max-generate-tokens (an older cloud does not say: 0)
        way = WayControl(objective=s.objective).carry(self._last_way).limit(
            int(getattr(info, "max_generate_tokens", 0) or 0))
        self._last_way = way  # the next session starts from this one's costs (one link, one cloud)
        return way

    def head(self) -> Any:
        """The feature-fed head of the settings (loaded once), or None for "none"."""
        if self.settings.head == "none":
            return None
        if self._head is None:
            from .drafters.attention_head import AttentionHead, is_attention_head
            from .drafters.feature_head import FeatureHead, is_feature_head

            if is_attention_head(self.settings.head):
                self._head = AttentionHead.load(Path(self.settings.head), self.settings.device)
            elif is_feature_head(self.settings.head):
                self._head = FeatureHead.load(Path(self.settings.head), self.settings.device)
            else:
                from shared.kvpool import UnsupportedModel
                raise UnsupportedModel(f"{self.settings.head} holds no feature-fed head (feature_head.json or "
                                       "attention_head.json): pass --head DIR or --head none")
        return self._head

    def _head_fits(self, info: ModelInfo) -> bool:
        """The head's config (read without its weights) names the cloud's width and tokenizer: a head made
        for another target is never loaded (False, said once; quietly for the default head)."""
        if self.settings.head == "none":
            return False
        if self._head is not None:
            return True
        import json

        from .drafters.attention_head import CONFIG_NAME as ATTENTION_CONFIG
        from .drafters.feature_head import CONFIG_NAME as FEATURE_CONFIG

        for name in (ATTENTION_CONFIG, FEATURE_CONFIG):
            path = Path(self.settings.head) / name
            if path.is_file():
                cfg = json.loads(path.read_text())
                width, fingerprint = int(cfg.get("hidden_size", 0)), str(cfg.get("tokenizer_fingerprint", ""))
                if width == info.feature_size and fingerprint in ("", info.tokenizer_fingerprint):
                    return True
                if not self._head_warned:
                    self._head_warned = True
                    quiet = self.settings.head == default_head()  # the default head meets other targets silently
                    (log.info if quiet else log.warning)(
                        "the head %s was trained on another target (width %d, tokenizer %s; the cloud's: %d, %s): "
                        "drafting without it (not loaded)", self.settings.head, width, fingerprint,
                        info.feature_size, info.tokenizer_fingerprint)
                return False
        return True  # not a head directory: head() names the problem

    def encoding_for(self, info: ModelInfo) -> str:
        """The feature encoding to ask for: the setting's when the cloud offers it; "auto": int8, else float16."""
        want = self.settings.feature_encoding
        for e in (("int8", "float16") if want == "auto" else (want,)):
            if e in info.feature_encodings:
                return e
        return ""

    def _feature_fed(self, info: ModelInfo, drafter: Drafter) -> Drafter | None:
        """`drafter` wrapped by the feature-fed head when the cloud offers features the head was trained on."""
        if not isinstance(drafter, NoDrafter) and info.feature_size and self.encoding_for(info) \
                and self._head_fits(info) and self.head() is not None:
            from .drafters.attention_drafter import AttentionDrafter
            from .drafters.attention_head import AttentionHead
            from .drafters.feature_head import FeatureDrafter

            cfg = self._head.cfg
            if cfg.hidden_size == info.feature_size and cfg.tokenizer_fingerprint in ("", info.tokenizer_fingerprint):
                if isinstance(self._head, AttentionHead):
                    return AttentionDrafter(self._head, drafter)
                return FeatureDrafter(self._head, drafter)
            if not self._head_warned:
                self._head_warned = True
                quiet = self.settings.head == default_head()  # the default head meets other targets silently
                (log.info if quiet else log.warning)(
                    "the feature-fed head %s was trained on another target (width %d, tokenizer %s; the cloud's: "
                    "%d, %s): drafting without it", self.settings.head, cfg.hidden_size, cfg.tokenizer_fingerprint,
                    info.feature_size, info.tokenizer_fingerprint)
        return None

    def _speculative(self, job: _Job, drafter: Drafter | None = None, origin_map: dict[str, Origin] | None = None,
                     ) -> Generator[CommittedToken, None, None]:
        s = self.settings
        drafter = drafter or self.drafter
        info = self.model_info()
        fed = self._feature_fed(info, drafter) if job.feature_fed else None
        if fed is not None:
            drafter = fed
            # a drafter that attends over past states asks for every committed position's (when offered)
            window = min(int(getattr(fed, "states_window", 0)), s.open_states, info.max_feature_window)
            job.params = replace(job.params, feature_encoding=self.encoding_for(info), feature_window=window)
        rows = _draft_part(drafter, "logit_rows")
        support = check_pairing(info, self.tokenizer, self.settings.tokenizer_dir(), _draft_fingerprint(drafter),
                                int(rows) if rows is not None else None)
        fit_drafter(drafter, support)  # q over the tokenizer's ids, as p
        gate = None
        if s.gating:
            gate = GateThresholds(t_nll=s.t_nll, t_entropy_bits=s.t_entropy_bits, t_margin=s.t_margin,
                                  t_mc_var=s.t_mc_var, r_hard=s.r_hard)
        transport = self._routed(job)
        run = SpeculativeRun(transport, drafter, job.params, self._k_controller(job.k_policy), job.metrics, self._policy(),
                             gate=gate, rule_triggers=s.rule_triggers, detokenize=self.decode if gate else None,
                             clock=self.clock, sleep=self.sleep, draft_ahead=s.draft_ahead,
                             tree=self._tree_control(info), way=self._way_control(info, transport),
                             stop_at_eos=s.stop_at_eos)
        job.rounds = run.records
        limits = [m for m in (info.max_context, drafter.max_context) if m]
        max_context = min(limits) if limits else None
        if drafter.max_context and len(job.prompt_ids) >= drafter.max_context:
            raise InvalidArgument(f"the prompt has {len(job.prompt_ids)} tokens; the draft model holds "
                                  f"{drafter.max_context} positions")
        traffic0 = (self.transport.traffic.bytes_up, self.transport.traffic.bytes_down)
        run.open(job.prompt_ids, job.max_new_tokens)
        try:
            emitted = 0
            while emitted < job.max_new_tokens and (max_context is None or len(run.S) < max_context):
                for tok, origin in run.advance(job.max_new_tokens - emitted, max_context):
                    emitted += 1
                    yield CommittedToken(tok, origin_map.get(origin, origin) if origin_map else origin,
                                         len(run.records) - 1)
        finally:
            run.close()
            job.metrics.bytes_up += self.transport.traffic.bytes_up - traffic0[0]
            job.metrics.bytes_down += self.transport.traffic.bytes_down - traffic0[1]

    def _edge_only(self, job: _Job) -> Generator[CommittedToken, None, None]:
        from .drafters import HybridDrafter

        drafter = self.drafter
        if isinstance(drafter, HybridDrafter):  # a hybrid writes with its model
            drafter = drafter.model
        if drafter.kind != "sampled":
            raise InvalidArgument("edge_only needs a draft model (the n-gram drafter cannot write alone)")
        drafter.reset()
        S = list(job.prompt_ids)
        chunk = max(self.settings.k_max, 1)
        while len(S) - len(job.prompt_ids) < job.max_new_tokens:
            if drafter.max_context is not None and len(S) >= drafter.max_context:
                break
            t0 = self.clock()
            left = job.max_new_tokens - (len(S) - len(job.prompt_ids))
            block = drafter.propose(S, min(chunk, left), job.params.sampling, job.params.seed)
            job.metrics.edge_time_ms += (self.clock() - t0) * 1000
            job.metrics.rounds += 1
            job.metrics.local_commits += block.k
            for tok in block.tokens:
                S.append(tok)
                yield CommittedToken(tok, "local", job.metrics.rounds - 1)

    def _cloud_only(self, job: _Job) -> Generator[CommittedToken, None, None]:
        transport = self._routed(job)
        if not transport.supports_generate:
            s0 = replace(job.params, send_q_dists=False)
            job.params = s0
            yield from self._speculative(job, NoDrafter(), origin_map={"bonus": "target"})
            return
        up, down = transport.traffic.bytes_up, transport.traffic.bytes_down
        policy, attempt, waited = self._policy(), 0, 0.0
        got: list[int] = []
        job.metrics.rounds += 1
        try:
            while True:
                job.metrics.cloud_calls += 1
                try:
                    # the cloud's draws are keyed by (seed, position): resuming from prompt + the
                    # tokens received so far continues the very same text
                    for item in transport.generate_stream(job.prompt_ids + got, job.params.sampling, job.params.seed,
                                                          job.max_new_tokens - len(got), policy.open_timeout_s):
                        if isinstance(item, int):
                            got.append(item)
                            yield CommittedToken(item, "target", 0)
                        else:  # the cloud says why it stopped
                            job.stop_reason = str(item.metrics.get("stop_reason", ""))
                    return
                except SpecSplitError as e:
                    if not (is_retryable(e) or isinstance(e, CloudTimeout)) or policy.gives_up(attempt, e, waited):
                        raise
                    attempt += 1
                    job.metrics.retries += 1
                    delay = retry_delay(e, policy.backoff(attempt))
                    waited += delay
                    self.sleep(delay)
        finally:
            job.metrics.bytes_up += transport.traffic.bytes_up - up
            job.metrics.bytes_down += transport.traffic.bytes_down - down
