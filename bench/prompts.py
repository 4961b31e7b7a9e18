"""The project's own benchmark prompt set: chat conversations for an instruct model.

Categories follow the work speculative decoding is asked to speed up: code
edit, bug fix, reformat and rewrite (the answer copies much of the prompt,
where prompt lookup shines), summarise, explain and open chat (the answer is
new text, where a trained draft has to guess), and one long-context case
(about 1,900 tokens of code with a question about one function). Every text
here was written for this project.

`copy_heavy` marks prompts whose answer is expected to repeat long spans of
the prompt; benchmarks report the two groups apart. The set is plain data so
that other benchmarks (drafters, peer comparisons) can import it:

    from bench.prompts import PROMPTS, by_name
"""

from __future__ import annotations

from dataclasses import dataclass

CATEGORIES = ("code_edit", "summarise", "reformat", "explain", "rewrite", "bug_fix",
              "long_context", "chat")


@dataclass(frozen=True, slots=True)
class Prompt:
    name: str
    category: str
    messages: tuple[dict[str, str], ...]  # a chat conversation, OpenAI-style roles
    copy_heavy: bool

    def __post_init__(self):
        if self.category not in CATEGORIES:
            raise ValueError(f"{self.name}: category {self.category!r} is not one of {CATEGORIES}")
        if not self.messages or self.messages[-1]["role"] != "user":
            raise ValueError(f"{self.name}: the conversation must end with a user turn")


