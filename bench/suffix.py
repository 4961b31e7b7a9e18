"""Suffix decoding against n-gram lookup: acceptance, speed and memory, in process.

Two prompt sets, each decoded greedily one prompt at a time (up to --tokens tokens,
stopping at EOS) through the verifier engine with the drafter in process at K = --k;
every output must equal plain greedy decoding:

  * bench: the project's benchmark prompts (bench/prompts.py), in order;
  * repeated tasks: a few agent-style tasks (a fixed instruction and output format,
    other inputs), each issued --rounds times, round after round, as an agent loop
    re-issues its steps: here past replies recur, which is what suffix decoding's
    global tree of past replies is for.

One drafter instance serves a whole set, so its global tree fills as the set runs.
Reported per drafter: acceptance length (1 + accepted / draft rounds), tokens per
step, decode rate (prefill included, one thread), and for suffix decoding the trees'
size at the end (nodes, and bytes measured with tracemalloc).

    .venv/bin/python -m bench.suffix [--tokens 96] [--k 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import tracemalloc
from pathlib import Path

import torch

from bench.eagle_acceptance import run
from bench.prompts import PROMPTS
from drafter.ngram import NgramMethod
from drafter.suffix import SuffixMethod, SuffixTree
from specdec.models import load_model
from specdec.models.prepare import prepare_default_model
from specdec.tokenizer import Tokenizer
from train.inprocess import InProcessProposer

RESULTS = Path(__file__).resolve().parent / "results"

# Agent-style tasks: the instruction and the output format stay, the input changes.
_TASKS = [
    ("You are a tool-calling agent. Reply with one JSON object "
     '{"tool": "get_weather", "arguments": {"city": ..., "unit": "celsius"}} and nothing '
     "else. Request: what is the weather in {}?", ["Paris", "Oslo", "Lima", "Cairo"]),
    ("Extract the fields of this order as YAML with keys customer, item, quantity and "
     "shipping. Order: {}", ["Ana buys 3 blue mugs, express shipping",
                             "Ben buys 1 desk lamp, standard shipping",
                             "Chloe buys 12 pencils, express shipping",
                             "Dev buys 2 chairs, pickup"]),
    ("Write a git commit message (a summary line under 50 characters, a blank line, then "
     "one sentence of detail) for this change: {}", ["fix a typo in the README",
                                                     "add retries to the HTTP client",
                                                     "remove the unused cache module",
                                                     "bump the version to 1.2.0"]),
]


def repeated_tasks(rounds: int) -> list[str]:
    """Each task's inputs in turn, the whole list `rounds` times over."""
    one_round = [template.replace("{}", value) for template, values in _TASKS
                 for value in values]
    return one_round * rounds


def tree_bytes(method: SuffixMethod) -> int:
    """Bytes the global tree takes: rebuilt from the replies it holds, under tracemalloc."""
    tracemalloc.start()
    tree = SuffixTree(method.max_depth)
    for reply in method.cached_replies:
        tree.add(reply)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return size


def render(result: dict) -> str:
    lines = [f"Suffix decoding against n-gram lookup: {result['model']} float32, greedy, one "
             f"prompt at a time, up to {result['tokens']} tokens (EOS ends a reply), K = "
             f"{result['k']}, {result['threads']} thread, in process, {result['device']}, "
             f"torch {result['torch']}. AL = acceptance length; tok/s includes prefill; "
             "x = over plain decoding in the same run.", ""]
    for name, s in result["sets"].items():
        lines += [f"### {name} ({s['prompts']} prompts, {s['tokens_out']} tokens out)", "",
                  "| drafter | AL | tokens/step | draft rounds | tok/s | x | identical | "
                  "tree nodes | tree MB |", "|---|---|---|---|---|---|---|---|---|",
                  f"| plain | - | 1.000 | 0 | {s['plain_tok_s']:.1f} | 1.00x | - | - | - |"]
        for drafter, r in s["drafters"].items():
            mem = (f"{r['tree_nodes']} | {r['tree_bytes'] / 1e6:.2f}" if "tree_nodes" in r
                   else "- | -")
            lines.append(f"| {drafter} | {r['acceptance_length']:.2f} | "
                         f"{r['tokens_per_step']:.3f} | {r['rounds']} | {r['tok_s']:.1f} | "
                         f"{r['tok_s'] / s['plain_tok_s']:.2f}x | yes | {mem} |")
        lines.append("")
    lines += ["Notes:", "",
              "- suffix: `--suffix-max-depth 24 --suffix-max-cached-requests 100 "
              "--suffix-max-spec-factor 1.0 --suffix-max-spec-offset 2 "
              "--suffix-min-token-prob 0.3` (the defaults); 'own context only' is "
              "`--suffix-max-cached-requests 0` (no global tree of past replies).",
              "- The defaults were chosen on the bench prompts (64 tokens, K = 4, tokens per "
              "step / draft rounds): Arctic's offset 0, min probability 0.1: 1.719 / 480; "
              "0.3: 1.721 / 437; offset 2 with 0.1: 1.796 / 451, 0.3: 1.793 / 410, 0.5: "
              "1.790 / 379; ngram 1.754 / 377.",
              "- ngram: prompt lookup of 1..4-grams, as deployed.",
              "- tree nodes / MB: the global tree of past replies at the end of the set "
              "(request trees are freed with their requests); MB measured with tracemalloc."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="target model dir (default: the prepared default model)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="repeated-task rounds")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "suffix")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = Path(args.target) if args.target else prepare_default_model()
    tok = Tokenizer.from_dir(target_dir)
    model = load_model(target_dir, dtype="float32")
    eos = frozenset(tok.eos_token_ids)
    sets = {
        "bench prompts": [tok.apply_chat_template(list(p.messages)) for p in PROMPTS],
        "repeated tasks": [tok.apply_chat_template([{"role": "user", "content": text}])
                           for text in repeated_tasks(args.rounds)],
    }
    max_len = max(len(p) for ps in sets.values() for p in ps) + args.tokens + args.k + 1
    result = {"model": target_dir.name, "tokens": args.tokens, "k": args.k,
              "threads": args.threads, "device": platform.processor() or platform.machine(),
              "torch": torch.__version__, "sets": {}}
    for set_name, prompts in sets.items():
        plain = run(model, prompts, args.tokens, 0, None, eos, max_len)
        entry = {"prompts": len(prompts), "tokens_out": sum(map(len, plain["outputs"])),
                 "plain_tok_s": plain["tok_s"], "drafters": {}}
        drafters = {"ngram": NgramMethod(max_num_speculative_tokens=args.k),
                    "suffix": SuffixMethod(max_num_speculative_tokens=args.k),
                    "suffix, own context only": SuffixMethod(max_num_speculative_tokens=args.k,
                                                             max_cached_requests=0)}
        for name, method in drafters.items():
            r = run(model, prompts, args.tokens, args.k, InProcessProposer(method, args.k), eos,
                    max_len)
            assert r["outputs"] == plain["outputs"], f"{name}: output differs from plain greedy"
            del r["outputs"]
            if isinstance(method, SuffixMethod):
                shared = method.shared_tree()
                r["tree_nodes"] = shared.num_nodes if shared is not None else 0
                r["tree_bytes"] = tree_bytes(method)
            entry["drafters"][name] = r
            print(f"{set_name} / {name}: AL {r['acceptance_length']:.3f}, "
                  f"{r['tok_s']:.1f} tok/s (plain {plain['tok_s']:.1f})", flush=True)
        result["sets"][set_name] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    text = render(result)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
