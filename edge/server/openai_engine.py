"""Runs the OpenAI server's generations: each in a thread of its own, each its own cloud session.

A request becomes a `TextRequest` (prompt ids, budget, sampling, seed, stop sequences). `start()`
runs it on a worker thread with a per-request EdgeClient: its own transport (so its traffic and
cloud calls are its own), its own drafter state over the shared draft weights (shared_draft.py),
the shared tokenizer and the cloud's model info fetched once. The thread hands `TextDelta`s and one
final `Finished` (or the error) to the event loop. `GenerationStream.cancel()` (the client went
away, or a stop sequence matched) ends the generation at the next committed token; closing the
generation closes its cloud session.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

from shared.config import SamplingConfig
from shared.errors import SpecSplitError

from ..client import EdgeClient
from ..exchange import TokenizerChanged
from ..metrics import EdgeMetrics
from ..pairing import check_pairing
from ..prom import EdgePrometheus
from ..settings import EdgeSettings
from ..transport import ModelInfo, transport_for
from .openai_errors import ServerBusy
from .shared_draft import LockedDrafter, LockedTokenizer, SharedDraftModel
from .stop_text import StopText

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length"]


class GenerationCancelled(SpecSplitError):
    """The client went away; the generation ended early and its cloud session is closed."""

    code, http_status = "cancelled", 499


@dataclass(frozen=True)
class TextRequest:
    # the prompt's token ids
    prompt_ids: list[int]
    # most tokens to generate
    max_tokens: int
    sampling: SamplingConfig
    # None: a fresh random seed
    seed: int | None
    # the text ends before the first of these; not returned
    stop: tuple[str, ...] = ()
    # "completions" | "chat" (a metrics label)
    endpoint: str = "completions"
    # the caller's X-Request-Id, logged and answered with ("" = none); the cloud calls carry it with a nonce
    # of this run (cloud_request_id)
    request_id: str = ""
    # time.monotonic() at the request's arrival (time to first token counts from here)
    arrived: float = field(default_factory=time.monotonic)


@dataclass
class TextDelta:
    # newly final text
    text: str


@dataclass
class Finished:
    # "stop" (end of text or a stop sequence) or "length" (max_tokens or the context is full)
    finish_reason: FinishReason
    # the generated text (stop sequence excluded)
    text: str
    prompt_tokens: int
    # tokens generated up to the end (the one completing a stop sequence included)
    completion_tokens: int
    metrics: EdgeMetrics
    # seconds this generation waited for the shared draft model
    draft_wait_s: float = 0.0

    def specsplit(self) -> dict[str, object]:
        """The `specsplit` extension object of a response."""
        m = self.metrics
        return {"rounds": m.rounds, "acceptance_rate": round(m.acceptance_rate, 6),
                "tokens_per_cloud_call": round(m.tokens_per_call, 6), "cloud_calls": m.cloud_calls,
                "tokens_per_verify_call": round(m.tokens_per_verify, 6), "target_forwards": m.target_forwards,
                "target_rows_per_token": round(m.rows_per_token, 6),
                "drafted": m.drafted, "accepted": m.accepted,
                "tokens_by_origin": {k: v for k, v in m.by_origin.items() if v},
                "local_commits": m.local_commits, "timeout_fallbacks": m.timeout_fallbacks,
                "tokens_by_way": {"speculated": m.emitted - m.streamed, "streamed": m.streamed},
                "switches": m.switches, "start_way": m.start_way, "start_reason": m.start_reason}


Event = TextDelta | Finished | SpecSplitError
# hex digits of the nonce that makes a run's cloud request id its own
NONCE_DIGITS = 8


def cloud_request_id(caller: str) -> str:
    """The X-Request-Id of one run's cloud calls: the caller's id (cut to fit 128 characters) and a nonce of
    this run. The cloud joins an open to an earlier one of the same id and body (PROTOCOL.md "Request ids"),
    so two runs of one seeded request under one caller's id would otherwise share a session and step on each
    other; the caller's id still leads, so the cloud's log lines are found by it."""
    nonce = secrets.token_hex(NONCE_DIGITS // 2)
    return f"{caller[:128 - NONCE_DIGITS - 1]}.{nonce}"


@dataclass
class GenerationStream:
    """The events of one running generation, consumed on the event loop."""

    queue: asyncio.Queue[Event]
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    async def events(self) -> AsyncIterator[Event]:
        while True:
            event = await self.queue.get()
            yield event
            if not isinstance(event, TextDelta):
                return


class OpenAIEngine:
    """Shared parts (settings, draft weights, tokenizer, cloud model info, metrics) and the runner."""

    def __init__(self, settings: EdgeSettings, draft: SharedDraftModel, tokenizer: LockedTokenizer,
                 prometheus: EdgePrometheus | None = None, choose_draft: bool = False) -> None:
        self.settings = settings
        # no --draft: the draft follows the cloud's tokenizer, chosen at the cloud's first answer (`_adopt`) and
        # again at the first answer after a session found the cloud speaking another (`forget_cloud`)
        self.follow_cloud = self.choose_draft = choose_draft
        # --chat-template FILE, and the template of a tokenizer adopted later (None until then: the server's own)
        self.chat_template_file: str | None = None
        self.adopted_template: Any = None
        self.draft = draft
        self.tokenizer = tokenizer
        self.prometheus = prometheus or EdgePrometheus.create()
        self._info: ModelInfo | None = None
        # the tree controller of the last generation to start: the next starts from what it learned
        # (TreeControl.carry), as one client's sessions do
        self._last_tree: Any = None
        self._info_lock = threading.Lock()
        # the fetch of the model info in flight: concurrent requests share its outcome instead of queueing
        self._info_fetch: Future[ModelInfo] | None = None
        # one per generation running (--max-generations): each holds a draft state of its own
        self._slots = threading.BoundedSemaphore(settings.max_generations)

    def new_client(self) -> EdgeClient:
        s = self.settings
        client = EdgeClient(s, transport=transport_for(s),
                            drafter=self.draft.for_generation(), tokenizer=self.tokenizer, model_info=self._info)
        client._last_tree = self._last_tree
        return client

    def model_info(self) -> ModelInfo:
        """The cloud's model, asked for once (with the client's retries). Requests arriving while it is
        being asked for wait for that one fetch and share its answer or its error: with the cloud down,
        each fails after one round of retries, not after everyone's before it."""
        with self._info_lock:
            if self._info is not None:
                return self._info
            fetch, mine = self._info_fetch, self._info_fetch is None
            if fetch is None:
                fetch = self._info_fetch = Future()
        if mine:
            try:
                info = self._fetch_model_info()
                self._adopt(info)
                self._info = info
                fetch.set_result(info)
            except BaseException as e:
                fetch.set_exception(e)
            finally:
                with self._info_lock:
                    self._info_fetch = None
        return fetch.result()

    def forget_cloud(self, err: TokenizerChanged) -> None:
        """A session found the cloud speaking another tokenizer (restarted or failed over with another model):
        the next request asks its model again and, without --draft, picks the draft that speaks it; with
        --draft, the pairing check then refuses the pair with the fix."""
        with self._info_lock:
            self._info = None
            self.choose_draft = self.follow_cloud
        log.warning("the cloud's tokenizer changed (%s, was %s): asking its model again at the next request%s",
                    err.now, err.paired, ", and the draft with it" if self.follow_cloud else "")

    def _adopt(self, info: ModelInfo) -> None:
        """At the cloud's first answer (and the first after `forget_cloud`), with no --draft: the draft under
        models/ that speaks its tokenizer (edge/model_choice.py; cloud_only, without --tokenizer: the tokenizer
        alone), with that tokenizer and its chat template, before any request uses them. None speaks it: the
        draft stays, and the pairing check refuses it with the fix (cloud_only: the choice refuses)."""
        if not self.choose_draft:
            return
        from shared.tokenizer_id import load_tokenizer

        from ..client import check_tokenizer_dir
        from ..model_choice import for_cloud
        from .chat import load_chat_template

        settings = for_cloud(self.settings, info)
        self.choose_draft = False
        if settings == self.settings:
            return
        tokenizer = load_tokenizer(check_tokenizer_dir(settings))
        if settings.draft != self.settings.draft:
            self.draft = SharedDraftModel(settings)
        self.settings, self.tokenizer = settings, LockedTokenizer(tokenizer)
        self.adopted_template = load_chat_template(self.chat_template_file, tokenizer) or False

    def chat_template(self, started_with: Any) -> Any:
        """The chat template requests use: the server's own, or the adopted tokenizer's (None: it has none)."""
        if self.adopted_template is None:
            return started_with
        return self.adopted_template or None

    def check_ready(self) -> None:
        """The cloud answers with this server's key (GET /v1/model needs it when auth is on), and the
        tokenizer and the draft model speak the target's ids; the project's error naming the fix otherwise."""
        info = self.model_info()
        m = self.draft.model if self.settings.mode != "cloud_only" else None  # cloud_only drafts nothing
        check_pairing(info, self.tokenizer, self.settings.tokenizer_dir(), m.tokenizer_fingerprint if m else None,
                      m.logit_rows if m else None)

    def _fetch_model_info(self) -> ModelInfo:
        client = EdgeClient(self.settings, tokenizer=self.tokenizer)
        try:
            return client.model_info()
        finally:
            client.close()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        if not ids:  # an empty prompt starts from the end-of-text token, as the edge client does
            ids = [int(self.tokenizer.eos_token_id or 0)]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def start(self, req: TextRequest) -> GenerationStream:
        """The generation on a thread of its own; ServerBusy (429) when --max-generations run already."""
        if not self._slots.acquire(blocking=False):
            raise ServerBusy(f"this server runs {self.settings.max_generations} generations at once "
                             "(--max-generations) and all are busy: retry after a second")
        loop = asyncio.get_running_loop()
        stream = GenerationStream(asyncio.Queue())

        def emit(event: Event) -> None:
            loop.call_soon_threadsafe(stream.queue.put_nowait, event)

        try:
            threading.Thread(target=self._run, args=(req, stream.cancelled, emit), daemon=True,
                             name="specsplit-generation").start()
        except BaseException:
            self._slots.release()
            raise
        return stream

    def _run(self, req: TextRequest, cancelled: threading.Event, emit: Callable[[Event], None]) -> None:
        self.prometheus.active.inc()
        finish = "error"
        summary: dict[str, object] = {}
        try:
            done = self._generate(req, cancelled, emit, summary)
            finish = "cancelled" if done is None else done.finish_reason
            if done is None:  # ends the event stream of a response that may still be waiting
                emit(GenerationCancelled("the generation was cancelled: its client went away"))
        except SpecSplitError as e:
            if isinstance(e, TokenizerChanged):
                self.forget_cloud(e)
            summary["error"] = f"{e.code}: {e.message}"
            emit(e)
        except Exception as e:  # a bug must still end the response, not hang it
            log.exception("generation failed", extra={"fields": {"x_request_id": req.request_id}})
            summary["error"] = f"internal: {type(e).__name__}"
            emit(SpecSplitError(f"internal error: {type(e).__name__}: {e}"))
        finally:
            self._slots.release()
            self.prometheus.active.dec()
            self.prometheus.generations.labels(req.endpoint, finish).inc()
            log.info("generation ended", extra={"fields": {
                "event": "generation", "x_request_id": req.request_id, "endpoint": req.endpoint, "finish": finish,
                "prompt_tokens": len(req.prompt_ids), "duration_s": round(time.monotonic() - req.arrived, 4),
                **summary}})

    def _generate(self, req: TextRequest, cancelled: threading.Event, emit: Callable[[Event], None],
                  summary: dict[str, object]) -> Finished | None:
        seed = secrets.randbelow(2**31) if req.seed is None else req.seed
        if self._info is None:
            self.model_info()
        client = self.new_client()
        eos = set(self._info.eos_ids if self._info and self._info.eos_ids else [self.tokenizer.eos_token_id])
        text = StopText(req.stop, self.decode)
        # a request's own seed promises the same text again. With the checked last draft (check_last, on
        # by default) every position is decided alike whatever the k schedule, as long as the draft's q
        # depends on the text alone; without check_last they take a k that ignores timing
        seeded = req.seed is not None and not req.sampling.greedy
        policy = "dynamic" if seeded and not self.settings.check_last else None
        cloud_id = cloud_request_id(req.request_id) if req.request_id else None
        if cloud_id:
            summary["cloud_request_id"] = cloud_id
        gen = client.stream(req.prompt_ids, max_new_tokens=req.max_tokens, seed=seed, sampling=req.sampling,
                            k_policy=policy, request_id=cloud_id)
        clock = self.prometheus.token_clock(req.arrived)
        n, last = 0, None
        try:
            for tok in gen:
                clock.tick()
                n, last = n + 1, tok.token_id
                delta = text.add(tok.token_id)
                if delta:
                    emit(TextDelta(delta))
                if text.stopped or cancelled.is_set():
                    break
        finally:
            gen.close()  # ends the generation: its cloud session is closed
            client.close()
            self._last_tree = client._last_tree or self._last_tree
            result = gen.result()
            drafter = client.drafter
            wait_s = drafter.wait_s if isinstance(drafter, LockedDrafter) else 0.0
            if isinstance(drafter, LockedDrafter):
                drafter.release()  # its draft state serves the next generation
            self.prometheus.record(result.metrics, wait_s, result.rounds)
            m = result.metrics
            summary.update(completion_tokens=n, rounds=m.rounds, drafted=m.drafted, accepted=m.accepted,
                           acceptance_rate=round(m.acceptance_rate, 4), cloud_calls=m.cloud_calls,
                           local_commits=m.local_commits,
                           ttft_s=None if clock.ttft_s is None else round(clock.ttft_s, 4),
                           route_key=result.route_key)
        if cancelled.is_set() and not text.stopped:
            return None
        rest = text.flush()
        if rest:
            emit(TextDelta(rest))
        stopped = text.stopped or (last in eos and self.settings.stop_at_eos)
        done = Finished("stop" if stopped else "length", text.final_text, len(req.prompt_ids), n, result.metrics,
                        wait_s)
        clock.finished()
        emit(done)
        return done
