"""Everything the verifier's GPU work needs measured, in one command that fits the few
minutes a GPU is lent for:

    python -m bench.gpu_check --out DIR [--budget-s 450] [--model random-1b]
        [--device cuda] [--sections steps,spec,...]
    TRITON_INTERPRET=1 python -m bench.gpu_check --tiny --device cpu --out DIR   # smoke test

Sections, most valuable first (each one's numbers are in DIR/gpu_check.json):
  env               GPU, driver, torch, triton and CUDA versions
  bandwidth         device-to-device copy bandwidth (read + write bytes, median); the decode
                    floor: weight bytes (+ the KV a step reads) / that bandwidth, batch 1 and 16
  steps             decode (1 row per sequence) and verify K = 4 (5 rows) at batch 1 and 16,
                    context 256, replayed from CUDA graphs, per fused configuration ("none",
                    each fusion alone, "all"): wall time per step (host work included) and
                    device time of the graph alone (CUDA events around back-to-back replays)
  kernels           one eager decode step under torch.profiler, "none" and "all": kernels per
                    step by kind, and the 10 longest
  accuracy          each fusion and "all" against "none" on the same weights and dtype: max
                    |logit difference| and greedy agreement over a prefill and 32 decode steps
                    (batch 4, every configuration fed the tokens "none" chose); a verify
                    step's logits against decode steps' at the same positions
  spec              the real Engine with a scripted in-process proposer (the plain greedy
                    continuation, drafted with errors for ~2.2 tokens per verify step), K = 2
                    and 4 against K = 0, batch 1 and 16, CUDA graphs on: tokens/s over 128
                    new tokens in the run's dtype (on a target whose logits are all 0, so
                    that bfloat16 near-ties cannot part the outputs: see `zeroed`), and
                    whether outputs equal plain's, in float32 on the real weights
  draft_token       a decode step of a draft-size model (SmolLM2-135M's shapes) against one
                    of the target
  compile_baseline  gpt-fast's whole-step torch.compile(mode="reduce-overhead") decode over
                    a static KV cache, on the same weights: step time, compile time, greedy
                    agreement with our model
  sampler           the rejection sampler, torch against Triton (bench.verifier)

DIR/gpu_check.json and .md are rewritten after every section, so a run cut off keeps what it
measured. The script keeps its own clock from the moment main() starts: a section whose
estimate does not fit the rest of --budget-s is recorded as {"skipped": "time"}, and one
still running when the budget ends is interrupted. A section that raises is recorded
(type, message, traceback tail) and the next one runs; the exit status is 1 when any did.
The table (DIR/gpu_check.md, also printed) has one line per headline.

--tiny: a 2-layer random model in float32 and a few iterations of everything, for the CPU
smoke test (tests/bench/test_gpu_check.py); the fused kernels then need Triton's
interpreter (TRITON_INTERPRET=1, set before Python starts). On CUDA the default is
random-1b in bfloat16 with random weights: step times depend on shapes alone.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    raise SystemExit("run as a module from the repository root: python -m bench.gpu_check")

import argparse
import contextlib
import gc
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench.verifier import (
    BLOCK_SIZE,
    GPU_BANDWIDTH_GBPS,
    RANDOM_MODELS,
    bench_sampler,
    device_name,
    make_step,
    percentile,
    prefill,
    random_model,
    sampler_speedup,
    timer,
    top_kernels,
)
from specdec.models import LlamaForCausalLM, ModelConfig
from specdec.models.cuda_graphs import CudaGraphRunner, bucket
from specdec.models.llama import FusedOps, rms_norm
from specdec.sampling import SamplingParams
from verifier.engine import Engine, EngineConfig, Proposal, Proposer, Request

# The default draft model's shapes (SmolLM2-135M), for a GPU machine without it prepared.
SMOLLM2_135M = ModelConfig(vocab_size=49_152, hidden_size=576, intermediate_size=1536,
                           num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                           rms_norm_eps=1e-5, rope_theta=100_000.0, max_position_embeddings=8192,
                           tie_word_embeddings=True)
TINY = ModelConfig(vocab_size=500, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=1024)
TINY_DRAFT = ModelConfig(vocab_size=500, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=1024,
                         tie_word_embeddings=True)
FUSIONS = ("add_rms_norm", "rotary_kv", "silu_mul", "attention")
CONFIGS = ("none", *FUSIONS, "all")
GREEDY = SamplingParams(temperature=0.0)
ACCEPTANCE_LENGTH = 2.2  # the spec section's target: tokens per verify step per sequence


@dataclass(frozen=True, slots=True)
class Settings:
    """Sizes of one run: the GPU defaults, or --tiny's."""

    device: torch.device
    dtype: str
    model: str
    cfg: ModelConfig
    draft_cfg: ModelConfig
    tiny: bool = False
    context: int = 256
    batches: tuple[int, int] = (1, 16)
    k: int = 4
    iters: int = 20
    warmup: int = 2
    replays: int = 5  # back-to-back graph replays per device-time sample
    copy_bytes: int = 1 << 30
    profile_iters: int = 5
    acc_batch: int = 4
    acc_prompt: int = 64
    acc_steps: int = 32
    spec_ks: tuple[int, ...] = (2, 4)
    spec_prompt: int = 32
    spec_tokens: int = 128
    exact_tokens: int = 32  # the float32 exactness runs
    compile_steps: int = 16
    compile_backend: str = "inductor"
    sampler: tuple[int, int, int, int] = (64, 4, 128_256, 20)  # batch, K, vocab, iters

    @classmethod
    def tiny_run(cls, device: torch.device, compile_backend: str) -> Settings:
        return cls(device, "float32", "tiny", TINY, TINY_DRAFT, tiny=True, context=32,
                   batches=(1, 2), iters=2, warmup=1, replays=1, copy_bytes=16 << 20,
                   profile_iters=1, acc_prompt=12, acc_steps=6, spec_prompt=6, spec_tokens=12,
                   exact_tokens=8, compile_steps=4, compile_backend=compile_backend,
                   sampler=(4, 4, 2048, 2))


