"""`specdec profile`: measure a running deployment's step time over batch size x K.

Dynamic K needs ITL(batch size, K) of the deployment as it runs (verifier,
drafter, wire), so this drives a verifier's Generate API directly: for each
batch size b and K, b concurrent greedy requests with that K, and the step
time is the median of StepStats.step_time_ms over the steps that ran exactly
b sequences (prefill steps excluded). Per-position acceptance of every
configured drafter is measured too, as the prior dynamic K starts from.
Writes the JSON that `specdec-gateway --profile` loads.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc

from gateway.policy import ItlProfile, OnlineAcceptance
from gateway.replicas import _METHOD_NAMES
from specdec.pb import common_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.server import GRPC_OPTIONS

# Chat-like prompts with some repetition, so copy-based drafters see realistic text.
PROMPTS = [
    "Explain what a hash table is and when to use one.",
    "Rewrite this sentence in a formal tone: we gotta ship the fix by friday or the client walks.",
    "Summarise: The meeting covered the budget, the hiring plan and the office move. The budget "
    "was approved. The hiring plan was postponed. The office move happens in March.",
    "Fix the bug: def mean(xs): return sum(xs) / len(xs) + 1",
    "List five fruits and one fact about each.",
    "Write a short story about a lighthouse keeper.",
]


def _start(prompt: list[int], k: int, method: int, max_tokens: int, rid: str):
    spec = common_pb2.SpeculationPolicy(method=method if k else common_pb2.SPEC_METHOD_NONE,
                                        num_speculative_tokens=k)
    return verifier_pb2.GenerateRequest(start=verifier_pb2.GenerateRequest.Start(
        request_id=rid, prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True),
        speculation=spec))


async def _one(stub, msg) -> list[common_pb2.StepStats]:
    steps = []
    async for resp in stub.Generate(iter([msg])):
        if resp.token_ids:
            steps.append(resp.step_stats)
    return steps[1:]  # the first carries the prefill


async def measure_cell(stub, prompts: Sequence[list[int]], batch: int, k: int, method: int,
                       max_tokens: int, tag: str) -> tuple[float | None, list]:
    msgs = [_start(prompts[i % len(prompts)], k, method, max_tokens, f"profile-{tag}-{i}")
            for i in range(batch)]
    results = await asyncio.gather(*(_one(stub, m) for m in msgs))
    steps = [s for r in results for s in r]
    full = [s.step_time_ms for s in steps if s.batch_size == batch]
    return (statistics.median(full) if full else None), steps


async def profile(address: str, prompts: Sequence[list[int]], batch_sizes: Sequence[int],
                  ks: Sequence[int], max_tokens: int, method: str | None,
                  log=print) -> ItlProfile:
    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        report = await stub.Load(verifier_pb2.LoadRequest(), timeout=10)
        methods = {_METHOD_NAMES[d.method]: d.method for d in report.drafters
                   if d.method in _METHOD_NAMES}
        if method is None:
            method = next(iter(methods), None)
        if method is not None and method not in methods:
            raise SystemExit(f"--method {method}: the verifier has no such drafter "
                             f"(it has {', '.join(methods) or 'none'})")
        k_max = report.max_num_speculative_tokens
        ks = sorted({0, *(k for k in ks if k <= k_max)}) if method else [0]
        batch_sizes = sorted(b for b in set(batch_sizes) if b <= report.max_num_seqs)
        itl: list[list[float]] = []
        for b in batch_sizes:
            row = []
            for k in ks:
                ms, _ = await measure_cell(stub, prompts, b, k, methods.get(method, 0),
                                           max_tokens, f"{b}-{k}")
                if ms is None:  # never ran b at once (KV or batch limits): next best
                    raise SystemExit(f"batch {b} never ran as one step; lower --batch-sizes")
                log(f"batch {b:3d}  K {k}: {ms:8.2f} ms/step")
                row.append(ms)
            itl.append(row)
        acceptance = {}
        for name, value in methods.items():
            acc = OnlineAcceptance()
            k = max(ks)
            if k == 0:
                break
            _, steps = await measure_cell(stub, prompts, min(len(prompts), 4), k, value,
                                          max_tokens, f"acc-{name}")
            for s in steps:
                acc.update(s.num_drafted, s.num_accepted)
            rates = acc.rates([0.0] * k, 0, k)
            acceptance[name] = tuple(round(r, 4) for r in rates)
            log(f"acceptance {name}: " + " ".join(f"{r:.2f}" for r in rates))
    return ItlProfile(batch_sizes=tuple(batch_sizes), ks=tuple(ks),
                      itl_ms=tuple(tuple(r) for r in itl), acceptance=acceptance)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(p) -> None:
    p.add_argument("--verifier", default="127.0.0.1:50051", help="HOST:PORT of a verifier")
    p.add_argument("--model", help="model directory for the tokenizer (default: the prepared "
                   "default model)")
    p.add_argument("--method", help="drafter method whose step times are measured (default: "
                   "the verifier's first drafter)")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16])
    p.add_argument("--ks", type=_ints, default=[0, 1, 2, 3, 4, 6, 8])
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per request per cell")
    from specdec.models.prepare import cache_dir

    p.add_argument("--output", default=str(cache_dir() / "profile.json"))


def run(args) -> int:
    from specdec.models.prepare import prepare_default_model
    from specdec.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(Path(args.model) if args.model else prepare_default_model())
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    result = asyncio.run(profile(args.verifier, prompts, args.batch_sizes, args.ks,
                                 args.max_tokens, args.method,
                                 log=lambda s: print(s, file=sys.stderr, flush=True)))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    result.save(out)
    print(f"profile written to {out}")
    return 0
