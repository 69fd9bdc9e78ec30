"""The README's "TLS in front of the cloud", run as written: its certificate recipe in a temporary folder (the one
path it writes to, /etc/ssl/specsplit, moved there; the placeholder name and address set to localhost and
127.0.0.1), its nginx snippet through `nginx -t` with Debian's nginx (scripts/install_nginx.sh), and the edge
through that nginx, in front of a real cloud, with `--ca-cert` naming the file the README tells the device to keep:
REST over https:// dialled by address (the certificate's IP: entry), gRPC over TLS dialled by name (its DNS:
entry)."""

from __future__ import annotations

import re
import shlex
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.cloud_proc import free_port
from bench.nginx_conf import nginx_binary
from cloud.settings import CloudSettings
from edge.cli import build_parser, settings_from_args
from edge.transport import transport_for
from tests.server import CloudProcess

REPO = Path(__file__).resolve().parents[2]
SECTION = "### TLS in front of the cloud"
CERT_DIR = "/etc/ssl/specsplit"
# what the test's certificate is made for: the placeholders of the recipe's `name=... ip=...` line
NAME, IP = "localhost", "127.0.0.1"


def section_blocks(readme: str) -> list[tuple[str, str]]:
    """(language, text) of every fenced code block of the README's TLS section (up to the next section: "## ")."""
    start = readme.index(SECTION) + len(SECTION)
    end = readme.index("\n## ", start)
    return re.findall(r"```(\w+)\n(.*?)```", readme[start:end], flags=re.S)


def block(lang: str, needle: str) -> str:
    """The one block of `lang` holding `needle`."""
    found = [text for kind, text in section_blocks((REPO / "README.md").read_text()) if kind == lang and needle in text]
    assert len(found) == 1, f"the TLS section should hold one {lang} block with {needle!r}, found {len(found)}"
    return found[0]


def recipe() -> str:
    return block("bash", "openssl req")


def snippet() -> str:
    return block("nginx", "ssl_certificate")


def device_commands() -> str:
    return block("bash", "specsplit-edge")


def read_paths(conf: str) -> dict[str, str]:
    """The certificate and key files the snippet's servers read (the same two in each server)."""
    found = {d: set(re.findall(rf"^\s*{d}\s+(\S+);", conf, flags=re.M)) for d in ("ssl_certificate",
                                                                                  "ssl_certificate_key")}
    assert all(len(v) == 1 for v in found.values()), found
    return {d: v.pop() for d, v in found.items()}


def run_recipe(where: Path) -> Path:
    """The recipe as written, with /etc/ssl/specsplit at `where` and the name and address set; returns `where`."""
    script = recipe().replace(CERT_DIR, str(where))
    script, placeholders = re.subn(r"^name=\S+ ip=\S+", f"name={NAME} ip={IP}", script, flags=re.M)
    assert placeholders == 1, "the recipe sets the name and the address on one line: name=... ip=..."
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return where


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tls")
    root.chmod(0o755)  # nginx's workers (nobody, when the tests run as root) read under it
    return run_recipe(root / "etc-ssl-specsplit")


