"""Write bench/prompts/code.jsonl from standard-library files the demo pair never trained on.

A file is held out by the same rule training uses (drafting/corpus.py: crc32 of its path). Each prompt
is the ~600 characters of source before the body of a function: the model writes the body.
Rerun to regenerate; the committed file is what the benchmark uses.
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from research.drafting.corpus import stdlib_files  # noqa: E402

FILES = ["copy.py", "glob.py", "hmac.py", "sched.py", "shutil.py", "site.py", "symtable.py", "uu.py",
         "modulefinder.py", "http/server.py", "asyncio/subprocess.py", "email/contentmanager.py"]


def prompt_from(text: str) -> str:
    lines = text.splitlines(keepends=True)
    defs = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and line.rstrip().endswith(":")]
    i = defs[len(defs) // 2]  # a function from the middle of the file
    out = "".join(lines[: i + 1])[-600:]
    return out[out.index("\n") + 1 :]  # start on a whole line


def main() -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    held = {p.relative_to(root).as_posix(): p for p in stdlib_files()[1]}
    out = Path(__file__).resolve().parent.parent / "bench" / "prompts" / "code.jsonl"
    with out.open("w") as f:
        for rel in FILES:
            assert rel in held, f"{rel} is not held out"
            text = prompt_from(held[rel].read_text(encoding="utf-8"))
            f.write(json.dumps({"id": rel, "source": f"stdlib/{rel} (held out)", "text": text}) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
