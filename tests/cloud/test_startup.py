"""Start-up refusals of `specsplit-cloud`: one line naming the cause and the fix, exit code 2."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from cloud import cli
from cloud.grpc_server import start_grpc
from cloud.ports import PortInUse
from cloud.service import VerifierService


def test_a_model_directory_without_a_tokenizer_is_refused_in_one_line(
        tmp_path: Path, tiny_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tiny_pair[0].iterdir():  # config and weights, no tokenizer files
        if not f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            (bare / f.name).write_bytes(f.read_bytes())
    assert cli.main(["--model", str(bare), "--http-port", "0", "--grpc-port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no tokenizer" in err and str(bare) in err


@pytest.fixture
def listener() -> Iterator[int]:
    """A port another process could hold: a plain listening socket on a free port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock.getsockname()[1]
    sock.close()


@pytest.mark.parametrize("flag", ["--http-port", "--grpc-port"])
def test_a_port_in_use_is_refused_in_one_line_naming_the_port_and_the_flag(
        flag: str, listener: int, tiny_pair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    ports = {"--http-port": "0", "--grpc-port": "0", flag: str(listener)}
    args = ["--model", str(tiny_pair[0]), *(x for kv in ports.items() for x in kv)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(listener) in err and flag in err and "in use" in err


def test_grpc_binds_exclusively(make_service: Callable[..., VerifierService]) -> None:
    """Another gRPC server on the port (grpcio's default SO_REUSEPORT would let both listen): refused."""
    svc = make_service()

    async def main() -> None:
        other = grpc.aio.server()
        port = other.add_insecure_port("127.0.0.1:0")
        await other.start()
        try:
            with pytest.raises(PortInUse, match=f"{port}.*--grpc-port"):
                server, _, _ = await start_grpc(svc, "127.0.0.1", port)
                await server.stop(None)
        finally:
            await other.stop(None)

    asyncio.run(main())
