"""llama.cpp through llama-cpp-python's low-level API: a GGUF model, contexts over it, batches with sequence ids.

What the drafter (edge/drafters/llamacpp.py) and the cloud's runner need and nothing more: load a GGUF file
once (`GGUFModel`), open contexts over it (`GGUFContext`: one unified KV cache whose cells carry sequence
ids), decode a batch whose tokens each carry a position, the sequences they belong to and whether their logits
are wanted, read those logits as float32 tensors, crop a sequence (`seq_rm`) and let one sequence share
another's cells (`seq_cp`: no copy in a unified cache, the cells gain a sequence id). A token tree is grown or
verified by giving each branch its own sequence id over the shared prefix, as llama.cpp's own
`examples/speculative` does.

llama-cpp-python is an optional dependency (a source distribution: setup builds it once for the host);
`unavailable()` says why it cannot be used, for the one line the caller logs before falling back.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

_init_lock = threading.Lock()
_initialised = False
# the llama-cpp-python version setup builds (scripts/setup.sh pins the same)
PINNED_VERSION = "0.3.36"


def unavailable() -> str | None:
    """None when llama.cpp can be used here, else why not (one line with the fix)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return (f"llama-cpp-python is not installed ({e}): `bash scripts/setup.sh` builds it once "
                f"(pip install llama-cpp-python=={PINNED_VERSION}, needs cmake and a C++ compiler)")
    except OSError as e:  # the package is there but its shared library does not load (built for another CPU)
        return f"llama.cpp's library does not load ({e}): rebuild it with `bash scripts/setup.sh`"
    return None


def _lib() -> Any:
    global _initialised
    import llama_cpp

    with _init_lock:
        if not _initialised:
            logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its log hook prints below ERROR
            note = version_note()
            if note is not None:
                log.warning(note)
            llama_cpp.llama_backend_init()
            _initialised = True
    return llama_cpp


def version_note() -> str | None:
    """One line when the installed llama-cpp-python is not the pinned one (None when it is): this code calls its
    low-level API, whose functions and structures change between releases, and every llama.cpp figure was
    measured on the pinned one."""
    found = llama_version()
    if found == PINNED_VERSION:
        return None
    return (f"llama-cpp-python {found} is installed, not the pinned {PINNED_VERSION}: its low-level API may differ "
            f"and the measured figures are the pinned one's; pip install llama-cpp-python=={PINNED_VERSION} "
            "(bash scripts/setup.sh builds it)")


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or a directory's `model.gguf`, else its only `*.gguf`."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir():
        if (p / "model.gguf").is_file():
            return p / "model.gguf"
        found = sorted(p.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
    return None


class GGUFModel:
    """A GGUF file's weights, loaded once (memory-mapped) and shared by every context over them."""

    def __init__(self, path: str | Path, repack: bool = True) -> None:
        from shared.attention_layout import UnsupportedModel

        lib = _lib()
        self.path = Path(path)
        if not self.path.is_file():
            raise UnsupportedModel(f"no GGUF file at {self.path}")
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0  # the CPU build; a GPU cloud runs the PyTorch runner
        # repacked weights (ggml's CPU "extra" buffers): faster batches, but a batch's rows split into blocks of
        # 4-8 for one kernel and the rest for another, so a row's logits depend on its batch
        params.use_extra_bufts = repack
        self.ptr = lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise UnsupportedModel(f"llama.cpp could not load {self.path}: not a GGUF file of an architecture "
                                   "this llama.cpp build knows")
        self._lib = lib
        vocab = self._vocab = lib.llama_model_get_vocab(self.ptr)
        # ids the model has logits for (its output rows)
        self.n_vocab = int(lib.llama_vocab_n_tokens(vocab))
        # context the model was trained for
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(self.ptr))
        self.n_embd = int(lib.llama_model_n_embd(self.ptr))
        self.n_layer = int(lib.llama_model_n_layer(self.ptr))
        if lib.llama_model_is_recurrent(self.ptr) or lib.llama_model_is_hybrid(self.ptr):
            raise UnsupportedModel(f"{self.path} is a recurrent or hybrid model: its state cannot be cropped "
                                   "to a position, which every rejected draft needs")

    def meta(self, key: str) -> str | None:
        """The GGUF header's value for `key` as llama.cpp writes it out (a number in decimal), None when absent.
        llama.cpp parsed the header at load: the Python gguf reader would parse it again, every vocabulary and
        merge entry in Python (about 25 s for Qwen2.5's 151,936 tokens on a 2-core CPU)."""
        buf = ctypes.create_string_buffer(256)
        n = int(self._lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf)))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            self._lib.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        """Token `token`'s string in the GGUF's vocabulary (tokenizer.ggml.tokens)."""
        return bytes(self._lib.llama_vocab_get_text(self._vocab, token)).decode("utf-8", errors="replace")

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self._lib.llama_model_free(self.ptr)
            self.ptr = None


@dataclass
class Token:
    # token id
    id: int
    # its position in its sequences
    pos: int
    # the sequences whose cells it joins (a tree node shared by several branches joins each)
    seqs: Sequence[int]
    # whether its logits are read back
    logits: bool = False


