"""scripts/demo.sh: stdout holds the answer alone, so a script reading it reads the answer, not set-up's chatter.

The demo runs with stand-ins for what it calls (set-up printing pip's and setuptools' banners on stdout, a cloud,
the edge printing its answer on stdout and its summary on stderr), so the test checks the demo's own plumbing in
a second, not the models."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BANNER = "Please be careful with folders in your working directory"


def _script(path: Path, text: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + text)
    path.chmod(0o755)


def test_the_demos_stdout_is_the_answer_and_setups_chatter_goes_to_stderr(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "demo.sh", tmp_path / "scripts" / "demo.sh")
    _script(tmp_path / "scripts" / "setup.sh", f'echo "Successfully installed specsplit"; echo "{BANNER}"; '
                                               'echo "pip: a warning" >&2\n')
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    # python: the readiness and model probes answer at once; anything else is the real interpreter
    _script(bin_dir / "python", 'case "$*" in *readyz*) exit 0 ;; *v1/model*) echo "pytorch / test"; exit 0 ;; esac\n'
                                f'exec {sys.executable} "$@"\n')
    _script(bin_dir / "specsplit-cloud", "exec sleep 30\n")
    _script(bin_dir / "specsplit-edge", 'echo "def fib(n): ..."; echo "mode  speculative" >&2\n')
    env = {**os.environ, "SPECSPLIT_DEMO_HTTP_PORT": "0", "SPECSPLIT_DEMO_GRPC_PORT": "0"}
    done = subprocess.run(["bash", "scripts/demo.sh", "--pair", "tiny"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "def fib(n): ...\n"
    assert BANNER in done.stderr and "pip: a warning" in done.stderr and "demo pair" in done.stderr
    assert "mode  speculative" in done.stderr