class Bench:
    """What the sections share: settings, the target model (built on first use), and the
    results so far (a section reads earlier ones, the floor from `bandwidth`)."""

    def __init__(self, settings: Settings, result: dict):
        self.s = settings
        self.result = result

    @cached_property
    def model(self) -> LlamaForCausalLM:
        return random_model(self.s.cfg, self.s.dtype, self.s.device)

    @property
    def device(self) -> torch.device:
        return self.s.device

    def section(self, name: str) -> dict:
        return self.result["sections"].get(name) or {}

    def floor_ms(self, batch: int) -> float | None:
        """A decode step's bandwidth floor at `batch`: what it must read over the measured
        copy bandwidth, else over the GPU's data-sheet peak; None when neither is known."""
        gbps = self.section("bandwidth").get("copy_gbps") or peak_gbps(self.device)
        if not gbps:
            return None
        return step_bytes(self.model, batch, self.s.context) / (gbps * 1e9) * 1e3


# -- timing ------------------------------------------------------------------


def event_ms(fn: Callable[[], object], device: torch.device, repeat: int = 1) -> float:
    """Device milliseconds per call over `repeat` back-to-back calls: CUDA events around
    them (the GPU stays busy when the host launches faster than it runs); elsewhere the
    host's clock."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        return (time.perf_counter() - t0) * 1e3 / repeat
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeat


def summary(xs: list[float]) -> dict:
    return {"median_ms": statistics.median(xs), "p90_ms": percentile(xs, 0.9), "n": len(xs)}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def release(device: torch.device) -> None:
    """Free what a finished section held (graph runners hold reference cycles)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- the section runner ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    run: Callable[[Bench], dict]
    cuda_s: float  # estimated seconds on an H100 with random-1b (the skip decision)
    tiny_s: float  # and with --tiny on a 2-core CPU

    def estimate_s(self, tiny: bool) -> float:
        return self.tiny_s if tiny else self.cuda_s


class OutOfTime(BaseException):
    """The budget ended inside a section (BaseException: no section code catches it)."""


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise OutOfTime in the main thread once `seconds` have passed."""
    def expire(signum, frame):
        raise OutOfTime(f"the budget ended after {seconds:.0f} s in this section")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def fits(estimate_s: float, remaining_s: float) -> bool:
    return estimate_s <= remaining_s


def error_record(e: BaseException) -> dict:
    tail = traceback.format_exception(type(e), e, e.__traceback__)[-6:]
    return {"type": type(e).__name__, "message": str(e)[:2000], "traceback": "".join(tail)}


def run_sections(sections: list[Section], bench: Bench, budget_s: float,
                 save: Callable[[dict], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
    """Each section in order into bench.result["sections"], saved after each: skipped
    when its estimate exceeds what is left of the budget, its error recorded when it
    raises. A section's "headline" dict goes to the result's top level."""
    result, start = bench.result, clock()
    for section in sections:
        remaining = budget_s - (clock() - start)
        estimate = section.estimate_s(bench.s.tiny)
        if not fits(estimate, remaining):
            out = {"skipped": "time", "estimate_s": estimate, "remaining_s": round(remaining, 1)}
        else:
            print(f"== {section.name} ({remaining:.0f} s left, estimate {estimate:.0f} s)",
                  flush=True)
            t0 = clock()
            try:
                with deadline(remaining):
                    out = section.run(bench)
            except (Exception, OutOfTime) as e:
                out = {"error": error_record(e)}
                print(f"   {section.name} failed: {type(e).__name__}: {e}", flush=True)
            out["elapsed_s"] = round(clock() - t0, 2)
            result.update(out.pop("headline", {}))
            release(bench.device)
        result["sections"][section.name] = out
        save(result)


# -- env, bandwidth ----------------------------------------------------------


def section_env(bench: Bench) -> dict:
    import triton

    dev = bench.device
    out = {"device_name": device_name(dev), "torch": torch.__version__,
           "cuda": torch.version.cuda, "triton": triton.__version__,
           "python": platform.python_version(),
           "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        out |= {"capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
                "multiprocessors": props.multi_processor_count}
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20).stdout.strip()
    return out


def peak_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = device_name(device)
    return next((v for k, v in GPU_BANDWIDTH_GBPS.items() if k in name), None)


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of weights a decode step reads: all but the embedding's rows it skips
    (a tied embedding is read whole as the lm_head). parameters() counts tied ones once."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        emb = model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def kv_bytes(model: LlamaForCausalLM, context: int) -> int:
    """KV bytes one sequence's decode step reads at `context` tokens."""
    c = model.config
    return 2 * c.num_layers * context * c.num_kv_heads * c.head_dim * model.dtype.itemsize


def step_bytes(model: LlamaForCausalLM, batch: int, context: int) -> int:
    return weight_bytes(model) + batch * kv_bytes(model, context)


def section_bandwidth(bench: Bench) -> dict:
    dev, n = bench.device, bench.s.copy_bytes
    src = torch.ones(n, dtype=torch.uint8, device=dev)
    copy = torch.empty_like(src).copy_
    for _ in range(2):
        copy(src)
    times = [event_ms(lambda: copy(src), dev) for _ in range(10)]
    gbps = 2 * n / statistics.median(times) / 1e6  # read + write
    out = {"copy_bytes": n, "copy_ms": summary(times), "copy_gbps": gbps,
           "weight_bytes": weight_bytes(bench.model),
           "kv_bytes_per_seq": kv_bytes(bench.model, bench.s.context), "context": bench.s.context}
    if peak := peak_gbps(dev):
        out["peak_gbps"] = peak
        out["copy_over_peak"] = gbps / peak
    for b in bench.s.batches:
        out[f"floor_ms_b{b}"] = step_bytes(bench.model, b, bench.s.context) / (gbps * 1e9) * 1e3
    return out


# -- graph steps (steps, draft_token) ----------------------------------------


@dataclass(slots=True)
class GraphSteps:
    """One model under one fused configuration: its own cache, prefilled, and a graph
    runner (captured graphs bake in the kernels, so every configuration has its own)."""

    model: LlamaForCausalLM
    fused: FusedOps
    runner: CudaGraphRunner
    steps: dict[tuple[int, int], Callable[[], object]] = field(default_factory=dict)

    def step(self, shape: tuple[int, int]) -> object:
        # Eager on CPU (capture=False) and at capture time the model's switch decides.
        self.model.set_fused(self.fused)
        return self.steps[shape]()

    def replay_ms(self, shape: tuple[int, int], repeat: int) -> float:
        """Device time of the shape's graph alone: one step fills the runner's inputs,
        then `repeat` replays back to back."""
        self.step(shape)
        batch, q = shape
        key = next(k for k in self.runner.graphs
                   if k.batch == bucket(self.runner.batch_sizes, batch) and k.query_len == q)
        return event_ms(self.runner.graphs[key].replay, self.model.device, repeat)


