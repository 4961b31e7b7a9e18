"""Concurrency sweep through the whole stack: static K against dynamic K.

Starts the real deployment on loopback (a drafter, the verifier on the default
model, the gateway), then sends C
concurrent streaming chat completions (greedy, fixed max tokens) for C in
--concurrency, with speculation off (K=0), static K in --ks, and dynamic K
("auto", bounded by the largest static K). Configurations alternate within
each concurrency level so machine noise hits them alike. Reported per cell:
output tokens per second over the cell's wall time, mean time to first
token, mean acceptance length; and dynamic K against the best static K and
against plain decoding.

    .venv/bin/python -m bench.gateway [--method ngram] [--concurrency 1,4,16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
import openai
import torch

from bench.prompts import PROMPTS
from specdec.launch import free_port
from specdec.models.prepare import cache_dir, prepare_default_model
from specdec.pb import verifier_pb2, verifier_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
HEAD = ROOT / "drafter/weights/smollm2-135m-eagle3"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


class Processes:
    """Child processes of the deployment, stopped with SIGTERM on exit."""

    def __init__(self, log_dir: Path, threads: int):
        self.log_dir = log_dir
        self.env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        self.procs: list[subprocess.Popen] = []

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        log = (self.log_dir / f"{name}.log").open("w")
        p = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=self.env, stdout=log,
                             stderr=subprocess.STDOUT)
        self.procs.append(p)
        return p

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def wait_for_verifier(address: str, method: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        while time.monotonic() < deadline:
            try:
                report = stub.Load(verifier_pb2.LoadRequest(), timeout=2)
                if method == "none" or any(d.available for d in report.drafters):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise SystemExit(f"verifier at {address} not ready in {timeout_s:.0f} s")


async def wait_for_gateway(base: str, timeout_s: float = 120) -> None:
    async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0) as client:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                await client.models.list()
                return
            except openai.APIError:
                await asyncio.sleep(0.5)
    raise SystemExit(f"gateway at {base} not ready in {timeout_s:.0f} s")


async def one_request(client, messages, max_tokens: int, spec: dict) -> dict:
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    spec_decode = {}
    text = []
    stream = await client.chat.completions.create(
        model="smollm2", messages=messages, temperature=0, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"speculative": spec})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            if ttft is None:
                ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            spec_decode = chunk.model_extra.get("spec_decode", {})
    return {"tokens": tokens, "ttft_s": ttft or 0.0, "seconds": time.perf_counter() - t0,
            "acceptance_length": spec_decode.get("acceptance_length", 0.0), "text": "".join(text)}


async def run_cell(client, prompts, concurrency: int, max_tokens: int, spec: dict,
                   offset: int) -> dict:
    chosen = [prompts[(offset + i) % len(prompts)] for i in range(concurrency)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_request(client, list(p.messages), max_tokens, spec)
                                     for p in chosen))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    als = [r["acceptance_length"] for r in results if r["acceptance_length"]]
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_s": statistics.mean(r["ttft_s"] for r in results),
            "acceptance_length": statistics.mean(als) if als else 0.0}


def configs(method: str, ks: list[int]) -> dict[str, dict]:
    out = {"K=0": {"method": "none"}}
    for k in ks:
        out[f"K={k}"] = {"method": method, "num_speculative_tokens": k}
    out["auto"] = {"method": method, "num_speculative_tokens": "auto"}
    return out


def render(result: dict) -> str:
    names = list(result["configs"])
    lines = [f"Gateway concurrency sweep, {result['method']} drafter, {result['max_tokens']} "
             f"tokens per request, greedy ({result['machine']}, {result['threads']} threads per "
             "process). Output tok/s over each cell's wall time; AL = acceptance length.", "",
             "| concurrency | " + " | ".join(names) + " | auto / best static | auto / K=0 |",
             "|---|" + "---|" * (len(names) + 2)]
    for c, row in result["cells"].items():
        cells = [f"{row[n]['tok_s']:.1f} (AL {row[n]['acceptance_length']:.2f})" for n in names]
        lines.append(f"| {c} | " + " | ".join(cells)
                     + f" | {row['auto_vs_best_static']:.3f} | {row['auto_vs_plain']:.3f} |")
    return "\n".join(lines)


async def sweep(args, base: str) -> dict:
    async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0,
                                  timeout=600) as client:
        return await _sweep(client, args)


async def _sweep(client, args) -> dict:
    prompts = [p for p in PROMPTS if p.category != "long_context"]
    cfgs = configs(args.method, args.ks)
    cells: dict[str, dict] = {}
    for c in args.concurrency:
        runs: dict[str, list[dict]] = {n: [] for n in cfgs}
        for rep in range(args.repeats):
            # Warm-up request so the first configuration does not pay for cold caches.
            await one_request(client, list(prompts[0].messages), 4, {"method": "none"})
            for name, spec in cfgs.items():
                cell = await run_cell(client, prompts, c, args.max_tokens, spec, rep * c)
                runs[name].append(cell)
                print(f"  C={c:3d} {name:5s}: {cell['tok_s']:7.2f} tok/s  "
                      f"AL {cell['acceptance_length']:.2f}", file=sys.stderr, flush=True)
        row = {}
        for name, rs in runs.items():
            row[name] = {"tok_s": statistics.mean(r["tok_s"] for r in rs),
                         "ttft_s": statistics.mean(r["ttft_s"] for r in rs),
                         "acceptance_length": statistics.mean(r["acceptance_length"] for r in rs),
                         "runs": rs}
        static = [row[n]["tok_s"] for n in cfgs if n != "auto"]
        row["auto_vs_best_static"] = row["auto"]["tok_s"] / max(static)
        row["auto_vs_plain"] = row["auto"]["tok_s"] / row["K=0"]["tok_s"]
        cells[str(c)] = row
    return {"configs": cfgs, "cells": cells}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--method", default="ngram", choices=["ngram", "eagle3"])
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16])
    p.add_argument("--ks", type=_ints, default=[2, 4])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=2, help="torch threads of each process")
    p.add_argument("--out", default=str(RESULTS / "gateway.json"))
    args = p.parse_args()

    model_dir = prepare_default_model()
    ports = {n: free_port() for n in ("drafter", "verifier", "http")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    log_dir = cache_dir() / "logs" / "bench-gateway"
    log_dir.mkdir(parents=True, exist_ok=True)
    verifier = f"127.0.0.1:{ports['verifier']}"
    max_num_speculative_tokens = max(args.ks)
    with Processes(log_dir, args.threads) as procs:
        drafter = ["-m", "drafter", "--method", args.method, "--target", str(model_dir),
                   "--port", str(ports["drafter"])]
        if args.method == "eagle3":
            drafter += ["--model", str(HEAD)]
        procs.spawn("drafter", drafter)
        procs.spawn(
            "verifier",
            [
                "-m",
                "verifier",
                "--model",
                str(model_dir),
                "--port",
                str(ports["verifier"]),
                "--max-num-seqs",
                str(max(args.concurrency)),
                "--max-model-len",
                "1024",
                "--max-num-speculative-tokens",
                str(max_num_speculative_tokens),
                "--threads",
                str(args.threads),
                "--drafter",
                f"{args.method}=127.0.0.1:{ports['drafter']}",
            ],
        )
        wait_for_verifier(verifier, args.method)
        procs.spawn("gateway", [
            "-m", "gateway", "--model", str(model_dir), "--served-model-name", "smollm2",
            "--verifier", verifier, "--port", str(ports["http"]), "--grpc-port", "-1",
            "--speculative-method", args.method])
        base = f"http://127.0.0.1:{ports['http']}/v1"
        asyncio.run(wait_for_gateway(base))
        result = asyncio.run(sweep(args, base))
    result.update({"method": args.method, "max_tokens": args.max_tokens,
                   "threads": args.threads, "machine": f"{platform.machine()} "
                   f"{os.cpu_count()} cores", "torch": torch.__version__,
                   "command": "python -m bench.gateway " + " ".join(sys.argv[1:])})
    Path(args.out).write_text(json.dumps(result, indent=1))
    table = render(result)
    Path(args.out).with_suffix(".md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
