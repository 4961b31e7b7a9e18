"""The prompt set for self-distillation, written by the project.

Built programmatically from text this machine has offline, so that it is
large and varied: open questions (instruction templates x topics), tasks
over prose passages from the Python standard library's docstrings
(summarise, rewrite, reformat, extract, explain, question answering), code
tasks over short standard-library functions (explain, type hints,
docstrings, tests, refactoring, a planted bug to fix), reformatting of
generated tables and settings (CSV, Markdown, JSON), story continuations
and short writing tasks.

`build_prompts("train")` and `build_prompts("heldout")` are disjoint by
construction: the held-out split draws its passages and code from other
modules (a fixed hash of the module name) and its chat prompts from other
topics, so held-out accuracy measures generalisation rather than
memorised templates. Neither split contains the project's benchmark
prompts (bench/prompts.py, bench/eagle_acceptance.py); tests check that.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import random
import sys
import textwrap
import warnings

TOPICS = [
    # computing
    "hash tables", "binary search", "HTTP caching", "Git branches", "unit testing",
    "Python generators", "SQL joins", "TCP handshakes", "garbage collection", "recursion",
    "REST APIs", "regular expressions", "public-key cryptography", "Docker containers",
    "the CAP theorem", "floating point rounding", "linked lists", "sorting algorithms",
    "big-O notation", "operating system processes", "threads and locks", "database indexes",
    "caching strategies", "version control", "code review", "password hashing",
    "web browsers", "cloud computing", "open-source licences", "compilers", "virtual memory",
    "JSON", "spreadsheets", "keyboard shortcuts", "backups", "Wi-Fi routers", "email spam",
    # science and nature
    "photosynthesis", "the water cycle", "black holes", "vaccines", "volcanoes",
    "the human heart", "earthquakes", "plate tectonics", "the immune system", "DNA",
    "evolution", "the Moon's phases", "tides", "rainbows", "magnets", "electricity",
    "sound waves", "bees", "coral reefs", "rainforests", "deserts", "migratory birds",
    "the periodic table", "gravity", "weather forecasts", "antibiotics", "sleep cycles",
    # everyday life
    "compound interest", "time management", "writing a cover letter", "learning a language",
    "healthy sleep", "baking bread", "budgeting", "running a first 5k", "house cleaning",
    "growing tomatoes", "composting", "public speaking", "negotiating a salary",
    "moving to a new city", "adopting a dog", "keeping a journal", "cooking rice",
    "choosing a laptop", "packing for a flight", "remote work", "making friends as an adult",
    "reading more books", "saving for retirement", "first aid for burns", "bicycle maintenance",
    # society and culture
    "climate change", "the French Revolution", "electric cars", "supply and demand",
    "chess openings", "meditation", "the stock market", "machine learning",
    "the printing press", "the Roman Empire", "democracy", "inflation", "recycling",
    "the Olympic Games", "jazz", "impressionist painting", "social media", "urban planning",
    "renewable energy", "the Silk Road", "ancient Egypt", "the Industrial Revolution",
    "minimalism", "volunteering", "board games", "film photography", "podcasts",
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
    "Why does {t} matter? Answer in a few sentences.",
    "What is the history of {t}, briefly?",
    "Write a short blog post introduction about {t}.",
    "Give me a quick quiz of three questions about {t}, with answers.",
    "What are the pros and cons of {t}? Use a table.",
    "I keep getting confused by {t}. Can you help me understand it?",
    "Write a tweet-length fun fact about {t}.",
    "Create a study plan for learning about {t} in one week.",
    "What questions should I ask an expert about {t}?",
    "Explain {t} using an everyday analogy.",
    "Write a short dialogue between a teacher and a student about {t}.",
    "What are five key terms related to {t}? Define each in one line.",
    "Tell me something surprising about {t}.",
    "How would you explain {t} in an interview, in under 100 words?",
]

CODE_TASKS = [
    "Write a Python function that {c}. Include a docstring.",
    "Write a Python function that {c}, then show one example call.",
    "Explain how you would write code that {c}, step by step.",
    "Write a Python function that {c}, with type hints and two unit tests.",
    "Write a JavaScript function that {c}.",
    "What is the simplest way in Python to write code that {c}?",
]

CODE_SUBJECTS = [
    "reverses the words in a sentence", "counts word frequencies in a text",
    "merges two sorted lists", "flattens a nested list",
    "computes the n-th Fibonacci number iteratively", "removes duplicates while keeping order",
    "parses a CSV line into fields", "validates an email address with a regular expression",
    "finds the largest element of a list without max()", "converts Celsius to Fahrenheit",
    "groups a list of words by their first letter", "returns the prime numbers below n",
    "reads a file and returns its non-empty lines", "computes the median of a list",
    "capitalises the first letter of every word", "checks whether two strings are anagrams",
    "rotates a list by k positions", "finds the second largest number in a list",
    "counts the vowels in a string", "sums the digits of an integer",
    "converts a Roman numeral to an integer", "transposes a matrix given as a list of lists",
    "chunks a list into pieces of size n", "returns the most common element of a list",
    "formats a number of seconds as hours, minutes and seconds",
    "checks whether a year is a leap year", "computes a running average of a list",
    "finds all pairs in a list that sum to a target", "removes punctuation from a string",
    "converts a dictionary to a sorted list of key-value pairs",
]

PASSAGE_TASKS = [
    "Summarise the following text in two sentences:\n\n{p}",
    "Rewrite the following text in plain English:\n\n{p}",
    "Turn the following text into a bulleted list:\n\n{p}",
    "Quote the first sentence of the following text, then explain it:\n\n{p}",
    "Reformat the following text as a short Markdown section with a title:\n\n{p}",
    "What are the main points of this text? Answer with a bullet list.\n\n{p}",
    "Give a one-paragraph summary of this documentation for a beginner.\n\n{p}",
    "Correct any spelling or grammar problems in this text and return it:\n\n{p}",
    "Explain this documentation to someone who is new to Python:\n\n{p}",
    "Write three questions a reader could answer from this text, with the answers.\n\n{p}",
    "{p}\n\nWhat does the text above describe? Answer briefly.",
    "Rewrite this text so that it is shorter, keeping every important detail:\n\n{p}",
    "Extract the names of functions, classes or parameters mentioned in this text as a "
    "list:\n\n{p}",
    "Paraphrase the following text sentence by sentence:\n\n{p}",
]

SOURCE_TASKS = [
    "Explain what this Python code does.\n\n```python\n{s}\n```",
    "Add type hints to this function. Reply with the full code only.\n\n```python\n{s}\n```",
    "Add a docstring to this function and show the whole function.\n\n```python\n{s}\n```",
    "Write two unit tests for this function.\n\n```python\n{s}\n```",
    "Rewrite this function to be more readable, keeping its behaviour:\n\n```python\n{s}\n```",
    "Add comments to this code explaining each step.\n\n```python\n{s}\n```",
    "What are the inputs and outputs of this function?\n\n```python\n{s}\n```",
    "Rename the variables in this function to clearer names and return the updated "
    "code.\n\n```python\n{s}\n```",
]

BUG_TASKS = [
    "This function has a bug. Find it, fix it and show the corrected function.\n\n"
    "```python\n{s}\n```",
    "Something is wrong with this code. What is the bug, and how do you fix it?\n\n"
    "```python\n{s}\n```",
]

TABLE_TASKS = [
    "Convert this CSV into a Markdown table with a header row.\n{d}",
    "Turn this CSV data into a JSON list of objects.\n{d}",
    "Which row of this CSV has the largest {col}? Explain briefly.\n{d}",
    "Sort this CSV by {col} and return it as CSV.\n{d}",
    "Describe the data in this CSV in a few sentences.\n{d}",
]

SETTINGS_TASKS = [
    "Turn this settings list into a JSON object, one key per setting.\n{d}",
    "Convert these settings into a YAML file.\n{d}",
    "Rewrite these settings as a Markdown table with columns Setting and Value.\n{d}",
    "Write a Python dictionary that holds these settings.\n{d}",
]

STORY_TASKS = [
    "Continue this story for one paragraph: {s}",
    "Write a short story that begins: \"{s}\"",
    "Write the opening of a children's story in which {w}.",
    "Write a short poem about {t}.",
    "Write a limerick about {t}.",
    "Write a friendly email to a colleague about {w}.",
    "Write a short product description for {o}.",
    "Write a polite complaint letter about {o} that arrived broken.",
    "Give me five creative names for a shop that sells {o}.",
]

CHARACTERS = ["a retired sailor", "a curious robot", "a young baker", "an old librarian",
              "a lost cat", "two rival chefs", "a nervous astronaut", "a village teacher",
              "a clever fox", "a street musician", "a lighthouse keeper", "a tired detective"]
EVENTS = ["finds a strange map", "misses the last train", "wins a small prize",
          "hears a knock at midnight", "discovers a hidden door", "receives an old letter",
          "gets lost in the fog", "meets a talking bird", "loses an important key",
          "plans a surprise party"]
OBJECTS = ["handmade candles", "a reusable water bottle", "noise-cancelling headphones",
           "a wooden chess set", "a solar garden lamp", "a travel backpack", "a teapot",
           "running shoes", "a desk lamp", "a puzzle book", "houseplants", "a bread knife"]

_NAMES = ["Ana", "Ben", "Chloe", "Dev", "Ema", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kai",
          "Lena", "Mo", "Nia", "Omar", "Pia", "Raj", "Sara", "Tom", "Uma", "Vic", "Wen"]
_CITIES = ["Lisbon", "Oslo", "Lyon", "Kyoto", "Austin", "Porto", "Dublin", "Quito", "Pune",
           "Graz", "Perth", "Cork", "Tartu", "Bergen", "Malmo", "Leeds"]
_ITEMS = ["apples", "pens", "cables", "notebooks", "mugs", "lamps", "chairs", "plates",
          "batteries", "towels", "candles", "scarves"]
_SETTINGS = [("theme", ["dark", "light"]), ("language", ["English", "French", "German"]),
             ("font size", ["12", "14", "16"]), ("autosave", ["on", "off"]),
             ("timeout", ["30 seconds", "5 minutes"]), ("max retries", ["3", "5"]),
             ("log level", ["info", "debug", "warning"]), ("notifications", ["on", "off"]),
             ("timezone", ["UTC", "Europe/Paris"]), ("page size", ["20", "50"]),
             ("cache", ["enabled", "disabled"]), ("port", ["8080", "9000"])]

# A planted bug: the first match of one of these is swapped in a function's source.
_MUTATIONS = [(" < ", " <= "), (" <= ", " < "), (" > ", " >= "), (" + 1", " - 1"),
              (" - 1", " + 1"), (" == ", " != "), (" and ", " or "), ("return True", "return False")]


def split_of(key: str) -> str:
    """A fixed 1-in-8 assignment to the held-out split (not Python's salted hash)."""
    return "heldout" if hashlib.sha1(key.encode()).digest()[0] % 8 == 0 else "train"


def _modules() -> list:
    skip = ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3",
            "ensurepip", "venv", "pydoc_data", "__phello__", "__hello__", "test")
    mods = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in skip:
            continue
        try:
            mods.append(importlib.import_module(name))
        except Exception:  # noqa: BLE001 - platform modules that do not import here
            continue
    return mods


