"""docs/PROTOCOL.md's examples hold: the context hash's test vectors are what shared/hashing.py computes, and the
worked exchange, read out of the doc (curl and grpcurl lines, the JSON answers), replays against a real cloud on
the model it names: every answer value is the doc's except those the doc names as varying, every documented field
is there, and the REST bodies and answers conform to the cloud's own OpenAPI schema.

`python -m tests.e2e.test_protocol_examples` prints the answers a fresh cloud gives to the doc's requests, for
updating the doc when the model or the answers change.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema_rs
import pytest
from google.protobuf import json_format

from shared.hashing import ctx_hash, fnv1a64
from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc
from tests.server import CloudProcess

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "PROTOCOL.md"
MODEL = REPO / "models" / "demo-target"
KEY = "secret-key"
# the answer fields whose values differ from run to run or machine to machine (PROTOCOL.md, "A worked exchange")
VARYING = {"ctx_id", "numerics", "node_budget", "node_acceptance", "forward_cost", "prefill_ms", "queue_ms",
           "row_ms"}


def section(title: str, text: str | None = None) -> str:
    """The text under the heading `title` (any level) up to the next heading of the same or a higher level."""
    text = DOC.read_text() if text is None else text
    m = re.search(rf"^(#+) {re.escape(title)}\n", text, flags=re.M)
    assert m, f"docs/PROTOCOL.md has no section {title!r}"
    level = len(m.group(1))
    end = re.search(rf"^#{{1,{level}}} ", text[m.end():], flags=re.M)
    return text[m.end(): m.end() + end.start() if end else len(text)]


def code_blocks(text: str) -> list[tuple[str, str, str]]:
    """(language, code, the prose before it) of each fenced block, in order."""
    out, last = [], 0
    for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, flags=re.M | re.S):
        out.append((m.group(1), m.group(2), text[last: m.start()]))
        last = m.end()
    return out


def command_args(code: str) -> list[str]:
    return shlex.split(code.replace("\\\n", " "))


def option(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]


# --- the hash -------------------------------------------------------------------------------------
def hash_vectors() -> list[tuple[list[int], str, str]]:
    """(token ids, the bytes column, ctx_hash) of each row of the Hash section's table."""
    rows = re.findall(r"^\| `(\[[-0-9, ]*\])` \| (.*?) \| `([0-9a-f]{16})` \|$", section("Hash"), flags=re.M)
    return [(json.loads(ids), hexes, h) for ids, hexes, h in rows]


def test_hash_vectors_are_what_the_shared_hash_computes() -> None:
    vectors = hash_vectors()
    assert len(vectors) >= 8
    for ids, hexes, expected in vectors:
        assert ctx_hash(ids) == expected, ids
        packed = b"".join(t.to_bytes(4, "little", signed=True) for t in ids)
        if re.fullmatch(r"`[0-9a-f ]+`", hexes):
            assert bytes.fromhex(hexes.strip("`")) == packed, ids
        h = 0xCBF29CE484222325  # the doc's one-line recipe, byte by byte
        for b in packed:
            h = ((h ^ b) * 0x100000001B3) % 2**64
        assert f"{h:016x}" == expected == f"{fnv1a64(ids):016x}", ids


# --- the worked exchange --------------------------------------------------------------------------
@dataclass
class Call:
    # the command line's arguments (curl or grpcurl)
    args: list[str]
    # the answer's JSON text as the doc shows it, or the text of a grpcurl error
    answer: str
    # REST: the status the doc says the cloud answers; gRPC: 0
    status: int


def exchange(title: str, tool: str) -> list[Call]:
    """The calls of a worked exchange: each `tool` command block and the answer block after it."""
    blocks = code_blocks(section(title))
    calls = []
    for i, (lang, code, _) in enumerate(blocks):
        if lang == "bash" and code.lstrip().startswith(tool):
            _, answer, prose = blocks[i + 1]
            status = re.findall(r"answers `(\d{3})`", prose)
            calls.append(Call(command_args(code), answer, int(status[-1]) if status else 0))
    assert calls, f"no {tool} lines under {title!r}"
    return calls


def compare(expected: Any, actual: Any, where: str = "") -> None:
    """`actual` holds every field of `expected`, each with its value (VARYING fields: any value, or absent where
    gRPC leaves a message unset: `node_acceptance` before the key's first round)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), where
        missing = set(expected) - set(actual) - VARYING
        assert not missing, f"{where}: fields the doc shows are missing: {sorted(missing)}"
        for key, value in expected.items():
            if key not in VARYING:
                compare(value, actual[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{where}: {actual} != {expected}"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            compare(e, a, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: the cloud answers {actual!r}, the doc says {expected!r}"


@pytest.fixture(scope="module")
def cloud() -> Iterator[CloudProcess]:
    """The cloud the doc names: the toy target in PyTorch float32, one key (whatever runner the suite runs)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SPECSPLIT_TEST_RUNNER", raising=False)
        with CloudProcess(MODEL, api_keys=(KEY,), env={"SPECSPLIT_CLOUD_RUNNER": "torch",
                                                        "SPECSPLIT_CLOUD_DTYPE": "float32"}) as c:
            yield c


def replay_rest(cloud: CloudProcess) -> Iterator[tuple[Call, httpx.Response, str | None]]:
    """Each REST call of the doc sent to `cloud`, with the cloud's answer and the body sent: the doc's ctx_id is
    replaced by the session's in the requests and in the answers the doc shows (the call yielded)."""
    doc_id = real_id = ""
    with httpx.Client(timeout=60) as http:
        for call in exchange("Over REST", "curl"):
            args = [a.replace(doc_id, real_id) for a in call.args] if doc_id else call.args
            url = next(a for a in args if a.startswith("http://"))
            headers = dict(h.split(": ", 1) for h in option(args, "-H"))
            body = (option(args, "-d") or [None])[0]
            r = http.request((option(args, "-X") or ["GET"])[0], cloud.http_url + httpx.URL(url).path,
                             headers=headers, content=body)
            if not doc_id:  # the open: its answer names the session
                doc_id, real_id = json.loads(call.answer)["ctx_id"], r.json()["ctx_id"]
            yield Call(args, call.answer.replace(doc_id, real_id), call.status), r, body


