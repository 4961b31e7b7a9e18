"""The serving grid: every drafter x K (2, 4, 6 and dynamic) x concurrency
(1, 4, 16) through the whole stack, side by side with peers under the same load.

One deployment serves every cell of ours: the n-gram, EAGLE-3 and draft-model
drafters as their own processes, the verifier on the default model, the
gateway, all started from their command lines on loopback with the same torch
thread count. Dynamic K is the verifier's, chosen each step from the step's
own batch and measured step times.

A cell is one system under one load: the same N requests (N = max(C,
--requests), prompts of bench/prompts.py without the long-context one, chat
template applied once), greedy, at most --max-tokens tokens each, sent in waves
of C concurrent requests (a wave starts when the last one has ended).
Throughput is all output tokens over the cell's wall time, so it includes
prefill and every wave's tail. Within a concurrency level the configurations of
ours run in an order that rotates per repeat, so drift of a shared machine
hits them alike; peers run after ours.

Systems:
- ours: streaming chat completions through the gateway's OpenAI API (HTTP,
  SSE, detokenization and the gRPC hop to the verifier included), method none
  (plain) or a drafter at static K or `"auto"`;
- transformers: `generate` in this process; plain runs each wave as one
  left-padded batch; prompt lookup (K draft tokens, n-grams up to 4) only at
  concurrency 1, the only batch size transformers supports for it;
- vLLM (when `make bench-peers` installed it): `LLM.generate` on each wave,
  plain and ngram (K, n-grams 1-4), in bench/peers_vllm.py inside .venv-peers.

Outputs are compared with ours plain request by request (as text: ours comes
back as text); a difference is counted, not failed.

    .venv/bin/python -m bench.grid [--quick] [--methods ngram,eagle3,draft_model]

writes bench/results/grid.json, grid.md and grid.png.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    raise SystemExit("run as a module from the repository root: python -m bench.grid")

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import openai
import torch

from bench.drafters import device_name, free_port, truncated_copy
from bench.gateway import Processes, _ints, one_request, wait_for_gateway, wait_for_verifier
from bench.peers import NGRAM_MAX, NGRAM_MIN, PEERS_PYTHON, run_vllm_mode, vllm_unavailable
from bench.prompts import PROMPTS, Prompt
from specdec.launch import service_flag
from specdec.models.prepare import cache_dir, prepare_default_model
from specdec.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
HEAD = ROOT / "drafter/weights/smollm2-135m-eagle3"
METHODS = ("ngram", "eagle3", "draft_model")
PEER_SYSTEMS = ("transformers plain", "transformers prompt lookup", "vllm plain", "vllm ngram")


def waves(items: list, concurrency: int) -> list[list]:
    return [items[i:i + concurrency] for i in range(0, len(items), concurrency)]


def workload(prompts: list[Prompt], concurrency: int, requests: int) -> list[Prompt]:
    """The cell's requests: at least one full wave, prompts cycled."""
    n = max(concurrency, requests)
    return [prompts[i % len(prompts)] for i in range(n)]


def configs(methods: list[str], ks: list[int]) -> dict[str, dict]:
    """Ours: name -> the request's `speculative` field."""
    out = {"plain": {"method": "none"}}
    for m in methods:
        for k in ks:
            out[f"{m} K={k}"] = {"method": m, "num_speculative_tokens": k}
        out[f"{m} auto"] = {"method": m, "num_speculative_tokens": "auto"}
    return out


# -- ours --------------------------------------------------------------------------


async def ours_cell(client, requests: list[Prompt], concurrency: int, max_tokens: int,
                    spec: dict) -> dict:
    results = []
    t0 = time.perf_counter()
    for wave in waves(requests, concurrency):
        results += await asyncio.gather(*(one_request(client, list(p.messages), max_tokens, spec)
                                          for p in wave))
    wall = time.perf_counter() - t0
    als = [r["acceptance_length"] for r in results if r["acceptance_length"]]
    return {"wall_s": wall, "tokens": sum(r["tokens"] for r in results),
            "ttft_ms": 1e3 * statistics.mean(r["ttft_s"] for r in results),
            "acceptance_length": statistics.mean(als) if als else None,
            "texts": [r["text"] for r in results]}


