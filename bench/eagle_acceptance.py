"""Acceptance of a trained EAGLE-3 head, drafting chains and token trees, against n-gram
lookup and the two together (the head with prompt lookup, a confidence stop and token
trees, as compose.yaml deploys eagle3), on held-out chat prompts.

Each prompt (none of them in train/prompts.py) is decoded greedily for
--tokens tokens, batch 1, through the verifier engine with a drafter in
process at K = --k; the output must equal plain greedy decoding. Reported per
drafter: acceptance length (1 + accepted / draft rounds), per-position
acceptance, decode rate; and the cost of one head step (one row, the
drafting steps after the first) against one target decode step.

    .venv/bin/python -m bench.eagle_acceptance [--head drafter/weights/smollm2-135m-eagle3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from drafter.eagle import Eagle3Method
from drafter.ngram import NgramMethod
from specdec.launch import service_flag
from specdec.models import load_model
from specdec.models.prepare import prepare_default_model
from specdec.sampling import SamplingParams
from specdec.tokenizer import Tokenizer
from train.inprocess import InProcessProposer
from verifier.engine import Engine, EngineConfig, Request
from verifier.engine.proposer import Proposer

DEFAULT_HEAD = Path(__file__).resolve().parent.parent / "drafter/weights/smollm2-135m-eagle3"
RESULTS = Path(__file__).resolve().parent / "results"

PROMPTS = [
    "What should I pack for a weekend hiking trip in the mountains?",
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about autumn leaves.",
    "How do I make a good first impression at a job interview?",
    "What are the main differences between cats and dogs as pets?",
    "Describe the rules of tic-tac-toe.",
    "Give me a simple recipe for pancakes.",
    "Why is the sky blue?",
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the difference between a list and a tuple in Python?",
    "Summarise the plot of Romeo and Juliet in a few sentences.",
    "How can I save money on groceries each week?",
    "Explain what an API is using an analogy.",
    "What are some good habits for staying focused while studying?",
    "Tell me about the planets of the solar system.",
    "How does a bicycle stay upright while moving?",
]


def run(model, prompts: list[list[int]], tokens: int, k: int,
        proposer: Proposer | None, eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int = 1024) -> dict:
    """Greedy decode of each prompt alone, `tokens` of them (fewer at an EOS when
    eos_token_ids are given); outputs and acceptance counts."""
    outputs, accepted_hist, rounds, drafted, steps, seconds = [], [0] * (k + 1), 0, 0, 0, 0.0
    for i, prompt in enumerate(prompts):
        engine = Engine(model, EngineConfig(max_model_len=max_model_len,
                                            num_kv_blocks=2 * -(-max_model_len // 16),
                                            max_num_speculative_tokens=max(k, 1)), proposer,
                        eos_token_ids)
        engine.add_request(Request(str(i), prompt, tokens, SamplingParams(temperature=0.0),
                                   ignore_eos=not eos_token_ids,
                                   num_speculative_tokens=k if proposer else 0,
                                   drafter="d" if proposer else None))
        out: list[int] = []
        t0 = time.perf_counter()
        while engine.has_work():
            for o in engine.step():
                out.extend(o.new_token_ids)
                steps += bool(o.new_token_ids)
                if o.num_drafted:
                    rounds += 1
                    drafted += o.num_drafted
                    accepted_hist[o.num_accepted] += 1
        seconds += time.perf_counter() - t0
        outputs.append(out)
    accepted = sum(a * n for a, n in enumerate(accepted_hist))
    # Position j is accepted when at least j drafts were; conditional on j - 1.
    at_least = [sum(accepted_hist[j:]) for j in range(k + 1)]
    # Rounds are steps that verified a draft; n-gram lookup skips steps without a match,
    # so tokens per step (prefill steps included) is the fairer whole-run number.
    return {"outputs": outputs, "rounds": rounds, "accepted_hist": accepted_hist,
            "mean_draft_len": drafted / max(rounds, 1),
            "tokens_per_step": sum(map(len, outputs)) / max(steps, 1),
            "acceptance_length": 1 + accepted / max(rounds, 1),
            "position_acceptance": [at_least[j] / max(rounds, 1) for j in range(1, k + 1)],
            "position_conditional": [at_least[j] / max(at_least[j - 1], 1)
                                     for j in range(1, k + 1)],
            "tok_s": sum(map(len, outputs)) / seconds}


@torch.inference_mode()
def step_costs(model, head, context: int = 200, repeats: int = 50) -> dict:
    """Milliseconds of one target decode step and one head step (one row), both at batch
    1 after `context` positions, medians over `repeats`."""
    def timed(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    tcache = model.make_kv_cache(-(-(context + 1) // 16) + 1, 16)
    tcache.add(0)
    model(torch.zeros(context, dtype=torch.int64), tcache.plan([(0, context)]), tcache)
    ids = torch.zeros(1, dtype=torch.int64)

    def target_step():
        meta = tcache.plan([(0, 1)])
        model(ids, meta, tcache)
        tcache.truncate(0, context)

    hcache = head.make_kv_cache(-(-(context + 1) // 16) + 1, 16)
    hcache.add(0)
    feats = torch.randn(context, head.config.decoder.hidden_size)
    head(torch.zeros(context, dtype=torch.int64), feats, torch.arange(context),
         hcache.plan([(0, context)]), hcache)
    hidden = feats[:1]
    pos = torch.tensor([context])

    def head_step():
        meta = hcache.plan([(0, 1)])
        head.draft_token_ids(head(ids, hidden, pos, meta, hcache))[0]
        hcache.truncate(0, context)

    target_ms = timed(target_step) if repeats else 0.0
    head_ms = timed(head_step)
    return {"target_step_ms": target_ms, "head_step_ms": head_ms,
            "ratio": head_ms / target_ms}


def render(result: dict) -> str:
    lines = [f"EAGLE-3 head `{result['head']}`, n-gram, and both, {result['prompts']} held-out chat "
             f"prompts, "
             f"greedy, {result['tokens']} tokens each, batch 1, K = {result['k']}, "
             f"{result['threads']} threads, {result['device']} (torch {result['torch']}); "
             "outputs equal plain greedy.", "",
             "| drafter | acceptance length | accepted at position 1..K | conditional 1..K | "
             "rounds | mean draft | tokens / step | tok/s |", "|---|---|---|---|---|---|---|---|"]
    for name, r in result["drafters"].items():
        lines.append(f"| {name} | {r['acceptance_length']:.3f} | "
                     + " ".join(f"{a:.3f}" for a in r["position_acceptance"]) + " | "
                     + " ".join(f"{a:.3f}" for a in r["position_conditional"])
                     + f" | {r['rounds']} | {r['mean_draft_len']:.2f} | {r['tokens_per_step']:.3f} "
                     f"| {r['tok_s']:.1f} |")
    lines.append(f"| none (plain greedy) | | | | | | 1 | {result['greedy_tok_s']:.1f} |")
    c = result["step_costs"]
    lines += ["", f"One head step (one row, context 200): {c['head_step_ms']:.2f} ms; one target "
              f"decode step: {c['target_step_ms']:.2f} ms; ratio {c['ratio']:.3f}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, default=DEFAULT_HEAD)
    ap.add_argument("--target", help="target model dir (default: the prepared default model)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=len(PROMPTS), help="first N prompts only")
    ap.add_argument("--lookup-min", type=int, default=int(service_flag("eagle3", "--lookup-min")),
                    help="eagle3+lookup's shortest n-gram (default %(default)s, as deployed)")
    ap.add_argument("--min-confidence", type=float,
                    default=float(service_flag("eagle3", "--min-confidence")),
                    help="eagle3+lookup's confidence stop (default %(default)s, as deployed)")
    ap.add_argument("--tree-width", type=int,
                    default=int(service_flag("eagle3", "--tree-width")),
                    help="token trees of K tokens with up to this many choices a depth, for "
                         "'eagle3 tree' (the head alone) and eagle3+lookup (default "
                         "%(default)s, as deployed)")
    ap.add_argument("--out", type=Path, default=RESULTS / "eagle_acceptance")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = Path(args.target) if args.target else prepare_default_model()
    tok = Tokenizer.from_dir(target_dir)
    model = load_model(target_dir, dtype="float32")
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}])
               for p in PROMPTS[:args.num_prompts]]

    greedy = run(model, prompts, args.tokens, 0, None)
    eagle = Eagle3Method(args.head, target_dir, max_num_speculative_tokens=args.k)
    drafters = {"eagle3": eagle, "ngram": NgramMethod(max_num_speculative_tokens=args.k),
                f"eagle3 tree (--tree-width {args.tree_width})": Eagle3Method(
                    args.head, target_dir, max_num_speculative_tokens=args.k,
                    tree_width=args.tree_width),
                f"eagle3+lookup (--lookup-min {args.lookup_min} --min-confidence "
                f"{args.min_confidence} --tree-width {args.tree_width})": Eagle3Method(
                    args.head, target_dir, max_num_speculative_tokens=args.k,
                    lookup_min_n=args.lookup_min, min_confidence=args.min_confidence,
                    tree_width=args.tree_width)}
    results = {}
    for name, method in drafters.items():
        r = run(model, prompts, args.tokens, args.k, InProcessProposer(method, args.k))
        assert r["outputs"] == greedy["outputs"], f"{name}: output differs from plain greedy"
        del r["outputs"]
        results[name] = r
        print(f"{name}: acceptance length {r['acceptance_length']:.3f}, per position "
              + " ".join(f"{a:.3f}" for a in r["position_acceptance"]), flush=True)
    result = {"head": str(args.head.name), "prompts": len(prompts), "tokens": args.tokens, "k": args.k,
              "threads": args.threads, "device": platform.processor() or platform.machine(),
              "torch": torch.__version__, "greedy_tok_s": greedy["tok_s"],
              "drafters": results, "step_costs": step_costs(model, eagle.head)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    text = render(result)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
