"""cloud_only speaks the cloud's tokenizer: `generate --mode cloud_only` and the OpenAI server's cloud_only mode,
each against two clouds with different tokenizers (the demo pair's, 4,096 ids, and SmolLM2's, 49,152), with
models/ holding one folder per tokenizer under names of one's own (not the bundled drafts' names). The prompt the
cloud receives must be its own tokenizer's ids and the printed text its own tokenizer's decoding of what it sent;
a cloud whose tokenizer no folder holds is refused with one line naming --tokenizer and --draft."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from edge.transport.base import GenerateResult
from shared.config import SamplingConfig
from shared.tokenizer_id import load_tokenizer, tokenizer_fingerprint
from tests.edge.fake_cloud import FakeCloud

REPO = Path(__file__).resolve().parents[2]
TOKENIZERS = {"demo": REPO / "models" / "demo-target", "smollm2": REPO / "models" / "smollm2-135m-draft"}
PROMPT = "Write a function that returns the n-th Fibonacci number."
ANSWER = " def fibonacci(n): return n"


class ScriptedCloud(FakeCloud):
    """A cloud speaking `tokenizer`: it records the prompt ids it is sent and answers ANSWER in its own ids."""

    def __init__(self, model_dir: Path, tokenizer: Any) -> None:
        super().__init__(model_dir)
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
        self.answer = list(tokenizer.encode(ANSWER, add_special_tokens=False))
        self.prompts: list[list[int]] = []

    def generate(self, prompt_ids: list[int], cfg: SamplingConfig, seed: int, max_new_tokens: int,
                 timeout: float, stop_at_eos: bool = True) -> GenerateResult:
        self._enter("generate")
        self.prompts.append(list(prompt_ids))
        return GenerateResult(self.answer[:max_new_tokens])


@pytest.fixture
def own_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """models/ with the two tokenizers only, in folders named as a user would name their own."""
    import edge.settings

    folders = {}
    for name, src in TOKENIZERS.items():
        d = tmp_path / "models" / f"my-{name}-tokenizer"
        d.mkdir(parents=True)
        for f in src.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
                shutil.copy(f, d / f.name)
        folders[name] = d
    monkeypatch.setattr(edge.settings, "REPO_ROOT", tmp_path)
    for var in ("SPECSPLIT_EDGE_DRAFT", "SPECSPLIT_EDGE_TOKENIZER", "SPECSPLIT_EDGE_MODE"):
        monkeypatch.delenv(var, raising=False)
    return folders


def _use_cloud(monkeypatch: pytest.MonkeyPatch, cloud: FakeCloud) -> None:
    import edge.server.openai_engine
    import edge.transport

    monkeypatch.setattr(edge.transport, "transport_for", lambda *a, **k: cloud)
    monkeypatch.setattr(edge.server.openai_engine, "transport_for", lambda *a, **k: cloud)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_generate_cloud_only_tokenizes_and_decodes_with_the_clouds_tokenizer(
        name: str, own_models: dict[str, Path], tiny_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from edge.cli import main

    tokenizer = load_tokenizer(TOKENIZERS[name])
    cloud = ScriptedCloud(tiny_pair[0], tokenizer)
    _use_cloud(monkeypatch, cloud)
    assert main(["generate", PROMPT, "--mode", "cloud_only", "--max-new-tokens", "32", "--json"]) == 0
    out = capsys.readouterr().out
    import json

    result = json.loads(out)
    assert cloud.prompts == [list(tokenizer.encode(PROMPT))]
    assert result["text"] == tokenizer.decode(cloud.answer) and result["text"].strip() == ANSWER.strip()


def test_generate_cloud_only_refuses_a_cloud_whose_tokenizer_no_folder_holds(
        own_models: dict[str, Path], tiny_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from edge.cli import main

    cloud = ScriptedCloud(tiny_pair[0], load_tokenizer(TOKENIZERS["demo"]))
    cloud.tokenizer_fingerprint = "0" * 16
    _use_cloud(monkeypatch, cloud)
    assert main(["generate", PROMPT, "--mode", "cloud_only"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tokenizer" in err and "--draft" in err
    assert cloud.prompts == []
    # a --tokenizer that is not the cloud's is refused too, before anything is generated
    assert main(["generate", PROMPT, "--mode", "cloud_only", "--tokenizer", str(own_models["demo"])]) == 1
    assert "--tokenizer" in capsys.readouterr().err and cloud.prompts == []


@pytest.fixture
def served(own_models: dict[str, Path], tiny_pair: tuple[Path, Path],
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """serve(cloud): a TestClient on the OpenAI server in cloud_only mode, built as `serve` builds it."""
    from edge.cli import build_parser, cloud_draft_or_later, settings_from_args
    from edge.server.serve import ServeArgs, build_app, build_engine

    clients: list[TestClient] = []

    def serve(cloud: FakeCloud) -> tuple[TestClient, Any]:
        _use_cloud(monkeypatch, cloud)
        args = build_parser().parse_args(["serve", "--mode", "cloud_only"])
        settings, later = cloud_draft_or_later(settings_from_args(args), args)
        engine = build_engine(settings, later)
        client = TestClient(build_app(settings, ServeArgs(served_model_name="m", choose_draft=later), engine))
        clients.append(client.__enter__())
        return client, engine

    yield serve
    for c in clients:
        c.__exit__(None, None, None)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_the_servers_cloud_only_mode_speaks_the_clouds_tokenizer(name: str, served: Any,
                                                                tiny_pair: tuple[Path, Path]) -> None:
    tokenizer = load_tokenizer(TOKENIZERS[name])
    cloud = ScriptedCloud(tiny_pair[0], tokenizer)
    http, _ = served(cloud)
    r = http.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 32, "temperature": 0})
    assert r.status_code == 200, r.text
    assert cloud.prompts == [list(tokenizer.encode(PROMPT))]
    assert r.json()["choices"][0]["text"].strip() == ANSWER.strip()


def test_the_servers_cloud_only_mode_refuses_a_cloud_whose_tokenizer_no_folder_holds(
        served: Any, tiny_pair: tuple[Path, Path]) -> None:
    from shared.errors import InvalidArgument

    cloud = ScriptedCloud(tiny_pair[0], load_tokenizer(TOKENIZERS["demo"]))
    cloud.tokenizer_fingerprint = "0" * 16
    with pytest.raises(InvalidArgument, match="--tokenizer.*--draft"):
        served(cloud)