async def run_ours(args, base: str, prompts: list[Prompt], cfgs: dict[str, dict]) -> dict:
    cells: dict[str, dict[str, list[dict]]] = {name: {} for name in cfgs}
    async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0,
                                  timeout=900) as client:
        for spec in cfgs.values():  # warm-up: every drafter's first stream, cold caches
            await one_request(client, list(prompts[0].messages), 8, spec)
        for c in args.concurrency:
            requests = workload(prompts, c, args.requests)
            names = list(cfgs)
            for rep in range(args.repeats):
                shift = (rep + args.concurrency.index(c)) % len(names)
                for name in names[shift:] + names[:shift]:
                    cell = await ours_cell(client, requests, c, args.max_tokens, cfgs[name])
                    cells[name].setdefault(str(c), []).append(cell)
                    al = cell["acceptance_length"]
                    print(f"  C={c:3d} {name:18s} {cell['tokens'] / cell['wall_s']:7.2f} tok/s"
                          + (f"  AL {al:.2f}" if al else ""), flush=True)
    return cells


def start_ours(args, model_dir: Path, procs: Processes) -> tuple[str, str]:
    """Drafters, verifier, gateway; (verifier address, API base)."""
    ports = {n: free_port() for n in (*args.methods, "verifier", "http")}
    drafter_argv = {
        "ngram": ["--method", "ngram", "--target", str(model_dir), "--ngram-min",
                  str(NGRAM_MIN), "--ngram-max", str(NGRAM_MAX)],
        "eagle3": ["--method", "eagle3", "--target", str(model_dir), "--model", str(args.head),
                   "--lookup-min", str(args.eagle_lookup_min),
                   "--min-confidence", str(args.eagle_min_confidence)],
        "draft_model": ["--method", "draft_model", "--target", str(model_dir), "--model",
                        str(truncated_copy(model_dir, args.draft_layers))],
    }
    verifier_argv = ["-m", "verifier", "--model", str(model_dir), "--port", str(ports["verifier"]),
                     "--max-num-seqs", str(max(args.concurrency)), "--max-model-len", "1024",
                     "--max-num-speculative-tokens", str(max(args.ks)),
                     "--threads", str(args.threads)]
    for m in args.methods:
        procs.spawn(f"drafter-{m}", ["-m", "drafter", *drafter_argv[m],
                                     "--port", str(ports[m])])
        verifier_argv += ["--drafter", f"{m}=127.0.0.1:{ports[m]}"]
    procs.spawn("verifier", verifier_argv)
    verifier = f"127.0.0.1:{ports['verifier']}"
    wait_for_verifier(verifier, args.methods[0] if args.methods else "none")
    procs.spawn("gateway", [
        "-m", "gateway", "--model", str(model_dir), "--served-model-name", "smollm2",
        "--verifier", verifier, "--port", str(ports["http"]), "--grpc-port", "-1"]
        + (["--speculative-method", args.methods[0]] if args.methods else []))
    base = f"http://127.0.0.1:{ports['http']}/v1"
    asyncio.run(wait_for_gateway(base))
    return verifier, base


# -- transformers ------------------------------------------------------------------


