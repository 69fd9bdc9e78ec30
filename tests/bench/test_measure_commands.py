"""Every `specsplit-bench` measurement subcommand (bench/run.py MEASURES) answers `--help` from its own
parser, loading no model and starting no server; a name that is none of them still gets the main parser's
usual error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.run import MEASURES, main

# each subcommand's first option or positional, as its --help names it
FIRST = {
    "acceptance": "--target",
    "block-size": "--model",
    "cloud-down": "--requests",
    "failover": "--kills",
    "overhead": "--model",
    "slow-link": "--rtt-ms",
    "stream-switch": "PROMPTS",
    "profile-rounds": "--model",
    "peer-loop": "--prompts",
}


def test_every_measure_is_checked() -> None:
    assert set(FIRST) == set(MEASURES)


@pytest.mark.parametrize("name", sorted(MEASURES))
def test_measure_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: specsplit-bench {name} ")
    assert FIRST[name] in out


def test_help_loads_no_model_runtime() -> None:
    """--help of every subcommand leaves torch unloaded when nothing loaded it before (a fresh process)."""
    code = ("import sys\nfrom bench.run import MEASURES, main\n"
            "for n in MEASURES:\n"
            "    try:\n        main([n, '--help'])\n    except SystemExit:\n        pass\n"
            "sys.stderr.write(str('torch' in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stderr.strip().endswith("False"), r.stderr


def test_unknown_name_is_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["no-such-measure"])
    assert exc.value.code == 2
    assert "unrecognized arguments: no-such-measure" in capsys.readouterr().err