def _members(mod) -> list:
    out = []
    for _, obj in sorted(vars(mod).items()):
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and \
                getattr(obj, "__module__", "") == mod.__name__:
            out.append(obj)
            if inspect.isclass(obj):
                out += [m for _, m in sorted(vars(obj).items()) if inspect.isfunction(m)]
    return out


def passages(mods: list, max_chars: int = 900) -> list[str]:
    """Prose from module, class and function docstrings of `mods`."""
    out: list[str] = []
    for mod in mods:
        for obj in [mod, *_members(mod)]:
            doc = (inspect.getdoc(obj) or "").strip()
            if len(doc) >= 200:
                out.append(doc[:max_chars].rsplit(" ", 1)[0] if len(doc) > max_chars else doc)
    return out


def sources(mods: list, max_lines: int = 22) -> list[str]:
    """Source of short pure-Python functions of `mods`, docstrings removed."""
    out: list[str] = []
    for mod in mods:
        for obj in _members(mod):
            if not inspect.isfunction(obj):
                continue
            try:
                src = textwrap.dedent(inspect.getsource(obj))
                tree = ast.parse(src)
            except (OSError, TypeError, SyntaxError, IndentationError):
                continue
            fn = tree.body[0]
            if not isinstance(fn, ast.FunctionDef):
                continue
            if fn.body and isinstance(fn.body[0], ast.Expr) and \
                    isinstance(getattr(fn.body[0], "value", None), ast.Constant):
                fn.body = fn.body[1:] or [ast.Pass()]
            fn.decorator_list = []
            code = ast.unparse(fn)
            if 3 <= code.count("\n") + 1 <= max_lines and len(code) <= 1200:
                out.append(code)
    return out


