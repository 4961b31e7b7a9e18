"""Everyday chat prompts for self-distillation: what people ask an assistant.

The mixed prompt set (train/prompts.py) is mostly work over text and
code, and its open questions come from about twenty instruction templates.
A head trained on it predicts the target's replies to those templates well
(held-out accuracy 0.56 at the first draft step) and its replies to plain
everyday questions badly (0.34 on the benchmark's chat prompts): a gap in
the distribution of prompts, not only in capacity. This set is the missing
kind: short natural questions and requests (how-to, how does it work, why,
compare, recipes, packing lists, rules of games, plots, advice, creative
writing, Python questions), each subject asked in a few phrasings.

Subjects are split as in prompts.py (a fixed 1-in-8 hash to "heldout"), so
held-out prompts ask about subjects the training split never saw. Neither
split contains the benchmark prompts (tests/drafter/test_train_prompts.py).
"""

from __future__ import annotations

import random

from train.prompts import split_of

HOW_TO = [
    "fix a squeaky door", "clean a cast-iron pan", "stop procrastinating", "train a puppy to sit",
    "write a good resume", "improve my handwriting", "sleep better on hot nights",
    "make cold brew coffee", "get rid of fruit flies", "remove a red wine stain",
    "change a flat tyre", "start a vegetable garden on a balcony", "organise my wardrobe",
    "wake up earlier", "memorise a speech", "calm down before an exam", "sharpen a kitchen knife",
    "paint a room quickly", "back up my phone", "set up a home Wi-Fi network",
    "learn to touch type", "keep my laptop battery healthy", "plan a birthday party",
    "reduce screen time", "make my apartment feel bigger", "care for a sourdough starter",
    "clean white sneakers", "hang a heavy mirror", "fold a fitted sheet", "unclog a sink",
    "start running again after an injury", "prepare for a long flight", "write a thank-you note",
    "ask for a raise", "make small talk at a party", "teach a child to ride a bike",
    "keep cut flowers fresh", "stop a dripping tap", "save energy at home in winter",
    "deal with a noisy neighbour", "choose a good watermelon", "freeze fresh herbs",
    "read a nutrition label", "take better photos with my phone", "learn to juggle",
    "get better at chess", "stay motivated when working from home", "pack a lunch for work",
    "make friends in a new job", "write a short speech for a wedding",
]
HOW_TO_T = [
    "How do I {x}?", "What is the best way to {x}?", "Any tips on how to {x}?",
    "I want to {x}. Where should I start?", "Can you explain how to {x}, step by step?",
    "What mistakes should I avoid when I try to {x}?",
]

DEVICES = [
    "a microwave oven", "a smoke detector", "GPS", "a dishwasher", "a thermostat", "an elevator",
    "a credit card chip", "solar panels", "a jet engine", "a toaster", "an electric kettle",
    "a touchscreen", "a washing machine", "a lock and key", "a camera lens", "a barcode scanner",
    "a hearing aid", "an induction hob", "a vacuum cleaner", "a heat pump", "a compass",
    "a pressure cooker", "a wind turbine", "an electric motor", "a battery", "a light bulb",
    "noise-cancelling headphones", "a 3D printer", "a search engine", "a QR code",
    "a hot air balloon", "a submarine", "a parachute", "an air conditioner", "a pendulum clock",
    "a traffic light", "a vending machine", "a fountain pen", "a sewing machine", "Bluetooth",
]
DEVICES_T = [
    "Explain how {x} works.", "How does {x} work?", "Explain {x} to me in simple words.",
    "What are the main parts of {x} and what does each do?", "Who invented {x}, and how has it changed?",
]

WHY = [
    "do cats purr", "is the ocean salty", "do we get goosebumps", "does bread go stale",
    "do onions make you cry", "is ice slippery", "do we yawn", "do stars twinkle",
    "does the Moon look bigger near the horizon", "do some people get seasick",
    "do our fingers wrinkle in water", "is the sunset red", "do birds fly south in winter",
    "do we have leap years", "does popcorn pop", "do we dream", "do boats float",
    "is the Dead Sea so salty", "do dogs wag their tails", "does metal feel colder than wood",
    "do we get hiccups", "do apples turn brown when cut", "do some trees lose their leaves",
    "is it colder at the top of a mountain", "do zebras have stripes", "does thunder follow lightning",
    "do cats land on their feet", "do we need sleep", "does soap clean", "is glass transparent",
    "do bubbles form in boiling water", "does ice float", "do we have different blood types",
    "do bees make honey", "do snakes shed their skin",
]
WHY_T = ["Why {x}?", "Can you explain why {x}?", "I have always wondered: why {x}?",
         "Explain to a child why {x}."]

