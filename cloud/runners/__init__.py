"""What runs the target's forward, behind one interface (`Runner`): the serving core (cloud/core.py, the
scheduler, the verify rule) calls only these, and never knows which runner it holds.

- torch_runner.py: `TargetModel`, a Hugging Face model in PyTorch over the paged KV pool (shared/kvpool.py); its
  forward runs through graphs.py (a forward of its own for Llama, Qwen2, Qwen3 and Mistral, replayed from CUDA
  graphs per bucket on a GPU, eager on a CPU) or through transformers' own modules (the other architectures).
  invariance.py measures on the device whether the graph executor's forwards are batch-invariant.
- tensor_parallel.py: the PyTorch runner split over torchrun ranks (rank 0 plans and serves).
- llamacpp.py: `LlamaTarget`, a GGUF file through llama.cpp on the CPU.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from shared.blocks import PagedSequences
from shared.protocol import ModelInfo
from shared.rows import Row

if TYPE_CHECKING:
    from cloud.settings import CloudSettings

log = logging.getLogger(__name__)


class Runner(Protocol):
    """The target as the serving core uses it."""
    # "pytorch" | "llama.cpp": what /v1/model names
    runner: str
    # the public facts (GET /v1/model); batch_invariant as measured by `calibrate`
    info: ModelInfo
    @property
    def pool(self) -> PagedSequences:
        """Every session's KV (blocks, prefix cache, crop by length): the PyTorch pool (shared/kvpool.py) or
        llama.cpp's (llamacpp.py), both read through their sequences' interface."""
        ...

    # ids p is taken over (the tokenizer's), bytes of one cached position, width of the feature offered (0: none)
    support: int
    kv_bytes_per_token: int
    feature_size: int
    # where the checkpoint lives (cloud/numerics.py fingerprints it)
    weights_path: Path

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        """One forward over every row; each row's logits for its last `keep` ids ([keep, support], float32)."""
        ...

    def calibrate(self, max_rows: int) -> bool:
        """Measure batch invariance on the model thread for forwards of up to `max_rows` tokens."""
        ...

    def use_pool(self, kv_budget_bytes: int | None, block_size: int = ..., prefix_cache: bool = ...,
                 preallocate: bool | str = ...) -> None: ...

    def keep_path(self, seq_id: int, start: int, src: list[int], tokens: list[int]) -> int:
        """A tree's accepted path (its nodes `src`, its `tokens`) becomes the sequence's positions start, start + 1,
        ...; returns how many of them hold their KV (the rest the session's next forward computes)."""
        ...

    def hidden_of(self, row: Row) -> torch.Tensor | None: ...

    def healthy(self) -> bool: ...


@runtime_checkable
class TreeSeqPool(Protocol):
    """A pool whose token-tree rows take sequence ids of their own from a fixed supply (llamacpp.py's `LlamaPool`:
    a sequence per leaf); the PyTorch pool runs a tree in the session's own KV rows and takes none. The scheduler
    reads both through the core (cloud/core.py `tree_seqs`)."""
    @property
    def tree_seqs_free(self) -> int:
        """Sequence ids free for trees."""
        ...

    def tree_seqs(self, row: Row) -> int:
        """Sequence ids the row's tree takes (0 for a chain)."""
        ...


def load_target(settings: CloudSettings) -> Runner:
    """The target on the runner `settings.runner` picks: llamacpp.py or torch_runner.py; the choice and its reason
    logged once the target loaded (so replicas that resolved `auto` differently show it)."""
    runner, why = settings.runner_and_reason()
    target = _load(settings, runner)
    log.info("runner %s (%s)", runner, why)
    return target


def _load(settings: CloudSettings, runner: str) -> Runner:
    from shared.attention_layout import UnsupportedModel

    if runner == "llamacpp":
        from cloud.runners.llamacpp import LlamaTarget

        if settings.device != "cpu":
            raise UnsupportedModel(f"--runner llamacpp runs on the CPU here, not {settings.device}: use --runner "
                                   "torch on a GPU")
        return LlamaTarget(settings.model, settings.torch_threads, settings.max_batch_tokens,  # type: ignore[return-value]
                           invariant=settings.batch_invariant)
    if settings.model.suffix == ".gguf":
        raise UnsupportedModel(f"{settings.model} is a GGUF file: the PyTorch runner reads a Hugging Face directory "
                               "(specsplit-models convert FILE.gguf --out DIR makes one), or run it with --runner "
                               "llamacpp (needs llama-cpp-python: bash scripts/setup.sh)")
    from cloud.runners.torch_runner import TargetModel

    return TargetModel(settings.model, settings.device, settings.dtype, invariant=settings.batch_invariant,
                       executor=settings.executor, attention=settings.attention,
                       fused_kernels=settings.fused_kernels)
