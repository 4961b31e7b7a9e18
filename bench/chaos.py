"""Reliability under `make run`: overload and faults, every reply checked.

Two phases against compose.yaml's local stack, started as `make run` starts it (on
free ports, supervised: a killed service is restarted):

The requests are bench/serving.py's six chat prompts, in turn.

  * overload: --burst requests of --burst-tokens tokens sent at once (streamed,
    greedy, the official `openai` client, no client retries). Wanted: only 200s and
    429s, never a 5xx or a hang, and 90 % of the served requests done within 90 s.
  * chaos: --chaos-s seconds of mixed load (--concurrency streams at a time, greedy,
    plain / ngram / eagle3 / dynamic K in turn) while faults are injected at random
    (every --fault-every-s on average): SIGKILL of a drafter or of the verifier. Each
    reply is compared with the same request's reply from before the faults (plain,
    unloaded): lost = no reply (an error), corrupted = a reply that differs.

Writes bench/results/chaos.json and .md (faults injected / requests / lost /
corrupted, and the overload table).

    .venv/bin/python -m bench.chaos [--burst 512] [--chaos-s 180]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import openai

from bench.drafters import device_name
from bench.serving import SERVED_NAME, _wait_drafters, percentile, prompts_by_name, rss_kb
from specdec.launch import EAGLE3_HEAD, LocalStack, local_services, on_free_ports
from specdec.models.prepare import cache_dir, prepare_default_model

RESULTS = Path(__file__).resolve().parent / "results"
# Speculation of the chaos phase's requests, in turn.
SPECS = [{"method": "none"}, {"method": "ngram", "num_speculative_tokens": 4},
         {"method": "eagle3", "num_speculative_tokens": 4},
         {"method": "ngram", "num_speculative_tokens": "auto"}]
FAULTS = ("ngram", "eagle3", "verifier")


async def one(client: openai.AsyncOpenAI, messages: list[dict], max_tokens: int,
              spec: dict | None) -> dict:
    """One streamed greedy request: its status (200, an HTTP error code, or 'error:
    ...'), text and seconds."""
    t0 = time.perf_counter()
    text: list[str] = []
    try:
        stream = await client.chat.completions.create(
            model=SERVED_NAME, messages=messages, max_tokens=max_tokens, temperature=0,
            stream=True, extra_body={"speculative": spec} if spec else None)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
        status: int | str = 200
    except openai.APIStatusError as e:
        status = e.status_code
    except (TimeoutError, openai.APIError) as e:
        status = f"error: {type(e).__name__}: {str(e)[:120]}"
    return {"status": status, "text": "".join(text), "seconds": time.perf_counter() - t0}


def client_for(base: str, timeout_s: float) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0, timeout=timeout_s)


async def overload(base: str, n: int, tokens: int, timeout_s: float) -> dict:
    prompts = [list(p.messages) for p in prompts_by_name()]
    async with client_for(base, timeout_s) as client:
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(one(client, prompts[i % len(prompts)], tokens, None)
                                         for i in range(n)))
        wall = time.perf_counter() - t0
    statuses: dict[str, int] = {}
    for r in replies:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    served = [r["seconds"] for r in replies if r["status"] == 200]
    return {"requests": n, "max_tokens": tokens, "wall_s": wall, "statuses": statuses,
            "served": len(served),
            "served_within_90s": sum(s <= 90 for s in served) / max(len(served), 1),
            "served_s_p50": percentile(served, 50), "served_s_p90": percentile(served, 90),
            "server_errors": sum(v for k, v in statuses.items() if k.startswith("5")),
            "client_errors": sum(v for k, v in statuses.items() if k.startswith("error"))}


