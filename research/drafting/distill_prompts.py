"""The distilled draft's prompts: chat and code templates x topics and tasks, with whole topics held out.

Deterministic for a seed; the evaluation prompts share neither subject nor task with training. The
feature-fed head's larger prompt set (research/scripts/head_prompts.py) starts from these topics and tasks.
"""

from __future__ import annotations

import random

CODE_TASKS = [
    "reverse a string", "check whether a number is prime", "return the n-th Fibonacci number",
    "merge two sorted lists", "count the words in a text", "find the largest element of a list",
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
    "generate the first n prime numbers", "compute the area of a circle", "download nothing but parse a URL",
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
]
CODE_TEMPLATES = [
    "Write a Python function to {t}.", "Write a Python function that can {t}. Include a docstring.",
    "How do I {t} in Python? Show an example.", "Explain how to {t} in Python, step by step.",
    "Write a JavaScript function to {t}.", "Can you write code to {t}?",
    "Write a short Python program to {t} and explain how it works.",
]
TOPICS = [
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
]
CHAT_TEMPLATES = [
    "Explain {t} in simple terms.", "What is {t}?", "Give me three interesting facts about {t}.",
    "Write a short paragraph about {t}.", "Why is {t} important?", "Explain {t} to a ten-year-old.",
    "What are the main ideas behind {t}?", "Write a haiku about {t}.", "Summarize the history of {t}.",
    "What are common misconceptions about {t}?",
]
EVAL_FRACTION = 0.12  # share of topics and tasks held out entirely for evaluation


def build_prompts(seed: int = 0) -> tuple[list[str], list[str]]:
    """(train prompts, eval prompts); eval prompts use held-out topics and tasks only."""
    rng = random.Random(seed)
    tasks, topics = CODE_TASKS[:], TOPICS[:]
    rng.shuffle(tasks)
    rng.shuffle(topics)
    n_task_eval, n_topic_eval = int(len(tasks) * EVAL_FRACTION), int(len(topics) * EVAL_FRACTION)
    split = {"eval": (tasks[:n_task_eval], topics[:n_topic_eval]),
             "train": (tasks[n_task_eval:], topics[n_topic_eval:])}
    out: dict[str, list[str]] = {}
    for name, (ts, ps) in split.items():
        prompts = [tpl.format(t=t) for t in ts for tpl in CODE_TEMPLATES]
        prompts += [tpl.format(t=t) for t in ps for tpl in CHAT_TEMPLATES]
        rng.shuffle(prompts)
        out[name] = prompts
    return out["train"], out["eval"][:40]
