"""`specdec profile`: measure a running deployment's step time over batch size x K.

Dynamic K needs ITL(batch size, K) of the deployment as it runs (verifier,
drafter, wire), so this drives a verifier's Generate API directly: for each
batch size b and K, b concurrent greedy requests with that K, and the step
time is the median of StepStats.step_time_ms over the steps that ran exactly
b sequences (prefill steps excluded). Drafters differ in cost per step (ngram
next to nothing, a draft model tens of ms), so the step times can be measured
for several methods (`--method ngram,draft_model`): the first method's table is
the profile's shared itl_ms, each further method's goes to method_itl_ms.
Per-position acceptance of every configured drafter is measured too, as the
prior dynamic K starts from. Writes the JSON that `specdec-gateway --profile`
loads.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from gateway.policy.dynamic_k import OnlineAcceptance
from gateway.policy.itl_profile import ItlProfile
from specdec.pb import common_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.server import GRPC_OPTIONS, INTERNAL_TOKEN_ENV, token_metadata
from specdec.speculation import DRAFTER_METHODS, method_name
from specdec.tls import TlsConfig, open_aio_channel

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


async def _one(stub, msg, auth: tuple = ()) -> list[common_pb2.StepStats]:
    steps = []
    async for resp in stub.Generate(iter([msg]), metadata=auth):
        if resp.token_ids:
            steps.append(resp.step_stats)
    return steps[1:]  # the first carries the prefill


async def measure_cell(stub, prompts: Sequence[list[int]], batch: int, k: int, method: int,
                       max_tokens: int, tag: str, auth: tuple = ()) -> tuple[float | None, list]:
    # max_tokens per K + 1: a request then lasts about as many steps at any K. With the
    # same token count at every K, requests at large K ended while later ones of the
    # batch were still in chunked prefill, so the batch never decoded all at once and
    # the only full-batch steps carried prefill chunks (seconds instead of ms).
    msgs = [_start(prompts[i % len(prompts)], k, method, max_tokens * (k + 1),
                   f"profile-{tag}-{i}") for i in range(batch)]
    results = await asyncio.gather(*(_one(stub, m, auth) for m in msgs))
    steps = [s for r in results for s in r]
    full = [s.step_time_ms for s in steps if s.batch_size == batch]
    return (statistics.median(full) if full else None), steps


async def profile(address: str, prompts: Sequence[list[int]], batch_sizes: Sequence[int],
                  ks: Sequence[int], max_tokens: int, method: str | Sequence[str] | None,
                  log=print, tls: TlsConfig | None = None,
                  token: str | None = None) -> ItlProfile:
    """Profile the verifier at `address`.

    `method`: the drafter method(s) whose step times are measured, one name or a
    sequence of names; None = the verifier's first drafter. The first method's
    table becomes itl_ms, which methods without a table of their own also use;
    each further method's table goes to method_itl_ms[method]. `tls`: the verifier's
    internal TLS, `token` its internal token, if it has them.
    """
    auth = token_metadata(token)
    async with open_aio_channel(address, tls, GRPC_OPTIONS) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        report = await stub.Load(verifier_pb2.LoadRequest(), timeout=10, metadata=auth)
        methods = {method_name(d.method): d.method for d in report.drafters
                   if method_name(d.method) in DRAFTER_METHODS}
        if method is None:
            wanted = list(methods)[:1]
        elif isinstance(method, str):
            wanted = [method]
        else:
            wanted = list(dict.fromkeys(method))  # order kept: the first is the shared table
        missing = [m for m in wanted if m not in methods]
        if missing:
            raise SystemExit(f"--method {','.join(missing)}: the verifier has no such drafter "
                             f"(it has {', '.join(methods) or 'none'})")
        max_num_speculative_tokens = report.max_num_speculative_tokens
        ks = sorted({0, *(k for k in ks if k <= max_num_speculative_tokens)}) if wanted else [0]
        batch_sizes = sorted(b for b in set(batch_sizes) if b <= report.max_num_seqs)

        async def step_ms(b: int, k: int, name: str | None) -> float:
            ms, _ = await measure_cell(stub, prompts, b, k, methods.get(name, 0), max_tokens,
                                       f"{b}-{k}-{name or 'none'}", auth)
            if ms is None:  # never ran b at once (KV or batch limits): next best
                raise SystemExit(f"batch {b} never ran as one step; lower --batch-sizes")
            log(f"batch {b:3d}  K {k}{f' {name}' if k else ''}: {ms:8.2f} ms/step")
            return ms

        # Without a drafter only K=0 is measured, as the shared table's single column.
        tables: dict[str | None, list[list[float]]] = {m: [] for m in wanted or [None]}
        for b in batch_sizes:
            # A K=0 step drafts nothing, so its time is the same for every method:
            # measured once, it is every table's first column.
            plain = await step_ms(b, 0, None)
            for name, table in tables.items():
                table.append([plain] + [await step_ms(b, k, name) for k in ks[1:]])
        acceptance, availability = {}, {}
        for name, value in methods.items():
            acc = OnlineAcceptance()
            k = max(ks)
            if k == 0:
                break
            _, steps = await measure_cell(stub, prompts, min(len(prompts), 4), k, value,
                                          max_tokens, f"acc-{name}", auth)
            for s in steps:
                acc.update(s.num_drafted, s.num_accepted)
            rates = acc.rates([0.0] * k, 0, k)
            acceptance[name] = tuple(round(r, 4) for r in rates)
            # Every step asked for k drafts: those without any had nothing to propose.
            availability[name] = round(sum(s.num_drafted > 0 for s in steps)
                                       / max(len(steps), 1), 4)
            log(f"acceptance {name}: " + " ".join(f"{r:.2f}" for r in rates)
                + f" (drafts in {availability[name]:.0%} of the steps)")
    shared, *own = tables.values()
    return ItlProfile(batch_sizes=tuple(batch_sizes), ks=tuple(ks),
                      itl_ms=tuple(tuple(r) for r in shared), acceptance=acceptance,
                      method_itl_ms={name: tuple(tuple(r) for r in table)
                                     for name, table in zip(wanted[1:], own, strict=True)},
                      availability=availability)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected one or more method names, comma-separated")
    return names


def register_command(sub: argparse._SubParsersAction) -> None:
    """`specdec profile`, registered through the `specdec.commands` entry point."""
    p = sub.add_parser("profile", help="measure a running deployment's step time over batch "
                       "size x K, for dynamic K (writes JSON for specdec-gateway --profile)")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier", default="127.0.0.1:50051", help="HOST:PORT of a verifier")
    p.add_argument("--model", help="model directory for the tokenizer (default: the prepared "
                   "default model)")
    p.add_argument("--method", type=_names,
                   help="drafter method(s) whose step times are measured, comma-separated, "
                   "e.g. ngram,eagle3; the first gives the shared table, each further one a "
                   "table of its own (default: the verifier's first drafter)")
    p.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16])
    p.add_argument("--ks", type=_ints, default=[0, 1, 2, 3, 4, 6, 8])
    p.add_argument("--max-tokens", type=int, default=24,
                   help="tokens per request per cell, times K + 1")
    from specdec.models.prepare import cache_dir

    p.add_argument("--output", default=str(cache_dir() / "profile.json"))


def run(args) -> int:
    from specdec.models.prepare import prepare_default_model
    from specdec.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(Path(args.model) if args.model else prepare_default_model())
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    result = asyncio.run(profile(args.verifier, prompts, args.batch_sizes, args.ks,
                                 args.max_tokens, args.method,
                                 log=lambda s: print(s, file=sys.stderr, flush=True),
                                 tls=TlsConfig.from_env(),
                                 token=os.environ.get(INTERNAL_TOKEN_ENV) or None))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    result.save(out)
    print(f"profile written to {out}")
    return 0