PAIRS = [
    ("tea", "coffee"), ("renting", "buying a home"), ("e-books", "paper books"),
    ("Python", "JavaScript"), ("a laptop", "a desktop computer"), ("running", "swimming"),
    ("a debit card", "a credit card"), ("baking soda", "baking powder"), ("weather", "climate"),
    ("a virus", "a bacterium"), ("a crocodile", "an alligator"), ("stocks", "bonds"),
    ("a tornado", "a hurricane"), ("a lake", "a pond"), ("butter", "margarine"),
    ("a frog", "a toad"), ("yoga", "pilates"), ("trains", "planes for travel in Europe"),
    ("an LED bulb", "an incandescent bulb"), ("a city break", "a beach holiday"),
    ("a town", "a city"), ("a podcast", "an audiobook"), ("a savings account", "an index fund"),
    ("email", "instant messaging at work"), ("a sprint", "a marathon"), ("a violin", "a viola"),
    ("a rabbit", "a hamster as a first pet"), ("an SSD", "a hard disk"), ("a mortgage", "a loan"),
    ("brown rice", "white rice"), ("a fruit", "a vegetable"), ("mountains", "the seaside"),
    ("living alone", "living with flatmates"), ("a sole trader", "a limited company"),
    ("jam", "jelly"), ("an ocean", "a sea"), ("HTTP", "HTTPS"), ("a router", "a modem"),
]
PAIRS_T = [
    "What are the main differences between {a} and {b}?", "{A} or {b}: which should I choose?",
    "Compare {a} and {b} in a few sentences.", "Is {a} better than {b}? Give me both sides.",
    "How are {a} and {b} alike, and how do they differ?",
]

DISHES = [
    "banana bread", "tomato soup", "guacamole", "a vegetable stir-fry", "chocolate chip cookies",
    "French toast", "a simple omelette", "lentil curry", "hummus", "a Greek salad",
    "spaghetti carbonara", "fried rice", "scrambled eggs", "a fruit smoothie", "potato salad",
    "homemade pizza dough", "chicken noodle soup", "overnight oats", "a grilled cheese sandwich",
    "roasted vegetables", "apple crumble", "lemonade", "vegetable chili", "garlic bread",
    "a cheese sauce", "pesto", "shortbread", "mashed potatoes", "a tuna pasta bake", "flatbread",
    "muffins", "a bean burrito", "iced tea", "porridge", "a mushroom risotto",
]
DISHES_T = [
    "Give me a simple recipe for {x}.", "How do I make {x}?", "What do I need to make {x}?",
    "I have never cooked before. How can I make {x}?", "What is a quick way to make {x} for four people?",
]

TRIPS = [
    "a beach holiday", "a week of camping", "a business trip", "a ski trip", "a city break in winter",
    "a long train journey", "a music festival", "a family visit with small children",
    "a canoe trip", "a cycling tour", "a day at the zoo", "a road trip across the country",
    "a first trip abroad", "a weekend at a cabin", "a sailing weekend", "a school exchange",
    "a wedding abroad", "a week in a tropical country", "a picnic in the park", "a fishing trip",
]
TRIPS_T = [
    "What should I pack for {x}?", "Make me a checklist for {x}.",
    "I am going on {x} soon. What should I bring, and what should I leave at home?",
    "How should I prepare for {x}?",
]

GAMES = [
    "chess", "checkers", "noughts and crosses on a 4x4 board", "rock paper scissors",
    "hide and seek", "Monopoly", "Scrabble", "sudoku", "poker", "dominoes", "bowling", "darts",
    "volleyball", "table tennis", "badminton", "basketball", "tennis", "cricket", "Go",
    "hangman", "battleship", "musical chairs", "charades", "mahjong", "snakes and ladders",
    "bridge", "solitaire", "backgammon", "croquet", "golf",
]
GAMES_T = [
    "Describe the rules of {x}.", "How do you play {x}?", "Explain {x} to a complete beginner.",
    "What is a good strategy for {x}?",
]

