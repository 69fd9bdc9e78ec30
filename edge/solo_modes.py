"""The two modes in which one side writes alone: edge_only (the drafter, every token local and unverified) and
cloud_only (the target: REST /v1/generate here; over gRPC the client runs k = 0 verify rounds with `NoDrafter`)."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

from shared.config import SamplingConfig
from shared.errors import InvalidArgument, SpecSplitError
from shared.verify import DraftKind

from .drafters.base import DraftBlock, Drafter
from .generation import GenerationJob
from .metrics import CommittedToken
from .policy.from_settings import Backoff
from .transport.base import Transport


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


def edge_only(drafter: Drafter, job: GenerationJob, chunk: int,
              clock: Callable[[], float]) -> Generator[CommittedToken, None, None]:
    """The drafter writes alone, `chunk` tokens per call (a hybrid writes with its model)."""
    from .drafters import HybridDrafter

    if isinstance(drafter, HybridDrafter):
        drafter = drafter.model
    if drafter.kind != "sampled":
        raise InvalidArgument("edge_only needs a draft model (the n-gram drafter cannot write alone)")
    drafter.reset()
    S = list(job.prompt_ids)
    while len(S) - len(job.prompt_ids) < job.max_new_tokens:
        if drafter.max_context is not None and len(S) >= drafter.max_context:
            break
        t0 = clock()
        left = job.max_new_tokens - (len(S) - len(job.prompt_ids))
        block = drafter.propose(S, min(chunk, left), job.params.sampling, job.params.seed)
        job.metrics.edge_time_ms += (clock() - t0) * 1000
        job.metrics.rounds += 1
        job.metrics.local_commits += block.k
        for tok in block.tokens:
            S.append(tok)
            yield CommittedToken(tok, "local", job.metrics.rounds - 1)


def target_only(transport: Transport, job: GenerationJob, backoff: Backoff,
                stop_at_eos: bool = True) -> Generator[CommittedToken, None, None]:
    """The cloud's /v1/generate stream; after a retryable failure it resumes from the tokens received. Without
    `stop_at_eos` the cloud goes on past an end-of-sequence token, as the speculative modes do."""
    up, down = transport.traffic.bytes_up, transport.traffic.bytes_down
    got: list[int] = []
    job.metrics.rounds += 1
    try:
        while True:
            job.metrics.cloud_calls += 1
            try:
                # the cloud's draws are keyed by (seed, position): resuming from prompt + the
                # tokens received so far continues the very same text
                for item in transport.generate_stream(job.prompt_ids + got, job.params.sampling, job.params.seed,
                                                      job.max_new_tokens - len(got), backoff.policy.open_timeout_s,
                                                      stop_at_eos):
                    if isinstance(item, int):
                        got.append(item)
                        yield CommittedToken(item, "target", 0)
                    else:  # the cloud says why it stopped
                        job.stop_reason = str(item.metrics.get("stop_reason", ""))
                return
            except SpecSplitError as e:
                if not backoff.wait(e):
                    raise
                job.metrics.retries += 1
    finally:
        job.metrics.bytes_up += transport.traffic.bytes_up - up
        job.metrics.bytes_down += transport.traffic.bytes_down - down
