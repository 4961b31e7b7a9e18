"""The prompt set for self-distillation, written by the project.

Two kinds: open questions built from tasks x topics (chat replies), and
tasks over a passage taken from the Python standard library's own
docstrings (summarise, rewrite, reformat, extract, explain), which is text
this machine has offline and which teaches a drafter to copy from the
prompt, the case prompt lookup is good at and heads trained on chat alone
miss.
"""

from __future__ import annotations

import importlib
import inspect
import random

TOPICS = [
    "hash tables", "binary search", "HTTP caching", "Git branches", "unit testing",
    "Python generators", "SQL joins", "TCP handshakes", "garbage collection", "recursion",
    "REST APIs", "regular expressions", "public-key cryptography", "Docker containers",
    "the CAP theorem", "floating point rounding", "photosynthesis", "the water cycle",
    "compound interest", "time management", "writing a cover letter", "learning a language",
    "healthy sleep", "baking bread", "climate change", "the French Revolution",
    "black holes", "vaccines", "electric cars", "supply and demand", "chess openings",
    "meditation", "the stock market", "volcanoes", "the human heart", "machine learning",
]

TASKS = [
    "Explain {t} to a beginner in a short paragraph.",
    "Give three practical tips about {t}.",
    "What are the most common misconceptions about {t}?",
    "Write a short FAQ with three questions about {t}.",
    "Summarise the key ideas of {t} in five bullet points.",
    "Compare {t} with a related idea and say when each matters.",
    "Write a haiku about {t}.",
    "Describe {t} to a ten-year-old.",
    "List the steps someone should follow to get started with {t}.",
    "Write a two-sentence definition of {t}, then an example.",
]

CODE_TASKS = [
    "Write a Python function that {c}. Include a docstring.",
    "Write a Python function that {c}, then show one example call.",
    "Explain how you would write code that {c}, step by step.",
]

CODE_SUBJECTS = [
    "reverses the words in a sentence", "checks whether a string is a palindrome",
    "counts word frequencies in a text", "merges two sorted lists", "flattens a nested list",
    "computes the n-th Fibonacci number iteratively", "removes duplicates while keeping order",
    "parses a CSV line into fields", "validates an email address with a regular expression",
    "finds the largest element of a list without max()", "converts Celsius to Fahrenheit",
    "groups a list of words by their first letter", "returns the prime numbers below n",
    "reads a file and returns its non-empty lines", "computes the median of a list",
]

CODE_EDIT = [
    ("Add type hints to this function:\n\n{code}"),
    ("Find and fix the bug in this function:\n\n{code}"),
    ("Rewrite this function to be more readable, keeping its behaviour:\n\n{code}"),
    ("Add a docstring to this function:\n\n{code}"),
]

SNIPPETS = [
    "def average(xs):\n    total = 0\n    for x in xs:\n        total += x\n    return total / len(xs) + 1",
    "def is_even(n):\n    return n % 2 == 1",
    "def first_word(s):\n    return s.split(' ')[1]",
    "def count_vowels(text):\n    n = 0\n    for ch in text:\n        if ch in 'aeiou':\n            n += 1\n    return n",
    "def clamp(x, lo, hi):\n    if x < lo:\n        return hi\n    if x > hi:\n        return lo\n    return x",
    "def join_names(names):\n    out = ''\n    for name in names:\n        out = out + name + ', '\n    return out",
]

PASSAGE_TASKS = [
    "Summarise the following text in two sentences:\n\n{p}",
    "Rewrite the following text in plain English:\n\n{p}",
    "Turn the following text into a bulleted list:\n\n{p}",
    "Quote the first sentence of the following text, then explain it:\n\n{p}",
    "Reformat the following text as a short Markdown section with a title:\n\n{p}",
]

# Standard-library modules whose docstrings are prose passages.
DOC_MODULES = [
    "json", "csv", "argparse", "collections", "functools", "itertools", "heapq", "bisect",
    "textwrap", "string", "re", "pathlib", "shutil", "tempfile", "logging", "unittest",
    "contextlib", "dataclasses", "enum", "fractions", "decimal", "statistics", "random",
    "datetime", "calendar", "zipfile", "tarfile", "gzip", "hashlib", "hmac", "secrets",
    "base64", "pickle", "copy", "pprint", "difflib", "shlex", "glob", "fnmatch", "sqlite3",
    "threading", "queue", "sched", "socket", "http.client", "urllib.parse", "email",
    "html", "xml.dom", "wave", "colorsys", "timeit", "trace", "doctest", "abc", "typing",
]


def passages(max_chars: int = 900) -> list[str]:
    """Prose from module, class and function docstrings of the standard library."""
    out: list[str] = []
    for name in DOC_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        docs = [inspect.getdoc(mod) or ""]
        for _, obj in sorted(vars(mod).items()):
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == name:
                docs.append(inspect.getdoc(obj) or "")
        for doc in docs:
            doc = doc.strip()
            if len(doc) >= 200:
                out.append(doc[:max_chars])
    return out


def build_prompts(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    prompts = [task.format(t=t) for t in TOPICS for task in TASKS]
    prompts += [task.format(c=c) for c in CODE_SUBJECTS for task in CODE_TASKS]
    prompts += [task.format(code=code) for code in SNIPPETS for task in CODE_EDIT]
    texts = passages()
    rng.shuffle(texts)
    prompts += [rng.choice(PASSAGE_TASKS).format(p=p) for p in texts[:240]]
    rng.shuffle(prompts)
    return prompts