def graph_steps(model: LlamaForCausalLM, fused: FusedOps, shapes: list[tuple[int, int]],
                context: int) -> GraphSteps:
    """shapes: (batch, query rows per sequence); every sequence prefilled to `context`."""
    max_batch = max(b for b, _ in shapes)
    max_q = max(q for _, q in shapes)
    longest = context + max_q
    cache = model.make_kv_cache(max_batch * -(-longest // BLOCK_SIZE) + 1, BLOCK_SIZE)
    runner = CudaGraphRunner(model, cache, max_batch, max_q, longest)
    # Prefill is set-up: the same (unfused) path for every configuration.
    model.set_fused(FusedOps())
    gen = torch.Generator().manual_seed(0)
    prefill(model, cache, max_batch, context, gen)
    out = GraphSteps(model, fused, runner)
    for batch, q in shapes:
        out.steps[(batch, q)] = make_step(model, cache, batch, q, context, gen, runner)
    return out


def time_graph_steps(benches: dict[str, GraphSteps], iters: int, warmup: int,
                     replays: int) -> dict[str, dict[tuple[int, int], dict]]:
    """Wall time per step (host planning and copies included, the device drained) and
    device time per replay, for every (configuration, shape); configurations take turns
    in a rotating order so that noise hits them alike."""
    names = list(benches)
    if not names:
        return {}
    time_ms = timer(benches[names[0]].model.device)
    for gs in benches.values():
        for shape in gs.steps:
            for _ in range(warmup):  # captures the graphs, compiles the kernels
                gs.step(shape)
    wall: dict = {n: {s: [] for s in benches[n].steps} for n in names}
    dev: dict = {n: {s: [] for s in benches[n].steps} for n in names}
    for i in range(iters):
        for name in names[i % len(names):] + names[: i % len(names)]:
            gs = benches[name]
            for shape in gs.steps:
                wall[name][shape].append(time_ms(lambda gs=gs, shape=shape: gs.step(shape)))
                dev[name][shape].append(gs.replay_ms(shape, replays))
    return {n: {s: {"wall": summary(wall[n][s]), "device": summary(dev[n][s])}
                for s in benches[n].steps} for n in names}


# -- steps -------------------------------------------------------------------


def section_steps(bench: Bench) -> dict:
    s = bench.s
    shapes = [(b, q) for b in s.batches for q in (1, s.k + 1)]
    configs: dict = {}
    benches = {}
    for name in CONFIGS:
        # Captured up front: a configuration that fails is recorded, the others timed.
        with guard(configs, name, bench.device):
            gs = graph_steps(bench.model, FusedOps.parse(name), shapes, s.context)
            for shape in shapes:
                gs.step(shape)
            benches[name] = gs
    times = time_graph_steps(benches, s.iters, s.warmup, s.replays)
    headline: dict = {}
    for name, per_shape in times.items():
        configs[name] = {f"b{b}": steps_cell(bench, name, b, per_shape[(b, 1)],
                                             per_shape[(b, s.k + 1)]) for b in s.batches}
        if name in ("all", "none"):
            suffix = "" if name == "all" else "_none"
            for b in s.batches:
                if "decode_over_floor" in configs[name][f"b{b}"]:
                    headline[f"decode_over_floor{suffix}_b{b}"] = \
                        configs[name][f"b{b}"]["decode_over_floor"]
    if "all" in times:
        headline[f"verify_over_decode_k{s.k}"] = {
            f"b{b}": configs["all"][f"b{b}"]["verify_over_decode_wall"] for b in s.batches}
    return {"context": s.context, "k": s.k, "iters": s.iters, "replays": s.replays,
            "configs": {n: configs[n] for n in CONFIGS}, "headline": headline}


def steps_cell(bench: Bench, name: str, batch: int, decode: dict, verify: dict) -> dict:
    cell = {"decode": decode, "verify": verify}
    for clock in ("wall", "device"):
        cell[f"verify_over_decode_{clock}"] = ms(verify, clock) / ms(decode, clock)
    floor = bench.floor_ms(batch)
    if floor:
        cell["floor_ms"] = floor
        cell["decode_over_floor"] = decode["wall"]["median_ms"] / floor
        cell["decode_device_over_floor"] = decode["device"]["median_ms"] / floor
    print(f"   {name} b{batch}: decode {decode['wall']['median_ms']:.3f} "
          f"ms, verify {verify['wall']['median_ms']:.3f} ms", flush=True)
    return cell


@contextlib.contextmanager
def guard(record: dict, key: str, device: torch.device) -> Iterator[None]:
    """One part of a section (a configuration): its error goes to record[key] and the
    section goes on with the others."""
    try:
        yield
    except Exception as e:
        record[key] = {"error": error_record(e)}
        print(f"   {key} failed: {type(e).__name__}: {e}", flush=True)
        release(device)


# -- kernels -----------------------------------------------------------------


def fused_kernel_names() -> set[str]:
    """Names of the Triton kernels in specdec/models/fused (how the profiler names them)."""
    from triton.runtime.jit import KernelInterface

    from specdec.models.fused import paged_attention, rms_norm, rotary_kv, silu_mul

    return {v.__name__ for m in (paged_attention, rms_norm, rotary_kv, silu_mul)
            for v in vars(m).values() if isinstance(v, KernelInterface)}


# First match wins: attention before gemm (flash_fwd_splitkv_kernel), copies before
# elementwise (index_elementwise_kernel).
KERNEL_KINDS = (
    ("attention", ("attention", "sdpa", "flash", "fmha", "attn", "softmax")),
    ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "addmm", "aten::mm",
              "bmm", "linear", "small_rows")),
    ("norm", ("rms_norm", "rmsnorm", "layer_norm", "norm")),
    ("reduce", ("reduce", "aten::mean", "aten::sum")),
    ("copy/index", ("copy", "memcpy", "memset", "index", "gather", "scatter", "catarray",
                    "aten::cat", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "aten::mul", "aten::add",
                     "silu", "aten::neg", "rsqrt", "aten::pow")),
)


def kernel_kind(name: str, triton_names: set[str]) -> str:
    if name in triton_names or name.startswith("triton_"):
        return f"triton:{name}"
    low = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in low for k in keys)), "other")