WORKS = [
    "Hamlet", "Macbeth", "Pride and Prejudice", "Moby-Dick", "The Odyssey", "Cinderella",
    "Little Red Riding Hood", "Frankenstein", "Dracula", "The Little Prince", "Treasure Island",
    "Alice's Adventures in Wonderland", "The Wizard of Oz", "Don Quixote", "Oliver Twist",
    "Jane Eyre", "A Christmas Carol", "The Tortoise and the Hare", "Robinson Crusoe",
    "Peter Pan", "The Jungle Book", "Gulliver's Travels", "Snow White", "Les Miserables",
    "The Three Little Pigs", "Beowulf", "The Iliad", "Great Expectations", "Sleeping Beauty",
    "The Ugly Duckling", "Heidi", "Pinocchio", "Wuthering Heights", "Hansel and Gretel",
]
WORKS_T = [
    "Summarise the plot of {x} in a few sentences.", "What is {x} about?",
    "Who are the main characters of {x}?", "What lessons can we learn from {x}?",
    "Tell me the story of {x} in five sentences.",
]

THINGS = [
    "the Great Wall of China", "the Amazon river", "octopuses", "the Eiffel Tower", "the Sahara",
    "penguins", "the Pyramids of Giza", "Mount Everest", "the Northern Lights", "elephants",
    "the Pacific Ocean", "dinosaurs", "the Moon landing", "whales", "the Grand Canyon",
    "honey bees", "the Olympic torch", "the Mona Lisa", "the Titanic", "Antarctica",
    "the human brain", "volcanic islands", "the invention of paper", "the first computers",
    "owls", "the Statue of Liberty", "coffee", "chocolate", "the Vikings", "the International Space Station",
    "the Milky Way", "sharks", "the Alps", "the piano", "the Nile",
]
THINGS_T = [
    "Tell me about {x}.", "What are some interesting facts about {x}?",
    "What should everyone know about {x}?", "Give me three fun facts about {x}.",
    "Write a short encyclopedia-style paragraph about {x}.",
]

GOALS = [
    "learn to swim", "start running", "learn Spanish", "learn to paint with watercolours",
    "learn to code", "get fit", "learn to cook", "learn the piano", "read more", "learn to draw",
    "start a small business", "learn photography", "learn to sing", "learn to dance",
    "learn to knit", "change careers into teaching", "write a novel", "learn to play the drums",
    "start meditating", "learn sign language", "learn to ski", "climb a big mountain",
    "learn chess", "run a half marathon", "start a podcast",
]
AGES = ["16", "25", "30", "40", "45", "52", "60", "68"]
GOALS_T = [
    "I am {age} and want to {x}. How should I start?",
    "I am {age} and want to {x}. How should I practise in the first month?",
    "Is {age} too old to {x}? What would you suggest?",
    "I want to {x} but I only have 20 minutes a day. Make me a plan.",
]

HABITS = [
    "staying healthy while travelling", "working at a desk all day", "saving money",
    "keeping a tidy home", "writing every day", "staying calm at work", "eating well on a budget",
    "keeping in touch with friends", "learning online", "looking after your eyes",
    "staying safe online", "managing email", "starting the day well", "ending the day well",
    "caring for your teeth", "staying active in winter", "reading with children", "running meetings",
]
HABITS_T = [
    "What are some good habits for {x}?", "Give me five tips for {x}.",
    "What daily routine would help with {x}?",
]

CONCEPTS = [
    "the internet", "a database", "a computer virus", "cloud storage", "a password manager",
    "an algorithm", "a spreadsheet formula", "machine learning", "a blockchain", "encryption",
    "an operating system", "a web server", "a firewall", "a compiler", "a cookie in a web browser",
    "RAM", "a domain name", "an IP address", "a neural network", "open-source software",
    "interest on a loan", "inflation", "insurance", "a budget", "a mortgage", "taxes",
    "electric current", "photosynthesis", "an ecosystem", "the immune system",
]
CONCEPTS_T = [
    "Explain what {x} is using an analogy.", "What is {x}, in simple terms?",
    "Explain {x} as if I were twelve.", "How would you describe {x} to my grandmother?",
]

PY_PAIRS = [
    ("a dictionary", "a set"), ("is", "=="), ("a function", "a method"), ("append", "extend"),
    ("a class", "an object"), ("a module", "a package"), ("break", "continue"),
    ("a for loop", "a while loop"), ("sort()", "sorted()"), ("a shallow copy", "a deep copy"),
    ("*args", "**kwargs"), ("an iterator", "a generator"), ("a string", "bytes"),
    ("a local variable", "a global variable"), ("return", "yield"), ("None", "False"),
    ("pip", "conda"), ("an exception", "a syntax error"), ("range", "a list"),
    ("str()", "repr()"),
]
PY_PAIRS_T = ["What is the difference between {a} and {b} in Python?",
              "In Python, when should I use {a} and when {b}?"]

