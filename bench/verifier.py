"""What verifying K drafts costs: a verify step (K + 1 query tokens per
sequence, logits at every one) against a one-token decode step, on the
model core over the paged KV cache, and the rejection sampler on its own.

Every sequence is prefilled to `--context` tokens first (untimed). A timed
iteration plans the step in the cache, runs the forward with logits at all
query rows, and truncates the cache back, so the context stays fixed. Decode
and the verify shapes of one batch size alternate, in a rotating order, so
that noise on a shared machine hits them alike; verify / decode is the ratio
of their medians. The issue's CPU target: at batch 1, a K = 4 verify step
costs at most 1.3x a decode step.

On CUDA every shape is also timed replayed from CUDA graphs (the engine's
CudaGraphRunner: padded to its buckets, captured during warm-up), next to
eager; the GPU target is graphs >= 1.5x faster than eager at batch 1, on the
default model and on `--model random-1b` (random weights, 1.1B parameters).
`--random-weights` keeps a model directory's config.json and draws random
weights: step times depend on the shapes alone, so a machine that cannot hold
the real weights still times the real model's shapes. On CUDA the Triton
rejection sampler is timed against the torch reference and its outputs
compared with it (target: >= 10x faster at batch 64, K = 4, vocabulary 128k):

    .venv/bin/python -m bench.verifier [--threads N] [--iters 40] [--quick]
    .venv/bin/python -m bench.verifier --device cuda --dtype bfloat16 \
        [--model random-1b | --model DIR --random-weights] --out bench/results/verifier_cuda.json

Run it as a module, from the repository root: as a script, its own name
would hide the `verifier` package.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    raise SystemExit("run as a module from the repository root: python -m bench.verifier")

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import torch

from specdec.models import LlamaForCausalLM, ModelConfig, PagedKVCache, load_model, parse_dtype
from specdec.models.cuda_graphs import CudaGraphRunner
from specdec.models.linear import pack_linear_weights
from specdec.models.prepare import prepare_default_model
from specdec.models.rope import inv_frequencies
from specdec.sampling import SamplingMetadata, apply_sampling
from verifier.sampling.rejection import draw_random, rejection_sample_from_random
from verifier.sampling.rejection_triton import HAS_TRITON, rejection_sample_from_random_triton

TARGET = {"batch": 1, "k": 4, "max_ratio": 1.3}  # the CPU target
GRAPHS_TARGET = {"batch": 1, "min_speedup": 1.5}  # the GPU target: eager / graphs step time
SAMPLER_TARGET = {"min_speedup": 10.0}  # the GPU target: torch / Triton sampler time
BLOCK_SIZE = 16
# Peak memory bandwidth of the GPUs we are lent, GB/s (vendor data sheets), by a part of
# the name torch reports: a decode step reads every weight once, so weight bytes over
# this is the step's floor.
GPU_BANDWIDTH_GBPS = {"H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H200": 4800.0,
                      "A100-SXM4-80GB": 2039.0, "A100-SXM4-40GB": 1555.0}
# Random-weight targets by name (--model), for shapes no prepared model has.
RANDOM_MODELS = {
    # TinyLlama-1.1B's layout with 8 KV heads: 1.1B parameters.
    "random-1b": ModelConfig(vocab_size=32_000, hidden_size=2048, intermediate_size=5632,
                             num_layers=22, num_heads=32, num_kv_heads=8, head_dim=64,
                             rms_norm_eps=1e-5, max_position_embeddings=4096),
}
SAMPLER_CASES = {
    "t=1, one-hot q": dict(temperature=1.0, dense_q=False),
    "t=1, dense q": dict(temperature=1.0, dense_q=True),
    "t=0.8 top-k 50 top-p 0.9, one-hot q": dict(temperature=0.8, top_k=50, top_p=0.9,
                                                 dense_q=False),
}


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Milliseconds one call takes, the device drained before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(fn: Callable[[], object]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t0) * 1e3

    return run


# -- verify vs decode --------------------------------------------------------


def prefill(model: LlamaForCausalLM, cache: PagedKVCache, num_seqs: int, context: int,
            gen: torch.Generator) -> None:
    """Sequences 0..num_seqs-1 with `context` random tokens of KV each, one at a time."""
    vocab = model.config.vocab_size
    empty = torch.empty(0, dtype=torch.int64, device=model.device)
    for s in range(num_seqs):
        cache.add(s)
        meta = cache.plan([(s, context)])
        ids = torch.randint(0, vocab, (context,), generator=gen).to(model.device)
        model(ids, meta, cache, logits_indices=empty)


def random_model(cfg: ModelConfig, dtype: str, device: torch.device) -> LlamaForCausalLM:
    """Random weights (torch's default init, seed 0), built on the device."""
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(cfg).to(parse_dtype(dtype))
    model.rotary.inv_freq = inv_frequencies(cfg).to(device)  # float32, as load_model keeps it
    pack_linear_weights(model, model.dtype == torch.float32)
    return model.eval()


def make_step(model: LlamaForCausalLM, cache: PagedKVCache, batch: int,
              num_query: int | tuple[int, ...], context: int, gen: torch.Generator,
              graphs: CudaGraphRunner | None = None) -> Callable[[], object]:
    """One step of `num_query` tokens for each of sequences 0..batch-1 (or
    num_query[s] for sequence s), logits at every query row, then the cache
    rolled back to `context`; through `graphs` (padded to its buckets,
    replayed) when given, else eager."""
    dev = model.device
    qs = num_query if isinstance(num_query, tuple) else (num_query,) * batch
    ids = torch.randint(0, model.config.vocab_size, (sum(qs),), generator=gen).to(dev)
    rows = torch.arange(sum(qs), device=dev)
    appends = list(enumerate(qs))
    host_ids = ids.cpu()

    def step() -> torch.Tensor:
        # Planned on the host for a graph, as the engine plans (the runner stages it).
        meta = cache.plan(appends, device=None if graphs is None else "cpu")
        if graphs is None:
            out = model(ids, meta, cache, logits_indices=rows)
        elif (out := graphs.run(host_ids, meta)) is None:
            raise RuntimeError(f"batch {batch} x {num_query} tokens has no CUDA graph shape")
        for s in range(batch):
            cache.truncate(s, context)
        return out.logits  # [B * num_query, V]

    return step


def bench_forward(model: LlamaForCausalLM, cache: PagedKVCache, batches: list[int],
                  ks: list[int], context: int, iters: int, warmup: int, mode: str,
                  graphs: CudaGraphRunner | None = None) -> list[dict]:
    """mode "graphs" runs every step through `graphs`, "eager" through the model."""
    gen = torch.Generator().manual_seed(0)
    time_ms = timer(model.device)
    runner = graphs if mode == "graphs" else None
    rows = []
    for batch in batches:
        # Query tokens per sequence: decode, then verify at each K, then (batch > 1) a
        # K per sequence, cycling through ks, as dynamic K makes.
        shapes: list[int | tuple[int, ...]] = [1] + [k + 1 for k in ks]
        mixed = tuple(ks[s % len(ks)] + 1 for s in range(batch))
        if batch > 1 and len(ks) > 1:
            shapes.append(mixed)
        # Warm-up also captures the graphs.
        steps = {n: make_step(model, cache, batch, n, context, gen, runner) for n in shapes}
        for n in shapes:
            for _ in range(warmup):
                steps[n]()
        times: dict[int | tuple[int, ...], list[float]] = {n: [] for n in shapes}
        for i in range(iters):
            order = shapes[i % len(shapes):] + shapes[: i % len(shapes)]
            for n in order:
                times[n].append(time_ms(steps[n]))
        decode = times[1]
        for k in ks + (["mixed"] if mixed in times else []):
            verify = times[mixed if k == "mixed" else k + 1]
            row = {
                "batch": batch, "k": k, "mode": mode,
                "decode_median_ms": statistics.median(decode),
                "decode_p90_ms": percentile(decode, 0.9),
                "verify_median_ms": statistics.median(verify),
                "verify_p90_ms": percentile(verify, 0.9),
                # Same-iteration ratios: robust to slow drifts of the machine.
                "ratio_paired_median": statistics.median(
                    v / d for v, d in zip(verify, decode, strict=True)),
                "decode_ms": [round(t, 3) for t in decode],
                "verify_ms": [round(t, 3) for t in verify],
            }
            row["ratio"] = row["verify_median_ms"] / row["decode_median_ms"]
            rows.append(row)
            print(f"  [{mode}] batch {batch:>2} K {k}: decode {row['decode_median_ms']:.1f} ms, "
                  f"verify {row['verify_median_ms']:.1f} ms, {row['ratio']:.2f}x", flush=True)
    return rows


def graphs_speedup(forward: list[dict]) -> list[dict]:
    """Eager median / graphs median step time per (batch, K), decode and verify."""
    eager = {(r["batch"], r["k"]): r for r in forward if r["mode"] == "eager"}
    out = []
    for r in forward:
        e = eager.get((r["batch"], r["k"]))
        if r["mode"] == "graphs" and e is not None:
            out.append({"batch": r["batch"], "k": r["k"],
                        "decode": e["decode_median_ms"] / r["decode_median_ms"],
                        "verify": e["verify_median_ms"] / r["verify_median_ms"]})
    return out


# -- rejection sampler -------------------------------------------------------


def sampler_inputs(batch: int, k: int, vocab: int, case: dict, device: torch.device):
    gen = torch.Generator().manual_seed(1)
    num_rows = batch * (k + 1)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 3).to(device)
    drafts = torch.randint(0, vocab, (batch * k,), generator=gen).to(device)
    q = None
    if case["dense_q"]:
        q = (torch.randn(batch * k, vocab, generator=gen) * 3).softmax(-1).to(device)
    num_drafts = torch.full((batch,), k, dtype=torch.int64, device=device)
    meta = SamplingMetadata.make_dummy(
        batch, temperature=case["temperature"], top_k=case.get("top_k", 0),
        top_p=case.get("top_p", 1.0), device=device)
    return logits, drafts, q, num_drafts, meta


