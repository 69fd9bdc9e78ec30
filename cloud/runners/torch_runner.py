"""The target model: loading and start-up checks, its public facts (GET /v1/model), batched forwards.

The model runner: it only runs what the scheduler (cloud/scheduler.py) decided. Only the model
thread calls `forward`; everything here is synchronous. Every session's KV lives in one paged
`KVPool` (shared/kvpool.py; blocks of `block_size` positions, sized from kv_budget_bytes, with a
prefix cache): a round is a `Row` of that pool, and the rows of several sessions run as one
flattened forward of their real tokens.

The target samples over the tokenizer's ids: when its embedding table has more rows than the
tokenizer has ids (padding, as Qwen2.5's), the extra columns are cut from every forward's logits,
so p, the id checks and every emitted token stay inside the tokenizer.

Every forward also keeps each row's hidden states at its kept positions: the output layer's input
(after the final norm), captured by a hook on the output layer, so `E h` is the target's logits.
A session that asked for feature-fed drafting gets one of them per round (`hidden_of`).

Start-up refuses, with one line, what cannot be served exactly: a model whose layers keep
recurrent or convolution state (no rollback by position), a directory without a tokenizer, and
any architecture whose batched, cropped forward does not reproduce its own plain forward
(`check_rollback`, run once at load on a short random sequence).

Under tensor parallelism (`group`, cloud/runners/tensor_parallel.py) every rank builds the same TargetModel
from its shard of the weights and runs the graph executor's forward eagerly over it; on rank 0 `forward` and
`use_pool` send each op to the other ranks before running it, and the other ranks run what they receive
(`run_step`, `use_pool`). Forwards are built batch-invariant there: each rank's linear layers run in tiles of
ROW_TILE, and the ranks' partial sums are added in rank order (`ordered_sum`). That construction is not measured at
start-up (a probe would run collectives), so a group reports `batch_invariant: false` and names its forwards
"tiled" in `numerics`; tests/e2e/test_tensor_parallel_invariant.py measures the bits.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cloud.runners.graph_inputs import graph_shapes
from cloud.runners.graphs import GPU_ROW_TILE, PagedForward
from cloud.runners.invariance import paged_invariance
from cloud.runners.model_forward import local_shard, support
from shared.dtypes import resolve_dtype
from shared.errors import Unavailable
from shared.hf_model import DTYPES, check_rollback, eos_ids, load_causal_lm
from shared.invariant import ROW_TILE, tile_linears
from shared.invariant_calibration import calibrate, linear_mode
from shared.kvpool import BLOCK_SIZE, KVPool, Row, UnsupportedModel, attention_layout
from shared.protocol import ModelInfo
from shared.tokenizer_id import load_tokenizer, tokenizer_fingerprint

if TYPE_CHECKING:
    from cloud.runners.tensor_parallel import TensorGroup

log = logging.getLogger(__name__)
# tokens of the largest forward a first forward measures batch invariance for when nobody called `calibrate`
# before it (the cloud's default --max-batch-tokens)
CALIBRATION_ROWS = 1024


class TargetModel:
    """A Hugging Face causal LM in eval mode, its facts, and the KV pool of every session."""

    # what /v1/model names this runner (cloud/runners/llamacpp.py is the other)
    runner = "pytorch"

    def __init__(self, model_dir: Path, device: str = "cpu", dtype: str = "float32", *,
                 kv_budget_bytes: int | None = None, block_size: int = BLOCK_SIZE, prefix_cache: bool = True,
                 group: TensorGroup | None = None, invariant: bool = True, executor: str = "auto",
                 attention: str = "sdpa", fused_kernels: bool = False) -> None:
        # the tensor-parallel group this rank belongs to (None: the whole model in this process)
        self.group = group
        if group is not None:
            from transformers import AutoConfig

            from cloud.runners.tensor_parallel import check_splits

            check_splits(AutoConfig.from_pretrained(model_dir), group.size)
            device = group.device
        self.device = torch.device(device)
        # what ModelInfo.numerics fingerprints as the weights (cloud/numerics.py)
        self.weights_path = Path(model_dir)
        dtype, self.dtype_reason = resolve_dtype(dtype, str(device))
        torch_dtype = DTYPES[dtype]
        tokenizer = load_tokenizer(model_dir)
        # a rank holds the group's lock while its load runs forwards (collectives): rank 0 sends no `idle` op
        # among them
        held: AbstractContextManager[Any] = group.lock if group is not None else nullcontext()
        with held:
            self.model = load_causal_lm(model_dir, device, torch_dtype, tensor_parallel=group is not None)
            if invariant and group is None:
                tile_linears(self.model)
            # the linear layers' row tile: ROW_TILE until the model thread measures its own (`calibrate`);
            # a tensor-parallel group keeps ROW_TILE on every rank (a probe there would run collectives, and
            # ranks that measured different tiles would pad their rows to different shapes)
            self.row_tile = ROW_TILE if invariant else 0
            # whether `calibrate` measures the forwards (invariant ones in one process), and the (largest forward,
            # torch threads) it last measured at
            self._measures = invariant and group is None
            self._measured: tuple[int, int] | None = None
            if invariant and group is not None:
                log.warning("batch_invariant reported false: a tensor-parallel group's forwards are tiled and sum "
                            "their ranks' parts in rank order, but this start-up does not measure them")
            # the graph executor's invariance probe's answer ("" when it found no difference or did not run), and
            # the cases it compared (what a batch_invariant claim on this executor covers)
            self.invariance_failure = ""
            self.invariance_probed = ""
            self.paged = self._executor(executor, invariant, attention, fused_kernels)
            cfg = self.model.config.get_text_config()
            n_ctx = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None) or 2048
            vocab = int(self.model.get_output_embeddings().weight.shape[0])
            # the ids p is taken over: the tokenizer's; rows past len(tokenizer) pad the embedding table
            self.support = min(len(tokenizer), vocab)
            self.info = ModelInfo(
                model_id=model_dir.resolve().name, vocab_size=vocab, eos_ids=eos_ids(self.model),
                max_context=int(n_ctx), dtype=dtype, dtype_reason=self.dtype_reason,
                batch_invariant=self._measures, device=str(self.device),
                tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), tokenizer_size=self.support,
                tensor_parallel=group.size if group is not None else 1, runner=self.runner,
                forward_path=self.forward_path)
            self.pool = KVPool(attention_layout(self.model.config), int(n_ctx), self.device, torch_dtype,
                               budget_bytes=kv_budget_bytes, block_size=block_size, prefix_cache=prefix_cache,
                               invariant=invariant, spare=self.paged is not None)
            try:
                self.pool.prepare(self.model)
            except ValueError as e:
                raise UnsupportedModel(str(e)) from None
            check_rollback(self.model, self.pool, vocab, torch_dtype)
        # K and V of every layer: bytes one position of one session's cache takes
        self.kv_bytes_per_token = self.pool.bytes_per_position
        # width of the output layer's input: the feature a session may ask for (0: no output layer found)
        head = self.model.get_output_embeddings()
        self.feature_size = int(head.weight.shape[1]) if isinstance(head, torch.nn.Linear) else 0
        self._captured: list[torch.Tensor] = []
        self._hidden: dict[int, torch.Tensor] = {}
        if self.feature_size:
            head.register_forward_pre_hook(lambda _m, args: self._captured.append(args[0]))
        # bytes of this process's weights (its shard under tensor parallelism)
        self.weight_bytes = sum(local_shard(p)[0].numel() * p.element_size() for p in self.model.parameters()) + \
            getattr(self.model, "packed_copy_bytes", 0)
        log.info("target loaded: %s; dtype %s (%s), batch-invariant forwards %s", self.info, dtype,
                 self.dtype_reason, "on" if invariant else "off")
        if group is not None:
            log.info("tensor-parallel rank memory", extra={"fields": {
                "event": "rank_memory", "rank": group.rank, "weight_bytes": self.weight_bytes,
                "kv_bytes_per_token": self.kv_bytes_per_token}})

    def use_pool(self, kv_budget_bytes: int | None, block_size: int = BLOCK_SIZE, prefix_cache: bool = True,
                 preallocate: bool | str = False) -> None:
        """A fresh, empty pool with these limits (each service starts with its own); rank 0 of a
        tensor-parallel group has every rank do the same."""
        if self.group is not None and self.group.rank == 0:
            from cloud.runners.tensor_parallel import Op

            with self.group.lock:
                self.group.send(Op("use_pool", pool=(kv_budget_bytes, block_size, prefix_cache, preallocate)))
        pool = KVPool(self.pool.layout, self.pool.max_positions, self.device, self.pool.dtype,
                      budget_bytes=kv_budget_bytes, block_size=block_size, prefix_cache=prefix_cache,
                      invariant=self.pool.invariant, preallocate=preallocate, spare=self.paged is not None)
        try:
            pool.prepare_like(self.pool)
        except ValueError as e:
            raise UnsupportedModel(str(e)) from None
        self.pool = pool

    @torch.inference_mode()
    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        """One forward over every row; each row's logits for its last `num_logits` ids ([num_logits, support], float32):
        the columns of the tokenizer's ids only. Each row's sequence then holds its ids' KV; the caller crops
        back what it does not keep."""
        self._captured.clear()
        if self._measures and self._measured is None:
            self.calibrate(CALIBRATION_ROWS)
        if self.paged is not None:
            run = self.paged.forward if self.group is None else self._forward_everywhere
            logits, hidden = self.pool.forward_with(run, rows)  # [P, vocab], [P, d]
            out = list(logits.float().split([r.num_logits for r in rows]))  # each [num_logits, vocab]
            self._captured = [hidden]
        else:
            out = self.pool.forward(self.model, rows)
        if self.support < self.info.vocab_size:
            out = [x[:, : self.support] for x in out]  # [num_logits, support]
        self._hidden = {}
        if len(self._captured) == 1:
            h, i = self._captured[0].reshape(-1, self.feature_size), 0  # [P, d]: the kept positions
            for r in rows:
                self._hidden[id(r)] = h[i: i + r.num_logits]  # [num_logits, d]
                i += r.num_logits
        self._captured.clear()
        if self.device.type == "cuda":  # the forward's time is the GPU's (the caller reads the logits next anyway)
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def calibrate(self, max_rows: int) -> bool:
        """Measure, on this thread at its torch thread count (the model thread's: call it there), whether
        forwards of up to `max_rows` tokens give every row the same bits whatever shares them, and the linear
        layers' row tile (shared/invariant_calibration.py); `info.batch_invariant` is the answer, returned.
        Measured again only for larger forwards or another thread count."""
        threads = torch.get_num_threads()
        done = self._measured
        if not self._measures or (done is not None and done[0] >= max_rows and done[1] == threads):
            return self.info.batch_invariant
        if self.paged is not None:
            return self._calibrate_paged(max_rows, threads)
        c = calibrate(self.model, max_rows, self.pool)
        self._measured, self.row_tile, self.info.batch_invariant = (max_rows, threads), c.tile, c.invariant
        self._captured.clear()
        if c.invariant:
            log.info("batch-invariant forwards measured: every row gets the same bits whatever shares its forward, "
                     "up to %d tokens on %d torch threads (linear rows in tiles of %d%s; calibration took %.1f s)",
                     max_rows, threads, c.tile, ", one call a tile" if c.calls else "", c.seconds)
        else:
            log.warning("batch-invariant forwards not proven: %s (measured up to %d tokens on %d torch threads in "
                        "%.1f s). batch_invariant is false: greedy texts are no longer promised to be the same "
                        "across batch shapes (one session or many, chains, trees, prefill chunks)",
                        c.failure, max_rows, threads, c.seconds)
        return c.invariant

    def _executor(self, executor: str, invariant: bool, attention: str = "sdpa",
                  fused: bool = False) -> PagedForward | None:
        """The forward of our own (cloud/runners/model_forward.py, graphs.py) where `executor` asks for it and the model
        allows: "auto" takes it with CUDA graphs on a CUDA device and eagerly elsewhere, "graphs" / "eager" anywhere (graphs
        on CUDA only), "transformers" never: every architecture it does not run keeps transformers' modules over the
        same pool. A tensor-parallel group runs it eagerly on every rank, or refuses the model. Sets `forward_path`."""
        self.forward_path = "transformers"
        why = support(self.model)
        if self.group is not None:
            return self._group_executor(executor, invariant, why)
        if executor == "transformers":
            return None
        if why is not None:
            if executor != "auto":
                raise UnsupportedModel(f"--executor {executor}: {why}; use --executor transformers")
            log.info("forwards through transformers' modules: the graph executor does not run this model (%s)", why)
            return None
        graphs = executor in ("auto", "graphs") and self.device.type == "cuda"
        self.forward_path = "cuda-graphs" if graphs else "paged-eager"
        tile = (GPU_ROW_TILE if self.device.type == "cuda" else ROW_TILE) if invariant else 0
        kernel = attention == "triton"
        for asked, flag, off in ((kernel, "--attention triton", "--attention sdpa"),
                                 (fused, "--fused-kernels", "--no-fused-kernels")):
            if asked and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise UnsupportedModel(f"{flag} runs on a CUDA device, not {self.device} (on a CPU only under "
                                       f"TRITON_INTERPRET=1, for tests): use {off}")
        paged = PagedForward(self.model, graphs=graphs, tile=tile, kernel=kernel, fused=fused)
        # a CPU's invariant forwards attend in shared/invariant.py's chunks (SDPA's sums there change with the query
        # count: a verify row's first token against a decode step differed on an AVX2 EPYC)
        paged.chunked = invariant and not graphs and not kernel and self.device.type == "cpu"
        return paged

    def _group_executor(self, executor: str, invariant: bool, why: str | None) -> PagedForward:
        """A tensor-parallel rank's forward: the executor's, eagerly, over this rank's shards."""
        from cloud.runners import tensor_parallel

        if why is not None or executor == "transformers":
            reason = why or "--executor transformers"
            raise UnsupportedModel(f"tensor parallelism runs the graph executor's forward ({reason}): serve this "
                                   "model from one process (without torchrun)")
        assert self.group is not None
        self.forward_path = "paged-eager"
        paged = PagedForward(self.model, graphs=False, tile=ROW_TILE if invariant else 0, ranks=self.group.size,
                             collectives=tensor_parallel)
        paged.chunked = invariant and self.device.type == "cpu"
        return paged

    def capture_graphs(self, rows: list[int], queries: list[int], keys: list[int], max_bytes: int) -> None:
        """The graph executor's CUDA graphs for these buckets (cloud/runners/graphs.py `capture`), within
        `max_bytes`; on the model thread, at start-up. Nothing without graphs."""
        if self.paged is not None and self.paged.graphs:
            self.paged.capture(self.pool, graph_shapes(rows, queries, keys), max_bytes)

    def _calibrate_paged(self, max_rows: int, threads: int) -> bool:
        """`calibrate` for the graph executor: measured on the model's device (cloud/runners/invariance.py)."""
        assert self.paged is not None
        t0 = time.perf_counter()
        self._measured = (max_rows, threads)  # the probe's own forwards do not measure again
        failure = ""
        if self.device.type == "cpu":  # the linear layers' tile measured as for the transformers path
            (self.paged.tile, self.paged.calls), failures = linear_mode(self.model, max_rows)
            failure = "; ".join(failures)
        if not failure:
            failure, self.invariance_probed = paged_invariance(self, max_rows)
        self.info.batch_invariant, self.invariance_failure = not failure, failure
        self.info.batch_invariant_probe = self.invariance_probed if not failure else ""
        self.row_tile = self.paged.tile
        self._captured.clear()
        if not failure:
            log.info("batch-invariant forwards measured on %s, up to %d tokens on %d torch threads: the probed token "
                     "gets the same bits %s (linear rows in tiles of %d%s; %.1f s)", self.device, max_rows, threads,
                     self.invariance_probed, self.paged.tile, ", one call a tile" if self.paged.calls else "",
                     time.perf_counter() - t0)
        else:
            log.warning("batch-invariant forwards not proven on %s (up to %d tokens on %d torch threads): %s. "
                        "batch_invariant is false: greedy texts are no longer promised to be the same across batch "
                        "shapes", self.device, max_rows, threads, failure)
        return not failure

    def keep_path(self, seq_id: int, start: int, src: list[int], tokens: list[int]) -> int:
        """A token tree's accepted path moves to the positions it holds (`KVPool.keep_path`); every rank of a
        tensor-parallel group moves the same rows of its share of the KV heads. All of the path is kept."""
        if self.group is None:
            self.pool.keep_path(seq_id, start, src, tokens)
            return len(src)
        from cloud.runners.tensor_parallel import Op

        with self.group.lock, self.group.watch:
            moves = self.pool.keep_path(seq_id, start, src, tokens)
            if moves:
                self.group.send(Op("move", moves=moves))
        return len(src)

    def hidden_of(self, row: Row) -> torch.Tensor | None:
        """The output layer's input at `row`'s kept positions in the last forward ([num_logits, d]), or None."""
        return self._hidden.get(id(row))

    def _forward_everywhere(self, pool: KVPool, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0 of a tensor-parallel group, inside `KVPool.forward_with`: the forward's host inputs go to every
        rank with the pool's growth and copy-on-write pairs, then every rank runs them."""
        from cloud.runners.tensor_parallel import Op

        assert self.group is not None and self.paged is not None
        with self.group.lock, self.group.watch:
            lost = self.group.lost()
            if lost is not None:
                raise Unavailable(f"this verifier lost a tensor-parallel rank ({lost}) and is restarting: retry "
                                  "(elsewhere)")
            step = self.paged.eager_inputs(pool, rows)
            try:
                self.group.send(Op("forward", step=step, capacity=pool.manager.capacity, copies=pool.copies))
                return self.paged.eager_forward(pool, step)
            except BaseException as e:
                # the ranks' collectives may be out of step now: this group cannot serve any more
                self.group.fail(f"a forward failed on rank 0 ({type(e).__name__}: {e})")
                raise Unavailable("this verifier lost a tensor-parallel rank and is restarting: retry "
                                  "(elsewhere)") from e

    @torch.inference_mode()
    def run_step(self, op: Any) -> None:
        """Ranks > 0 of a tensor-parallel group: run rank 0's forward on this rank's shard (output discarded)."""
        assert self.paged is not None
        self.pool.grow_and_copy(op.capacity, op.copies)
        self.paged.eager_forward(self.pool, op.step)
        self._captured.clear()

    def healthy(self) -> bool:
        """False once a tensor-parallel rank is lost (always True in one process)."""
        return self.group is None or self.group.lost() is None