PY_TASKS = [
    "checks whether a number is even", "counts the words in a sentence", "reverses a string",
    "finds the smallest number in a list", "converts miles to kilometres", "adds up a list of prices",
    "checks whether a list is sorted", "removes the spaces from a string",
    "returns the factorial of a number", "prints a multiplication table",
    "swaps the keys and values of a dictionary", "counts how often each letter appears",
    "generates a random password", "checks whether a number is prime",
    "returns the last n items of a list", "joins a list of words with commas",
    "finds the longest word in a sentence", "converts a string to title case",
    "checks whether a string contains only digits", "calculates the area of a circle",
    "reads a number from the user and doubles it", "returns the average of three numbers",
    "finds the index of an item in a list", "merges two dictionaries",
    "counts down from ten and prints each number",
]
PY_TASKS_T = [
    "Write a Python function that {x}.", "How do I write a Python function that {x}?",
    "Show me a short Python program that {x}, and explain it.",
]

WRITING = [
    "the first snow of winter", "a rainy Sunday", "the sea at night", "a busy train station",
    "an old bookshop", "a summer thunderstorm", "a cup of morning coffee", "a city at dawn",
    "a lost umbrella", "spring flowers", "a quiet forest", "the last day of school",
    "a friendly dog", "a full moon", "a kitchen on a holiday morning", "the sound of rain",
    "a garden in June", "an empty beach in winter", "a mountain lake", "a night sky full of stars",
]
WRITING_T = [
    "Write a short poem about {x}.", "Write a haiku about {x}.",
    "Write a short paragraph describing {x}.", "Write four lines of rhyming verse about {x}.",
]

NOTES = [
    ("a neighbour", "watering my plants while I was away"), ("my teacher", "a great school year"),
    ("a colleague", "covering my shift"), ("my aunt", "a birthday present"),
    ("a friend", "helping me move house"), ("my manager", "a work anniversary"),
    ("a nurse", "looking after my father"), ("a coach", "a great season"),
    ("my grandparents", "a lovely weekend"), ("a client", "ten years of business"),
    ("my sister", "her graduation"), ("a new team member", "joining the team"),
]
NOTES_T = [
    "Write a short thank-you note to {a} for {b}.", "Write a short, warm message to {a} about {b}.",
]


def _family(items, templates, mine, rng, n: int, fmt) -> list[str]:
    out: list[str] = []
    for item in items:
        key = item if isinstance(item, str) else " / ".join(item)
        if mine(key):
            out += [fmt(t, item) for t in rng.sample(templates, min(n, len(templates)))]
    return out


def _one(t: str, x: str) -> str:
    return t.format(x=x)


def _pair(t: str, ab: tuple[str, str]) -> str:
    a, b = ab
    return t.format(a=a, b=b, A=a[:1].upper() + a[1:])


def build_chat_prompts(split: str = "train", seed: int = 0) -> list[str]:
    """The everyday chat prompts of one split ("train" or "heldout"), shuffled;
    deterministic."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    rng = random.Random(f"chat-{split}-{seed}")
    mine = lambda key: split_of(key) == split  # noqa: E731
    prompts: list[str] = []
    for items, templates, n, fmt in (
            (HOW_TO, HOW_TO_T, 4, _one), (DEVICES, DEVICES_T, 4, _one), (WHY, WHY_T, 3, _one),
            (PAIRS, PAIRS_T, 4, _pair), (DISHES, DISHES_T, 4, _one), (TRIPS, TRIPS_T, 4, _one),
            (GAMES, GAMES_T, 4, _one), (WORKS, WORKS_T, 4, _one), (THINGS, THINGS_T, 4, _one),
            (HABITS, HABITS_T, 3, _one), (CONCEPTS, CONCEPTS_T, 4, _one),
            (PY_PAIRS, PY_PAIRS_T, 2, _pair), (PY_TASKS, PY_TASKS_T, 3, _one),
            (WRITING, WRITING_T, 4, _one), (NOTES, NOTES_T, 2, _pair)):
        prompts += _family(items, templates, mine, rng, n, fmt)
    for goal in GOALS:
        if mine(goal):
            prompts += [t.format(x=goal, age=rng.choice(AGES)) for t in GOALS_T]
    prompts = list(dict.fromkeys(prompts))
    rng.shuffle(prompts)
    return prompts
