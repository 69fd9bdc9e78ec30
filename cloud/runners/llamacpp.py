"""The target on llama.cpp: a GGUF file run by the same serving core (cloud/runners/torch_runner.py is the PyTorch runner).

The core (scheduler, sessions, the verify rule, trees, prefill chunks, streams, /v1/generate, eviction) drives a
runner through the `Runner` interface (cloud/runners/__init__.py): `forward(rows)` with each row's logits,
`keep_path` for a tree's accepted path, and a pool whose sequences and block accounting (shared/blocks.py
`PagedSequences`) admission and eviction read. Here the pool (`LlamaPool`) stands beside the PyTorch one: the same
accounting, and the KV itself in one llama.cpp context:

- a session's seq_id is a llama.cpp sequence id; crop is `seq_rm` past a length, release drops the sequence;
- a forward is one llama.cpp batch of every row's tokens, each at its position and in its row's sequence;
- a tree row: each leaf of the tree gets a sequence of its own that shares the session's cells (`seq_cp` adds an
  id to cells, it copies nothing); a node joins the sequences of every leaf below it and attends through its
  first one, which holds the context and the node's own path. The accepted path joins the session's sequence up
  to its first node that is not the next in row order (`keep_path`: past it, dropped nodes' cells lie between the
  path's own, so the rest of the path is cropped and the session's next forward computes it again, in its row);
  the leaves go;
- the KV budget (kv_budget_bytes) sizes the context: its cells are allocated at start, as --kv-preallocate does.

p comes from llama.cpp's float32 logits through shared/sampling.py, so the verify rule, draw and match and every
exactness test hold as on the PyTorch runner. What llama.cpp does not give: bit-identical logits whatever shares a
batch (BENCHMARKS.md measures how far they move), the target's hidden states (no feature-fed heads), prefix
sharing across sessions, tensor parallelism. With --batch-invariant (the default) the weights are not repacked
and every micro-batch is at most as long as the kernels keep a token's one-token bits (shared/llama_invariance.py,
measured at start); `batch_invariant` in /v1/model is true only if the whole claim was measured to hold.
Attention sums a sequence's keys in cell order, and the cache gives a batch's tokens the lowest free cells: a
session's own crops and kept tree paths leave its cells in position order, but cells another session freed below
a session's own are taken by its next tokens, which moves their logits, so with sessions side by side the claim
does not hold and the probe says so.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from shared.attention_layout import UnsupportedModel
from shared.blocks import BlockManager, OutOfBlocks, PagedSequences
from shared.errors import ResourceExhausted
from shared.llama_runtime import GGUFContext, GGUFModel, Token, find_gguf, unavailable, vocabulary_mismatch
from shared.protocol import ModelInfo
from shared.rows import Row

log = logging.getLogger(__name__)

# llama.cpp's sequence ids (LLAMA_MAX_SEQ): sessions take the first SESSION_SEQS, tree leaves the rest
MAX_SEQS = 256
SESSION_SEQS = 128
# most KV cells of the context, whatever the budget allows: llama.cpp walks every cell on each crop and copy, so a
# small model's budget of millions of cells would make every round pay for them
MAX_CELLS = 1 << 17


def kv_bytes_per_position(model: GGUFModel) -> int:
    """K and V of every layer for one position, float16 (llama.cpp's cache type), from the GGUF's header."""

    def value(key: str, default: int | None = None) -> int:
        text = model.meta(key)
        if text is None:
            if default is None:
                raise UnsupportedModel(f"{model.path} has no {key}: not a GGUF of a transformer this runner knows")
            return default
        try:
            return int(text)
        except ValueError:
            raise UnsupportedModel(f"{model.path}: {key} is {text!r}, not one number: per-layer shapes are not "
                                   "supported by this runner") from None

    arch = model.meta("general.architecture")
    heads = value(f"{arch}.attention.head_count")
    kv_heads = value(f"{arch}.attention.head_count_kv", heads)
    head_dim = value(f"{arch}.embedding_length") // heads
    dk = value(f"{arch}.attention.key_length", head_dim)
    dv = value(f"{arch}.attention.value_length", head_dim)
    return value(f"{arch}.block_count") * kv_heads * (dk + dv) * 2


def leaves_of(parents: tuple[int, ...]) -> list[int]:
    """The nodes without children of a tree given by its parents."""
    has_child = set(parents)
    return [j for j in range(len(parents)) if j not in has_child]


class LlamaPool(PagedSequences):
    """Every session's KV in one llama.cpp context, with the paged pool's accounting (see the module docstring)."""

    def __init__(self, model: GGUFModel, bytes_per_position: int, budget_bytes: int, block_size: int,
                 threads: int, max_batch_tokens: int, n_ubatch: int = 0) -> None:
        self.bytes_per_position, self.block_size = bytes_per_position, block_size
        blocks = min(budget_bytes // (bytes_per_position * block_size), MAX_CELLS // block_size)
        if blocks < 1:
            raise ValueError(f"kv_budget_bytes = {budget_bytes} holds not one KV block of "
                             f"{bytes_per_position * block_size} bytes; raise it")
        self.blocks = BlockManager(block_size, blocks, False, initial_blocks=blocks)
        # a tree's nodes and a round's chunk may sit in cells beside the positions the manager counts
        self.n_ctx = blocks * block_size + max_batch_tokens
        self.ctx = GGUFContext(model, self.n_ctx, MAX_SEQS, threads, n_batch=min(max_batch_tokens, 512),
                               n_ubatch=n_ubatch)
        self._seq: dict[int, int] = {}  # seq_id -> llama.cpp sequence
        self._free = list(range(SESSION_SEQS - 1, -1, -1))
        self._leaf_free = list(range(MAX_SEQS - 1, SESSION_SEQS - 1, -1))
        self._trees: dict[int, dict[int, int]] = {}  # seq_id -> the leaf sequence each node of its tree reads

    @property
    def allocated_bytes(self) -> int:
        return self.n_ctx * self.bytes_per_position

    # --- sequences ----------------------------------------------------------------------------
    def allocate(self, salt: bytes = b"") -> int:
        if not self._free:
            raise ResourceExhausted(f"this llama.cpp verifier holds {SESSION_SEQS} sequences at most, all in use; "
                                    "retry later", limit="max_sessions")
        sid = self.manager.new_seq(salt)
        self._seq[sid] = self._free.pop()
        return sid

    def release(self, seq_id: int) -> None:
        self.manager.free_seq(seq_id)
        self._drop_tree(seq_id)
        seq = self._seq.pop(seq_id, None)
        if seq is not None:
            self.ctx.seq_rm(seq)
            self._free.append(seq)

    def crop(self, seq_id: int, n: int) -> None:
        self.manager.crop(seq_id, n)
        self._cut(seq_id, n)

    def set_length(self, seq_id: int, n: int) -> None:
        if seq_id in self.manager.seqs:
            self.manager.set_length(seq_id, n)
            self._cut(seq_id, n)

    def _cut(self, seq_id: int, n: int) -> None:
        self._drop_tree(seq_id)
        if seq_id in self._seq:
            self.ctx.seq_rm(self._seq[seq_id], n, -1)

    def match_prefix(self, seq_id: int, ids: list[int], limit: int) -> int:
        return 0  # no prefix sharing across sessions on this runner

    def keep_tree_path(self, seq_id: int, start: int, src: list[int], tokens: list[int]) -> int:
        """The accepted path's first nodes join the session's sequence at positions start, start + 1, ...; every
        leaf of the tree goes. Returns how many of the path's positions hold their KV (the caller sets the length
        there: the next forward computes the rest).

        Attention sums a sequence's keys in cell order, so a session's cells must ascend with its positions for
        its logits to be the bits of a plain decode. The tree's tokens took cells in row order: the path's first
        nodes while they are nodes 0, 1, 2, ... keep their cells, with the dropped nodes' cells above them. Past
        the first node that is not, dropped nodes' cells lie between the path's own, so the rest of the path is
        not kept: the session's next row feeds it before its own tokens, into the cells the tree freed (a chain's
        kernel path, so the same K and V bits), at the cost of its rows in a forward that runs anyway."""
        self.manager.rewrite(seq_id, start, tokens)
        if seq_id not in self._trees:  # a tree of one branch, forwarded as the chain it is (cloud/engine.py): its
            return len(src)  # nodes are the session's own cells already, in position order; the commit crops the rest
        leaf_of = self._trees[seq_id]
        kept = next((i for i, j in enumerate(src) if i != j), len(src))
        if kept:
            self.ctx.seq_cp(leaf_of[src[kept - 1]], self._seq[seq_id], start, start + kept)
        self._drop_tree(seq_id)
        return kept

    def _drop_tree(self, seq_id: int) -> None:
        for leaf in set(self._trees.pop(seq_id, {}).values()):
            self.ctx.seq_rm(leaf)
            self._leaf_free.append(leaf)

    def tree_seqs(self, row: Row) -> int:
        """Leaf sequences a row takes (0 for a chain)."""
        return len(leaves_of(row.tree)) if row.tree else 0

    @property
    def tree_seqs_free(self) -> int:
        return len(self._leaf_free)

    # --- the forward ------------------------------------------------------------------------
    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        """Every row in one llama.cpp batch; each row's logits for its last `num_logits` ids ([num_logits, vocab] float32)."""
        if not rows:
            return []
        m = self.manager
        self.check_rows(rows)
        if sum(self.tree_seqs(r) for r in rows) > len(self._leaf_free):
            raise OutOfBlocks(f"this forward's trees need more than the {len(self._leaf_free)} free sequences")
        tokens: list[Token] = []
        num_logits = []
        try:
            for r in rows:
                m.prepare_write(r.seq_id, r.num_cached_tokens, len(r.ids))
                self._cut(r.seq_id, r.num_cached_tokens)
                tokens += self._tokens(r)
                num_logits.append(r.num_logits)
            logits = self.ctx.decode(tokens)  # [sum of num_logits, vocab]
        except BaseException:
            m.undo_writes()
            for r in rows:
                self._cut(r.seq_id, r.num_cached_tokens)
            raise
        for r in rows:
            m.extend(r.seq_id, list(r.ids))
        out, i = [], 0
        for n in num_logits:
            out.append(logits[i: i + n])  # [num_logits, vocab]
            i += n
        return out

    def _tokens(self, r: Row) -> list[Token]:
        seq = self._seq[r.seq_id]
        pos = r.positions()
        n = len(r.ids)
        if not r.tree:
            return [Token(t, pos[i], (seq,), i >= n - r.num_logits) for i, t in enumerate(r.ids)]
        parents = r.tree
        leaves = leaves_of(parents)
        leaf_seq = {leaf: self._leaf_free.pop() for leaf in leaves}
        for s in leaf_seq.values():
            self.ctx.seq_cp(seq, s)  # the context so far
        under: dict[int, list[int]] = {j: [] for j in range(len(parents))}  # node -> the leaf sequences below it
        for leaf, s in leaf_seq.items():
            at = leaf
            while at >= 0:
                under[at].append(s)
                at = parents[at]
        self._trees[r.seq_id] = {j: under[j][0] for j in range(len(parents))}
        first_node = r.tree_base - r.num_cached_tokens  # this row's ids: the rest of S', then every node
        out = []
        for i, t in enumerate(r.ids):
            seqs = (seq, *leaf_seq.values()) if i < first_node else tuple(under[i - first_node])
            out.append(Token(t, pos[i], seqs, i >= n - r.num_logits))
        return out


