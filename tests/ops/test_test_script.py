"""scripts/test.sh, run as written in a copy of the checkout whose setup, installers and pytest are stand-ins that
record their calls: the whole suite installs nginx and prometheus; a selection installs what its files run (the
replica tests nginx, the promtool tests prometheus) and nothing for tests/shared; a selection naming no test path
installs both. .ci/run keeps calling the script with no arguments."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.ops.tools import REPO

STUBS = ("scripts/setup.sh", "scripts/install_nginx.sh", "scripts/install_prometheus.sh")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real scripts/test.sh and tests/ (linked) beside stand-in setup, installers and .venv/bin/python, each
    appending its name and arguments to calls.log."""
    root = tmp_path_factory.mktemp("checkout")
    (root / "scripts").mkdir()
    (root / "scripts" / "test.sh").write_text((REPO / "scripts" / "test.sh").read_text())
    (root / "tests").symlink_to(REPO / "tests")
    (root / ".venv" / "bin").mkdir(parents=True)
    for stub in (*STUBS, ".venv/bin/python"):
        path = root / stub
        path.write_text(f'#!/usr/bin/env bash\necho "{stub} $*" >> "{root}/calls.log"\n')
        path.chmod(0o755)
    return root


def installs(checkout: Path, *selection: str) -> set[str]:
    """Which installers `bash scripts/test.sh SELECTION` ran (setup and pytest always run)."""
    log = checkout / "calls.log"
    log.unlink(missing_ok=True)
    done = subprocess.run(["bash", "scripts/test.sh", *selection], cwd=checkout, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATH": os.environ["PATH"]})
    assert done.returncode == 0, done.stdout + done.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("scripts/setup.sh") and any(c.startswith(".venv/bin/python -m pytest") for c in calls)
    return {c.split()[0].removeprefix("scripts/install_").removesuffix(".sh") for c in calls if "install_" in c}


@pytest.mark.parametrize(("selection", "wanted"), [
    ((), {"nginx", "prometheus"}),
    (("tests/shared",), set()),
    (("tests/shared", "-x"), set()),
    (("tests/cloud/test_rest.py",), set()),
    (("tests/e2e/test_replicas.py::test_x",), {"nginx"}),
    (("tests/ops/test_tls_recipe.py",), {"nginx"}),
    (("tests/ops",), {"nginx", "prometheus"}),
    (("tests/edge/test_prom.py", "tests/shared"), {"prometheus"}),
    (("-k", "replica"), {"nginx", "prometheus"}),
])
def test_the_installers_run_only_for_the_tests_that_need_them(checkout: Path, selection: tuple[str, ...],
                                                              wanted: set[str]) -> None:
    assert installs(checkout, *selection) == wanted


def test_ci_runs_the_whole_suite_through_the_script() -> None:
    assert "\nbash scripts/test.sh\n" in (REPO / ".ci" / "run").read_text()
