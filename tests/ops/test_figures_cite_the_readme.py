"""docker-compose.yml and scripts/demo.sh state the measured sizes the README's requirements table states (its place
of record) and no others: every figure in GB either file gives, a checkpoint's weights apart, is written in the
table's memory, disk or first-run rows, and each file names the table. The README's "Your own model" says what
`convert` writes from a GGUF as modelprep/convert.py does: no float32 safetensors unless asked for."""

from __future__ import annotations

import re

import pytest

from tests.ops.tools import REPO

# a figure in GB, not the size of a checkpoint's weights (a property of the file, not a measurement)
FIGURE = re.compile(r"(?<![\d.])(\d+(?:\.\d+)?) GB(?! of (?:float32 )?weights)")
ROWS = ("| memory |", "| disk |", "| time, first run |")


def table_figures() -> set[str]:
    lines = (REPO / "README.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith(ROWS)]
    assert len(rows) == len(ROWS)
    return set(FIGURE.findall("\n".join(rows)))


@pytest.mark.parametrize("name", ["docker-compose.yml", "scripts/demo.sh"])
def test_every_size_a_file_states_is_the_readmes(name: str) -> None:
    text = (REPO / name).read_text()
    stated = FIGURE.findall(text)
    assert stated and set(stated) <= table_figures(), (name, sorted(set(stated) - table_figures()))
    assert 'README.md "Requirements"' in text or "README.md, \"Requirements\"" in text


def test_the_readme_says_convert_writes_safetensors_from_a_gguf_only_when_asked() -> None:
    text = (REPO / "README.md").read_text()
    own = text[text.index("## Your own model"):text.index("## Reference")]
    assert "--safetensors" in own and "safetensors for PyTorch, the tokenizer" not in own