def sampler_steps(core, logits, drafts, q, num_drafts, meta, core_inputs):
    """The whole sampling step with `core` as accept/recover/bonus (what
    rejection_sample does), and the core alone on `core_inputs`: probabilities,
    argmax and random numbers drawn once, so every implementation sees the
    same ones (told max K, as the engine knows it, so neither reads the device)."""
    vocab, max_k = logits.shape[-1], core_inputs[-1]

    def full():
        p = apply_sampling(logits, meta, num_drafts + 1)
        u, e = draw_random(num_drafts, vocab, meta)
        return core(p, logits.argmax(-1), drafts, q, num_drafts, meta.is_greedy, u, e, max_k)

    def core_only():
        return core(*core_inputs)

    return full, core_only


def kernel_time_us(fn: Callable[[], object], iters: int) -> dict[str, float]:
    """GPU time of each kernel over `iters` calls of fn (torch.profiler), µs by name,
    without the host's launch work."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total for e in prof.key_averages()}


def device_time_ms(fn: Callable[[], object], iters: int) -> float | None:
    """Mean GPU time of the kernels one call runs; None when the profiler sees no
    device activity."""
    total_us = sum(kernel_time_us(fn, iters).values())
    return total_us / 1000 / iters if total_us > 0 else None


def top_kernels(kernel_us: dict[str, float], iters: int, top: int) -> dict:
    """GPU time per step by kernel, from totals over `iters` steps (µs): the
    `top` longest kernels in ms per step, longest first, and the sum of all."""
    per_step = sorted(((name, us / 1000 / iters) for name, us in kernel_us.items() if us > 0),
                      key=lambda kv: -kv[1])
    return {"total_ms": sum(ms for _, ms in per_step),
            "top": [{"kernel": name, "ms": ms} for name, ms in per_step[:top]]}


def kernel_breakdown(model: LlamaForCausalLM, cache: PagedKVCache, batches: list[int],
                     context: int, iters: int = 5, top: int = 8) -> list[dict]:
    """Where an eager decode step's GPU time goes, per batch (torch.profiler):
    the kernels' own time, without the host's launch gaps that CUDA graphs remove,
    so the sum set beside the graphs step time tells kernel work from overhead."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in batches:
        step = make_step(model, cache, batch, 1, context, gen)
        step()
        torch.cuda.synchronize()  # the warm-up's kernels stay out of the profile
        rows.append({"batch": batch, **top_kernels(kernel_time_us(step, iters), iters, top)})
    return rows