def conforms(openapi: dict[str, Any], schema: dict[str, Any], instance: Any, what: str) -> None:
    validator = jsonschema_rs.validator_for({**schema, "components": openapi["components"]})
    errors = [f"{e.message} at {list(e.instance_path)}" for e in validator.iter_errors(instance)]
    assert not errors, f"{what} does not conform to the OpenAPI schema: {errors}"


def test_the_rest_exchange_replays_and_conforms_to_the_schema(cloud: CloudProcess) -> None:
    openapi = httpx.get(cloud.http_url + "/openapi.json").json()
    seen = []
    for call, r, body in replay_rest(cloud):
        assert r.status_code == call.status, r.text
        compare(json.loads(call.answer), r.json(), f"{r.request.method} {r.request.url.path}")
        route = re.sub(r"/v1/sessions/[^/]+", "/v1/sessions/{ctx_id}", r.request.url.path)
        operation = openapi["paths"][route][r.request.method.lower()]
        if body is not None:
            conforms(openapi, operation["requestBody"]["content"]["application/json"]["schema"], json.loads(body),
                     f"the doc's {r.request.method} {route} body")
        conforms(openapi, operation["responses"][str(r.status_code)]["content"]["application/json"]["schema"],
                 r.json(), f"the {r.status_code} answer to {r.request.method} {route}")
        seen.append((r.request.method, route, r.status_code))
    assert seen == [("POST", "/v1/sessions", 200), ("POST", "/v1/verify", 200),
                    ("DELETE", "/v1/sessions/{ctx_id}", 200), ("POST", "/v1/verify", 404)]


def grpc_call(stub: pb_grpc.VerifierStub, call: Call, metadata: tuple[tuple[str, str], ...]
              ) -> tuple[Any, type[Any]]:
    """Send the grpcurl line's request with the generated stubs; (answer or RpcError, the answer's type)."""
    name = call.args[-1].rsplit("/", 1)[1]
    method = pb.DESCRIPTOR.services_by_name["Verifier"].methods_by_name[name]
    request = json_format.Parse(option(call.args, "-d")[0], getattr(pb, method.input_type.name)())
    try:
        return getattr(stub, name)(request, metadata=metadata, timeout=60), getattr(pb, method.output_type.name)
    except grpc.RpcError as e:
        return e, getattr(pb, method.output_type.name)


def as_dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True,
                                     always_print_fields_with_no_presence=True)


def replay_grpc(cloud: CloudProcess) -> Iterator[tuple[Call, Any, type[Any]]]:
    """Each grpcurl call of the doc sent to `cloud` with the stubs, with the answer (or RpcError) and the answer's
    type: the doc's ctx_id is replaced by the session's in the requests and the answers the doc shows."""
    calls = exchange("Over gRPC", "grpcurl")
    doc_id, real_id = json.loads(calls[0].answer)["ctxId"], ""
    with grpc.insecure_channel(cloud.grpc_target) as channel:
        stub = pb_grpc.VerifierStub(channel)
        for call in calls:
            if real_id:
                call = Call([a.replace(doc_id, real_id) for a in call.args], call.answer.replace(doc_id, real_id), 0)
            metadata = tuple((k.lower(), v) for k, v in (h.split(": ", 1) for h in option(call.args, "-H")))
            answer, kind = grpc_call(stub, call, metadata)
            if not real_id:  # the open: its answer names the session
                real_id = answer.ctx_id
                call = Call(call.args, call.answer.replace(doc_id, real_id), 0)
            yield call, answer, kind


def test_the_grpc_exchange_replays_with_the_generated_stubs(cloud: CloudProcess) -> None:
    """grpcurl is not packaged for Debian or PyPI: the same JSON goes through json_format and the Python stubs."""
    seen = []
    for call, answer, kind in replay_grpc(cloud):
        seen.append(call.args[-1])
        if call.answer.startswith("ERROR:"):
            assert isinstance(answer, grpc.RpcError), answer
            code = re.search(r"Code: (\w+)", call.answer).group(1)  # type: ignore[union-attr]
            assert answer.code().name == re.sub(r"(?<!^)([A-Z])", r"_\1", code).upper()
            assert answer.details() == re.search(r"Message: (.*)", call.answer).group(1)  # type: ignore[union-attr]
            continue
        assert not isinstance(answer, grpc.RpcError), answer
        compare(as_dict(json_format.Parse(call.answer, kind())), as_dict(answer), call.args[-1])
    assert seen == [f"specsplit.v1.Verifier/{m}" for m in ("OpenSession", "Verify", "CloseSession", "Verify")]


def main() -> None:
    """Print a fresh cloud's answers to the doc's REST and gRPC requests."""
    with CloudProcess(MODEL, api_keys=(KEY,), env={"SPECSPLIT_CLOUD_RUNNER": "torch",
                                                    "SPECSPLIT_CLOUD_DTYPE": "float32"}) as c:
        for call, r, _ in replay_rest(c):
            print(" ".join(call.args[:4]), "->", r.status_code, json.dumps(r.json(), indent=2))
        for call, answer, _ in replay_grpc(c):
            print(call.args[-1], "->", answer if isinstance(answer, grpc.RpcError) else
                  json_format.MessageToJson(answer, indent=2))


if __name__ == "__main__":
    sys.exit(main())
