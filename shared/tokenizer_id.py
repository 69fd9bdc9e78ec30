"""Which tokenizer a model speaks: a fingerprint both sides compare before a session.

The fingerprint is the first 16 hex digits of SHA-256 over the vocabulary (every token string
with its id, added tokens included) and the special tokens with their ids. Two tokenizers with
the same fingerprint map every id to the same string, which is what the draft and the target
must share for their ids to mean the same text.

Hashing a 49k-token vocabulary takes about 80 ms, and the edge checks the pairing before every
generation: the fingerprint is kept per tokenizer object and recomputed when its size or its special
tokens change.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from pathlib import Path
from typing import Any

# tokenizer -> (its size and special tokens when hashed, fingerprint)
_known: weakref.WeakKeyDictionary[Any, tuple[tuple[int, tuple[str, ...]], str]] = weakref.WeakKeyDictionary()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    size = (len(tokenizer), tuple(map(str, tokenizer.all_special_tokens)))
    try:
        hit = _known.get(tokenizer)
    except TypeError:  # neither hashable nor weakly referable: hashed every time
        hit = None
    if hit is not None and hit[0] == size:
        return hit[1]
    fp = _fingerprint(tokenizer)
    try:
        _known[tokenizer] = (size, fp)
    except TypeError:
        pass
    return fp


def _fingerprint(tokenizer: Any) -> str:
    vocab = sorted((int(i), str(t)) for t, i in tokenizer.get_vocab().items())
    special = sorted((str(t), int(tokenizer.convert_tokens_to_ids(t))) for t in tokenizer.all_special_tokens)
    blob = json.dumps({"vocab": vocab, "special": special}, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer stored in `path`; UnsupportedModel (a ValueError) with one line when there is none."""
    from transformers import AutoTokenizer

    from shared.attention_layout import UnsupportedModel

    if not Path(path).is_dir():  # never a hub download: every model here is a local directory
        raise UnsupportedModel(f"no tokenizer directory {path}: it does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnsupportedModel(f"no usable tokenizer in {path}: {first}") from None
    if len(tokenizer) < 2:  # a directory without tokenizer files loads as an empty tokenizer
        raise UnsupportedModel(f"no tokenizer in {path}: it has no tokenizer files (tokenizer.json, vocab.json, "
                               "tokenizer.model, ...); copy the model's tokenizer files into it")
    return tokenizer


def directory_fingerprint(model_dir: str | Path) -> str | None:
    """The fingerprint of the tokenizer stored in `model_dir`; None when it holds none or one that does not load."""
    d = Path(model_dir)
    if not any(d.glob("tokenizer*")) and not (d / "vocab.json").exists():
        return None
    try:
        return tokenizer_fingerprint(load_tokenizer(d))
    except (OSError, ValueError):
        return None
