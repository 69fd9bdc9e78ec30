"""What the deploy tests share: docker-compose.yml as `docker compose config` resolves it, the memory the
coder pair's processes were measured to peak at and the disk its prepared files take, Kubernetes quantities and
.dockerignore's matching rules."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE_FILE = REPO / "docker-compose.yml"

# Peak resident memory of the coder pair's processes (Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft) as the deploy
# files run them, as the README's requirements table records them with their machines and dates (the place of
# record; tests/ops/test_deploy_files.py checks these agree with it): the cloud on PyTorch in float32, 15.1 GB
# (BENCHMARKS.md, "The cloud on llama.cpp"); the PyTorch edge 9,278 MB (BENCHMARKS.md, "The draft's cost and
# memory"); `specsplit-models prepare qwen-coder` 13.5 GB (models/README.md, "The coder pair").
CLOUD_PEAK_BYTES = 15_100 * 10**6
EDGE_PEAK_BYTES = 9_278 * 10**6
PREPARE_PEAK_BYTES = 13_500 * 10**6
# what `prepare qwen-coder` leaves on disk (models/README.md, `du -sb`: 11.3 GB; the README's table too)
PREPARED_BYTES = 11_261 * 10**6
# a memory limit must exceed its process's measured peak by this factor at least
HEADROOM = 1.25


def compose_command() -> list[str]:
    """`docker compose`: skipped without a docker client; with one, the plugin is installed when missing
    (deploy/install_compose.sh) and a failure to do so fails the test."""
    if shutil.which("docker") is None:
        pytest.skip("no docker client on this machine")
    if _compose_works():
        return ["docker", "compose"]
    out = subprocess.run(["bash", str(DEPLOY / "install_compose.sh")], capture_output=True, text=True, timeout=600)
    if out.returncode != 0 or not _compose_works():
        pytest.fail(f"docker compose is missing and deploy/install_compose.sh could not install it:\n{out.stderr}")
    return ["docker", "compose"]


def _compose_works() -> bool:
    done = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=60)
    return done.returncode == 0 and "v2." in done.stdout


def compose_env() -> dict[str, str]:
    """The environment without the variables that docker-compose.yml reads or that steer compose itself."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SPECSPLIT_", "COMPOSE_"))}


def run_compose_config(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`docker compose config` of `path` with every profile on (no engine needed)."""
    cmd = [*compose_command(), "-f", str(path), "-p", "specsplit", "--profile", "*", "config", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=path.parent, env=compose_env())


@functools.cache
def resolved_compose() -> dict[str, Any]:
    """docker-compose.yml as compose itself reads it: anchors merged, variables at their defaults, sizes in bytes."""
    out = run_compose_config(COMPOSE_FILE, "--format", "json")
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def runs_cloud(svc: dict[str, Any]) -> bool:
    """A compose service that runs specsplit-cloud (directly or under torchrun)."""
    entry = " ".join(svc.get("entrypoint") or [])
    return svc.get("image", "").startswith("specsplit-cloud") and (not entry or entry.endswith("specsplit-cloud"))


K8S_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity(q: str | int) -> float:
    """A Kubernetes quantity ("12Gi", "500m", "2") as a number."""
    text = str(q)
    if text.endswith("m"):
        return float(text[:-1]) / 1000
    for unit in sorted(K8S_UNITS, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[: -len(unit)]) * K8S_UNITS[unit]
    return float(text)


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(exception, pattern) per line of a .dockerignore, in order; patterns as Docker reads them (Go's
    filepath.Match per path element, `**` for any number of directories)."""
    rules = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = os.path.normpath(line.removeprefix("!").strip()).lstrip("/")
        rules.append((exception, re.compile(_glob_regex(pattern))))
    return rules


def _glob_regex(pattern: str) -> str:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            c = pattern[i]
            out += "[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
            i += 1
    return f"^{out}$"


def dockerignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether Docker leaves `path` (relative, with /) out of the build context: a rule matches the path or
    one of its parent directories, and the last rule that matches decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    left_out = False
    for exception, rx in rules:
        if any(rx.match(c) for c in candidates):
            left_out = not exception
    return left_out


def build_context(root: Path, rules: list[tuple[bool, re.Pattern[str]]], exceptions: list[str]) -> dict[str, int]:
    """{path: bytes} of every file Docker would send from `root`. A directory left out is not walked unless an
    exception line names something under it."""
    files: dict[str, int] = {}
    for here, dirs, names in os.walk(root):
        rel = Path(here).relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        dirs[:] = [d for d in dirs if not dockerignored(prefix + d, rules)
                   or any(e.startswith(prefix + d + "/") for e in exceptions)]
        for name in names:
            path = Path(here) / name
            if not path.is_symlink() and not dockerignored(prefix + name, rules):
                files[prefix + name] = path.stat().st_size
    return files
