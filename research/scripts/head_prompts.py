"""The prompt set the drafts are trained on, and the held-out one they are measured on.

Templates x subjects, in five kinds (explanation, lists, advice and comparison, short creative tasks,
code). Whole subjects and code tasks are held out for evaluation, and every prompt of
`bench/real_pair.py` is checked to be absent from training, so the evaluation prompts are unseen in
subject as well as wording. Deterministic for a seed.
"""

from __future__ import annotations

import random

from research.drafting.distill_prompts import CODE_TASKS as DISTILL_TASKS
from research.drafting.distill_prompts import TOPICS as DISTILL_TOPICS

# the distillation's topics (drafting/distill_prompts.py), then more
SUBJECTS = [*DISTILL_TOPICS,
    "ancient Egypt", "the pyramids", "the Cold War", "nuclear power", "solar panels", "wind turbines",
    "the human skeleton", "digestion", "blood types", "bacteria", "viruses", "fungi", "coral reefs",
    "deserts", "the Arctic", "penguins", "whales", "elephants", "migration of birds", "butterflies",
    "the Milky Way", "comets", "Mars", "Jupiter", "telescopes", "satellites", "GPS", "3D printing",
    "blockchain", "encryption", "passwords", "open source software", "databases", "operating systems",
    "compilers", "the history of computers", "video games", "social media", "email", "music theory",
    "the violin", "opera", "ballet", "impressionist painting", "sculpture", "architecture", "bridges",
    "skyscrapers", "trains", "ships", "rockets", "the wheel", "paper", "glass", "steel", "plastics",
    "chocolate", "tea", "cheese", "fermentation", "spices", "vegetarian cooking", "running", "yoga",
    "swimming", "football", "the marathon", "mountains", "rivers", "lakes", "weather forecasting",
    "hurricanes", "lightning", "snow", "the seasons", "calendars", "clocks", "money", "banks",
    "taxes", "supply and demand", "trade", "languages", "writing systems", "libraries", "newspapers",
    "the scientific method", "statistics", "probability", "prime numbers", "geometry", "algebra",
    "the number zero", "infinity", "logic puzzles", "friendship", "habits", "motivation", "stress",
    "learning a language", "reading", "journaling", "volunteering", "city planning", "public transport",
]
# the distillation's tasks (drafting/distill_prompts.py) without the benchmark's own, then more
CODE_TASKS = [*(("parse a URL into its parts" if t == "download nothing but parse a URL" else t)
                for t in DISTILL_TASKS if t != "return the n-th Fibonacci number"),
    "implement a least-recently-used cache", "compute the dot product of two vectors",
    "find the longest word in a sentence", "shuffle a list", "validate a password's strength",
    "convert a string to title case", "compute the median of two sorted arrays", "implement merge sort",
    "find pairs in a list that sum to a target", "count the lines of code in a directory",
    "print a multiplication table", "implement a simple calculator", "generate a random password",
]
TOPIC_TEMPLATES = {
    "explain": ["Explain {t} in simple terms.", "What is {t}?", "How does {t} work?",
                "Explain {t} to a ten-year-old.", "What are the main ideas behind {t}?",
                "Summarize the history of {t}.", "Why is {t} important?", "Describe {t} in a few sentences."],
    "list": ["Give me three interesting facts about {t}.", "List five things everyone should know about {t}.",
             "What are common misconceptions about {t}?", "List the pros and cons of {t}.",
             "Give me a short list of questions to ask about {t}."],
    "advice": ["How can I learn more about {t}?", "What is a good way to teach {t} to beginners?",
               "What are some tips for getting started with {t}?", "How does {t} affect everyday life?"],
    "creative": ["Write a haiku about {t}.", "Write a short poem about {t}.", "Write a short story involving {t}.",
                 "Write a short paragraph about {t}.", "Write a limerick about {t}.",
                 "Write a tweet announcing a discovery about {t}."],
}
CODE_TEMPLATES = [
    "Write a Python function to {t}.", "Write a Python function that can {t}. Include a docstring.",
    "How do I {t} in Python? Show an example.", "Explain how to {t} in Python, step by step.",
    "Write a JavaScript function to {t}.", "Can you write code to {t}?",
    "Write a short Python program to {t} and explain how it works.", "Write a unit test for a function that can {t}.",
]
EVAL_FRACTION = 0.1  # share of subjects and code tasks held out entirely for evaluation


def build_prompts(seed: int = 0, eval_size: int = 48) -> tuple[list[str], list[str]]:
    """(train prompts, eval prompts): the eval prompts use held-out subjects and tasks only."""
    rng = random.Random(seed)
    subjects, tasks = SUBJECTS[:], CODE_TASKS[:]
    rng.shuffle(subjects)
    rng.shuffle(tasks)
    n_subj, n_task = int(len(subjects) * EVAL_FRACTION), int(len(tasks) * EVAL_FRACTION)
    parts = {"eval": (subjects[:n_subj], tasks[:n_task]), "train": (subjects[n_subj:], tasks[n_task:])}
    out: dict[str, list[str]] = {}
    for name, (subj, task) in parts.items():
        prompts = [tpl.format(t=t) for t in subj for tpls in TOPIC_TEMPLATES.values() for tpl in tpls]
        prompts += [tpl.format(t=t) for t in task for tpl in CODE_TEMPLATES]
        rng.shuffle(prompts)
        out[name] = prompts
    evals = out["eval"][:eval_size]
    from bench.real_pair import PROMPTS as BENCH_PROMPTS  # the bench's own unseen prompts
    train = [p for p in out["train"] if p not in BENCH_PROMPTS]
    assert not set(train) & set(evals)
    return train, evals


DOC_TEMPLATES = [
    "Explain what the Python function `{name}` does, with a short example.",
    "What is `{name}` in Python's standard library for? {summary}",
    "Write a Python function that does the same as `{name}`: {summary}",
    "I read this in the docs of `{name}`: \"{summary}\" What does it mean?",
]


def doc_prompts(limit: int = 1500, seed: int = 3) -> list[str]:
    """Chat prompts about the standard library's documented functions and classes (their docstrings'
    first sentences), four templates; the files the benchmarks evaluate on are left out and no prompt
    equals a benchmark or held-out prompt."""
    import ast
    import json
    import os
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    held = {json.loads(line)["source"].split()[0].removeprefix("stdlib/")
            for line in (repo / "bench" / "prompts" / "code.jsonl").read_text().splitlines()}
    root = Path(os.__file__).parent
    found: list[tuple[str, str]] = []
    for path in sorted(root.glob("*.py")):
        if path.name in held:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                first = " ".join((doc or "").split("\n\n")[0].split())
                if 30 <= len(first) <= 300:
                    found.append((f"{path.stem}.{node.name}", first))
    rng = random.Random(seed)
    rng.shuffle(found)
    from bench.real_pair import PROMPTS as BENCH_PROMPTS
    _, evals = build_prompts()
    out = [rng.choice(DOC_TEMPLATES).format(name=name, summary=summary) for name, summary in found[:limit]]
    return [p for p in out if p not in BENCH_PROMPTS and p not in evals]
