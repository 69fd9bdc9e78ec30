"""shared/invariant_calibration.py: batch invariance is measured where the server runs, and a kernel that breaks
it is named and reported (`batch_invariant: false` in GET /v1/model, one WARNING), never papered over.

The failing cases plant a kernel whose result moves by one tiny step with a row's place in its call (a linear
layer, the output layer in its last column only) or with its call's size (the attention of a call with more than
one pseudo-row); a calibration that missed them would report batch invariance it does not have. A linear kernel
whose result moves with its call's row count (as oneDNN's bfloat16 kernels on AMX do) is run one call per tile,
and whole forwards then agree. The passing case runs at two torch threads
and is checked against whole forwards (tests/shared/test_invariant.py's schedules) at the same thread count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

import shared.invariant_calibration as ic
from cloud.rest import create_app
from cloud.runners.torch_runner import TargetModel
from cloud.service import VerifierService
from cloud.settings import CloudSettings
from shared.hf_model import load_causal_lm
from shared.invariant import ROW_TILE, InvariantCall, tile_linears
from shared.invariant_calibration import calibrate, probe_rows
from shared.kvpool import KVPool, attention_layout
from tests.shared.test_invariant import differing_in
from tests.tiny_models import build

# the largest forward the tests calibrate for (their models' forwards stay below it)
MAX_ROWS = 256


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("llama", tmp_path_factory.mktemp("llama"))


def tiled(model: Any, dtype: torch.dtype = torch.float32) -> tuple[Any, KVPool]:
    """`model` with tiled linear layers, and its prepared KV pool (not calibrated)."""
    tile_linears(model)
    pool = KVPool(attention_layout(model.config), 4096, "cpu", dtype, invariant=True)
    pool.prepare(model)
    return model, pool


def drifting(f: Callable[[torch.Tensor], torch.Tensor], column: slice = slice(None),
             by: str = "place") -> Callable[..., torch.Tensor]:
    """f, plus in `column` of its output a term of 1e-6 per row before this one in its call (`by` "place"), or
    per row of its call ("rows"): a row's bits move with its place, or with the call's row count."""
    def g(x: torch.Tensor) -> torch.Tensor:
        y = f(x).clone()  # [rows, out]
        step = torch.arange(x.shape[0], dtype=y.dtype)[:, None] if by == "place" else x.shape[0]
        y[:, column] += 1e-6 * step
        return y
    return g


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread unless a test asks for two (the fastest setting on a small shared machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def two_threads(one_thread: None) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_probe_rows_reach_the_largest_forward() -> None:
    rows = probe_rows(1024)
    assert rows[:16] == list(range(1, 17)) and rows[-1] == 1024
    assert {17, 33, 129, 257, 513, 769} <= set(rows)  # odd counts: a padded tail at every scale
    assert probe_rows(40)[-1] == 40


def test_a_linear_kernel_that_varies_with_a_rows_place_fails_calibration(llama: Path) -> None:
    model, pool = tiled(load_causal_lm(llama, "cpu", torch.float32))
    for layer in model.model.layers:  # one kernel per shape: every layer of this one drifts
        layer.mlp.down_proj._untiled_forward = drifting(layer.mlp.down_proj._untiled_forward)
    c = calibrate(model, MAX_ROWS, pool)
    assert not c.invariant and (c.tile, c.calls) == (ROW_TILE, True)
    assert "mlp.down_proj (128 -> 64" in c.failure and "rows" in c.failure
    assert all(f"tile {t}:" in c.failure for t, calls in ic.LINEAR_MODES if not calls)
    assert f"calls of {ROW_TILE} rows:" in c.failure


def test_a_linear_kernel_that_varies_with_its_row_count_runs_one_call_a_tile(llama: Path) -> None:
    """The drift moves with the call's row count alone: no tile of one call hides it, one call per tile does, and
    then whole forwards (tests/shared/test_invariant.py's schedules) give every position one-token decoding's bits."""
    model, pool = tiled(load_causal_lm(llama, "cpu", torch.float32))
    for layer in model.model.layers:
        layer.mlp.down_proj._untiled_forward = drifting(layer.mlp.down_proj._untiled_forward, by="rows")
    c = calibrate(model, MAX_ROWS, pool)
    assert c.invariant and (c.tile, c.calls) == (ROW_TILE, True), c.failure
    bad, total = differing_in(model, pool)
    assert bad == 0, f"calibrated invariant, yet {bad} of {total} positions differ from one-token decoding"
    tile_linears(model, ROW_TILE)  # one call of whole tiles: the same schedules now differ
    assert differing_in(model, pool)[0] > 0


def test_the_output_layer_is_probed_at_its_whole_width() -> None:
    """The drift sits in the last of 10,000 output columns only (an earlier probe read the first 8,192)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=10_000, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    model, pool = tiled(tf.AutoModelForCausalLM.from_config(cfg).eval())
    head = model.get_output_embeddings()
    head._untiled_forward = drifting(head._untiled_forward, slice(-1, None))
    c = calibrate(model, MAX_ROWS, pool)
    assert not c.invariant and "lm_head" in c.failure


def test_attention_that_varies_with_its_batch_fails_calibration(llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, pool = tiled(load_causal_lm(llama, "cpu", torch.float32))
    real = ic.attend

    def attend(call: InvariantCall, q_all: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               *args: Any) -> None:
        real(call, q_all, k, v, out, *args)
        out[call.dst] += 1e-6 * (call.shape[0] - 1)  # a call of G pseudo-rows drifts by G - 1 steps

    monkeypatch.setattr(ic, "attend", attend)
    c = calibrate(model, MAX_ROWS, pool)
    assert not c.invariant
    assert "attention of the full-attention layers" in c.failure and "beside" in c.failure


def test_the_service_reports_a_failed_calibration(llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    target = TargetModel(llama, invariant=True)
    for layer in target.model.model.layers:
        layer.self_attn.q_proj._untiled_forward = drifting(layer.self_attn.q_proj._untiled_forward)
    with caplog.at_level(logging.WARNING, logger="cloud.runners.torch_runner"):
        service = VerifierService(CloudSettings(model=llama, dtype="float32", max_batch_tokens=64), target)
    try:
        with TestClient(create_app(service)) as client:
            assert client.get("/v1/model").json()["batch_invariant"] is False
            assert 'batch_invariant="false"' in client.get("/metrics").text
    finally:
        service.close()
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "self_attn.q_proj" in warning and "rows" in warning
    assert "greedy texts are no longer promised" in warning


def test_the_service_calibrates_at_its_model_threads_thread_count(llama: Path, two_threads: None,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """This thread runs two torch threads; the service's model thread runs (and measures at) --torch-threads 1."""
    target = TargetModel(llama, invariant=True)
    with caplog.at_level(logging.INFO, logger="cloud.runners.torch_runner"):
        service = VerifierService(CloudSettings(model=llama, dtype="float32", max_batch_tokens=64, torch_threads=1),
                                  target)
    service.close()
    assert service.info.batch_invariant is True
    assert "up to 64 tokens on 1 torch threads" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_at_two_threads_calibration_is_measured_there_and_whole_forwards_agree(
        llama: Path, dtype: torch.dtype, two_threads: None) -> None:
    model, pool = tiled(load_causal_lm(llama, "cpu", dtype), dtype)
    c = calibrate(model, MAX_ROWS, pool)
    assert c.threads == 2 and c.max_rows == MAX_ROWS
    if c.invariant:  # what it claims holds for whole forwards on these two threads
        bad, total = differing_in(model, pool)
        assert bad == 0, f"calibrated invariant, yet {bad} of {total} positions differ from one-token decoding"
    else:  # what it does not claim is named
        assert c.failure and (c.tile, c.calls) == (ROW_TILE, True)