class GGUFContext:
    """One KV cache over a GGUFModel: up to `n_seq` sequences in `n_ctx` cells, decoded `n_batch` tokens at a time
    (in micro-batches of `n_ubatch`), at most `n_outputs` of them with logits (0: all)."""

    def __init__(self, model: GGUFModel, n_ctx: int, n_seq: int = 1, threads: int = 1,
                 n_batch: int = 512, n_outputs: int = 0, flash_attn: bool = True, n_ubatch: int = 0) -> None:
        from shared.attention_layout import UnsupportedModel

        lib = model._lib
        self.model, self._lib = model, lib
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        # tokens one kernel call takes (0: n_batch); a decode of more runs in micro-batches of this many
        # (shared/llama_invariance.py picks the size whose kernels give every token its one-token bits)
        params.n_ubatch = min(n_ubatch or n_batch, n_batch)
        # rows of logits one batch may return (0: n_batch); the buffer holds that many rows of the vocabulary
        params.n_outputs_max = n_outputs
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True  # one cache: a branch shares its prefix's cells instead of copying them
        # flash attention: each query row over its keys alone
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.no_perf = True
        self.ptr = lib.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise UnsupportedModel(f"llama.cpp could not make a context of {n_ctx} positions for {model.path}")
        self.mem = lib.llama_get_memory(self.ptr)
        self.n_ctx = int(lib.llama_n_ctx(self.ptr))
        self.n_batch, self.n_seq, self.threads = n_batch, n_seq, threads
        self._batch = lib.llama_batch_init(n_batch, 0, n_seq)

    def __del__(self) -> None:
        if getattr(self, "ptr", None):
            self._lib.llama_batch_free(self._batch)
            self._lib.llama_free(self.ptr)
            self.ptr = None

    def decode(self, tokens: Sequence[Token]) -> torch.Tensor:
        """Run `tokens` (any number: split into batches of n_batch); the logits of those that asked, in order
        ([n, vocab] float32)."""
        out: list[torch.Tensor] = []
        for at in range(0, len(tokens), self.n_batch):
            out.extend(self._decode_one(tokens[at:at + self.n_batch]))
        if not out:
            return torch.empty(0, self.model.n_vocab)
        return torch.stack(out)  # [n, vocab]

    def _decode_one(self, tokens: Sequence[Token]) -> list[torch.Tensor]:
        b = self._batch
        b.n_tokens = len(tokens)
        wanted = []
        for i, t in enumerate(tokens):
            b.token[i] = t.id
            b.pos[i] = t.pos
            b.n_seq_id[i] = len(t.seqs)
            for j, s in enumerate(t.seqs):
                b.seq_id[i][j] = s
            b.logits[i] = 1 if t.logits else 0
            if t.logits:
                wanted.append(i)
        rc = self._lib.llama_decode(self.ptr, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed ({rc}): {len(tokens)} tokens, KV of {self.n_ctx} cells "
                               "(1: no room for the batch; raise the context size)")
        rows = []
        for i in wanted:
            ptr = self._lib.llama_get_logits_ith(self.ptr, i)
            rows.append(torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,)).copy()))
        return rows

    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Drop sequence `seq`'s cells at positions [p0, p1) (-1: open end); cells other sequences hold stay."""
        if not self._lib.llama_memory_seq_rm(self.mem, seq, p0, p1):
            raise RuntimeError(f"llama.cpp cannot crop sequence {seq} at {p0}")

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Sequence `dst` also holds `src`'s cells at positions [p0, p1)."""
        self._lib.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_len(self, seq: int) -> int:
        """One past the last position sequence `seq` holds (0: none)."""
        return int(self._lib.llama_memory_seq_pos_max(self.mem, seq)) + 1

    def clear(self) -> None:
        self._lib.llama_memory_clear(self.mem, True)


def vocabulary_mismatch(source: str | Path | GGUFModel, tokenizer: Any) -> str | None:
    """None when `tokenizer` (the files beside a GGUF) speaks the GGUF's own vocabulary, else what differs: it
    defines more ids than the GGUF has tokens, or one of eight ids spread over its range (the first three, where
    special tokens sit, and the last) is another token string there. The GGUF may pad its vocabulary past the
    tokenizer's ids. `source`: a loaded model (its vocabulary as llama.cpp read it) or a file, read with the gguf
    reader (seconds to tens of seconds: `specsplit-models convert`, which loads no model)."""
    text: Callable[[int], str]
    if isinstance(source, GGUFModel):
        rows, text = source.n_vocab, source.token_text
    else:
        import gguf

        field = gguf.GGUFReader(str(source)).get_field("tokenizer.ggml.tokens")
        if field is None:
            return f"{source} holds no vocabulary (tokenizer.ggml.tokens)"
        rows = len(field.data)
        text = lambda i: bytes(field.parts[field.data[i]]).decode("utf-8", errors="replace")  # noqa: E731
    n = len(tokenizer)
    if n > rows:
        return f"the tokenizer defines {n} ids and the GGUF {rows}"
    for i in sorted({0, 1, 2, n // 7, n // 3, n // 2, 2 * n // 3, n - 1} & set(range(n))):
        theirs = text(i)
        mine = tokenizer.convert_ids_to_tokens(i)
        if mine != theirs:
            return f"id {i} is {mine!r} in the tokenizer and {theirs!r} in the GGUF"
    return None


def llama_version() -> str:
    import llama_cpp

    return str(getattr(llama_cpp, "__version__", "?"))

