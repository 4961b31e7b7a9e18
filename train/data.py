"""Self-distillation data: the target's own greedy replies to the prompt set.

A drafter is judged by how often the target accepts its guesses, so it
learns best from what the target itself says. Replies come from the
verifier engine (float32, greedy, batched in waves, no drafter) and are
written as JSON lines of token ids, one per prompt:
{"i": prompt index, "prompt": [...], "reply": [...]}. Re-running continues
an interrupted file. The target's EAGLE-3 feature layers, and its final normed
hidden state for soft labels, are recorded on the way (FeatureRecorder) into
OUT.features/, which train/eagle3.py reads instead of running the
target again.

    python -m train.data --out ~/.cache/specdec/train/selfdistill_v2.jsonl --threads 1
    python -m train.data --split heldout --limit 64 --threads 1 \\
        --out ~/.cache/specdec/train/selfdistill_v2_heldout.jsonl
    python -m train.data --prompts chat --out ~/.cache/specdec/train/selfdistill_chat.jsonl
    python -m train.data --prompts chat \\
        --followups-of ~/.cache/specdec/train/selfdistill_chat.jsonl \\
        --out ~/.cache/specdec/train/selfdistill_followups.jsonl

--followups-of builds second-turn prompts from an earlier file's replies
(train/followups.py); its split is that file's, and --prompts names
the set that file was generated from.

The prompts are shuffled, so a file stopped early is a sample of its split.
On a shared 2-core machine use --threads 1: two threads competing with
another process run several times slower.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdec.models import load_model
from specdec.models.prepare import cache_dir, prepare_default_model
from specdec.sampling import SamplingParams
from specdec.tokenizer import Tokenizer
from train.chat_prompts import build_chat_prompts
from train.eagle3 import default_layers, feature_key, feature_layers
from train.followups import build_followups
from train.prompts import build_prompts
from verifier.engine import Engine, EngineConfig, Request
from verifier.engine.proposer import Outcome, Proposal, Proposer

MAX_MODEL_LEN = 1024
FEATURE_MAX_LEN = 640  # train/eagle3.py's default --max-len
# The prompt sets, by --prompts name: the mixed set (text, code and data tasks, templated
# questions) and everyday chat (train/chat_prompts.py).
PROMPT_SETS = {"mixed": build_prompts, "chat": build_chat_prompts}


class FeatureRecorder(Proposer):
    """A proposer that never drafts and keeps the target's hidden states of `layers`
    for every position the target computes, as float16: the EAGLE-3 training
    features, recorded while generating instead of by a second target pass."""

    def __init__(self, layers: tuple[int, ...]):
        self.layers = layers
        self.rows: dict[int, list[torch.Tensor]] = {}
        self.request_of: dict[int, str] = {}
        self.finished: dict[str, torch.Tensor] = {}  # request id -> [P, len(layers), H]

    def start(self, seq_id: int, request: Request) -> None:
        self.rows[seq_id], self.request_of[seq_id] = [], request.request_id

    def propose(self, wanted: dict[int, int], tokens: dict[int, list[int]]) -> dict[int, Proposal]:
        return {}

    def advance(self, seq_id: int, outcome: Outcome) -> None:
        if outcome.hidden_states is not None:
            self.rows[seq_id].append(outcome.hidden_states.to(torch.float16))

    def free(self, seq_id: int) -> None:
        rows = self.rows.pop(seq_id)
        self.finished[self.request_of.pop(seq_id)] = torch.cat(rows) if rows else None

    def hidden_layers(self, seq_id: int) -> tuple[int, ...]:
        return self.layers


def sequence_features(rows: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """[length, L, H] features of a finished sequence from the recorded rows, which stop
    two short: the last step's input (its outcome is not reported) and the last token
    (never fed). Neither feeds a labelled training row, so they are zeros."""
    if rows is None or len(rows) != length - 2:
        return None
    return torch.cat([rows, rows.new_zeros(2, *rows.shape[1:])])


def default_path() -> Path:
    return cache_dir() / "train" / "selfdistill.jsonl"


def features_dir(out: Path) -> Path:
    """Where `generate` keeps the target features of `out`'s rows: one file per wave of
    {feature_key: [T, len(layers), H] float16}, read by train/eagle3.py."""
    return out.with_suffix(".features")


def conversations_of(tok: Tokenizer, prompt_set: str, split: str,
                     followups_of: Path | None = None) -> list[list[dict]]:
    """The conversations to reply to: one user turn per prompt of the set's split, or,
    with `followups_of`, second-turn conversations built from that file's rows (whose
    prompts come from `prompt_set`, either split)."""
    if followups_of is None:
        return [[{"role": "user", "content": text}] for text in PROMPT_SETS[prompt_set](split)]
    # The file keeps token ids; the user's words come back from the prompt set itself,
    # which is independent of the chat template's markup.
    text_of = {tuple(tok.apply_chat_template([{"role": "user", "content": t}])): t
               for s in ("train", "heldout") for t in PROMPT_SETS[prompt_set](s)}
    rows = [json.loads(line) for line in followups_of.open()]
    missing = sum(tuple(r["prompt"]) not in text_of for r in rows)
    if missing:
        raise ValueError(f"{followups_of}: {missing} of {len(rows)} prompts are not in the "
                         f"{prompt_set!r} prompt set (pass the set it was generated from)")
    return build_followups(rows, tok.decode, lambda ids: text_of[tuple(ids)])


def generate(model_dir: Path, out: Path, max_tokens: int, batch: int, limit: int | None,
             split: str = "train", record_features: bool = True,
             prompt_set: str = "mixed", followups_of: Path | None = None) -> int:
    """Replies to the conversations (`conversations_of`) that `out` lacks, in waves of
    `batch` prompts.

    Each wave is prefilled together and then decoded to its end, without admitting
    new prompts midway: the CPU attention pads a ragged batch to its longest query
    and key, so a prefill mixed into decode steps, or one long prompt among short
    ones, costs as much as a whole batch of long prompts. Waves are therefore cut
    from blocks of 8 waves sorted by prompt length (the blocks follow the shuffled
    prompt order, so a file stopped early is still a sample of the split). Rows
    carry their prompt's index "i", which is how a re-run finds what is left."""
    tok = Tokenizer.from_dir(model_dir)
    model = load_model(model_dir, dtype="float32")
    layers = feature_layers(default_layers(model.config.num_layers), model.config.num_layers)
    recorder = FeatureRecorder(layers) if record_features else None
    conversations = conversations_of(tok, prompt_set, split, followups_of)[:limit]
    # Prompts too long for the engine are left out (deterministically, so resuming works).
    encoded = [tok.apply_chat_template(c) for c in conversations]
    encoded = [ids for ids in encoded if len(ids) + max_tokens <= MAX_MODEL_LEN]
    have = set()
    if out.exists():
        have = {json.loads(line).get("i", n) for n, line in enumerate(out.open())}
    todo = [i for i in range(len(encoded)) if i not in have]
    out.parent.mkdir(parents=True, exist_ok=True)
    engine = Engine(model, EngineConfig(max_num_seqs=batch, max_model_len=MAX_MODEL_LEN,
                                        num_kv_blocks=batch * MAX_MODEL_LEN // 16,
                                        max_num_batched_tokens=batch * MAX_MODEL_LEN),
                    eos_token_ids=tok.eos_token_ids, proposer=recorder)
    if recorder is not None:
        features_dir(out).mkdir(parents=True, exist_ok=True)
    t0, n_tokens, written = time.perf_counter(), 0, 0
    with out.open("a") as f:
        for b in range(0, len(todo), 8 * batch):
            block = sorted(todo[b:b + 8 * batch], key=lambda i: len(encoded[i]))
            for w in range(0, len(block), batch):
                wave = block[w:w + batch]
                replies: dict[int, list[int]] = {i: [] for i in wave}
                for i in wave:
                    engine.add_request(Request(str(i), encoded[i], max_tokens,
                                               SamplingParams(temperature=0.0)))
                while engine.has_work():
                    for o in engine.step():
                        replies[int(o.request_id)].extend(o.new_token_ids)
                        n_tokens += len(o.new_token_ids)
                shard = {}
                for i in wave:
                    tokens = (encoded[i] + replies[i])[:FEATURE_MAX_LEN]
                    if recorder is not None:
                        feats = sequence_features(recorder.finished.pop(str(i)),
                                                  len(encoded[i]) + len(replies[i]))
                        if feats is not None:
                            shard[feature_key(tokens, layers)] = feats[:FEATURE_MAX_LEN].clone()
                if shard:
                    torch.save(shard, features_dir(out) / f"{wave[0]}.pt")
                for i in wave:
                    f.write(json.dumps({"i": i, "prompt": encoded[i], "reply": replies[i]}) + "\n")
                f.flush()
                written += len(wave)
                rate = n_tokens / (time.perf_counter() - t0)
                print(f"{len(have) + written}/{len(encoded)} prompts, {n_tokens} reply tokens, "
                      f"{rate:.0f} tok/s", flush=True)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="target model dir (default: the prepared default model)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--split", choices=("train", "heldout"), default="train")
    p.add_argument("--prompts", choices=sorted(PROMPT_SETS), default="mixed",
                   help="prompt set: mixed (train/prompts.py) or everyday chat "
                        "(train/chat_prompts.py)")
    p.add_argument("--followups-of", type=Path, default=None, metavar="FILE",
                   help="second-turn prompts built from FILE's replies (a file of the "
                        "--prompts set; its split is FILE's)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--no-features", action="store_true",
                   help="do not record the target features (EAGLE-3 training computes them)")
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else prepare_default_model()
    out = args.out or default_path()
    n = generate(model_dir, out, args.max_tokens, args.batch, args.limit, args.split,
                 not args.no_features, args.prompts, args.followups_of)
    print(f"wrote {n} replies to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
