"""What the ops tests share: promtool / prometheus binaries, and the series names a registry exports."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from prometheus_client import CollectorRegistry

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def binary(name: str) -> str:
    """The path of a Prometheus tool; a clear failure (not a skip) when it is missing."""
    found = shutil.which(name) or next((p for p in (f"/usr/bin/{name}", f"/usr/local/bin/{name}")
                                        if Path(p).exists()), None)
    if found is None:
        raise RuntimeError(f"{name} is not installed: bash scripts/install_prometheus.sh (scripts/test.sh runs it)")
    return found


def promtool(*args: str, stdin: bytes | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([binary("promtool"), *args], input=None if stdin is None else stdin.decode(),
                          capture_output=True, text=True, timeout=60, cwd=cwd)


def exported_series(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry can expose (labelled series included before their first use)."""
    names: set[str] = set()
    for fam in registry.collect():
        if fam.type == "counter":
            names |= {fam.name + "_total", fam.name + "_created"}
        elif fam.type == "histogram":
            names |= {fam.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(fam.name)
    return names