def profile_step(fn: Callable[[], object], device: torch.device, iters: int
                 ) -> dict[str, tuple[float, float]]:
    """name -> (calls, µs) over `iters` calls of fn: GPU kernels on CUDA (their own
    time); on CPU the operators (nested ones too: a smoke test of the path only)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        synchronize(device)
    out = {}
    for e in prof.key_averages():
        us = e.self_device_time_total if cuda else e.self_cpu_time_total
        if us > 0:
            out[e.key] = (e.count, us)
    return out


def kernel_summary(kernels: dict[str, tuple[float, float]], iters: int, triton_names: set[str]
                   ) -> dict:
    by_kind: dict[str, dict] = {}
    for name, (count, us) in kernels.items():
        kind = by_kind.setdefault(kernel_kind(name, triton_names), {"count": 0.0, "ms": 0.0})
        kind["count"] += count / iters
        kind["ms"] += us / 1000 / iters
    top = top_kernels({n: us for n, (_, us) in kernels.items()}, iters, 10)
    return {"kernels_per_step": sum(c for c, _ in kernels.values()) / iters,
            "by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]["count"])), **top}


def section_kernels(bench: Bench) -> dict:
    s, model = bench.s, bench.model
    names = fused_kernel_names()
    cache = model.make_kv_cache(max(s.batches) * -(-(s.context + 1) // BLOCK_SIZE), BLOCK_SIZE)
    model.set_fused(FusedOps())
    gen = torch.Generator().manual_seed(0)
    prefill(model, cache, max(s.batches), s.context, gen)
    out: dict = {"what": "kernels" if bench.device.type == "cuda" else "cpu operators"}
    for config in ("none", "all"):
        for b in s.batches:
            with guard(out, f"{config}_b{b}", bench.device):
                model.set_fused(config)
                step = make_step(model, cache, b, 1, s.context, gen)
                step()  # the warm-up's kernels (and Triton's compiles) stay out of the profile
                synchronize(bench.device)
                out[f"{config}_b{b}"] = kernel_summary(
                    profile_step(step, bench.device, s.profile_iters), s.profile_iters, names)
    return out


# -- accuracy ----------------------------------------------------------------


@torch.inference_mode()
def decode_logits(model: LlamaForCausalLM, fused: FusedOps | str, prompts: list[list[int]],
                  steps: int, feed: torch.Tensor | None = None, verify_rows: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A ragged prefill of `prompts`, then `steps` decode steps on a fresh cache.
    Returns logits [steps + 1, B, V] (float32) after the prompt and each fed token, the
    tokens fed [steps + 1, B] (`feed`, else each row's greedy choice), and with
    verify_rows: the cache rolled back to the prompts, one verify block of the first
    `verify_rows` fed tokens per sequence: logits [verify_rows, B, V], which row j of
    equal to decode step j + 1's."""
    model.set_fused(fused)
    dev, b = model.device, len(prompts)
    longest = max(map(len, prompts)) + steps + 1
    cache = model.make_kv_cache(b * -(-longest // BLOCK_SIZE), BLOCK_SIZE)
    for i in range(b):
        cache.add(i)
    meta = cache.plan([(i, len(p)) for i, p in enumerate(prompts)])
    ids = torch.tensor([t for p in prompts for t in p], device=dev)
    logits = [model(ids, meta, cache).logits.float()]  # [B, V]
    fed = []
    for i in range(steps + 1):
        fed.append(feed[i] if feed is not None else logits[-1].argmax(-1))
        if i < steps:
            meta = cache.plan([(s, 1) for s in range(b)])
            logits.append(model(fed[-1].to(dev), meta, cache).logits.float())
    verify = None
    if verify_rows:
        for s, p in enumerate(prompts):
            cache.truncate(s, len(p))
        tokens = torch.stack(fed[:verify_rows], 1).reshape(-1).to(dev)  # [B * rows], by sequence
        meta = cache.plan([(s, verify_rows) for s in range(b)])
        rows = torch.arange(b * verify_rows, device=dev)
        verify = model(tokens, meta, cache, logits_indices=rows).logits.float()
        verify = verify.view(b, verify_rows, -1).transpose(0, 1)
    return torch.stack(logits), torch.stack(fed), verify


def compare(logits: torch.Tensor, reference: torch.Tensor) -> dict:
    """logits and reference: [N, B, V] at the same positions."""
    return {"max_abs_logit_diff": (logits - reference).abs().max().item(),
            "greedy_agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
            "positions": logits.shape[0] * logits.shape[1]}


def random_prompts(batch: int, length: int, vocab: int, seed: int, ragged: bool = True
                   ) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length - (3 * i if ragged else 0))]
            for i in range(batch)]


def section_accuracy(bench: Bench) -> dict:
    s, model = bench.s, bench.model
    prompts = random_prompts(s.acc_batch, s.acc_prompt, s.cfg.vocab_size, seed=1)
    rows = s.k + 1
    ref, tokens, ref_verify = decode_logits(model, "none", prompts, s.acc_steps, verify_rows=rows)
    out: dict = {"batch": s.acc_batch, "decode_steps": s.acc_steps, "dtype": s.dtype,
                 "configs": {}, "verify_vs_decode": {
                     "none": compare(ref_verify, ref[1:rows + 1])}}
    for name in (*FUSIONS, "all"):
        with guard(out["configs"], name, bench.device):
            logits, _, verify = decode_logits(model, name, prompts, s.acc_steps, feed=tokens,
                                              verify_rows=rows if name == "all" else 0)
            out["configs"][name] = compare(logits, ref)
            if verify is not None:
                out["verify_vs_decode"]["all"] = compare(verify, logits[1:rows + 1])
    return out


# -- spec --------------------------------------------------------------------