class LlamaTarget:
    """The runner over a GGUF file: the same calls as cloud/runners/torch_runner.py's TargetModel for the serving core."""

    runner = "llama.cpp"
    group = None
    feature_size = 0

    def __init__(self, model: Path, threads: int = 0, max_batch_tokens: int = 1024, invariant: bool = True) -> None:
        from shared.tokenizer_id import load_tokenizer, tokenizer_fingerprint

        why = unavailable()
        if why is not None:
            raise UnsupportedModel(why)
        path = find_gguf(model)
        if path is None:
            raise UnsupportedModel(f"no GGUF file at {model}: --runner llamacpp needs a .gguf file or a directory "
                                   "with model.gguf")
        self.path = self.weights_path = path
        self.threads = threads or max(1, torch.get_num_threads())
        self.max_batch_tokens = max_batch_tokens
        # --batch-invariant: weights not repacked, micro-batches of the size whose kernels give every token its
        # one-token bits (shared/llama_invariance.py, measured in use_pool)
        self.invariant = invariant
        self.gguf = GGUFModel(path, repack=not invariant)
        self.ubatch, self.invariant_ok = 0, False
        tokenizer = load_tokenizer(path.parent)  # the tokenizer files beside the GGUF (a prepared directory)
        wrong = vocabulary_mismatch(self.gguf, tokenizer)
        if wrong is not None:
            raise UnsupportedModel(f"the tokenizer beside {path} is not the GGUF's own ({wrong}): put the model's "
                                   "own tokenizer files beside it (specsplit-models convert FILE.gguf --out DIR "
                                   "writes both)")
        self.support = min(len(tokenizer), self.gguf.n_vocab)
        eos = [int(tokenizer.eos_token_id)] if tokenizer.eos_token_id is not None else []
        self.kv_bytes_per_token = kv_bytes_per_position(self.gguf)
        self.weight_bytes = path.stat().st_size
        self.dtype_reason = f"the GGUF file's own types ({file_type(self.gguf)}), run by llama.cpp"
        name = path.parent.resolve().name if path.name == "model.gguf" else path.stem
        self.info = ModelInfo(model_id=name, vocab_size=self.gguf.n_vocab, eos_ids=eos,
                              max_context=self.gguf.n_ctx_train, dtype="gguf", dtype_reason=self.dtype_reason,
                              batch_invariant=False, device="cpu",
                              tokenizer_fingerprint=tokenizer_fingerprint(tokenizer), tokenizer_size=self.support,
                              tensor_parallel=1, runner=self.runner)
        self.pool: LlamaPool | None = None
        log.info("target loaded on llama.cpp: %s (%s), %d threads", path, self.dtype_reason, self.threads)

    def use_pool(self, kv_budget_bytes: int | None, block_size: int = 16, prefix_cache: bool = True,
                 preallocate: bool = False) -> None:
        if prefix_cache:
            log.info("prefix sharing is off on the llama.cpp runner: every session computes its own prompt")
        if self.invariant:
            from shared.llama_invariance import measure

            self.ubatch, self.invariant_ok = measure(self.gguf, self.threads)
        self.pool = LlamaPool(self.gguf, self.kv_bytes_per_token, kv_budget_bytes or 2 * 1024**3, block_size,
                              self.threads, self.max_batch_tokens, self.ubatch)

    def forward(self, rows: list[Row]) -> list[torch.Tensor]:
        assert self.pool is not None
        out = self.pool.forward(rows)
        if self.support < self.info.vocab_size:
            out = [x[:, : self.support] for x in out]  # [num_logits, support]
        return out

    def keep_path(self, seq_id: int, start: int, src: list[int], tokens: list[int]) -> int:
        assert self.pool is not None
        return self.pool.keep_tree_path(seq_id, start, src, tokens)

    def hidden_of(self, row: Row) -> torch.Tensor | None:
        return None

    def calibrate(self, max_tokens: int) -> bool:
        """What use_pool measured (shared/llama_invariance.py): true only if a token's logits were the bits of a
        one-token step beside batch mates and in cells another sequence's crop freed below its own."""
        if not self.invariant:
            log.warning("batch-invariant forwards off: llama.cpp's kernels change a token's logits with the batch "
                        "around it, so greedy text may part from the cloud's own at near-ties")
        return self.invariant_ok

    def healthy(self) -> bool:
        return True


def file_type(model: GGUFModel) -> str:
    """The GGUF's general.file_type as llama.cpp names it (e.g. MOSTLY_Q4_K_M)."""
    import gguf

    text = model.meta("general.file_type")
    if text is None or not text.isdigit():
        return "unknown types"
    try:
        return gguf.LlamaFileType(int(text)).name
    except ValueError:
        return f"file type {text}"