def bench_sampler(batch: int, k: int, vocab: int, iters: int, warmup: int,
                  device: torch.device) -> list[dict]:
    """The whole sampling step (argmax, filters + softmax, random draws,
    accept/recover/bonus) and the accept/recover/bonus core alone, per
    implementation of the core: wall time per call (host and device), and on
    CUDA also the core's kernel time alone."""
    impls = {"torch": rejection_sample_from_random}
    if device.type == "cuda" and HAS_TRITON:
        impls["triton"] = rejection_sample_from_random_triton
    time_ms = timer(device)
    rows = []
    for name, case in SAMPLER_CASES.items():
        logits, drafts, q, num_drafts, meta = sampler_inputs(batch, k, vocab, case, device)
        core_inputs = (apply_sampling(logits, meta, num_drafts + 1), logits.argmax(-1), drafts, q,
                       num_drafts, meta.is_greedy, *draw_random(num_drafts, vocab, meta), k)
        reference = None
        for impl, core in impls.items():
            full, core_only = sampler_steps(core, logits, drafts, q, num_drafts, meta, core_inputs)
            out = core_only()
            if reference is None:
                reference = out
            equal = all(torch.equal(a, b) for a, b in zip(out, reference, strict=True))
            for _ in range(warmup):
                full()
                core_only()
            full_ms, core_ms = [], []
            for _ in range(iters):
                full_ms.append(time_ms(full))
                core_ms.append(time_ms(core_only))
            row = {"case": name, "impl": impl, "equals_torch": equal,
                   "step_median_ms": statistics.median(full_ms),
                   "step_p90_ms": percentile(full_ms, 0.9),
                   "core_median_ms": statistics.median(core_ms),
                   "core_p90_ms": percentile(core_ms, 0.9)}
            if device.type == "cuda":
                row["core_device_ms"] = device_time_ms(core_only, iters)
            rows.append(row)
            print(f"  sampler {name} [{impl}]: step {row['step_median_ms']:.3f} ms, "
                  f"core {row['core_median_ms']:.3f} ms (kernels "
                  f"{row.get('core_device_ms') or float('nan'):.3f} ms), "
                  f"outputs equal torch's: {equal}", flush=True)
    return rows