def _plant_bug(code: str, rng: random.Random) -> str | None:
    muts = [m for m in _MUTATIONS if m[0] in code]
    if not muts:
        return None
    a, b = rng.choice(muts)
    return code.replace(a, b, 1)


def _csv(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(3)
    n = rng.randint(3, 6)
    if kind == 0:
        head, col = "name,city,age", "age"
        rows = [f"{rng.choice(_NAMES)},{rng.choice(_CITIES)},{rng.randint(18, 80)}" for _ in range(n)]
    elif kind == 1:
        head, col = "item,quantity,price", "price"
        rows = [f"{rng.choice(_ITEMS)},{rng.randint(1, 40)},{rng.randint(1, 300) / 4:.2f}"
                for _ in range(n)]
    else:
        head, col = "city,month,rainfall_mm", "rainfall_mm"
        rows = [f"{rng.choice(_CITIES)},{rng.choice(['Jan', 'Apr', 'Jul', 'Oct'])},"
                f"{rng.randint(5, 200)}" for _ in range(n)]
    return "\n".join([head, *rows]), col


def _settings(rng: random.Random) -> str:
    chosen = rng.sample(_SETTINGS, rng.randint(3, 6))
    sep = rng.choice([": ", " = ", " - "])
    return "\n".join(f"{k}{sep}{rng.choice(v)}" for k, v in chosen)


def build_prompts(split: str = "train", seed: int = 0) -> list[str]:
    """The prompts of one split ("train" or "heldout"), shuffled; deterministic."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    rng = random.Random(f"{split}-{seed}")
    mine = lambda key: split_of(key) == split  # noqa: E731
    prompts: list[str] = []
    # Open questions: every topic of the split with a sample of the instruction templates.
    for t in TOPICS:
        if mine(t):
            prompts += [task.format(t=t) for task in rng.sample(TASKS, 10)]
    for c in CODE_SUBJECTS:
        if mine(c):
            prompts += [task.format(c=c) for task in rng.sample(CODE_TASKS, 3)]
    # Passages and code from the split's own standard-library modules (minus text that
    # the other split's modules share, such as inherited docstrings).
    with warnings.catch_warnings():  # deprecated modules warn when their members are read
        warnings.simplefilter("ignore")
        mods = _modules()
        other = [m for m in mods if not mine(m.__name__)]
        mods = [m for m in mods if mine(m.__name__)]
        texts = sorted(set(passages(mods)) - set(passages(other)))
        codes = sorted(set(sources(mods)) - set(sources(other)))
    rng.shuffle(texts)
    prompts += [rng.choice(PASSAGE_TASKS).format(p=p) for p in texts[:1400]]
    rng.shuffle(codes)
    for code in codes[:900]:
        bugged = _plant_bug(code, rng) if rng.random() < 0.3 else None
        if bugged:
            prompts.append(rng.choice(BUG_TASKS).format(s=bugged))
        else:
            prompts.append(rng.choice(SOURCE_TASKS).format(s=code))
    # Generated data to reformat, and short writing tasks (sized like the rest of the split).
    n_small = 120 if split == "train" else 16
    topics = [t for t in TOPICS if mine(t)]
    objects = [o for o in OBJECTS if mine(o)] or OBJECTS[:1]
    for _ in range(n_small):
        d, col = _csv(rng)
        prompts.append(rng.choice(TABLE_TASKS).format(d=d, col=col))
        prompts.append(rng.choice(SETTINGS_TASKS).format(d=_settings(rng)))
        s = f"{rng.choice(CHARACTERS).capitalize()} {rng.choice(EVENTS)}."
        w = f"{rng.choice(CHARACTERS)} {rng.choice(EVENTS)}"
        prompts.append(rng.choice(STORY_TASKS).format(
            s=s, w=w, t=rng.choice(topics), o=rng.choice(objects)))
    prompts = list(dict.fromkeys(prompts))
    if split == "heldout":  # the few generated writing prompts both splits can draw
        train = set(build_prompts("train", seed))
        prompts = [p for p in prompts if p not in train]
    rng.shuffle(prompts)
    return prompts