def error_rate_for(acceptance_length: float, k: int) -> float:
    """The per-token draft error rate e at which K drafts give `acceptance_length` tokens
    per verify step: each draft right with probability a = 1 - e until the first wrong
    one, so 1 + a + ... + a^K tokens (the bonus token included)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if sum(a**i for i in range(k + 1)) < acceptance_length:
            lo = a
        else:
            hi = a
    return 1.0 - (lo + hi) / 2


class ScriptedProposer(Proposer):
    """Drafts the known greedy continuation of each request (`references`, by request
    id: prompt + output), each token replaced by a different random one with probability
    `error_rate`."""

    def __init__(self, vocab: int, seed: int = 0):
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.references: dict[str, list[int]] = {}
        self.error_rate = 0.0
        self.by_seq: dict[int, list[int]] = {}

    def start(self, seq_id, request):
        self.by_seq[seq_id] = self.references.get(request.request_id, [])

    def propose(self, wanted, tokens):
        out = {}
        for seq_id, k in wanted.items():
            ref, n = self.by_seq[seq_id], len(tokens[seq_id])
            draft = []
            for i in range(k):
                right = ref[n + i] if n + i < len(ref) else 0
                wrong = self.rng.random() < self.error_rate
                draft.append((right + self.rng.randrange(1, self.vocab)) % self.vocab
                             if wrong else right)
            out[seq_id] = Proposal(draft)
        return out

    def advance(self, seq_id, outcome):
        pass

    def free(self, seq_id):
        self.by_seq.pop(seq_id, None)


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int, k: int) -> dict:
    """Every prompt to max_tokens greedy tokens at K = k: outputs, seconds, and the mean
    tokens per verify step per sequence."""
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"s{i}", p, max_tokens, GREEDY, ignore_eos=True,
                                   num_speculative_tokens=k))
    outputs: dict[str, list[int]] = {f"s{i}": [] for i in range(len(prompts))}
    verified = emitted = steps = 0
    synchronize(engine.model.device)
    t0 = time.perf_counter()
    while engine.has_work():
        steps += 1
        for o in engine.step():
            outputs[o.request_id] += o.new_token_ids
            if o.num_drafted:
                verified += 1
                emitted += o.num_accepted + 1
    synchronize(engine.model.device)
    seconds = time.perf_counter() - t0
    return {"outputs": [outputs[f"s{i}"] for i in range(len(prompts))], "seconds": seconds,
            "steps": steps, "acceptance_length": emitted / verified if verified else None}


def section_spec(bench: Bench) -> dict:
    """Speed in the run's dtype, exactness in float32 (see spec_speed)."""
    s = bench.s
    fused = FusedOps.default_for(bench.device)  # what load_model gives the engine
    with zeroed(bench.model.norm.weight):
        speed = spec_runs(bench.model, fused, s, s.spec_tokens, warmup=True)
    exact_model = (bench.model if s.dtype == "float32"
                   else random_model(s.cfg, "float32", bench.device))
    exact = spec_runs(exact_model, fused, s, s.exact_tokens, warmup=False)
    return {"fused": fused_name(fused), "dtype": s.dtype, "new_tokens": s.spec_tokens,
            "target_acceptance_length": ACCEPTANCE_LENGTH, "runs": speed,
            "exact_new_tokens": s.exact_tokens, "exact_float32": exact,
            "all_equal_to_plain": all(r["equal_to_plain"] for r in speed + exact)}


@contextlib.contextmanager
def zeroed(weight: torch.Tensor) -> Iterator[None]:
    """The speed runs' target: its final norm's weight zeroed, so every logit is exactly 0
    and greedy picks token 0 whatever path computed it. Random weights' logits are flat:
    in bfloat16 near-ties are common (logits sit a few ulps apart), a verify step's rows
    and a decode step's (other GEMM kernels) round them apart, outputs part from plain's,
    and drafts that follow plain's continuation stop being accepted. Zeroed, the step
    runs the same kernels on the same shapes and the proposer alone sets the acceptance;
    the float32 runs on the real weights check exactness."""
    kept = weight.detach().clone()
    with torch.no_grad():
        weight.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            weight.copy_(kept)


def spec_runs(model: LlamaForCausalLM, fused: FusedOps, s: Settings, new_tokens: int,
              warmup: bool) -> list[dict]:
    """Plain (K = 0), then each K, at each batch size, through one engine with CUDA graphs;
    with `warmup` every run is done twice and the second timed (graphs captured)."""
    model.set_fused(fused)
    max_batch, max_k = max(s.batches), max(s.spec_ks)
    max_len = s.spec_prompt + new_tokens + max_k + 1
    proposer = ScriptedProposer(model.config.vocab_size)
    engine = Engine(model, EngineConfig(
        max_num_seqs=max_batch, max_model_len=max_len, block_size=BLOCK_SIZE,
        num_kv_blocks=max_batch * -(-max_len // BLOCK_SIZE) + 1,
        max_num_batched_tokens=max(512, max_batch * s.spec_prompt),
        max_num_speculative_tokens=max_k, cuda_graphs=True, enable_prefix_caching=False),
        proposer)
    rows = []
    for batch in s.batches:
        prompts = random_prompts(batch, s.spec_prompt, model.config.vocab_size, seed=2,
                                 ragged=False)
        runs = 2 if warmup else 1
        plain = [generate(engine, prompts, new_tokens, 0) for _ in range(runs)][-1]
        proposer.references = {f"s{i}": p + o for i, (p, o) in
                               enumerate(zip(prompts, plain["outputs"], strict=True))}
        rows.append(spec_row(batch, 0, plain, plain, new_tokens))
        for k in s.spec_ks:
            proposer.error_rate = error_rate_for(ACCEPTANCE_LENGTH, k)
            spec = [generate(engine, prompts, new_tokens, k) for _ in range(runs)][-1]
            rows.append(r := spec_row(batch, k, spec, plain, new_tokens))
            print(f"   {fused_name(fused)} {model.dtype} b{batch} K{k}: {r['speedup']:.2f}x, "
                  f"acceptance length {r['acceptance_length']:.2f}, equal {r['equal_to_plain']}",
                  flush=True)
    return rows


def spec_row(batch: int, k: int, run: dict, plain: dict, new_tokens: int) -> dict:
    def prefix(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))

    same = [prefix(a, b) for a, b in zip(run["outputs"], plain["outputs"], strict=True)]
    return {"batch": batch, "k": k, "steps": run["steps"], "seconds": run["seconds"],
            "tokens_per_s": batch * new_tokens / run["seconds"],
            "speedup": plain["seconds"] / run["seconds"],
            "acceptance_length": run["acceptance_length"],
            "equal_to_plain": run["outputs"] == plain["outputs"],
            # Where outputs part (bfloat16 near-ties flip between verify and decode rows).
            "first_difference": [n if n < new_tokens else None for n in same]}


# -- draft_token -------------------------------------------------------------


