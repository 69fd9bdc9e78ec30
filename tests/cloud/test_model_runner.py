"""The service core as the scheduler's model runner (cloud/scheduler.py `ModelRunner`, cloud/core.py): tree
sequence ids are the llama.cpp pool's, and a PyTorch pool's trees take none."""

from __future__ import annotations

from collections.abc import Callable

from cloud.runners import TreeSeqPool
from cloud.runners.llamacpp import LlamaTarget
from cloud.service import VerifierService
from shared.kvpool import Row
from tests.cloud.test_llama_runner import runner, target_dir  # noqa: F401 - the tiny GGUF target's fixtures


def test_only_the_llamacpp_pool_gives_tree_rows_sequence_ids(runner: LlamaTarget) -> None:  # noqa: F811
    assert isinstance(runner.pool, TreeSeqPool)
    tree = Row(0, 4, [1, 2, 3, 4], 4, tree=(-1, 0, 0, 1), tree_base=4)
    assert runner.pool.tree_seqs(tree) == 2 and runner.pool.tree_seqs_free > 0


def test_a_pytorch_services_trees_take_no_sequence_ids(make_service: Callable[..., VerifierService]) -> None:
    svc = make_service()
    assert not isinstance(svc.model.pool, TreeSeqPool)
    tree = Row(0, 4, [1, 2, 3, 4], 4, tree=(-1, 0, 0, 1), tree_base=4)
    assert svc.tree_seqs(tree) == 0 and svc.tree_seqs_available() == 1 << 30
    assert svc.scheduler.model_runner is svc