def sampler_speedup(rows: list[dict]) -> list[dict]:
    """torch / Triton per case: the core's wall time and kernel time, the whole step."""
    torch_rows = {r["case"]: r for r in rows if r["impl"] == "torch"}
    out = []
    for r in rows:
        if r["impl"] != "triton":
            continue
        t = torch_rows[r["case"]]
        kernels = (t["core_device_ms"] / r["core_device_ms"]
                   if t.get("core_device_ms") and r.get("core_device_ms") else None)
        out.append({"case": r["case"], "core": t["core_median_ms"] / r["core_median_ms"],
                    "core_kernels": kernels,
                    "step": t["step_median_ms"] / r["step_median_ms"],
                    "equals_torch": r["equals_torch"]})
    return out


# -- report ------------------------------------------------------------------


def render_table(result: dict) -> str:
    modes = result["modes"]
    lines = [
        f"Verify vs decode step: {result['model']}, {result['dtype']}, {result['device']} "
        f"({result['device_name']}), {result['threads']} threads, context {result['context']} "
        f"tokens/seq, median (p90) of {result['iters']} alternating iterations, "
        f"torch {result['torch']}"
        + (", load average {:.1f} -> {:.1f}".format(*result["load_average_1min"])
           if "load_average_1min" in result else ""),
        "",
        "| batch | K | " + " | ".join(
            f"decode ms [{m}] | verify ms [{m}] | verify/decode [{m}]" for m in modes) + " |",
        "|---|---|" + "---|---|---|" * len(modes),
    ]
    by_key: dict[tuple[int, int], dict[str, dict]] = {}
    for r in result["forward"]:
        by_key.setdefault((r["batch"], r["k"]), {})[r["mode"]] = r
    for (batch, k), per_mode in by_key.items():
        cells = []
        for m in modes:
            r = per_mode[m]
            mark = ""
            if result.get("target") and (batch, k) == (TARGET["batch"], TARGET["k"]) and m == "eager":
                mark = " (target <= 1.3x: " + ("met" if result["target"]["met"] else "NOT met") + ")"
            cells.append(f"{r['decode_median_ms']:.1f} ({r['decode_p90_ms']:.1f}) | "
                         f"{r['verify_median_ms']:.1f} ({r['verify_p90_ms']:.1f}) | "
                         f"{r['ratio']:.2f}x{mark}")
        lines.append(f"| {batch} | {k} | " + " | ".join(cells) + " |")
    if any(r["k"] == "mixed" for r in result["forward"]):
        lines += ["", "K mixed: sequence s verifies the s-th K of the list, cyclically "
                      "(a K per sequence in one step, as dynamic K makes)."]
    if result.get("graphs_speedup"):
        g = result.get("graphs_target")
        lines += [
            "",
            "CUDA graphs: speedup = eager median / graphs median step time"
            + (f" (target at batch {g['batch']}: >= {g['min_speedup']}x, "
               + ("met" if g["met"] else "NOT met") + ")" if g else ""),
            "",
            "| batch | K | decode speedup | verify speedup |",
            "|---|---|---|---|",
        ]
        for r in result["graphs_speedup"]:
            lines.append(f"| {r['batch']} | {r['k']} | {r['decode']:.2f}x | {r['verify']:.2f}x |")
    lines += bandwidth_floor_lines(result)
    lines += kernel_lines(result)
    s = result["sampler"]
    lines += [
        "",
        f"Rejection sampler: batch {s['batch']}, K = {s['k']}, vocab {s['vocab']}, "
        f"{result['device']}, median (p90) of {s['iters']}; step = filters + softmax + random "
        "draws + accept/recover/bonus, core = accept/recover/bonus alone",
        "",
        "| case | core impl | step ms | core ms | core kernel ms | outputs = torch's |",
        "|---|---|---|---|---|---|",
    ]
    for r in s["rows"]:
        kernel = f"{r['core_device_ms']:.3f}" if r.get("core_device_ms") else "-"
        lines.append(f"| {r['case']} | {r['impl']} | {r['step_median_ms']:.3f} "
                     f"({r['step_p90_ms']:.3f}) | {r['core_median_ms']:.3f} ({r['core_p90_ms']:.3f}) "
                     f"| {kernel} | {'yes' if r.get('equals_torch', True) else 'NO'} |")
    if s.get("speedup"):
        t = s["target"]
        lines += [
            "",
            "Triton sampler: speedup = torch / Triton, median wall time per call (host launch "
            "work included) and GPU kernel time (torch.profiler); target: core >= "
            f"{t['min_speedup']:.0f}x: wall " + ("met" if t["met"] else "NOT met")
            + ", kernels " + ("met" if t.get("kernels_met") else "NOT met"),
            "",
            "| case | core speedup, wall | core speedup, kernels | step speedup, wall |",
            "|---|---|---|---|",
        ]
        for r in s["speedup"]:
            kernels = f"{r['core_kernels']:.1f}x" if r.get("core_kernels") else "-"
            lines.append(f"| {r['case']} | {r['core']:.1f}x | {kernels} | {r['step']:.2f}x |")
    return "\n".join(lines) + "\n"


