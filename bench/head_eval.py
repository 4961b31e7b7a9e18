"""Score EAGLE-3 heads on the benchmark prompts, without training on them.

The target's greedy replies (float32, batched, up to --max-tokens) to the
project's benchmark prompts (bench/prompts.py, and the held-out chat prompts
of bench/eagle_acceptance.py) are generated once and cached; they are for
measuring only, never training data. For each head the script reports:

  * draft-vocabulary coverage: the share of reply tokens the head can draft;
  * teacher-forced accuracy of draft steps 1..S over those replies, with each
    chain fed the head's own previous outputs (what drafting computes, as in
    train/eagle3.py's held-out evaluation), and the acceptance length
    it implies, 1 + a1 + a1 a2 + ... (greedy verification, K = S);
  * with --engine-tokens N: the acceptance length measured by decoding each
    prompt through the verifier engine with the head in process (batch 1,
    K = S, N tokens, bench/eagle_acceptance.py's `run`); outputs of all heads
    must agree.

    python -m bench.head_eval drafter/weights/smollm2-135m-eagle3 /tmp/new-head
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.eagle_acceptance import PROMPTS as CHAT
from bench.eagle_acceptance import run
from bench.prompts import PROMPTS
from drafter.eagle import Eagle3Method
from drafter.heads.load import load_head
from specdec.models import load_model
from specdec.models.prepare import cache_dir, prepare_default_model
from specdec.sampling import SamplingParams
from specdec.tokenizer import Tokenizer
from train import eagle3
from train.inprocess import InProcessProposer
from verifier.engine import Engine, EngineConfig, Request


def bench_conversations() -> dict[str, list[list[dict]]]:
    return {"bench": [list(p.messages) for p in PROMPTS],
            "eagle_acceptance": [[{"role": "user", "content": p}] for p in CHAT]}


def bench_replies(model, tok: Tokenizer, path: Path, max_tokens: int) -> list[dict]:
    """Rows {set, prompt, reply} of greedy replies, from `path` or generated into it."""
    if path.exists():
        return [json.loads(line) for line in path.open()]
    rows = [{"set": name, "prompt": tok.apply_chat_template(conv)}
            for name, convs in bench_conversations().items() for conv in convs]
    engine = Engine(model, EngineConfig(max_num_seqs=8, max_model_len=4096, num_kv_blocks=2048,
                                        max_num_batched_tokens=8 * 4096),
                    eos_token_ids=tok.eos_token_ids)
    # Waves of similar prompt lengths (see train/data.py: padding is costly on CPU).
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt"]))
    short = [i for i in order if len(rows[i]["prompt"]) <= 1024]
    waves = [short[w:w + 8] for w in range(0, len(short), 8)]
    waves += [[i] for i in order if len(rows[i]["prompt"]) > 1024]
    for wave in waves:
        for i in wave:
            engine.add_request(Request(str(i), rows[i]["prompt"], max_tokens,
                                       SamplingParams(temperature=0.0)))
            rows[i]["reply"] = []
        while engine.has_work():
            for o in engine.step():
                rows[int(o.request_id)]["reply"].extend(o.new_token_ids)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def implied_acceptance_length(acc: list[float]) -> float:
    out, p = 1.0, 1.0
    for a in acc:
        p *= a
        out += p
    return out


def score(head_dir: Path, target_dir: Path, rows: list[dict], feats: list[torch.Tensor],
          steps: int) -> dict:
    head = load_head("eagle3", head_dir, target_dir, dtype="float32")
    vocab = head.config.vocab_size
    draft_ids = torch.arange(head.config.draft_vocab_size) + head.d2t
    t2d = eagle3.target_to_draft(draft_ids, vocab)
    out = {}
    for name in sorted({r["set"] for r in rows}):
        exs = [eagle3.Example(torch.tensor(r["prompt"] + r["reply"]), len(r["prompt"]), f)
               for r, f in zip(rows, feats, strict=True) if r["set"] == name]
        reply = torch.cat([ex.tokens[ex.prompt_len:] for ex in exs])
        ev = eagle3.evaluate(head, exs, t2d, steps)
        out[name] = {"coverage": float((t2d[reply] >= 0).float().mean()),
                     "accuracy": ev["accuracy"],
                     "implied_acceptance_length": implied_acceptance_length(ev["accuracy"])}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("heads", type=Path, nargs="+", help="EAGLE-3 head directories")
    p.add_argument("--target", help="target model dir (default: the prepared default model)")
    p.add_argument("--replies", type=Path, default=cache_dir() / "train" / "bench_replies.jsonl")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--engine-tokens", type=int, default=0,
                   help="also measure acceptance through the engine, this many tokens each")
    p.add_argument("--json", type=Path, help="also write the scores here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir = Path(args.target) if args.target else prepare_default_model()
    tok = Tokenizer.from_dir(target_dir)
    model = load_model(target_dir, dtype="float32")
    rows = bench_replies(model, tok, args.replies, args.max_tokens)
    layers = load_head("eagle3", args.heads[0], target_dir).config.target_layers
    feats = [eagle3.target_features(model, torch.tensor(r["prompt"] + r["reply"]), layers)
             for r in rows]
    result = {}
    for head_dir in args.heads:
        result[str(head_dir)] = s = score(head_dir, target_dir, rows, feats, args.steps)
        for name, r in s.items():
            print(f"{head_dir} {name}: coverage {r['coverage']:.3f}, accuracy "
                  + " / ".join(f"{a:.3f}" for a in r["accuracy"])
                  + f", implied acceptance length {r['implied_acceptance_length']:.3f}",
                  flush=True)
    if args.engine_tokens:
        outputs: dict[str, list[list[int]]] = {}  # greedy output is the same for every head
        for head_dir in args.heads:
            method = Eagle3Method(head_dir, target_dir, max_num_speculative_tokens=args.steps)
            for name in sorted({r["set"] for r in rows}):
                # bench/eagle_acceptance.py's engine holds 1024 positions: the long-context
                # prompt is scored teacher-forced only.
                prompts = [r["prompt"] for r in rows if r["set"] == name
                           and len(r["prompt"]) + args.engine_tokens <= 1024]
                r = run(model, prompts, args.engine_tokens, args.steps,
                        InProcessProposer(method, args.steps))
                assert outputs.setdefault(name, r["outputs"]) == r["outputs"], \
                    f"{head_dir}: outputs differ from the first head's"
                result[str(head_dir)][name]["engine"] = {
                    k: r[k] for k in ("acceptance_length", "position_acceptance", "rounds")}
                print(f"{head_dir} {name}: engine acceptance length {r['acceptance_length']:.3f}, "
                      "per position " + " ".join(f"{a:.3f}" for a in r["position_acceptance"]),
                      flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
