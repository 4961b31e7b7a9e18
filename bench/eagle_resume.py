"""EAGLE-3 acceptance once speculation resumes after plain steps: the head kept in sync
with every position's hidden states (what the verifier does: a sequence at K = 0 holds
its outcomes and sends them when it drafts again, and the head takes them all in),
against a head whose context starts over at the resume (no states sent while plain),
and against drafting from the first token.

A sequence at K = 0 still costs its hidden states each step (taken out of the step's
output, held, and the head's catch-up at resume); starting the head over would save
all of it. This says what that would cost in acceptance. The bench's chat prompts
(bench/prompts.py) are decoded greedily together through the verifier engine with
the head in process, plain until each reply has --off tokens and at K = --k after;
every reply must equal plain greedy decoding.

    .venv/bin/python -m bench.eagle_resume [--off 40,90] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch

from bench.serving import prompts_by_name
from drafter.eagle import Eagle3Method
from specdec.models import load_model
from specdec.models.prepare import prepare_default_model
from specdec.sampling import SamplingParams
from specdec.tokenizer import Tokenizer
from train.inprocess import InProcessProposer
from verifier.engine import Engine, EngineConfig, Request
from verifier.engine.proposer import Outcome

DEFAULT_HEAD = Path(__file__).resolve().parent.parent / "drafter/weights/smollm2-135m-eagle3"
RESULTS = Path(__file__).resolve().parent / "results"
MODES = {
    "from the start": "drafting at K from the first token (the positions after --off counted)",
    "held": "plain until --off, every state sent at the resume (the verifier's way)",
    "started over": "plain until --off, no states sent while plain: the head's context "
                    "starts at the resume",
}


class _Resumable(InProcessProposer):
    """The head in process; with `drop`, a sequence not in `drafting` sends its tokens
    without their hidden states."""

    def __init__(self, method: Eagle3Method, k_max: int, drop: bool):
        super().__init__(method, k_max)
        self.drop = drop
        self.drafting: set[int] = set()

    def advance(self, seq_id: int, outcome: Outcome) -> None:
        if self.drop and seq_id not in self.drafting:
            self.method.advance(seq_id, 0, 0, outcome.new_token_ids, 0, None, 0)
        else:
            super().advance(seq_id, outcome)


def run(model, head: Path, target: Path, tok: Tokenizer, prompts: list[list[int]],
        mode: str, off: int, k: int, tokens: int) -> dict:
    proposer = _Resumable(Eagle3Method(head, target, max_num_speculative_tokens=k), k,
                          drop=mode == "started over")
    engine = Engine(model, EngineConfig(max_num_seqs=len(prompts), max_model_len=2048,
                                        num_kv_blocks=1024, max_num_speculative_tokens=k),
                    proposer, tok.eos_token_ids)
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", p, tokens, SamplingParams(temperature=0.0),
                                   num_speculative_tokens=k if mode == "from the start" else 0))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    asked = drafted = accepted = 0
    while engine.has_work():
        for o in engine.step():
            if len(out[o.request_id]) >= off and o.num_speculative_tokens:
                asked += 1
                drafted += o.num_drafted > 0
                accepted += o.num_accepted
            out[o.request_id] += o.new_token_ids
        for rid, ids in out.items():
            seq = engine._by_request.get(rid)
            if seq is not None and len(ids) >= off and seq.seq_id not in proposer.drafting:
                engine.set_num_speculative_tokens(rid, k)
                proposer.drafting.add(seq.seq_id)
    return {"steps": asked, "steps_with_drafts": drafted, "accepted": accepted,
            "accepted_per_step": accepted / asked if asked else 0.0,
            "replies": [out[f"r{i}"] for i in range(len(prompts))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", type=Path, default=DEFAULT_HEAD)
    ap.add_argument("--target", help="target model dir (default: the prepared default model)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--off", default="40,90", help="plain tokens before drafting, per run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=RESULTS / "eagle_resume")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Path(args.target) if args.target else prepare_default_model()
    tok = Tokenizer.from_dir(target)
    model = load_model(target, dtype="float32")
    prompts = [tok.apply_chat_template(list(p.messages)) for p in prompts_by_name()]
    rows, plain = [], None
    for off in (int(x) for x in args.off.split(",")):
        for mode in MODES:
            got = run(model, args.head, target, tok, prompts, mode, off, args.k, args.tokens)
            replies = got.pop("replies")
            plain = plain or run(model, args.head, target, tok, prompts, "held", args.tokens + 1,
                                 args.k, args.tokens)["replies"]
            got.update(off=off, mode=mode, exact=replies == plain)
            rows.append(got)
            print(f"  from token {off:3d}  {mode:15s} {got['steps']:4d} steps at K={args.k}, "
                  f"{got['accepted_per_step']:.3f} drafts accepted a step, exact: {got['exact']}",
                  flush=True)
    result = {"bench": "eagle_resume", "head": str(args.head.name), "k": args.k,
              "tokens": args.tokens, "prompts": len(prompts), "cpu": platform.processor(),
              "torch": torch.__version__, "modes": MODES, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"EAGLE-3 head ({result['head']}) resuming at K = {args.k} after plain steps: the "
             f"bench's {len(prompts)} chat prompts decoded greedily together, up to "
             f"{args.tokens} tokens; drafts accepted per step at K > 0 from the resume on, "
             "every reply equal to plain greedy decoding where `exact`.", "",
             "| plain tokens first | head | steps at K | accepted a step | exact |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['off']} | {r['mode']}: {MODES[r['mode']]} | {r['steps']} | "
              f"{r['accepted_per_step']:.3f} | {r['exact']} |" for r in rows]
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out.with_suffix('.json')} and .md")


if __name__ == "__main__":
    main()