def draft_config(bench: Bench) -> tuple[str, ModelConfig]:
    if bench.s.tiny:
        return "tiny draft", bench.s.draft_cfg
    from specdec.models.prepare import default_model_dir, is_prepared

    path = default_model_dir()
    if is_prepared(path):
        return path.name, ModelConfig.from_dir(path)
    return "SmolLM2-135M shapes (hard-coded)", SMOLLM2_135M


def section_draft_token(bench: Bench) -> dict:
    s = bench.s
    name, cfg = draft_config(bench)
    draft = random_model(cfg, s.dtype, bench.device)
    fused = FusedOps.default_for(bench.device)
    benches = {"draft": graph_steps(draft, fused, [(1, 1)], s.context),
               "target": graph_steps(bench.model, fused, [(1, 1)], s.context)}
    times = time_graph_steps(benches, s.iters, s.warmup, s.replays)
    d, t = times["draft"][(1, 1)], times["target"][(1, 1)]
    return {"draft": name, "draft_parameters": sum(p.numel() for p in draft.parameters()),
            "fused": fused_name(fused), "context": s.context, "draft_step": d, "target_step": t,
            "ratio_wall": d["wall"]["median_ms"] / t["wall"]["median_ms"],
            "ratio_device": d["device"]["median_ms"] / t["device"]["median_ms"]}


# -- compile_baseline --------------------------------------------------------