async def chaos(base: str, stack: LocalStack, seconds: float, concurrency: int, tokens: int,
                fault_every_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [list(p.messages) for p in prompts_by_name()]
    async with client_for(base, 600) as client:
        # References: each prompt alone, plain, before any fault.
        reference = [(await one(client, m, tokens, {"method": "none"}))["text"]
                     for m in prompts]
        faults: list[dict] = []
        pids = {name: proc.pid for name, proc in stack.procs.items()}
        rss_before = {name: rss_kb(pid) for name, pid in pids.items()}
        stop = time.monotonic() + seconds

        async def inject() -> None:
            while time.monotonic() < stop:
                await asyncio.sleep(rng.expovariate(1 / fault_every_s))
                if time.monotonic() >= stop:
                    return
                name = rng.choice(FAULTS)
                proc = stack.procs.get(name)
                if proc is None or proc.poll() is not None:
                    continue  # down already (being restarted)
                os.kill(proc.pid, signal.SIGKILL)
                faults.append({"service": name, "at_s": round(seconds - (stop - time.monotonic()),
                                                             1)})

        results: list[dict] = []
        counter = iter(range(10**9))

        async def slot() -> None:
            while time.monotonic() < stop:
                i = next(counter)
                r = await one(client, prompts[i % len(prompts)], tokens, SPECS[i % len(SPECS)])
                r["prompt"] = i % len(prompts)
                results.append(r)

        await asyncio.gather(inject(), *(slot() for _ in range(concurrency)))
        # RSS after, per service; one killed and restarted meanwhile is a new process.
        rss = {name: {"before_kb": rss_before[name], "after_kb": rss_kb(proc.pid),
                      "restarted": proc.pid != pids[name]}
               for name, proc in stack.procs.items()}
    lost = [r for r in results if r["status"] != 200]
    corrupted = [r for r in results if r["status"] == 200
                 and r["text"] != reference[r["prompt"]]]
    by_service = {s: sum(f["service"] == s for f in faults) for s in FAULTS}
    return {"seconds": seconds, "concurrency": concurrency, "max_tokens": tokens,
            "faults": faults, "faults_by_service": by_service, "requests": len(results),
            "lost": len(lost), "corrupted": len(corrupted),
            "lost_statuses": sorted({str(r["status"]) for r in lost}),
            "mean_s": statistics.mean(r["seconds"] for r in results) if results else None,
            "rss": rss}


def render(result: dict) -> str:
    o, c = result["overload"], result["chaos"]
    lines = [
        f"Reliability of `make run` ({result['device_name']}, {result['timestamp'][:10]}): "
        f"compose.yaml's local stack, supervised (a killed service is restarted).",
        "",
    ]
    if o is not None:
        lines += [
            f"Overload: {o['requests']} streamed greedy requests of up to {o['max_tokens']} "
            f"tokens sent at once, no client retries ({o['wall_s']:.0f} s in all).",
            "",
            "| responses | served | served within 90 s | served p50 / p90 s | 5xx "
            "| hung or broken |",
            "|---|---|---|---|---|---|",
            f"| {', '.join(f'{k}: {v}' for k, v in sorted(o['statuses'].items()))} | "
            f"{o['served']} | {100 * o['served_within_90s']:.0f} % | "
            f"{o['served_s_p50'] or 0:.1f} / {o['served_s_p90'] or 0:.1f} | "
            f"{o['server_errors']} | {o['client_errors']} |",
            "",
        ]
    lines += [
        f"Chaos: {c['seconds']:.0f} s of {c['concurrency']} greedy streams at a time (plain, "
        f"ngram, eagle3, dynamic K in turn, up to {c['max_tokens']} tokens) while a random "
        "service is killed with SIGKILL; every reply compared with the same request's reply "
        "before the faults.",
        "",
        "| faults injected | requests | lost | corrupted |",
        "|---|---|---|---|",
        f"| {len(c['faults'])} ({', '.join(f'{k} {v}' for k, v in c['faults_by_service'].items())})"
        f" | {c['requests']} | {c['lost']} | {c['corrupted']} |",
    ]
    if c["lost_statuses"]:
        lines += ["", "Lost requests ended with: " + "; ".join(c["lost_statuses"])]
    if c.get("rss"):
        lines += ["", "| service | RSS before (MiB) | after (MiB) | growth |", "|---|---|---|---|"]
        for name, r in sorted(c["rss"].items()):
            growth = ("restarted (a fault killed it)" if r["restarted"] else
                      f"{(r['after_kb'] - r['before_kb']) / max(r['before_kb'], 1):+.1%}")
            lines.append(f"| {name} | {r['before_kb'] / 1024:.0f} | {r['after_kb'] / 1024:.0f}"
                         f" | {growth} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burst", type=int, default=512,
                    help="requests of the overload phase (0: no overload phase, a soak)")
    ap.add_argument("--burst-tokens", type=int, default=64)
    ap.add_argument("--chaos-s", type=float, default=180.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--fault-every-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS / "chaos.json")
    args = ap.parse_args(argv)

    model_dir = prepare_default_model()
    env = {"SPECDEC_MODEL_ROOT": str(model_dir.parent), "SPECDEC_MODEL": model_dir.name,
           "EAGLE3_HEAD": str(EAGLE3_HEAD), **os.environ}
    services, ports = on_free_ports(local_services(environ=env))
    log_dir = cache_dir() / "logs" / "bench-chaos"
    stack = LocalStack(services, log_dir, log=lambda s: print("  " + s, flush=True))
    stop = threading.Event()
    try:
        stack.start(timeout_s=600)
        threading.Thread(target=stack.supervise, args=(stop,), daemon=True).start()
        _wait_drafters(f"127.0.0.1:{ports[50051]}",
                       {s.name for s in services if s.name not in ("verifier", "gateway")})
        base = f"http://127.0.0.1:{ports[8000]}/v1"
        over = None
        if args.burst:
            print("overload ...", flush=True)
            over = asyncio.run(overload(base, args.burst, args.burst_tokens, timeout_s=600))
            print(f"  {over}", flush=True)
        print("chaos ...", flush=True)
        kaos = asyncio.run(chaos(base, stack, args.chaos_s, args.concurrency, args.tokens,
                                 args.fault_every_s, args.seed))
        print(f"  {kaos}", flush=True)
    finally:
        stop.set()
        stack.stop()
    result = {"bench": "chaos", "device_name": device_name(), "machine": platform.machine(),
              "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
              "command": "python -m bench.chaos " + " ".join(sys.argv[1:] if argv is None else argv), "args": {k: str(v) for k, v in vars(args).items()},
              "overload": over, "chaos": kaos}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    table = render(result)
    args.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