def run_transformers(args, model_dir: Path, ids: dict[str, list[int]], prompts: list[Prompt],
                     eos: set[int]) -> dict[str, dict[str, list[dict]]]:
    import transformers

    torch.set_num_threads(args.threads)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = min(eos)

    def wave_generate(wave: list[list[int]], extra: dict) -> list[list[int]]:
        width = max(map(len, wave))
        x = torch.tensor([[pad] * (width - len(w)) + w for w in wave])  # [B, width], left-padded
        mask = torch.tensor([[0] * (width - len(w)) + [1] * len(w) for w in wave])
        with torch.inference_mode():
            out = hf.generate(x, attention_mask=mask, max_new_tokens=args.max_tokens,
                              do_sample=False, pad_token_id=pad, **extra)
        return [_until_eos(row[width:].tolist(), eos) for row in out]

    modes = {"transformers plain": {},
             "transformers prompt lookup": {"prompt_lookup_num_tokens": args.peer_k,
                                            "max_matching_ngram_size": NGRAM_MAX}}
    wave_generate([ids[prompts[0].name]], {})  # warm-up
    cells: dict[str, dict[str, list[dict]]] = {name: {} for name in modes}
    for c in args.concurrency:
        requests = workload(prompts, c, args.requests)
        for name, extra in modes.items():
            if extra and c > 1:
                continue  # prompt lookup decoding is batch 1 only in transformers
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                tokens = [t for wave in waves(requests, c)
                          for t in wave_generate([ids[p.name] for p in wave], extra)]
                cells[name].setdefault(str(c), []).append(
                    {"wall_s": time.perf_counter() - t0, "tokens": sum(map(len, tokens)),
                     "ttft_ms": None, "acceptance_length": None, "token_ids": tokens})
                cell = cells[name][str(c)][-1]
                print(f"  C={c:3d} {name:26s} {cell['tokens'] / cell['wall_s']:7.2f} tok/s",
                      flush=True)
    return cells


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


# -- vLLM, in the peers venv -------------------------------------------------------


def run_vllm(args, model_dir: Path, ids: dict[str, list[int]], prompts: list[Prompt]
             ) -> tuple[dict[str, dict[str, list[dict]]], dict, dict[str, str]]:
    """(cells, versions and startup seconds, unavailable) for vllm plain and vllm ngram."""
    python = Path(args.peers_python)
    if (why := vllm_unavailable(python)) is not None:
        return {}, {}, {"vllm": why}
    cells, info, unavailable = {}, {"startup_s": {}}, {}
    log_dir = cache_dir() / "logs" / "bench-grid"
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specdec-grid-") as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps({
            "model": str(model_dir), "max_tokens": args.max_tokens, "threads": args.threads,
            "k": args.peer_k, "ngram_min": NGRAM_MIN, "ngram_max": NGRAM_MAX,
            "repeats": args.repeats, "max_num_seqs": max(args.concurrency),
            "cells": [{"concurrency": c,
                       "prompts": [ids[p.name] for p in workload(prompts, c, args.requests)]}
                      for c in args.concurrency]}))
        for mode in ("plain", "ngram"):
            name, out = f"vllm {mode}", Path(tmp) / f"{mode}.json"
            log = log_dir / f"vllm-{mode}.log"
            frag, why = run_vllm_mode(python, "grid", mode, request, out, log,
                                      args.vllm_timeout_s)
            if frag is None:
                unavailable[name] = why
                continue
            cells[name] = {str(c): runs for c, runs in frag["cells"].items()}
            info["vllm"], info["vllm torch"] = frag["versions"]["vllm"], frag["versions"]["torch"]
            info["startup_s"][name] = frag["startup_s"]
            for c, runs in cells[name].items():
                for r in runs:
                    print(f"  C={int(c):3d} {name:26s} {r['tokens'] / r['wall_s']:7.2f} tok/s",
                          flush=True)
    return cells, info, unavailable


# -- summary -----------------------------------------------------------------------


def summarise(cells: dict[str, dict[str, list[dict]]], reference: dict[str, list[str]],
              decode) -> dict[str, dict[str, dict]]:
    """Per system and concurrency: tok/s (mean over repeats), speedup over ours plain at
    the same concurrency, TTFT, acceptance length, outputs equal to ours plain."""
    out: dict[str, dict[str, dict]] = {}
    for name, by_c in cells.items():
        out[name] = {}
        for c, runs in by_c.items():
            als = [r["acceptance_length"] for r in runs if r.get("acceptance_length")]
            ttfts = [r["ttft_ms"] for r in runs if r.get("ttft_ms") is not None]
            texts = runs[-1].get("texts")
            if texts is None and runs[-1].get("token_ids") is not None:
                texts = [decode(t) for t in runs[-1]["token_ids"]]
            ref = reference.get(c)
            out[name][c] = {
                "tok_s": statistics.mean(r["tokens"] / r["wall_s"] for r in runs),
                "tokens": runs[-1]["tokens"],
                "ttft_ms": statistics.mean(ttfts) if ttfts else None,
                "acceptance_length": statistics.mean(als) if als else None,
                "identical": (sum(a == b for a, b in zip(texts, ref, strict=True))
                              if texts is not None and ref is not None else None),
                "requests": len(texts) if texts is not None else None,
            }
    base = out.get("plain", {})
    for by_c in out.values():
        for c, s in by_c.items():
            b = base.get(c, {}).get("tok_s")
            s["vs_plain"] = s["tok_s"] / b if b else None
    return out


