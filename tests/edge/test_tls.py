"""TLS for the edge's clients, against real servers with a real self-signed certificate (openssl): REST over an
https:// URL verified against --ca-cert (uvicorn serving TLS), gRPC over a secure channel with --grpc-tls
(a grpc server with TLS credentials). Without the CA the certificate is refused; a plaintext channel to the TLS
port gets nothing."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from fastapi import FastAPI

from edge.cli import build_parser, settings_from_args
from edge.settings import EdgeSettings
from edge.transport import transport_for
from shared.errors import SpecSplitError
from shared.pb import verify_pb2 as pb
from shared.pb import verify_pb2_grpc as pb_grpc

MODEL = {"model_id": "behind-tls", "vocab_size": 8}


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(certificate, key): self-signed for 127.0.0.1 and localhost; the certificate is its own CA."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl on this machine")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


@pytest.fixture(scope="module")
def https_url(cert: tuple[Path, Path]) -> Iterator[str]:
    """A uvicorn server answering GET /v1/model over TLS."""
    import uvicorn

    app = FastAPI()
    app.get("/v1/model")(lambda: MODEL)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, ssl_certfile=str(cert[0]), ssl_keyfile=str(cert[1]),
                            log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"https://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


class _Model(pb_grpc.VerifierServicer):
    def GetModel(self, request: pb.GetModelRequest, context: grpc.ServicerContext) -> pb.ModelInfo:
        return pb.ModelInfo(**MODEL)


@pytest.fixture(scope="module")
def grpc_tls_target(cert: tuple[Path, Path]) -> Iterator[str]:
    """A gRPC server answering GetModel over TLS only."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_VerifierServicer_to_server(_Model(), server)
    creds = grpc.ssl_server_credentials([(cert[1].read_bytes(), cert[0].read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def model_id(settings: EdgeSettings) -> str:
    transport = transport_for(settings)
    try:
        return transport.get_model(5.0).model_id
    finally:
        transport.close()


def test_rest_over_https_verifies_the_cloud_against_the_ca_given(https_url: str, cert: tuple[Path, Path]) -> None:
    args = build_parser().parse_args(["generate", "x", "--cloud", https_url, "--ca-cert", str(cert[0])])
    assert model_id(settings_from_args(args)) == "behind-tls"
    with pytest.raises(SpecSplitError):  # the system's trust does not know a self-signed certificate
        model_id(EdgeSettings(cloud_url=https_url))


def test_grpc_tls_opens_a_secure_channel_checked_against_the_ca(grpc_tls_target: str,
                                                                cert: tuple[Path, Path]) -> None:
    args = build_parser().parse_args(["generate", "x", "--grpc", grpc_tls_target, "--grpc-tls",
                                      "--ca-cert", str(cert[0])])
    assert model_id(settings_from_args(args)) == "behind-tls"
    with pytest.raises(SpecSplitError):  # plaintext to a TLS port
        model_id(EdgeSettings(grpc_target=grpc_tls_target, max_retries=0))
    with pytest.raises(SpecSplitError):  # TLS, but gRPC's own roots do not know the certificate
        model_id(EdgeSettings(grpc_target=grpc_tls_target, grpc_tls=True))


def test_a_ca_cert_that_is_no_file_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="not a file"):
        EdgeSettings(ca_cert="/nonexistent/ca.pem")


@pytest.mark.parametrize("where", [{"cloud_url": "http://cloud.example.org:8000"},
                                   {"grpc_target": "10.0.0.5:50051"}])
def test_a_key_sent_in_clear_beyond_this_machine_is_said_in_one_warning(
        where: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="edge.transport"):
        transport_for(EdgeSettings(api_key="k", **where)).close()  # type: ignore[arg-type]
        assert "in clear" in caplog.text
        caplog.clear()
        for private in ({"cloud_url": "https://cloud.example.org"}, {"grpc_target": "10.0.0.5:50051", "grpc_tls": True},
                        {"cloud_url": "http://127.0.0.1:8000"}, {"grpc_target": "[::1]:50051"}):
            transport_for(EdgeSettings(api_key="k", **private)).close()  # type: ignore[arg-type]
    assert not caplog.text


@pytest.mark.parametrize(("flags", "cause", "fix"), [
    (["--grpc", "cloud.example.org:50443"], "plaintext", "--grpc-tls"),
    (["--cloud", "http://cloud.example.org:8000"], "plain http://", "https://cloud.example.org:8000"),
    ([], "plain http://", "https://127.0.0.1:8000"),
])
def test_a_ca_cert_without_tls_is_refused_in_one_line_naming_the_cause_and_the_fix(
        cert: tuple[Path, Path], flags: list[str], cause: str, fix: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A CA certificate checks nothing over a plaintext connection: with a gRPC target and no --grpc-tls, or a
    plain http:// cloud URL, the edge stops before any connection with one line, not an insecure channel."""
    from edge.cli import main

    assert main(["generate", "x", *flags, "--ca-cert", str(cert[0]), "--draft", "ngram"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("specsplit-edge: bad settings:"), err
    assert "--ca-cert" in err and cause in err and fix in err, err


def test_a_ca_cert_with_tls_is_taken_either_way(cert: tuple[Path, Path]) -> None:
    grpc_tls = EdgeSettings(grpc_target="cloud.example.org:50443", grpc_tls=True, ca_cert=str(cert[0]))
    https = EdgeSettings(cloud_url="https://cloud.example.org", ca_cert=str(cert[0]))
    assert grpc_tls.ca_cert == https.ca_cert == str(cert[0])


def test_an_ipv6_grpc_target_without_brackets_is_refused_naming_the_bracketed_form() -> None:
    with pytest.raises(ValueError, match=r"\[::1\]:50051"):
        EdgeSettings(grpc_target="::1:50051")
    assert EdgeSettings(grpc_target="[::1]:50051").grpc_target == "[::1]:50051"