def bandwidth_floor_ms(result: dict) -> float | None:
    """Weight bytes over the GPU's peak bandwidth in ms; None off a known GPU."""
    gbps = next((v for k, v in GPU_BANDWIDTH_GBPS.items() if k in result["device_name"]), None)
    if result["device"] != "cuda" or gbps is None or "num_parameters" not in result:
        return None
    weight_bytes = result["num_parameters"] * parse_dtype(result["dtype"]).itemsize
    return weight_bytes / (gbps * 1e9) * 1e3


def bandwidth_floor_lines(result: dict) -> list[str]:
    """Each batch's fastest decode step against the weight-bandwidth floor."""
    floor = bandwidth_floor_ms(result)
    if floor is None:
        return []
    best: dict[int, float] = {}
    for r in result["forward"]:
        best[r["batch"]] = min(best.get(r["batch"], float("inf")), r["decode_median_ms"])
    lines = ["", f"Weight-bandwidth floor: {result['num_parameters'] / 1e9:.2f}B parameters in "
             f"{result['dtype']} read once per step at the {result['device_name']}'s peak "
             f"bandwidth = {floor:.2f} ms (weights alone: the KV cache read at each step adds to it)", "",
             "| batch | decode ms (fastest mode) | floor ms | decode / floor |", "|---|---|---|---|"]
    lines += [f"| {b} | {ms:.2f} | {floor:.2f} | {ms / floor:.1f}x |" for b, ms in best.items()]
    return lines


