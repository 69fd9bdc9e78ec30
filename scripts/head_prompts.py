"""The prompt set the drafts are trained on, and the held-out one they are measured on.

Templates x subjects, in five kinds (explanation, lists, advice and comparison, short creative tasks,
code). Whole subjects and code tasks are held out for evaluation, and every prompt of
`bench/real_pair.py` is checked to be absent from training, so the evaluation prompts are unseen in
subject as well as wording. Deterministic for a seed.
"""

from __future__ import annotations

import random

SUBJECTS = [
    "photosynthesis", "the water cycle", "black holes", "how vaccines work", "the French Revolution",
    "climate change", "the stock market", "machine learning", "the human heart", "volcanoes",
    "the Roman Empire", "electric cars", "the internet", "DNA", "renewable energy", "the moon landing",
    "honey bees", "earthquakes", "the immune system", "inflation", "the printing press", "rainbows",
    "gravity", "the solar system", "recycling", "sleep", "coffee", "the Great Wall of China",
    "democracy", "antibiotics", "plate tectonics", "the Renaissance", "cloud computing", "tides",
    "the human brain", "dinosaurs", "electricity", "the ocean", "bread baking", "the Olympic Games",
    "meditation", "compound interest", "rain forests", "the speed of light", "World War I", "jazz music",
    "photography", "the periodic table", "nutrition", "bicycles", "chess", "the Amazon river",
    "public speaking", "time management", "gardening", "the theory of evolution", "airplanes",
    "the Industrial Revolution", "batteries", "glaciers", "the Silk Road", "smartphones",
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
CODE_TASKS = [
    "reverse a string", "check whether a number is prime", "merge two sorted lists",
    "count the words in a text", "find the largest element of a list",
    "remove duplicates from a list while keeping order", "compute the factorial of n",
    "check whether a string is a palindrome", "flatten a nested list", "read a CSV file and print each row",
    "sort a list of dictionaries by a key", "compute the greatest common divisor of two numbers",
    "convert Celsius to Fahrenheit", "find the second smallest number in a list", "binary search a sorted list",
    "count vowels in a string", "transpose a matrix", "compute the mean and median of a list",
    "validate an email address with a regular expression", "return the intersection of two lists",
    "capitalize the first letter of every word", "compute the sum of the digits of a number",
    "find all anagrams of a word in a list", "implement a stack class", "implement a queue with two stacks",
    "parse a JSON string and print its keys", "check whether brackets in a string are balanced",
    "rotate a list by k positions", "compute the power set of a list", "convert a decimal number to binary",
    "find the longest common prefix of a list of strings", "count the frequency of each character",
    "generate the first n prime numbers", "compute the area of a circle", "parse a URL into its parts",
    "chunk a list into pieces of size n", "compute a running average", "merge two dictionaries",
    "find the missing number in a list from 1 to n", "check whether two strings are anagrams",
    "implement bubble sort", "implement quicksort", "implement a linked list", "compute n choose k",
    "write a decorator that times a function", "read a text file and count its lines",
    "remove whitespace from both ends of every line", "compute the Levenshtein distance",
    "return the most common element of a list", "group words by their first letter",
    "simulate rolling two dice", "convert a Roman numeral to an integer", "compute compound interest",
    "find the depth of a binary tree", "implement depth-first search on a graph",
    "implement breadth-first search on a graph", "format a number with thousands separators",
    "check whether a year is a leap year", "split a sentence into words and sort them",
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
