"""Which models split over N tensor-parallel ranks (cloud/tensor_parallel.check_splits), without processes."""

from __future__ import annotations

import pytest
import transformers as tf

from cloud.runners.tensor_parallel import check_splits, world_size
from shared.kvpool import UnsupportedModel


def llama(heads: int, kv: int, inner: int = 192) -> tf.LlamaConfig:
    return tf.LlamaConfig(hidden_size=16 * heads, intermediate_size=inner, num_attention_heads=heads,
                          num_key_value_heads=kv)


def test_heads_that_divide_split() -> None:
    for n in (1, 3):
        check_splits(llama(9, 3), n)
    for n in (1, 2, 3, 6):
        check_splits(llama(6, 6), n)


def test_heads_that_do_not_divide_are_refused_naming_the_counts_and_what_works() -> None:
    with pytest.raises(UnsupportedModel) as e:
        check_splits(llama(9, 3), 2)
    assert str(e.value) == ("model type 'llama': 9 attention heads and 3 KV heads do not split over 2 ranks; "
                            "--nproc-per-node must divide both: 1, 3")
    with pytest.raises(UnsupportedModel, match="an MLP width of 128 do not all split over 3 ranks.*: 1, 2$"):
        check_splits(llama(6, 6, inner=128), 3)


def test_an_architecture_the_forward_does_not_run_is_refused() -> None:
    """A group runs the graph executor's forward over its shards: another family is refused before loading."""
    with pytest.raises(UnsupportedModel, match="'gpt2': tensor parallelism runs llama, qwen2, qwen3, mistral; serve"):
        check_splits(tf.GPT2Config(), 2)
    check_splits(tf.Qwen2Config(hidden_size=96, intermediate_size=192, num_attention_heads=6, num_key_value_heads=2),
                 2)


def test_without_torchrun_there_is_one_rank() -> None:
    assert world_size({}) == 1 and world_size({"WORLD_SIZE": "1"}) == 1 and world_size({"WORLD_SIZE": "3"}) == 3