def nginx_conf_around(snippet_text: str, runtime: Path) -> Path:
    """A whole nginx.conf for an unprivileged nginx in `runtime` that includes `snippet_text` in `http`, as
    Debian's /etc/nginx/nginx.conf includes /etc/nginx/conf.d/*.conf."""
    (runtime / "specsplit.conf").write_text(snippet_text)
    temps = "\n".join(f"    {kind}_temp_path {runtime}/{kind}_temp;"
                      for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    conf = runtime / "nginx.conf"
    conf.write_text(f"worker_processes 1;\npid {runtime}/nginx.pid;\nerror_log {runtime}/error.log warn;\n"
                    f"events {{ worker_connections 64; }}\nhttp {{\n    access_log {runtime}/access.log;\n{temps}\n"
                    f"    include {runtime}/specsplit.conf;\n}}\n")
    return conf


def nginx_test(conf: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([nginx_binary(), "-t", "-p", str(conf.parent), "-c", str(conf), "-e",
                           str(conf.parent / "error.log")], capture_output=True, text=True, timeout=30)


def test_the_recipe_writes_the_files_the_snippet_reads_for_both_the_name_and_the_address(cert_dir: Path) -> None:
    paths = read_paths(snippet())
    for path in paths.values():
        assert path.startswith(CERT_DIR + "/"), path
        assert (cert_dir / Path(path).relative_to(CERT_DIR)).is_file(), f"the recipe does not write {path}"
    key = cert_dir / Path(paths["ssl_certificate_key"]).relative_to(CERT_DIR)
    assert key.stat().st_mode & 0o077 == 0, "the key is readable by others"
    cert = cert_dir / Path(paths["ssl_certificate"]).relative_to(CERT_DIR)
    san = subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-ext", "subjectAltName"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert f"DNS:{NAME}" in san and f"IP Address:{IP}" in san, san


def test_the_device_keeps_the_cloud_certificate_under_the_name_it_passes_to_ca_cert() -> None:
    """A self-signed certificate is its own CA: the file the device copies is the one nginx serves, and every
    `--ca-cert` names that copy."""
    commands = device_commands()
    served = read_paths(snippet())["ssl_certificate"]
    (copy,) = [shlex.split(line) for line in commands.splitlines() if line.startswith("scp ")]
    assert copy[1].endswith(":" + served), copy
    given = re.findall(r"--ca-cert (\S+)", commands)
    assert given and set(given) == {copy[2]}, given


def test_the_readme_says_how_to_reload_nginx_and_open_both_ports() -> None:
    ops = block("bash", "systemctl reload nginx")
    assert "nginx -t && systemctl reload nginx" in ops
    ports = re.findall(r"^\s*listen (\d+) ", snippet(), flags=re.M)
    assert len(ports) == 2
    for port in ports:
        assert f"ufw allow {port}/tcp" in ops, port


def test_nginx_accepts_the_snippet_with_the_recipes_files(cert_dir: Path, tmp_path: Path) -> None:
    """`nginx -t` of Debian 12's nginx (1.22) on the snippet, which reads the recipe's certificate and key."""
    tmp_path.chmod(0o755)
    conf = nginx_conf_around(snippet().replace(CERT_DIR, str(cert_dir)), tmp_path)
    out = nginx_test(conf)
    assert out.returncode == 0, out.stderr
    assert "unknown directive" not in out.stderr and "[emerg]" not in out.stderr


@pytest.fixture(scope="module")
def cloud(tiny_pair: tuple[Path, Path]) -> Iterator[CloudProcess]:
    with CloudProcess(tiny_pair[0]) as c:
        yield c


@pytest.fixture(scope="module")
def tls_nginx(cert_dir: Path, cloud: CloudProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, int]]:
    """The snippet served by a real nginx in front of `cloud`: its two listen ports moved to free loopback ports,
    its upstreams (the cloud's default ports) to the cloud's; {README port: the port it listens on here}."""
    http_default, grpc_default = (CloudSettings.model_fields[f].default for f in ("http_port", "grpc_port"))
    text = snippet()
    assert f"proxy_pass http://127.0.0.1:{http_default};" in text
    assert f"grpc_pass grpc://127.0.0.1:{grpc_default};" in text
    text = text.replace(f"127.0.0.1:{http_default};", f"127.0.0.1:{cloud.http_port};")
    text = text.replace(f"127.0.0.1:{grpc_default};", f"127.0.0.1:{cloud.grpc_port};")
    ports = {int(p): free_port() for p in re.findall(r"^\s*listen (\d+) ", text, flags=re.M)}
    text = re.sub(r"^(\s*)listen (\d+) ", lambda m: f"{m[1]}listen 127.0.0.1:{ports[int(m[2])]} ", text, flags=re.M)
    runtime = tmp_path_factory.mktemp("nginx")
    runtime.chmod(0o755)
    conf = nginx_conf_around(text.replace(CERT_DIR, str(cert_dir)), runtime)
    proc = subprocess.Popen([nginx_binary(), "-p", str(runtime), "-c", str(conf), "-e", str(runtime / "error.log"),
                             "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for port in ports.values():
            deadline = time.monotonic() + 15
            while True:
                assert proc.poll() is None, (runtime / "error.log").read_text(errors="replace")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"nginx is not listening on {port}"
                    time.sleep(0.05)
        yield ports
    finally:
        proc.send_signal(signal.SIGQUIT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def model_id(*flags: str) -> str:
    settings = settings_from_args(build_parser().parse_args(["generate", "x", *flags]))
    transport = transport_for(settings)
    try:
        return transport.get_model(10.0).model_id
    finally:
        transport.close()


def test_the_edge_reaches_the_cloud_through_the_snippet_with_ca_cert(tls_nginx: dict[str, int], cert_dir: Path,
                                                                      cloud: CloudProcess) -> None:
    """REST dialled by address and gRPC dialled by name, each checked against the recipe's cert.pem (the file the
    device keeps as its --ca-cert), reach the cloud behind nginx."""
    cert = str(cert_dir / Path(read_paths(snippet())["ssl_certificate"]).relative_to(CERT_DIR))
    want = model_id("--cloud", cloud.http_url)
    rest_port, grpc_port = sorted(tls_nginx)  # the README's 443 (REST) and 50443 (gRPC)
    assert model_id("--cloud", f"https://{IP}:{tls_nginx[rest_port]}", "--ca-cert", cert) == want
    assert model_id("--grpc", f"{NAME}:{tls_nginx[grpc_port]}", "--grpc-tls", "--ca-cert", cert) == want