def kernel_lines(result: dict) -> list[str]:
    """Each batch's decode step: its kernels' GPU time beside the graphs step
    time, then the longest kernels."""
    if not result.get("kernels"):
        return []
    graphs = {r["batch"]: r["decode_median_ms"] for r in result["forward"] if r["mode"] == "graphs"}
    lines = ["", "Decode step by kernel (eager, torch.profiler; kernel time alone, launch gaps "
                 "excluded; ms per step):", "",
             "| batch | kernels ms | graphs step ms | longest kernels (ms) |", "|---|---|---|---|"]
    for r in result["kernels"]:
        step = graphs.get(r["batch"])
        top = "; ".join(f"{k['kernel'][:60]} {k['ms']:.3f}" for k in r["top"])
        lines.append(f"| {r['batch']} | {r['total_ms']:.2f} | "
                     f"{f'{step:.2f}' if step is not None else '-'} | {top} |")
    return lines


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="Hugging Face directory (default: the prepared default model), "
                                    f"or random weights: {', '.join(RANDOM_MODELS)}")
    ap.add_argument("--random-weights", action="store_true",
                    help="--model DIR's config.json with random weights (its shapes, no weights read)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="torch CPU threads (default: all cores)")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=256, help="prefilled tokens per sequence")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sampler-batch", type=int, default=64)
    ap.add_argument("--sampler-k", type=int, default=4)
    ap.add_argument("--sampler-vocab", type=int, default=128_256)
    ap.add_argument("--sampler-iters", type=int, default=20)
    ap.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                    help="on CUDA, time eager steps only (default: eager and CUDA graphs)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, a smoke test; writes nothing unless --out is given")
    ap.add_argument("--out", help="JSON path (default: bench/results/verifier.json; "
                                  "the table goes next to it as .md)")
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    modes = ("eager", "graphs") if device.type == "cuda" and args.cuda_graphs else ("eager",)
    if args.quick:
        args.batches, args.ks, args.context = "1,2", "2,4", 32
        args.iters, args.warmup, args.sampler_iters = 4, 1, 3
        args.sampler_batch, args.sampler_vocab = 4, 2048
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    torch.set_num_threads(args.threads)

    if args.model in RANDOM_MODELS:
        model_name = args.model
        model = random_model(RANDOM_MODELS[args.model], args.dtype, device)
    else:
        model_dir = Path(args.model) if args.model else prepare_default_model()
        if args.random_weights:
            model_name = f"{model_dir.name} shapes, random weights"
            model = random_model(ModelConfig.from_dir(model_dir), args.dtype, device)
        else:
            model_name = model_dir.name
            model = load_model(model_dir, dtype=args.dtype, device=device)
    num_parameters = sum(p.numel() for p in model.parameters())
    longest = args.context + max(ks) + 1
    # One block more: the graph runner's scratch block.
    cache = model.make_kv_cache(max(batches) * -(-longest // BLOCK_SIZE) + 1, BLOCK_SIZE)
    graphs = None
    if "graphs" in modes:
        graphs = CudaGraphRunner(model, cache, max(batches), max(ks) + 1, longest)
    print(f"prefilling {max(batches)} x {args.context} tokens ...", flush=True)
    prefill(model, cache, max(batches), args.context, torch.Generator().manual_seed(0))

    load_start = os.getloadavg()[0]  # other work on the machine shows up as noise
    forward = []
    for mode in modes:
        forward += bench_forward(model, cache, batches, ks, args.context, args.iters,
                                 args.warmup, mode, graphs)
    kernels = kernel_breakdown(model, cache, batches, args.context) if device.type == "cuda" else []
    del model, cache, graphs
    sampler_rows = bench_sampler(args.sampler_batch, args.sampler_k, args.sampler_vocab,
                                 args.sampler_iters, args.warmup, device)

    result = {
        "bench": "verifier",
        "model": model_name,
        "num_parameters": num_parameters,
        "dtype": args.dtype,
        "device": device.type,
        "device_name": device_name(device),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "context": args.context,
        "iters": args.iters,
        "warmup": args.warmup,
        "load_average_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)],  # start, end
        "modes": list(modes),
        "forward": forward,
        "kernels": kernels,
        "sampler": {"batch": args.sampler_batch, "k": args.sampler_k, "vocab": args.sampler_vocab,
                    "iters": args.sampler_iters, "rows": sampler_rows},
    }
    hit = [r for r in forward if (r["batch"], r["k"], r["mode"]) ==
           (TARGET["batch"], TARGET["k"], "eager")]
    if device.type == "cpu" and hit:
        result["target"] = {**TARGET, "ratio": hit[0]["ratio"],
                            "met": hit[0]["ratio"] <= TARGET["max_ratio"]}
    if "graphs" in modes:
        result["graphs_speedup"] = graphs_speedup(forward)
        at = [r for r in result["graphs_speedup"] if r["batch"] == GRAPHS_TARGET["batch"]]
        if at:
            worst = min(min(r["decode"], r["verify"]) for r in at)
            result["graphs_target"] = {**GRAPHS_TARGET, "speedup_min": worst,
                                       "met": worst >= GRAPHS_TARGET["min_speedup"]}
    if any(r["impl"] == "triton" for r in sampler_rows):
        speedup = sampler_speedup(sampler_rows)
        result["sampler"]["speedup"] = speedup
        worst = min(r["core"] for r in speedup)
        kernels = [r["core_kernels"] for r in speedup if r["core_kernels"]]
        result["sampler"]["target"] = {
            **SAMPLER_TARGET, "core_speedup_min": worst,
            "met": worst >= SAMPLER_TARGET["min_speedup"],
            "core_kernels_speedup_min": min(kernels) if kernels else None,
            "kernels_met": bool(kernels) and min(kernels) >= SAMPLER_TARGET["min_speedup"]}
    table = render_table(result)
    print()
    print(table, end="")
    out = args.out or (None if args.quick else str(Path(__file__).parent / "results" / "verifier.json"))
    if out:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        out.with_suffix(".md").write_text(table)
        print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
