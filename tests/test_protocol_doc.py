"""docs/PROTOCOL.md names every REST path of the app and every gRPC method of the proto."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from cloud.rest import create_app
from cloud.service import VerifierService
from cloud.settings import CloudSettings

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "PROTOCOL.md"
PROTO = REPO / "proto" / "specsplit" / "v1" / "verify.proto"


def test_every_grpc_method_is_documented() -> None:
    methods = re.findall(r"^\s*rpc\s+(\w+)\s*\(", PROTO.read_text(), flags=re.M)
    assert len(methods) >= 5
    doc = DOC.read_text()
    missing = [m for m in methods if f"`{m}`" not in doc]
    assert not missing, f"gRPC methods missing from docs/PROTOCOL.md: {missing}"


def test_every_rest_path_is_documented(tiny_pair: tuple[Path, Path]) -> None:
    from cloud.runners.torch_runner import TargetModel

    service = VerifierService(CloudSettings(model=tiny_pair[0]), TargetModel(tiny_pair[0]))
    try:
        with TestClient(create_app(service)) as c:
            paths = c.get("/openapi.json").json()["paths"]
    finally:
        service.close()
    assert {"/v1/verify", "/v1/sessions"} <= set(paths)
    doc = DOC.read_text()
    missing = [p for p in paths if f" {p}`" not in doc]
    assert not missing, f"REST paths missing from docs/PROTOCOL.md: {missing}"


def test_the_sections_left_to_others_are_there() -> None:
    doc = DOC.read_text()
    for title in ("### Batching", "### Routing key", "### Model info: tokenizer fingerprint"):
        assert title in doc