def best_static(summary: dict, method: str, c: str) -> tuple[str, float] | None:
    found = [(name, s[c]["tok_s"]) for name, s in summary.items()
             if name.startswith(method + " K=") and c in s]
    return max(found, key=lambda x: x[1]) if found else None


def render(result: dict) -> str:
    cfg = result["config"]
    cs = [str(c) for c in cfg["concurrency"]]
    v = result["versions"]
    versions = ", ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "vllm", "vllm torch")
                         if k in v)
    lines = [
        f"Serving grid: {result['model']} float32, greedy, up to {cfg['max_tokens']} tokens per "
        f"request, requests per cell max(C, {cfg['requests']}) sent in waves of C, "
        f"{cfg['repeats']} repeat(s); {cfg['threads']} torch thread(s) per system (each of our "
        f"drafters its own process); {result['device_name']} x{result['cpus']} ({versions}); "
        f"load average {result['load_average_1min'][0]} -> {result['load_average_1min'][1]}; "
        f"{result['wall_s'] / 60:.1f} min.",
        "",
        "tok/s = output tokens over the cell's wall time (prefill and wave tails included); "
        "x = over ours plain at the same concurrency; AL = mean acceptance length; same = "
        "outputs equal to ours plain (requests).",
        "",
        "| system | " + " | ".join(f"C={c} tok/s | x | AL | same" for c in cs) + " |",
        "|---|" + "---|---|---|---|" * len(cs),
    ]
    order = ["plain"] + [n for n in result["summary"] if n != "plain" and not
                         n.startswith(("transformers", "vllm"))] + list(PEER_SYSTEMS)
    for name in order:
        s = result["summary"].get(name)
        if s is None:
            reason = result["unavailable"].get(name) or result["unavailable"].get(name.split()[0])
            if reason:
                lines.append(f"| {name} | unavailable: {reason.replace('|', '/')} |"
                             + "|" * (4 * len(cs) - 1))
            continue
        label = name if name.startswith(("transformers", "vllm")) else f"ours {name}"
        row = []
        for c in cs:
            if c not in s:
                row.append("- | - | - | -")
                continue
            x = s[c]
            al = f"{x['acceptance_length']:.2f}" if x["acceptance_length"] else "-"
            same = f"{x['identical']}/{x['requests']}" if x["identical"] is not None else "-"
            row.append(f"{x['tok_s']:.1f} | {x['vs_plain']:.2f}x | {al} | {same}")
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    lines += ["", "Dynamic K against the best static K of the same drafter (tok/s ratio):", "",
              "| drafter | " + " | ".join(f"C={c}" for c in cs) + " |",
              "|---|" + "---|" * len(cs)]
    for m in cfg["methods"]:
        row = []
        for c in cs:
            best = best_static(result["summary"], m, c)
            auto = result["summary"].get(f"{m} auto", {}).get(c)
            row.append(f"{auto['tok_s'] / best[1]:.2f} (best {best[0].split()[-1]})"
                       if best and auto else "-")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    if result.get("plot"):
        lines += ["", f"![tok/s by concurrency]({result['plot']})"]
    lines += ["", "Notes:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def plot(result: dict, png: Path) -> str | None:
    """Throughput against concurrency: ours plain, each drafter's dynamic K and best
    static K, and the peers. None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("plot skipped: matplotlib is not installed (make bench installs it)", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, cs = result["summary"], [str(c) for c in result["config"]["concurrency"]]
    series: dict[str, list[float | None]] = {"ours plain": [summary["plain"][c]["tok_s"]
                                                            for c in cs]}
    for m in result["config"]["methods"]:
        if f"{m} auto" in summary:
            series[f"ours {m} auto"] = [summary[f"{m} auto"][c]["tok_s"] for c in cs]
        series[f"ours {m} best static"] = [(best_static(summary, m, c) or (None, None))[1]
                                           for c in cs]
    for name in PEER_SYSTEMS:
        if name in summary:
            series[name] = [summary[name].get(c, {}).get("tok_s") for c in cs]
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, ys in series.items():
        pts = [(int(c), y) for c, y in zip(cs, ys, strict=True) if y is not None]
        style = "--" if "static" in name else (":" if not name.startswith("ours") else "-")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(c) for c in cs], cs)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s")
    cfg = result["config"]
    ax.set_title(f"{result['model']} float32 on {result['cpus']} CPU cores, greedy, "
                 f"{cfg['max_tokens']} tokens, {cfg['threads']} thread(s) per system", fontsize=10)
    ax.legend(fontsize=7, ncols=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png.name


# -- main ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=",".join(METHODS),
                    help="our drafters (ngram, eagle3, draft_model = the target's first "
                         "--draft-layers layers)")
    ap.add_argument("--ks", type=_ints, default=[2, 4, 6])
    ap.add_argument("--concurrency", type=_ints, default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=8, help="requests per cell at least")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each system")
    ap.add_argument("--systems", default="ours,transformers,vllm")
    ap.add_argument("--peer-k", type=int, default=4, help="draft tokens of the peers' n-gram modes")
    ap.add_argument("--head", type=Path, default=HEAD, help="EAGLE-3 head directory")
    ap.add_argument("--eagle-lookup-min", type=int,
                    default=int(service_flag("eagle3", "--lookup-min")),
                    help="eagle3's prompt lookup n-gram size, 0 = the head alone (default "
                         "%(default)s, as compose.yaml deploys it)")
    ap.add_argument("--eagle-min-confidence", type=float,
                    default=float(service_flag("eagle3", "--min-confidence")),
                    help="eagle3 ends a head chain before a draft the head gives less than "
                         "this (default %(default)s, as compose.yaml deploys it; 0 = K drafts)")
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--peers-python", default=str(PEERS_PYTHON))
    ap.add_argument("--vllm-timeout-s", type=float, default=600.0, help="per vLLM mode")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: ngram only, K=2, concurrency 1 and 4, 2 requests, 8 tokens")
    ap.add_argument("--out", type=Path, default=RESULTS / "grid.json")
    args = ap.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        ap.error(f"--methods: unknown {', '.join(sorted(unknown))} (choose from {METHODS})")
    if args.quick:
        args.methods, args.ks, args.concurrency = ["ngram"], [2], [1, 4]
        args.requests, args.max_tokens = 2, 8
    systems = set(args.systems.split(","))

    t_start = time.perf_counter()
    load0 = round(os.getloadavg()[0], 2)
    model_dir = prepare_default_model()
    tokenizer = Tokenizer.from_dir(model_dir)
    prompts = [p for p in PROMPTS if p.category != "long_context"]
    ids = {p.name: tokenizer.apply_chat_template(list(p.messages)) for p in prompts}
    cfgs = configs(args.methods, args.ks)
    cells: dict[str, dict[str, list[dict]]] = {}
    phase_s: dict[str, float] = {}
    unavailable: dict[str, str] = {}
    versions = {"torch": torch.__version__}
    vllm_info: dict = {}
    log_dir = cache_dir() / "logs" / "bench-grid"
    log_dir.mkdir(parents=True, exist_ok=True)
    if "ours" in systems:
        t0 = time.perf_counter()
        with Processes(log_dir, args.threads) as procs:
            _, base = start_ours(args, model_dir, procs)
            cells.update(asyncio.run(run_ours(args, base, prompts, cfgs)))
        phase_s["ours"] = round(time.perf_counter() - t0, 1)
    if "transformers" in systems:
        import transformers

        t0 = time.perf_counter()
        versions["transformers"] = transformers.__version__
        cells.update(run_transformers(args, model_dir, ids, prompts,
                                      set(tokenizer.eos_token_ids)))
        phase_s["transformers"] = round(time.perf_counter() - t0, 1)
    if "vllm" in systems:
        t0 = time.perf_counter()
        vcells, vllm_info, unavailable = run_vllm(args, model_dir, ids, prompts)
        cells.update(vcells)
        versions.update({k: vllm_info[k] for k in ("vllm", "vllm torch") if k in vllm_info})
        phase_s["vllm"] = round(time.perf_counter() - t0, 1)

    reference = {c: runs[-1]["texts"] for c, runs in cells.get("plain", {}).items()}
    summary = summarise(cells, reference, tokenizer.decode)
    result = {
        "bench": "grid", "model": "SmolLM2-135M-Instruct", "device_name": device_name(),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "versions": versions,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.grid " + " ".join(argv if argv is not None
                                                         else sys.argv[1:]),
        "wall_s": round(time.perf_counter() - t_start, 1), "phase_s": phase_s,
        "vllm_startup_s": vllm_info.get("startup_s", {}),
        "load_average_1min": [load0, round(os.getloadavg()[0], 2)],
        "config": {"methods": args.methods, "ks": args.ks, "concurrency": args.concurrency,
                   "requests": args.requests, "max_tokens": args.max_tokens,
                   "repeats": args.repeats, "threads": args.threads, "peer_k": args.peer_k,
                   "draft_layers": args.draft_layers, "head": str(args.head.relative_to(ROOT))
                   if args.head.is_relative_to(ROOT) else str(args.head),
                   "prompts": [p.name for p in prompts], "ours": cfgs},
        "summary": summary, "unavailable": unavailable,
        "notes": notes(args), "cells": cells,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    png = args.out.with_suffix(".png")
    result["plot"] = plot(result, png)
    args.out.write_text(json.dumps(result, indent=1))
    table = render(result)
    args.out.with_suffix(".md").write_text(table)
    print(table)


def notes(args) -> list[str]:
    return [
        f"eagle3 is the EAGLE-3 head with prompt lookup where the context repeats an n-gram of "
        f"{args.eagle_lookup_min}+ tokens, its chains ending before a draft it gives less than "
        f"{args.eagle_min_confidence} (`--lookup-min {args.eagle_lookup_min} --min-confidence "
        f"{args.eagle_min_confidence}`, as compose.yaml deploys it).",
        "Ours pays for HTTP, SSE, detokenization and a gRPC hop per token block (gateway -> "
        "verifier) that the in-process peers do not; our drafters run as their own "
        "processes, each with its own thread, as a split deployment gives each its own device.",
        f"draft_model is the target's first {args.draft_layers} of 30 layers (no smaller SmolLM2 "
        "exists offline): a poor draft, shown for the cost of drafting; dynamic K is expected "
        "to turn it off.",
        "Dynamic K (auto) is bounded by the largest static K; the verifier chooses each "
        "step's K from the step's batch, its measured step times and each request's "
        "acceptance.",
        "transformers prompt lookup runs at concurrency 1 only (its `generate` supports no "
        "batch for it); transformers plain runs each wave as one left-padded batch.",
        "vLLM: `LLM(dtype=float32, gpu_memory_utilization=0.3, kv_cache_memory_bytes=1 GiB, "
        "max_num_seqs=max C)`, each wave one `LLM.generate` call, OMP_NUM_THREADS as ours, "
        f"ngram with num_speculative_tokens={args.peer_k}, prompt_lookup_min=1, "
        "prompt_lookup_max=4. vLLM's automatic prefix caching is on (its default) and each "
        "mode runs all cells in one engine, so prompts seen in an earlier cell skip prefill "
        "at C=4 and C=16; ours has no prefix cache.",
    ]


if __name__ == "__main__":
    main()