class StaticKVCache(nn.Module):
    def __init__(self, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        shape = (batch, num_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device))
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device))

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # input_pos: [S]; k, v: [B, Hkv, S, D]
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotate-half. x: [B, S, H, D]; cos, sin: [S, 1, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class StaticDecoder(nn.Module):
    """gpt-fast's forward over our model's parameters: a static [B, Hkv, L, D] cache per
    layer, written at input_pos, and SDPA over all of it under a mask."""

    def __init__(self, model: LlamaForCausalLM, batch: int, max_len: int):
        super().__init__()
        c = model.config
        assert not c.qk_norm and c.sliding_window is None, "Llama layout only"
        self.model, self.max_len = model, max_len
        self.caches = nn.ModuleList(
            StaticKVCache(batch, c.num_kv_heads, max_len, c.head_dim, model.dtype, model.device)
            for _ in range(c.num_layers))

    def forward(self, ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        # ids: [B, S]; input_pos: [S] -> next-token logits [B, V] after the last
        m, c = self.model, self.model.config
        b, s = ids.shape
        h, hkv, d, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        x = m.embed_tokens(ids)  # [B, S, hidden]
        freqs = input_pos[:, None].float() * m.rotary.inv_freq  # [S, D / 2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [S, 1, D]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        mask = torch.arange(self.max_len, device=ids.device) <= input_pos[:, None]  # [S, L]
        for layer, cache in zip(m.layers, self.caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = F.linear(rms_norm(x, layer.input_layernorm.weight, eps), attn.qkv_proj.weight,
                           attn.qkv_proj.bias).view(b, s, h + 2 * hkv, d)
            q, k, v = qkv.split([h, hkv, hkv], dim=2)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            k, v = cache.update(input_pos, k.transpose(1, 2), v.transpose(1, 2))
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                               enable_gqa=True)  # [B, H, S, D]
            x = x + F.linear(o.transpose(1, 2).reshape(b, s, h * d), attn.o_proj.weight)
            gate, up = F.linear(rms_norm(x, layer.post_attention_layernorm.weight, eps),
                                mlp.gate_up_proj.weight).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, mlp.down_proj.weight)
        return F.linear(rms_norm(x[:, -1], m.norm.weight, eps), m.lm_head.weight)


def compiled_decode(bench: Bench, batch: int, prompts: torch.Tensor, tokens: torch.Tensor
                    ) -> dict:
    """prompts: [B, context]; tokens: [steps + 1, B] our model's greedy tokens, fed in turn
    (the compiled step's argmax compared with the next one)."""
    s, dev = bench.s, bench.device
    decoder = StaticDecoder(bench.model, batch, s.context + len(tokens) + 1)
    for cache in decoder.caches:  # cudagraphs may then keep the buffers where they are
        torch._dynamo.mark_static_address(cache.k)
        torch._dynamo.mark_static_address(cache.v)
    mode = "reduce-overhead" if dev.type == "cuda" else None
    step = torch.compile(decoder, mode=mode, fullgraph=True, dynamic=False,
                         backend=s.compile_backend)

    positions = torch.arange(s.context + len(tokens), device=dev)

    def decode(ids: torch.Tensor, pos: int) -> torch.Tensor:
        # Outputs of a cudagraph-tree replay are overwritten by the next one: cloned.
        torch.compiler.cudagraph_mark_step_begin()
        return step(ids[:, None], positions[pos: pos + 1]).clone()

    with torch.no_grad():
        first = decoder(prompts, positions[: s.context])  # prefill, eager
        t0 = time.perf_counter()
        decode(tokens[0], s.context)
        synchronize(dev)
        compile_s = time.perf_counter() - t0
        agree = [first.argmax(-1) == tokens[0]]
        for i in range(len(tokens) - 1):
            agree.append(decode(tokens[i], s.context + i).argmax(-1) == tokens[i + 1])
        # Timed at one position, rewriting its slot, so the context stays fixed.
        pos, ids = s.context, tokens[0]
        for _ in range(s.warmup):
            decode(ids, pos)
        wall = [timer(dev)(lambda: decode(ids, pos)) for _ in range(s.iters)]
        device = [event_ms(lambda: decode(ids, pos), dev, s.replays) for _ in range(s.iters)]
    return {"compile_s": compile_s, "wall": summary(wall), "device": summary(device),
            "greedy_agreement": torch.stack(agree).float().mean().item()}


def section_compile_baseline(bench: Bench) -> dict:
    s = bench.s
    fused = FusedOps.default_for(bench.device)
    out: dict = {"mode": "reduce-overhead", "backend": s.compile_backend,
                 "compared_with": fused_name(fused), "context": s.context}
    for batch in s.batches:
        with guard(out, f"b{batch}", bench.device):
            out[f"b{batch}"] = compile_row(bench, fused, batch)
        torch._dynamo.reset()
    # Dynamo's counters (over both batches) say whether cudagraphs were skipped, and why.
    with contextlib.suppress(Exception):  # their layout changes between versions
        from torch._dynamo.utils import counters

        out["counters"] = {k: dict(v) for k, v in counters.items()
                           if k in ("inductor", "stats", "graph_break")}
    return out


def compile_row(bench: Bench, fused: FusedOps, batch: int) -> dict:
    s = bench.s
    prompts = random_prompts(batch, s.context, s.cfg.vocab_size, seed=3, ragged=False)
    _, tokens, _ = decode_logits(bench.model, fused, prompts, s.compile_steps)
    ids = torch.tensor(prompts, device=bench.device)
    t0 = time.perf_counter()
    row = compiled_decode(bench, batch, ids, tokens.to(bench.device))
    row["total_s"] = time.perf_counter() - t0
    ours = bench.section("steps").get("configs", {}).get(fused_name(fused), {})
    if "decode" in ours.get(f"b{batch}", {}):
        row["ours_decode_wall_ms"] = ours[f"b{batch}"]["decode"]["wall"]["median_ms"]
    print(f"   b{batch}: {row['wall']['median_ms']:.3f} ms wall, compiled in "
          f"{row['compile_s']:.0f} s", flush=True)
    return row


def fused_name(fused: FusedOps) -> str:
    on = [n for n in FUSIONS if getattr(fused, n)]
    return "all" if len(on) == len(FUSIONS) else ",".join(on) or "none"


# -- sampler -----------------------------------------------------------------


def section_sampler(bench: Bench) -> dict:
    """The sampler with torch's sorted filters, then with the sort-free Triton filters
    (specdec.sampling.SORT_FREE_FILTERS, off by default until this has run)."""
    from specdec import sampling

    batch, k, vocab, iters = bench.s.sampler
    out = {"batch": batch, "k": k, "vocab": vocab, "iters": iters}
    for name, sort_free in (("sorted_filters", False), ("sort_free_filters", True)):
        sampling.SORT_FREE_FILTERS = sort_free
        try:
            rows = bench_sampler(batch, k, vocab, iters, bench.s.warmup, bench.device)
        finally:
            sampling.SORT_FREE_FILTERS = False
        out[name] = {"rows": rows, "speedup": sampler_speedup(rows)}
    return out


SECTIONS = [
    Section("env", section_env, 5, 2),
    Section("bandwidth", section_bandwidth, 10, 3),
    Section("steps", section_steps, 75, 40),
    Section("kernels", section_kernels, 15, 10),
    Section("accuracy", section_accuracy, 15, 15),
    Section("spec", section_spec, 50, 10),
    Section("draft_token", section_draft_token, 15, 5),
    Section("compile_baseline", section_compile_baseline, 150, 30),
    Section("sampler", section_sampler, 25, 5),
]


# -- the table ---------------------------------------------------------------


def ms(cell: dict, clock: str = "wall") -> float:
    return cell[clock]["median_ms"]


def failed(part: dict) -> str:
    return "ERROR {type}: {message}".format(**part["error"]).splitlines()[0][:120]


def table_lines(result: dict) -> list[str]:
    sec = result["sections"]
    lines = [f"# GPU check: {result['model']} {result['dtype']} on {result['device_name']}, "
             f"{result.get('elapsed_s', '(running)')} s of {result['budget_s']:.0f} s"]
    for name, out in sec.items():
        if "error" in out:
            lines.append(f"{name}: {failed(out)}")
            continue
        if "skipped" in out:
            left = (f": estimate {out['estimate_s']:.0f} s, {out['remaining_s']:.0f} s left"
                    if "estimate_s" in out else "")
            lines.append(f"{name}: skipped ({out['skipped']}{left})")
            continue
        try:
            lines += LINES[name](out, result)
        except Exception as e:  # a line the table cannot render must not stop the run
            lines.append(f"{name}: (no table line: {type(e).__name__}: {e})")
    return lines


def env_lines(out: dict, result: dict) -> list[str]:
    return [f"env: torch {out['torch']}, CUDA {out['cuda']}, triton {out['triton']}"
            + (f", driver {out['driver']}" if out.get("driver") else "")]


def bandwidth_lines(out: dict, result: dict) -> list[str]:
    floors = ", ".join(f"b{k[len('floor_ms_b'):]} {v:.3f} ms" for k, v in out.items()
                       if k.startswith("floor_ms_b"))
    peak = f" ({out['copy_over_peak']:.0%} of peak)" if out.get("copy_over_peak") else ""
    return [f"bandwidth: copy {out['copy_gbps']:.0f} GB/s{peak}; floor "
            f"({out['weight_bytes'] / 1e9:.2f} GB weights + KV at {out['context']}): {floors}"]


def steps_lines(out: dict, result: dict) -> list[str]:
    batches = [f"b{b}" for b in result["batches"]]
    head = " | ".join(f"{b} decode ms (x floor) | {b} verify ms | {b} v/d" for b in batches)
    lines = [f"steps (graphs, context {out['context']}, K {out['k']}, wall median; device "
             "in []):", f"| config | {head} |", "|---" * (1 + 3 * len(batches)) + "|"]
    for name, row in out["configs"].items():
        if "error" in row:
            lines.append(f"| {name} | {failed(row)} |")
            continue
        cells = []
        for b in batches:
            c = row[b]
            over = f" (x{c['decode_over_floor']:.1f})" if "decode_over_floor" in c else ""
            cells.append(f"{ms(c['decode']):.3f} [{ms(c['decode'], 'device'):.3f}]{over} | "
                         f"{ms(c['verify']):.3f} [{ms(c['verify'], 'device'):.3f}] | "
                         f"{c['verify_over_decode_wall']:.2f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def kernels_lines(out: dict, result: dict) -> list[str]:
    cells = []
    for key, v in out.items():
        if isinstance(v, dict) and "error" in v:
            cells.append(f"{key} {failed(v)}")
        elif isinstance(v, dict):
            kinds = ", ".join(f"{k} {d['count']:.0f}" for k, d in list(v["by_kind"].items())[:4])
            cells.append(f"{key} {v['kernels_per_step']:.0f} ({kinds})")
    return [f"{out['what']} per eager decode step: " + "; ".join(cells[:2]),
            "  " + "; ".join(cells[2:])]


def accuracy_lines(out: dict, result: dict) -> list[str]:
    def cell(c: dict) -> str:
        return failed(c) if "error" in c else \
            f"{c['max_abs_logit_diff']:.3g}/{c['greedy_agreement']:.3f}"

    configs = ", ".join(f"{n} {cell(c)}" for n, c in out["configs"].items())
    verify = ", ".join(f"{n} {cell(c)}" for n, c in out["verify_vs_decode"].items())
    return [f"accuracy vs none (max |dlogit| / greedy agreement, {out['dtype']}): {configs}",
            f"  verify vs decode rows: {verify}"]


def spec_lines(out: dict, result: dict) -> list[str]:
    cells = [f"b{r['batch']} K{r['k']} {r['tokens_per_s']:.0f} tok/s {r['speedup']:.2f}x "
             f"acc {r['acceptance_length'] or 0:.2f}" for r in out["runs"] if r["k"]]
    plain = ", ".join(f"b{r['batch']} {r['tokens_per_s']:.0f}" for r in out["runs"] if not r["k"])
    exact = [r for r in out["exact_float32"] if r["k"]]
    differs = "; ".join(f"b{r['batch']} K{r['k']} at {r['first_difference']}" for r in exact
                        if not r["equal_to_plain"])
    acceptance = ", ".join(f"{r['acceptance_length'] or 0:.2f}" for r in exact)
    return [f"spec ({out['fused']}, {out['dtype']}; plain tok/s {plain}): " + "; ".join(cells[:2]),
            "  " + "; ".join(cells[2:]),
            "  float32, real weights: outputs = plain's "
            f"{'NO: ' + differs[:150] if differs else 'yes'}"
            f" (acceptance {acceptance})"]


def draft_lines(out: dict, result: dict) -> list[str]:
    return [f"draft token: {out['draft']} {ms(out['draft_step']):.3f} ms vs target "
            f"{ms(out['target_step']):.3f} ms = {out['ratio_wall']:.3f} "
            f"(device {out['ratio_device']:.3f})"]


def compile_lines(out: dict, result: dict) -> list[str]:
    cells = []
    for key, r in out.items():
        if key.startswith("b") and isinstance(r, dict) and "error" in r:
            cells.append(f"{key} {failed(r)}")
        elif key.startswith("b") and isinstance(r, dict):
            ours = f" (ours {r['ours_decode_wall_ms']:.3f})" if "ours_decode_wall_ms" in r else ""
            cells.append(f"{key} {ms(r):.3f} ms [{ms(r, 'device'):.3f}]{ours}, compile "
                         f"{r['compile_s']:.0f} s, agreement {r['greedy_agreement']:.3f}")
    return ["compile baseline (gpt-fast): " + "; ".join(cells)]


def sampler_lines(out: dict, result: dict) -> list[str]:
    lines = []
    for name in ("sorted_filters", "sort_free_filters"):
        part = out[name]
        label = name.replace("_", " ")
        if not part["speedup"]:
            lines.append(f"sampler, {label}: torch only on {result['device']}, "
                         f"{part['rows'][0]['step_median_ms']:.3f} ms a step")
            continue
        lines.append(f"sampler, {label}: Triton vs torch (core wall / kernels, step): "
                     + "; ".join(f"{r['case']} {r['core']:.1f}x/{r['core_kernels'] or 0:.1f}x, "
                                 f"{r['step']:.2f}x" for r in part["speedup"]))
    return lines


LINES = {"env": env_lines, "bandwidth": bandwidth_lines, "steps": steps_lines,
         "kernels": kernels_lines, "accuracy": accuracy_lines, "spec": spec_lines,
         "draft_token": draft_lines, "compile_baseline": compile_lines,
         "sampler": sampler_lines}


# -- main --------------------------------------------------------------------


def settings_for(args: argparse.Namespace) -> Settings:
    device = torch.device(args.device)
    if args.tiny:
        return Settings.tiny_run(device, args.compile_backend or "inductor")
    if args.model in RANDOM_MODELS:
        cfg = RANDOM_MODELS[args.model]
    else:
        cfg = ModelConfig.from_dir(Path(args.model))
    s = Settings(device, args.dtype, args.model, cfg, SMOLLM2_135M)
    return replace(s, compile_backend=args.compile_backend) if args.compile_backend else s


def save(out_dir: Path, result: dict) -> None:
    """gpu_check.json and the table so far (a run killed from outside keeps both)."""
    json_path = out_dir / "gpu_check.json"
    tmp = json_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2, default=str) + "\n")
    tmp.replace(json_path)  # a run killed mid-write keeps the previous file whole
    (out_dir / "gpu_check.md").write_text("\n".join(table_lines(result)) + "\n")


