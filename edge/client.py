"""The edge client: `generate(prompt)` and a streaming iterator of committed tokens, in three modes.

- speculative: the drafter proposes, the cloud verifies (see speculative.py);
- edge_only: the drafter alone, every token local and unverified (solo_modes.py);
- cloud_only: target-only generation by the cloud (REST /v1/generate, solo_modes.py; over gRPC, k = 0 verify
  rounds).

Its parts: the generation's handle and result (generation.py), the recovery policy and the run's controllers
(policy/from_settings.py), and the hook a drafter fed the target's states plugs in by (states_hook.py).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from shared.config import SamplingConfig
from shared.errors import InvalidArgument, SpecSplitError
from shared.request_id import check_request_id

from .drafters.base import Drafter
from .exchange import RecoveryPolicy, SessionParams, TokenizerChanged
from .generation import Generation, GenerationJob, GenerationResult, new_request_id
from .metrics import CommittedToken, Origin
from .pairing import check_pairing, fit_drafter
from .policy.from_settings import Backoff, k_controller, recovery_policy, tree_control, way_control
from .policy.gating import GateThresholds
from .policy.stream import WayControl
from .policy.tree import TreeControl
from .settings import EdgeSettings, Mode, load_draft_model
from .solo_modes import NoDrafter, edge_only, target_only
from .speculative import SpeculativeRun
from .states_hook import StatesDrafting
from .transport.base import ModelInfo, Transport, check_route_key, new_route_key

T = TypeVar("T")

__all__ = ["EdgeClient", "Generation", "GenerationResult", "NoDrafter", "check_tokenizer_dir", "new_request_id"]


def _takes_request_id(transport: Transport) -> bool:
    """Whether `transport.routed` accepts a request id (a custom transport's may take the routing key alone)."""
    params = inspect.signature(transport.routed).parameters
    return "request_id" in params or any(p.kind is p.VAR_POSITIONAL for p in params.values()) or len(params) >= 2


def check_tokenizer_dir(settings: EdgeSettings) -> str:
    """The tokenizer directory; UnsupportedModel naming the flag when it does not exist (no hub download)."""
    from pathlib import Path

    from shared.attention_layout import UnsupportedModel

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
                 states_drafting: StatesDrafting | None = None):
        self.settings = settings or EdgeSettings()
        self._transport = transport
        self._drafter = drafter
        self._tokenizer = tokenizer
        # the cloud's model (GET /v1/model), asked for once unless given
        self._model_info = model_info
        # wraps the drafter to draft from the cloud's states when it offers them (states_hook.py); None: never asked
        self.states_drafting = states_drafting
        # the last session's speculate-or-stream controller: the next one starts from its costs
        self._last_way: WayControl | None = None
        self._last_tree: TreeControl | None = None
        self.clock = clock
        self.sleep = sleep

    # -- lazily built parts ---------------------------------------------------------------------

    @property
    def transport(self) -> Transport:
        if self._transport is None:
            from .transport import transport_for

            self._transport = transport_for(self.settings)
        return self._transport

    @property
    def drafter(self) -> Drafter:
        if self._drafter is None:
            from .drafters import HybridDrafter, NGramDrafter

            s = self.settings
            if s.draft == "ngram":
                self._drafter = NGramDrafter(order=s.ngram_order, filler_top_k=s.filler_top_k)
            else:
                model = load_draft_model(s)
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
        backoff = Backoff(self._policy(), self.sleep)
        while True:
            try:
                return fn()
            except SpecSplitError as e:
                if not backoff.wait(e):
                    raise

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
               request_id: str | None = None) -> Generation:
        """Start a generation. `route_key` (default: the settings', else a fresh random key) goes with
        every cloud call of it, so a load balancer hashing on it keeps the session on one replica.
        `k_policy` overrides the settings' for this generation ("cost" | "dynamic"). `request_id` (default: a
        fresh one) goes with every call as X-Request-Id: the cloud logs and echoes it, and joins a resent open
        to its first attempt."""
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
        job = GenerationJob(prompt_ids, mode or s.mode, n_new, params,
                            check_route_key(route_key or s.route_key or new_route_key()),
                            request_id=new_request_id() if request_id is None else check_request_id(request_id),
                            k_policy=k_policy or s.k_policy)
        if job.mode != "cloud_only":  # load the draft model before the clock starts
            _ = self.drafter
        return Generation(self._run(job), lambda toks: self._finish(job, toks))

    def generate(self, prompt: str | Sequence[int], **kwargs: Any) -> GenerationResult:
        return self.stream(prompt, **kwargs).result()

    def _run(self, job: GenerationJob) -> Iterator[CommittedToken]:
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
        except TokenizerChanged:
            self._model_info = None  # the next generation asks the cloud's model again and pairs anew
            raise
        finally:
            source.close()  # the speculative source closes its cloud session
            job.metrics.wall_ms = (self.clock() - job.started) * 1000

    def _finish(self, job: GenerationJob, tokens: list[CommittedToken]) -> GenerationResult:
        ids = [t.token_id for t in tokens]
        return GenerationResult(text=self.decode(ids), token_ids=ids, prompt_ids=job.prompt_ids, tokens=tokens,
                                rounds=job.rounds, metrics=job.metrics, mode=job.mode, stop_reason=job.stop_reason,
                                route_key=job.route_key)

    def _routed(self, job: GenerationJob) -> Transport:
        """The generation's view of the transport, carrying its request id (so a resent open joins the first
        attempt on the cloud: cloud/idempotent_opens.py) unless the transport's routed() takes the routing key alone."""
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
        return recovery_policy(self.settings)

    def _tree_control(self, info: ModelInfo) -> TreeControl | None:
        """The tree controller, starting from what the last session's learned (one draft, link and cloud)."""
        ctl = tree_control(self.settings, info)
        if ctl is not None:
            self._last_tree = ctl.carry(self._last_tree)
        return ctl

    def _way_control(self, info: ModelInfo, transport: Transport) -> WayControl | None:
        """The speculate-or-stream controller (None: rounds only); the next session starts from its costs (one
        link, one cloud)."""
        way = way_control(self.settings, info, transport, self._last_way)
        if way is not None:
            if way.fit is None:  # the cloud's forward cost from its model info, until an open answer says it
                way.know_costs(getattr(info, "forward_cost", None))
            self._last_way = way
        return way

    def _speculative(self, job: GenerationJob, drafter: Drafter | None = None,
                     origin_map: dict[str, Origin] | None = None) -> Generator[CommittedToken, None, None]:
        s = self.settings
        drafter = drafter or self.drafter
        info = self.model_info()
        fed = None  # cloud_only over gRPC (NoDrafter) drafts nothing to feed
        if self.states_drafting is not None and not isinstance(drafter, NoDrafter):
            fed = self.states_drafting.fed(info, drafter)
        if fed is not None:
            drafter = fed.drafter
            job.params = replace(job.params, feature_encoding=fed.encoding,
                                 feature_window=min(fed.window, info.max_feature_window))
        rows = _draft_part(drafter, "logit_rows")
        support = check_pairing(info, self.tokenizer, self.settings.tokenizer_dir(), _draft_fingerprint(drafter),
                                int(rows) if rows is not None else None)
        fit_drafter(drafter, support)  # q over the tokenizer's ids, as p
        # every open answer of the session must name the tokenizer paired here (CloudSession._open)
        job.params = replace(job.params, tokenizer_fingerprint=info.tokenizer_fingerprint)
        gate = None
        if s.gating:
            gate = GateThresholds(t_nll=s.t_nll, t_entropy_bits=s.t_entropy_bits, t_margin=s.t_margin,
                                  t_mc_var=s.t_mc_var, r_hard=s.r_hard)
        transport = self._routed(job)
        run = SpeculativeRun(transport, drafter, job.params, k_controller(s, job.k_policy), job.metrics, self._policy(),
                             gate=gate, rule_triggers=s.rule_triggers, detokenize=self.decode if gate else None,
                             clock=self.clock, sleep=self.sleep, draft_ahead=s.draft_ahead,
                             tree=self._tree_control(info), way=self._way_control(info, transport),
                             stop_at_eos=s.stop_at_eos, node_budget=s.node_budget)
        job.rounds = run.records
        limits = [m for m in (info.max_context, drafter.max_context) if m]
        max_context = min(limits) if limits else None
        if drafter.max_context and len(job.prompt_ids) >= drafter.max_context:
            raise InvalidArgument(f"the prompt has {len(job.prompt_ids)} tokens; the draft model holds "
                                  f"{drafter.max_context} positions")
        traffic0 = (self.transport.traffic.bytes_up, self.transport.traffic.bytes_down)
        try:
            run.open(job.prompt_ids, job.max_new_tokens)  # inside: a session opened and then refused is closed
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

    def _edge_only(self, job: GenerationJob) -> Generator[CommittedToken, None, None]:
        yield from edge_only(self.drafter, job, max(self.settings.k_max, 1), self.clock)

    def _cloud_only(self, job: GenerationJob) -> Generator[CommittedToken, None, None]:
        transport = self._routed(job)
        if transport.supports_generate:
            # no session opens (and checks the pairing): the cloud's ids are decoded with this tokenizer
            check_pairing(self.model_info(), self.tokenizer, self.settings.tokenizer_dir(), None, None)
            yield from target_only(transport, job, Backoff(self._policy(), self.sleep), self.settings.stop_at_eos)
            return
        job.params = replace(job.params, send_q_dists=False)  # over gRPC: k = 0 verify rounds
        yield from self._speculative(job, NoDrafter(), origin_map={"bonus": "target"})