def _user(text: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": text.strip()},)


# -- code edit -----------------------------------------------------------------

_INVENTORY = '''
def restock(items, threshold, amount):
    orders = []
    for item in items:
        if item["count"] < threshold:
            orders.append({"sku": item["sku"], "qty": amount - item["count"]})
    return orders


def total_value(items):
    total = 0
    for item in items:
        total += item["count"] * item["price"]
    return total
'''

_TEMPERATURE = '''
class Thermometer:
    def __init__(self, readings):
        self.readings = readings

    def average(self):
        return sum(self.readings) / len(self.readings)

    def highest(self):
        return max(self.readings)

    def lowest(self):
        return min(self.readings)
'''

_GREETER = '''
def greet(name):
    message = "Hello, " + name + "!"
    print(message)
    return message


def greet_all(names):
    results = []
    for name in names:
        results.append(greet(name))
    return results
'''

# -- bug fix -------------------------------------------------------------------

_WINDOW = '''
def moving_average(values, window):
    """Average of every run of `window` consecutive values."""
    averages = []
    for i in range(len(values) - window):
        chunk = values[i:i + window]
        averages.append(sum(chunk) / window)
    return averages
'''

_TAGS = '''
def add_tag(tag, tags=[]):
    """Return the list of tags with `tag` added once."""
    if tag not in tags:
        tags.append(tag)
    return tags
'''

_SEARCH = '''
def find_index(sorted_values, target):
    low, high = 0, len(sorted_values)
    while low < high:
        mid = (low + high) // 2
        if sorted_values[mid] == target:
            return mid
        if sorted_values[mid] < target:
            high = mid
        else:
            low = mid + 1
    return -1
'''

# -- reformat ------------------------------------------------------------------

_CSV = '''
city,country,population_millions,founded
Lisbon,Portugal,0.55,1200 BC
Oslo,Norway,0.71,1040
Nairobi,Kenya,4.40,1899
Montreal,Canada,1.76,1642
Hanoi,Vietnam,8.05,1010
'''

_SETTINGS = '''
- timeout: 30 seconds
- retries: 5
- log level: warning
- cache size: 256 MB
- compression: enabled
- region: eu-west
'''

# -- rewrite ---------------------------------------------------------------------

_NOTICE = '''
Hi everyone, just a heads up that the office kitchen is gonna be closed all of next
week because their replacing the sink and the old fridge. Please dont leave any food
in there after friday cause it will get thrown out. The coffee machine is being moved
to the meeting room on the second floor so you can still get your coffee, its next to
the window. Sorry for the hassle and thanks for bearing with us!
'''

_RECIPE_NOTE = '''
ok so first u boil the water and put the pasta in, cook it for like 10 mins. while thats
going chop up the garlic and fry it in olive oil but not too long or it burns. then
drain the pasta, keep a cup of the water, mix everything together in the pan and add
the pasta water bit by bit till its glossy. finish with lemon zest, parmesan and black
pepper.
'''

# -- summarise -------------------------------------------------------------------

_BEES = '''
Honeybee colonies make decisions without a leader. When a colony outgrows its hive,
the old queen leaves with about half of the workers, and the swarm hangs from a branch
while a few hundred scouts search the surroundings for a new home. A scout that finds a
promising cavity returns and performs a waggle dance whose length reflects how good the
site seems. Other scouts go to inspect the advertised sites and, if they agree, dance
for them in turn. Poor sites lose support as their dancers stop, while good sites gain
recruits. Once enough scouts gather at one site, they sense the crowd and signal the
swarm to warm up its flight muscles. Within an hour the whole swarm flies to the chosen
cavity. Researchers see this as a model of group decision making that balances speed
against accuracy.
'''

_TRAM = '''
The city council met on Tuesday to discuss the proposed tram line between the central
station and the university campus. Supporters argued that the line would cut commuting
times by a third, reduce car traffic on the river bridges and encourage housing near
the new stops. Opponents worried about the cost, estimated at 410 million euros, and
about two years of road works along the main shopping street, which local businesses
fear would drive customers away. The transport department presented a plan to build
the line in three phases so that no street would be closed for more than five months.
After four hours of debate, the council voted to fund a detailed engineering study and
to hold public consultations in every affected district before a final decision next
spring.
'''

_SLEEP = '''
Sleep is not a single state but a cycle that repeats several times a night. Each cycle
lasts roughly ninety minutes and moves from light sleep into deep, slow-wave sleep and
then into rapid eye movement sleep, when most vivid dreams happen. Deep sleep dominates
the first half of the night and helps the body repair tissue and the brain consolidate
facts learned during the day. REM sleep becomes longer toward morning and seems to
matter for emotional memory and creativity. Cutting a night short therefore removes a
disproportionate share of REM sleep. Regular bed times, a dark and cool room, and
avoiding caffeine late in the day are the simplest ways to protect the full cycle.
'''

# -- explain ---------------------------------------------------------------------

_FIZZ = '''
def label(n):
    out = ""
    if n % 3 == 0:
        out += "Fizz"
    if n % 5 == 0:
        out += "Buzz"
    return out or str(n)

print([label(n) for n in range(1, 16)])
'''

# -- long context ------------------------------------------------------------------

_LONG_MODULE = '''
"""A small task scheduler: tasks with priorities, dependencies and retries."""

import heapq
import time
from dataclasses import dataclass, field


class SchedulerError(Exception):
    """Raised when the task graph cannot be scheduled."""


@dataclass(order=True)
class Task:
    priority: int
    name: str = field(compare=False)
    action: object = field(compare=False, default=None)
    depends_on: tuple = field(compare=False, default=())
    max_retries: int = field(compare=False, default=0)
    attempts: int = field(compare=False, default=0)
    done: bool = field(compare=False, default=False)
    last_error: str = field(compare=False, default="")


class Scheduler:
    def __init__(self, clock=time.monotonic):
        self.tasks = {}
        self.clock = clock
        self.history = []

    def add(self, name, action, priority=10, depends_on=(), max_retries=0):
        if name in self.tasks:
            raise SchedulerError(f"task {name!r} is already registered")
        for dep in depends_on:
            if dep == name:
                raise SchedulerError(f"task {name!r} cannot depend on itself")
        self.tasks[name] = Task(priority, name, action, tuple(depends_on), max_retries)
        return self.tasks[name]

    def remove(self, name):
        task = self.tasks.pop(name, None)
        if task is None:
            raise SchedulerError(f"no task named {name!r}")
        for other in self.tasks.values():
            if name in other.depends_on:
                other.depends_on = tuple(d for d in other.depends_on if d != name)
        return task

    def check(self):
        """Raise SchedulerError for missing dependencies or cycles."""
        for task in self.tasks.values():
            for dep in task.depends_on:
                if dep not in self.tasks:
                    raise SchedulerError(f"task {task.name!r} depends on unknown {dep!r}")
        visiting, visited = set(), set()

        def visit(name, path):
            if name in visited:
                return
            if name in visiting:
                cycle = " -> ".join(path + [name])
                raise SchedulerError(f"dependency cycle: {cycle}")
            visiting.add(name)
            for dep in self.tasks[name].depends_on:
                visit(dep, path + [name])
            visiting.discard(name)
            visited.add(name)

        for name in self.tasks:
            visit(name, [])

    def ready(self):
        """Tasks whose dependencies are all done, highest priority first."""
        heap = []
        for task in self.tasks.values():
            if task.done:
                continue
            if all(self.tasks[dep].done for dep in task.depends_on):
                heapq.heappush(heap, task)
        return [heapq.heappop(heap) for _ in range(len(heap))]

    def run_one(self, task):
        task.attempts += 1
        started = self.clock()
        try:
            task.action()
        except Exception as exc:  # the task decides what counts as failure
            task.last_error = f"{type(exc).__name__}: {exc}"
            elapsed = self.clock() - started
            self.history.append((task.name, "failed", elapsed))
            if task.attempts > task.max_retries:
                raise SchedulerError(
                    f"task {task.name!r} failed after {task.attempts} attempts: "
                    f"{task.last_error}") from exc
            return False
        elapsed = self.clock() - started
        self.history.append((task.name, "ok", elapsed))
        task.done = True
        return True

    def run(self):
        """Run every task once its dependencies are done; return the order."""
        self.check()
        order = []
        while True:
            batch = self.ready()
            if not batch:
                break
            for task in batch:
                if self.run_one(task):
                    order.append(task.name)
        pending = [t.name for t in self.tasks.values() if not t.done]
        if pending:
            raise SchedulerError(f"tasks never became ready: {', '.join(pending)}")
        return order

    def reset(self):
        for task in self.tasks.values():
            task.done = False
            task.attempts = 0
            task.last_error = ""
        self.history.clear()

    def summary(self):
        """One line per task: name, state, attempts and the last error, if any."""
        lines = []
        for task in sorted(self.tasks.values()):
            state = "done" if task.done else "pending"
            line = f"{task.name:<20} {state:<8} attempts={task.attempts}"
            if task.last_error:
                line += f" error={task.last_error}"
            lines.append(line)
        return "\\n".join(lines)

    def total_time(self):
        return sum(elapsed for _, _, elapsed in self.history)

    def slowest(self, n=3):
        """The n slowest successful runs as (name, seconds), slowest first."""
        runs = [(name, elapsed) for name, outcome, elapsed in self.history if outcome == "ok"]
        runs.sort(key=lambda item: item[1], reverse=True)
        return runs[:n]

    def failures(self):
        return [(name, elapsed) for name, outcome, elapsed in self.history
                if outcome == "failed"]

    def dependents(self, name):
        """Names of the tasks that depend on `name`, directly or not."""
        found, queue = set(), [name]
        while queue:
            current = queue.pop()
            for task in self.tasks.values():
                if current in task.depends_on and task.name not in found:
                    found.add(task.name)
                    queue.append(task.name)
        return sorted(found)

    def critical_path(self, durations):
        """The longest chain of dependencies, weighted by `durations` (name -> seconds)."""
        self.check()
        best = {}

        def longest(name):
            if name in best:
                return best[name]
            task = self.tasks[name]
            chains = [longest(dep) for dep in task.depends_on]
            head = max(chains, key=lambda c: c[0], default=(0.0, []))
            best[name] = (head[0] + durations.get(name, 0.0), head[1] + [name])
            return best[name]

        return max((longest(name) for name in self.tasks), key=lambda c: c[0], default=(0.0, []))


def load_plan(scheduler, plan):
    """Register tasks from a list of dicts with keys name, priority, depends_on, retries."""
    for entry in plan:
        name = entry["name"]
        priority = entry.get("priority", 10)
        depends_on = entry.get("depends_on", ())
        retries = entry.get("retries", 0)
        scheduler.add(name, entry.get("action", lambda: None), priority, depends_on, retries)
    return scheduler


def format_report(scheduler):
    lines = ["Scheduler report", "================", ""]
    lines.append(scheduler.summary())
    lines.append("")
    lines.append(f"total time: {scheduler.total_time():.3f} s")
    slow = scheduler.slowest()
    if slow:
        lines.append("slowest: " + ", ".join(f"{n} ({s:.3f} s)" for n, s in slow))
    failed = scheduler.failures()
    if failed:
        lines.append("failed runs: " + ", ".join(n for n, _ in failed))
    return "\\n".join(lines)


if __name__ == "__main__":
    demo = Scheduler()
    load_plan(demo, [
        {"name": "fetch", "priority": 1},
        {"name": "parse", "priority": 2, "depends_on": ["fetch"]},
        {"name": "index", "priority": 3, "depends_on": ["parse"]},
        {"name": "report", "priority": 5, "depends_on": ["index", "parse"]},
    ])
    print(demo.run())
    print(format_report(demo))
'''


PROMPTS: list[Prompt] = [
    # code edit: the answer is the code again with a small change
    Prompt("code_edit_type_hints", "code_edit", _user(
        "Add type hints to both functions below. Reply with the full code only.\n\n```python"
        + _INVENTORY + "```"), copy_heavy=True),
    Prompt("code_edit_add_method", "code_edit", _user(
        "Add a method `spread` to this class that returns the highest reading minus the "
        "lowest. Show the whole class.\n\n```python" + _TEMPERATURE + "```"), copy_heavy=True),
    Prompt("code_edit_rename", "code_edit", _user(
        "Rename the parameter `name` to `person` everywhere in this code and return the "
        "updated code.\n\n```python" + _GREETER + "```"), copy_heavy=True),
    # bug fix: find the bug, return the corrected code
    Prompt("bug_fix_off_by_one", "bug_fix", _user(
        "This function misses the last window. Fix the bug and show the corrected "
        "function.\n\n```python" + _WINDOW + "```"), copy_heavy=True),
    Prompt("bug_fix_mutable_default", "bug_fix", _user(
        "Calling this function twice keeps tags from the first call. Fix it and show the "
        "corrected code.\n\n```python" + _TAGS + "```"), copy_heavy=True),
    Prompt("bug_fix_binary_search", "bug_fix", _user(
        "This binary search never finds values in the upper half. Fix the bug and return "
        "the whole function.\n\n```python" + _SEARCH + "```"), copy_heavy=True),
    # reformat: the same content in another layout
    Prompt("reformat_csv_to_markdown", "reformat", _user(
        "Convert this CSV into a Markdown table with a header row.\n" + _CSV), copy_heavy=True),
    Prompt("reformat_list_to_json", "reformat", _user(
        "Turn this settings list into a JSON object, one key per setting.\n" + _SETTINGS),
        copy_heavy=True),
    # rewrite: the same text, corrected or restyled
    Prompt("rewrite_fix_grammar", "rewrite", _user(
        "Correct the spelling and grammar of this message without changing its meaning:\n"
        + _NOTICE), copy_heavy=True),
    Prompt("rewrite_recipe_formal", "rewrite", _user(
        "Rewrite these cooking notes as clear numbered recipe steps in proper English:\n"
        + _RECIPE_NOTE), copy_heavy=False),
    # summarise: a short new text about a given one
    Prompt("summarise_bees", "summarise", _user(
        "Summarise this paragraph in three sentences.\n" + _BEES), copy_heavy=False),
    Prompt("summarise_tram", "summarise", _user(
        "Give a short summary of this news report for someone in a hurry.\n" + _TRAM),
        copy_heavy=False),
    Prompt("summarise_sleep", "summarise", _user(
        "What are the main points of this text? Answer with a bullet list.\n" + _SLEEP),
        copy_heavy=False),
    # explain
    Prompt("explain_fizzbuzz_code", "explain", _user(
        "Explain what this Python code prints and why.\n\n```python" + _FIZZ + "```"),
        copy_heavy=False),
    Prompt("explain_dns", "explain", _user(
        "Explain how DNS turns a website name into an IP address, step by step."),
        copy_heavy=False),
    # long context: a question about one function of a long module
    Prompt("long_context_scheduler", "long_context", _user(
        "Here is a Python module.\n\n```python" + _LONG_MODULE + "```\n\n"
        "The method `slowest` should skip runs shorter than 0.01 seconds. Show the "
        "updated `slowest` method and explain the change in one sentence."), copy_heavy=True),
    # open chat
    Prompt("chat_trip_planning", "chat", _user(
        "I have a free weekend in early autumn. Suggest a plan for two days of hiking "
        "with a friend, including what to bring."), copy_heavy=False),
    Prompt("chat_learn_guitar", "chat", _user(
        "I am 35 and want to learn the guitar. How should I practise in the first month?"),
        copy_heavy=False),
    Prompt("chat_houseplants", "chat", (
        {"role": "user", "content": "Which houseplants are easy to keep alive?"},
        {"role": "assistant", "content": "Snake plants, pothos and spider plants are all "
                                         "forgiving: they tolerate low light and irregular "
                                         "watering."},
        {"role": "user", "content": "How often should I water a pothos, and how do I know "
                                    "it needs water?"},
    ), copy_heavy=False),
]


def by_name(names: list[str] | None = None) -> list[Prompt]:
    """The prompts called `names` (all when None), in the set's order; KeyError on an
    unknown name."""
    if names is None:
        return list(PROMPTS)
    known = {p.name: p for p in PROMPTS}
    missing = [n for n in names if n not in known]
    if missing:
        raise KeyError(f"unknown prompts: {', '.join(missing)}")
    return [known[n] for n in names]