def main(argv: list[str] | None = None) -> int:
    start = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for gpu_check.json and .md")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="wall seconds for the whole run, counted from the start of main()")
    ap.add_argument("--model", default="random-1b",
                    help=f"random weights: {', '.join(RANDOM_MODELS)}, or a directory's "
                         "config.json")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny float32 model and few iterations (the CPU smoke test)")
    ap.add_argument("--sections", default=",".join(s.name for s in SECTIONS),
                    help="comma-separated subset, run in the fixed order")
    ap.add_argument("--compile-backend", help="torch.compile backend (default inductor)")
    args = ap.parse_args(argv)
    wanted = [n for n in args.sections.split(",") if n]
    if unknown := set(wanted) - {s.name for s in SECTIONS}:
        ap.error(f"unknown sections {sorted(unknown)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")

    s = settings_for(args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"bench": "gpu_check", "model": s.model, "dtype": s.dtype,
                    "device": s.device.type, "device_name": device_name(s.device),
                    "batches": list(s.batches),
                    "budget_s": args.budget_s, "argv": sys.argv[1:] if argv is None else argv,
                    "started": datetime.now(UTC).isoformat(timespec="seconds"), "sections": {}}
    for name in (x.name for x in SECTIONS if x.name not in wanted):
        result["sections"][name] = {"skipped": "not selected"}
    bench = Bench(s, result)
    spent = time.monotonic() - start
    run_sections([x for x in SECTIONS if x.name in wanted], bench, args.budget_s - spent,
                 lambda r: save(out_dir, r))
    result["sections"] = {x.name: result["sections"][x.name] for x in SECTIONS}
    result["elapsed_s"] = round(time.monotonic() - start, 1)
    save(out_dir, result)
    print((out_dir / "gpu_check.md").read_text(), end="")
    return 1 if has_error(result["sections"]) else 0


def has_error(obj: object) -> bool:
    """Whether a section, or a configuration inside one, recorded an error."""
    if isinstance(obj, dict):
        return "error" in obj or any(has_error(v) for v in obj.values())
    return isinstance(obj, list) and any(has_error(v) for v in obj)


if __name__ == "__main__":
    sys.exit(main())
