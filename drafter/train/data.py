"""Self-distillation data: the target's own greedy replies to the prompt set.

A drafter is judged by how often the target accepts its guesses, so it
learns best from what the target itself says. Replies come from the
verifier engine (continuous batching, no drafter) and are written as JSON
lines of token ids, one per prompt: {"prompt": [...], "reply": [...]}.
Re-running continues an interrupted file.

    python -m drafter.train.data --out ~/.cache/specdec/train/selfdistill.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from drafter.train.prompts import build_prompts
from specdec.models import load_model
from specdec.models.prepare import cache_dir, prepare_default_model
from specdec.tokenizer import Tokenizer
from verifier.engine import Engine, EngineConfig, Request
from verifier.sampling.params import SamplingParams


def default_path() -> Path:
    return cache_dir() / "train" / "selfdistill.jsonl"


def generate(model_dir: Path, out: Path, max_tokens: int, batch: int, limit: int | None) -> int:
    tok = Tokenizer.from_dir(model_dir)
    model = load_model(model_dir, dtype="float32")
    prompts = build_prompts()[:limit]
    done = 0
    if out.exists():
        done = sum(1 for _ in out.open())
    out.parent.mkdir(parents=True, exist_ok=True)
    engine = Engine(model, EngineConfig(max_num_seqs=batch, max_model_len=1024,
                                        num_kv_blocks=batch * 1024 // 16, max_num_batched_tokens=1024),
                    eos_token_ids=tok.eos_token_ids)
    ids = {}
    for i, text in enumerate(prompts[done:], start=done):
        prompt = tok.apply_chat_template([{"role": "user", "content": text}])
        ids[str(i)] = prompt
        engine.add_request(Request(str(i), prompt, max_tokens, SamplingParams(temperature=0.0)))
    replies: dict[str, list[int]] = {}
    finished: set[str] = set()
    next_to_write = done
    t0, n_tokens = time.perf_counter(), 0
    with out.open("a") as f:
        while engine.has_work():
            for o in engine.step():
                replies.setdefault(o.request_id, []).extend(o.new_token_ids)
                n_tokens += len(o.new_token_ids)
                if o.finish_reason is not None:
                    finished.add(o.request_id)
            # Write in prompt order so that an interrupted file resumes cleanly.
            while str(next_to_write) in finished:
                key = str(next_to_write)
                finished.discard(key)
                f.write(json.dumps({"prompt": ids[key], "reply": replies.pop(key)}) + "\n")
                f.flush()
                next_to_write += 1
                if next_to_write % 25 == 0:
                    rate = n_tokens / (time.perf_counter() - t0)
                    print(f"{next_to_write}/{len(prompts)} prompts, {rate:.0f} tok/s", flush=True)
    return next_to_write - done


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target model dir (default: the prepared default model)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else prepare_default_model()
    out = args.out or default_path()
    n = generate(model_dir, out, args.max_tokens, args.batch, args.limit)
    print(f"wrote {n} replies to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
