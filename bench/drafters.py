"""Drafters end to end: acceptance length and tokens/s per method and K against
plain decoding, on the real split deployment over loopback.

The verifier and one drafter service per method run as separate processes,
started from their command lines (`python -m verifier`, `python -m drafter`)
with fixed thread counts; the benchmark waits for their gRPC health, then
drives the verifier's Generate stream with token ids of the prompt set in
bench/prompts.py (chat template applied), greedy, one stream at a time.
Per prompt, plain decoding (method NONE) and every (method, K) cell run in a
rotating order, so that drift of a shared machine hits them alike. Reported
per cell and per group (copy-heavy prompts, the others):

- acceptance length: 1 + accepted / drafting steps, from the final SpecDecodeStats;
- decode tok/s: tokens after the first / time from the first token to the last
  message (prefill excluded; TTFT apart), and the speedup over plain decoding
  of the same prompts in the same run;
- outputs identical to plain greedy (a float32 divergence is a near tie when
  plain decoding's top-2 logprobs there are within 1e-4).

Pipelined drafting (docs/design.md section 2) is measured apart: draft_model
drafters run inside this process (their hit statistics are only in-process,
DrafterServicer.pipeline_stats), with pipelining on and off, behind another
verifier process.

    .venv/bin/python -m bench.drafters [--quick] [--max-tokens 96] [--ks 2,4,6]
        [--methods ngram,eagle3,eagle3_lookup] [--prompts NAME_OR_CATEGORY,...]
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    raise SystemExit("run as a module from the repository root: python -m bench.drafters")

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.prompts import CATEGORIES, PROMPTS, Prompt
from specdec.launch import free_port, service_flag
from specdec.models.prepare import cache_dir, prepare_default_model
from specdec.pb import common_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
HEAD = ROOT / "drafter/weights/smollm2-135m-eagle3"
# Drafter names of the bench -> their method; eagle3_tree is the EAGLE-3 head alone
# proposing token trees of K tokens (the deployed --tree-width); eagle3_lookup is the
# EAGLE-3 head as compose.yaml deploys it: prompt lookup where the context repeats an
# n-gram, and head chains that end before a draft the head is unsure of
# (drafter/eagle.py).
METHODS = {"ngram": common_pb2.SPEC_METHOD_NGRAM, "eagle3": common_pb2.SPEC_METHOD_EAGLE3,
           "eagle3_tree": common_pb2.SPEC_METHOD_EAGLE3,
           "eagle3_lookup": common_pb2.SPEC_METHOD_EAGLE3,
           "draft_model": common_pb2.SPEC_METHOD_DRAFT_MODEL}
DEPLOYED_EAGLE3_FLAGS = ("--lookup-min", "--min-confidence", "--tree-width")
# Prompt groups of the summary: the two halves of the set, all of it, and open chat alone
# (bench/prompts.py's "chat" category: conversations with no given text to work on).
GROUPS = {"copy_heavy": lambda p: p.copy_heavy, "other": lambda p: not p.copy_heavy,
          "chat": lambda p: p.category == "chat", "all": lambda p: True}
NEAR_TIE = 1e-4  # docs/design.md section 4: float32 verify and decode may differ below this
QUICK_PROMPTS = "code_edit_rename,chat_learn_guitar"
TARGETS = "ngram >= 1.5x plain on copy-heavy prompts; eagle3 acceptance length >= 1.8 at K=4 " \
          "and, at its best K, faster than plain on the chat prompts (each for eagle3, " \
          "eagle3_tree and eagle3_lookup; also reported on the chat/other half and all prompts)"


# -- services ----------------------------------------------------------------


class Process:
    """A service started from its command line, its output in a log file."""

    def __init__(self, name: str, argv: list[str], threads: int, log_dir: Path):
        self.name = name
        self.log = log_dir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def wait_healthy(self, address: str, timeout_s: float) -> None:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + timeout_s
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not healthy after {timeout_s} s:\n{self.tail()}")
                time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Deployment:
    """A verifier process and its drafters (processes, or addresses served elsewhere)."""

    def __init__(self, args: argparse.Namespace, target: Path, drafter_argv: dict[str, list[str]],
                 external: dict[str, str] | None = None, deadline_ms: float | None = None):
        self.log_dir = Path(tempfile.mkdtemp(prefix="specdec-bench-drafters-"))
        self.processes: list[Process] = []
        addresses = dict(external or {})
        drafters: dict[str, Process] = {}
        try:
            for name, argv in drafter_argv.items():
                port = free_port()
                drafters[name] = Process(f"drafter-{name}",
                                         ["-m", "drafter", *argv, "--port", str(port)],
                                         args.drafter_threads, self.log_dir)
                self.processes.append(drafters[name])
                addresses[name] = f"127.0.0.1:{port}"
            port = free_port()
            argv = ["-m", "verifier", "--model", str(target), "--port", str(port),
                    "--threads", str(args.verifier_threads), "--dtype", "float32",
                    "--max-num-seqs", "4", "--max-model-len", "4096",
                    "--max-num-speculative-tokens", "8",
                    "--draft-deadline-ms", str(deadline_ms or args.draft_deadline_ms)]
            for name, address in addresses.items():
                argv += ["--drafter", f"{name}={address}"]
            self.verifier = Process("verifier", argv, args.verifier_threads, self.log_dir)
            self.processes.append(self.verifier)
            for name, p in drafters.items():
                p.wait_healthy(addresses[name], 300)
            self.address = f"127.0.0.1:{port}"
            self.verifier.wait_healthy(self.address, 300)
            self.channel = grpc.insecure_channel(self.address)
            self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
            self._wait_drafters(set(addresses), 120)
        except BaseException:
            self.close()
            raise

    def _wait_drafters(self, names: set[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            report = self.stub.Load(verifier_pb2.LoadRequest(), timeout=5)
            if names <= {d.name for d in report.drafters if d.available}:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"drafters not available: {report.drafters}\n{self.verifier.tail()}")
            time.sleep(0.3)

    def close(self) -> None:
        if hasattr(self, "channel"):
            self.channel.close()
        for p in reversed(self.processes):  # the verifier first: it closes drafter streams
            p.stop()
        shutil.rmtree(self.log_dir, ignore_errors=True)


class LoopThread:
    """An asyncio loop on a thread, hosting in-process drafter servers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 120.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


# -- one request ---------------------------------------------------------------


@dataclass(slots=True)
class Run:
    prompt: str
    method: str  # "plain" or a drafter name
    k: int
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = 0.0  # Start sent -> first token (prefill)
    decode_s: float = 0.0  # first token -> final message
    decode_tokens: int = 0  # tokens after the first message's
    decode_steps: int = 0
    draft_wait_ms: float = 0.0  # summed over decode steps
    step_ms: float = 0.0  # the verifier's step times (draft wait included), summed likewise
    # Steps the verifier ran without drafts, reason DEADLINE: `late` waited out the
    # deadline; `empty` did not (the step right after a late one, which does not ask the
    # drafter; verifiers before commit a697400 also gave this reason to a drafter that
    # answered in time with no draft, e.g. no n-gram match).
    late: int = 0
    empty: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    acceptance_length: float = 0.0
    finish_reason: str = ""

    def record(self) -> dict:
        d = {f: getattr(self, f) for f in self.__slots__ if f != "tokens"}
        d["num_tokens"] = len(self.tokens)
        return d


def generate(stub, prompt_ids: list[int], max_tokens: int, method: str, k: int, *,
             drafter: str = "", ignore_eos: bool = False, logprobs: int = 0,
             deadline_ms: float = 100.0, timeout_s: float = 600) -> tuple[Run, list]:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                         ignore_eos=ignore_eos, logprobs=logprobs)
    spec = (common_pb2.SpeculationPolicy(method=common_pb2.SPEC_METHOD_NONE) if method == "plain"
            else common_pb2.SpeculationPolicy(method=METHODS[method], drafter=drafter or method,
                                              num_speculative_tokens=k))
    msg = verifier_pb2.GenerateRequest(start=verifier_pb2.GenerateRequest.Start(
        prompt_token_ids=prompt_ids, sampling=sampling, speculation=spec))
    run, lps = Run("", method, k), []
    t_first = t_last = None
    last = None
    t0 = time.perf_counter()
    for resp in stub.Generate(iter([msg]), timeout=timeout_s):
        t_last = time.perf_counter()
        if t_first is None and resp.token_ids:
            t_first = t_last
        elif t_first is not None:
            run.decode_tokens += len(resp.token_ids)
            run.decode_steps += bool(resp.token_ids)
            run.draft_wait_ms += resp.step_stats.draft_wait_ms
            run.step_ms += resp.step_stats.step_time_ms
        if resp.step_stats.disabled_reason == common_pb2.DISABLED_REASON_DEADLINE:
            if resp.step_stats.draft_wait_ms >= 0.9 * deadline_ms:
                run.late += 1
            else:
                run.empty += 1
        run.tokens.extend(resp.token_ids)
        lps.extend(resp.logprobs)
        last = resp
    run.ttft_s = (t_first or t_last) - t0
    run.decode_s = t_last - (t_first or t_last)
    s = last.spec_decode
    run.num_drafts, run.num_draft_tokens = s.num_drafts, s.num_draft_tokens
    run.num_accepted, run.acceptance_length = s.num_accepted_tokens, s.acceptance_length
    run.finish_reason = common_pb2.FinishReason.Name(last.finish_reason)
    return run, lps


def near_tie_gap(stub, prompt_ids: list[int], max_tokens: int, ignore_eos: bool,
                 position: int) -> float | None:
    """Plain decoding's top-1 minus top-2 logprob at `position` (None past its end)."""
    _, lps = generate(stub, prompt_ids, max_tokens, "plain", 0, ignore_eos=ignore_eos, logprobs=2)
    if position >= len(lps) or len(lps[position].top_logprobs) < 2:
        return None
    top = lps[position].top_logprobs
    return top[0].logprob - top[1].logprob


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# -- the sweep -------------------------------------------------------------------


def sweep(stub, prompts: list[Prompt], ids: dict[str, list[int]], cells: list[tuple[str, int]],
          args: argparse.Namespace, tok: Tokenizer) -> list[dict]:
    """Every prompt through plain decoding and every cell, in rotating order; runs as
    dicts, each spec run checked against the same prompt's plain output."""
    drafter_names: dict[str, str] = {}  # the drafter of each method is named after it
    order = [("plain", 0), *cells]
    # Warm-up (untimed): first requests pay for lazy initialisation on both sides.
    warm = ids[min(ids, key=lambda n: len(ids[n]))]
    for method, k in order:
        generate(stub, warm, 8, method, k, drafter=drafter_names.get(method, ""))
    records: list[dict] = []
    for i, p in enumerate(prompts):
        runs: dict[tuple[str, int], Run] = {}
        for method, k in order[i % len(order):] + order[:i % len(order)]:
            for _ in range(args.repeats):
                run, _ = generate(stub, ids[p.name], args.max_tokens, method, k,
                                  drafter=drafter_names.get(method, ""), ignore_eos=args.ignore_eos,
                                  deadline_ms=args.draft_deadline_ms)
                run.prompt = p.name
                prev = runs.get((method, k))
                if prev is None or run.decode_s < prev.decode_s:  # best of repeats
                    runs[(method, k)] = run
        plain = runs[("plain", 0)]
        for run in runs.values():
            rec = run.record()
            rec["copy_heavy"] = p.copy_heavy
            rec["identical"] = run.tokens == plain.tokens
            if run is plain:
                rec["text"] = tok.decode(run.tokens)[:300]  # to see what the prompt yields
            if not rec["identical"]:
                j = first_difference(run.tokens, plain.tokens)
                gap = near_tie_gap(stub, ids[p.name], args.max_tokens, args.ignore_eos, j)
                rec["divergence"] = {"position": j, "plain_top2_gap": gap,
                                     "near_tie": gap is not None and gap < NEAR_TIE}
            records.append(rec)
        print(f"  {p.name}: plain {plain.decode_tokens / max(plain.decode_s, 1e-9):.1f} tok/s; "
              + ", ".join(f"{m} K{k} AL {r.acceptance_length:.2f} "
                          f"{r.decode_s and plain.decode_s / r.decode_s:.2f}x"
                          for (m, k), r in runs.items() if m != "plain"), flush=True)
    return records


def aggregate(runs: list[dict]) -> dict:
    tokens = sum(r["decode_tokens"] for r in runs)
    seconds = sum(r["decode_s"] for r in runs)
    drafts = sum(r["num_drafts"] for r in runs)
    steps = sum(r["decode_steps"] for r in runs)
    return {
        "prompts": len(runs),
        "decode_tok_s": tokens / seconds if seconds else 0.0,
        "e2e_tok_s": sum(r["num_tokens"] for r in runs) / max(sum(r["ttft_s"] + r["decode_s"]
                                                                  for r in runs), 1e-9),
        "ttft_ms_mean": 1e3 * statistics.mean(r["ttft_s"] for r in runs),
        "acceptance_length": 1 + sum(r["num_accepted"] for r in runs) / drafts if drafts else 0.0,
        "mean_draft_len": sum(r["num_draft_tokens"] for r in runs) / drafts if drafts else 0.0,
        "drafting_step_share": drafts / max(steps + len(runs), 1),
        "draft_wait_ms_per_step": sum(r["draft_wait_ms"] for r in runs) / steps if steps else 0.0,
        # The verifier's step against the client's time per step: the difference is what
        # passes between steps (the service's loop, the wire to the client).
        "step_ms_per_step": sum(r["step_ms"] for r in runs) / steps if steps else 0.0,
        "wall_ms_per_step": 1e3 * seconds / steps if steps else 0.0,
        "late_steps": sum(r["late"] for r in runs),
        "empty_steps": sum(r["empty"] for r in runs),
        "identical": sum(r.get("identical", True) for r in runs),
        "near_ties": sum(r.get("divergence", {}).get("near_tie", False) for r in runs),
    }


def summarise(records: list[dict], prompts: list[Prompt], cells: list[tuple[str, int]]) -> list[dict]:
    out = []
    for method, k in [("plain", 0), *cells]:
        row = {"method": method, "k": k, "groups": {}}
        for group, member in GROUPS.items():
            names = {p.name for p in prompts if member(p)}
            runs = [r for r in records if (r["method"], r["k"]) == (method, k) and r["prompt"] in names]
            plain = [r for r in records if r["method"] == "plain" and r["prompt"] in names]
            if not runs:
                continue
            agg = aggregate(runs)
            base = aggregate(plain)["decode_tok_s"]
            agg["speedup"] = agg["decode_tok_s"] / base if base else 0.0
            # Per prompt, the same prompt's plain run over this one: robust to one slow run.
            rates = {r["prompt"]: r["decode_tokens"] / r["decode_s"] for r in plain + runs
                     if r["method"] == "plain" and r["decode_s"] > 0}
            paired = [r["decode_tokens"] / r["decode_s"] / rates[r["prompt"]] for r in runs
                      if r["decode_s"] > 0 and r["prompt"] in rates]
            agg["speedup_median_per_prompt"] = statistics.median(paired) if paired else 0.0
            row["groups"][group] = agg
        row["categories"] = {}
        for category in [c for c in CATEGORIES if any(p.category == c for p in prompts)]:
            names = {p.name for p in prompts if p.category == category}
            runs = [r for r in records if (r["method"], r["k"]) == (method, k)
                    and r["prompt"] in names]
            if runs:
                agg = aggregate(runs)
                row["categories"][category] = {"prompts": agg["prompts"],
                                               "acceptance_length": agg["acceptance_length"]}
        out.append(row)
    return out


# -- pipelining --------------------------------------------------------------------


def truncated_copy(target: Path, layers: int) -> Path:
    """The target's first `layers` decoder layers + final norm + (tied) lm_head, as a
    model directory under the cache (made once). Tokenizer files are left out: the
    draft method then takes the target's."""
    from safetensors.torch import load_file, save_file

    config = json.loads((target / "config.json").read_text())
    if not 1 <= layers <= config["num_hidden_layers"]:
        raise ValueError(f"--draft-layers {layers}: the target has {config['num_hidden_layers']}")
    dest = cache_dir() / "bench" / f"{target.name}-first{layers}layers"
    if (dest / "model.safetensors").exists():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    keep = {k: v for k, v in load_file(target / "model.safetensors").items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, tmp / "model.safetensors")
    config["num_hidden_layers"] = layers
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tmp.rename(dest)
    return dest


def pipelining(args: argparse.Namespace, target: Path, prompts: list[Prompt],
               ids: dict[str, list[int]]) -> dict:
    """draft_model drafters in this process, pipelining on and off, for each draft:
    the truncated target (a poor draft) and the target itself (an oracle, so bets
    mostly hit: the upper bound of what pipelining takes off the critical path)."""
    from drafter.draft_model import DraftModelMethod
    from drafter.service import serve
    from specdec.models import load_model

    torch.set_num_threads(args.drafter_threads)
    drafts = {"truncated": truncated_copy(target, args.draft_layers), "oracle": target}
    loop = LoopThread()
    services, methods = {}, {}
    deployment = None
    try:
        for label, d in drafts.items():
            model = load_model(d, dtype="float32")
            for pipe in (True, False):
                name = f"{label}_{'pipe' if pipe else 'sync'}"
                methods[name] = DraftModelMethod(model=model, target_dir=target, pipeline=pipe)
                services[name] = loop.run(serve(methods[name], "127.0.0.1:0"))
        deployment = Deployment(args, target, {},
                                {n: f"127.0.0.1:{s.port}" for n, s in services.items()},
                                deadline_ms=args.pipeline_deadline_ms)
        stub = deployment.stub
        result = {"draft_layers": args.draft_layers, "deadline_ms": args.pipeline_deadline_ms,
                  "prompts": [p.name for p in prompts], "max_tokens": args.pipeline_max_tokens,
                  "rows": []}
        for label in drafts:
            for k in args.pipeline_ks:
                pipe, sync = f"{label}_pipe", f"{label}_sync"
                stats = services[pipe].servicer.pipeline_stats
                generate(stub, ids[prompts[0].name], 8, "draft_model", k, drafter=pipe)  # warm-up
                generate(stub, ids[prompts[0].name], 8, "draft_model", k, drafter=sync)
                before = (stats.hits, stats.misses, stats.predraft_ms, stats.saved_ms)
                runs: dict[str, list[Run]] = {pipe: [], sync: []}
                for i, p in enumerate(prompts):
                    for name in ((pipe, sync) if i % 2 == 0 else (sync, pipe)):
                        run, _ = generate(stub, ids[p.name], args.pipeline_max_tokens, "draft_model",
                                          k, drafter=name, ignore_eos=args.ignore_eos,
                                          deadline_ms=args.pipeline_deadline_ms)
                        runs[name].append(run)
                hits, misses, predraft_ms, saved_ms = (
                    a - b for a, b in zip((stats.hits, stats.misses, stats.predraft_ms,
                                           stats.saved_ms), before, strict=True))
                steps = {n: sum(r.decode_steps for r in rs) for n, rs in runs.items()}
                row = {
                    "draft": label, "k": k, "hits": hits, "misses": misses,
                    "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                    "predraft_ms_per_step": predraft_ms / max(steps[pipe], 1),
                    "saved_ms_per_step": saved_ms / max(steps[pipe], 1),
                    "identical": sum(a.tokens == b.tokens for a, b in zip(runs[pipe], runs[sync],
                                                                  strict=True)),
                }
                for mode, name in (("pipelined", pipe), ("sync", sync)):
                    rs = runs[name]
                    row[mode] = {
                        "draft_wait_ms_per_step": sum(r.draft_wait_ms for r in rs) / max(steps[name], 1),
                        "decode_tok_s": sum(r.decode_tokens for r in rs)
                        / max(sum(r.decode_s for r in rs), 1e-9),
                        "acceptance_length": 1 + sum(r.num_accepted for r in rs)
                        / max(sum(r.num_drafts for r in rs), 1),
                        "late_steps": sum(r.late for r in rs),
                    }
                # What the verifier stopped waiting for: the critical path really shortened.
                row["wait_reduction_ms_per_step"] = (row["sync"]["draft_wait_ms_per_step"]
                                                     - row["pipelined"]["draft_wait_ms_per_step"])
                result["rows"].append(row)
                print(f"  pipelining {label} K{k}: hit rate {row['hit_rate']:.2f}, "
                      f"saved {row['saved_ms_per_step']:.1f} ms/step, draft wait "
                      f"{row['pipelined']['draft_wait_ms_per_step']:.1f} vs "
                      f"{row['sync']['draft_wait_ms_per_step']:.1f} ms/step", flush=True)
        return result
    finally:
        if deployment is not None:
            deployment.close()
        for s in services.values():
            loop.run(s.stop(1.0))
        loop.close()


# -- report ------------------------------------------------------------------------


def targets(summary: list[dict]) -> list[dict]:
    def cell(method, k):
        return next((r for r in summary if (r["method"], r["k"]) == (method, k)), None)

    def best(method, group):
        rows = [r for r in summary if r["method"] == method and group in r["groups"]]
        return max(rows, key=lambda r: r["groups"][group]["speedup"], default=None)

    out = []
    b = best("ngram", "copy_heavy")
    if b:
        s = b["groups"]["copy_heavy"]["speedup"]
        out.append({"target": "ngram >= 1.5x plain on copy-heavy prompts (best K)",
                    "k": b["k"], "value": s, "met": s >= 1.5})
    for method in ("eagle3", "eagle3_tree", "eagle3_lookup"):
        c = cell(method, 4)
        if c:
            for group in ("chat", "other", "all"):
                if group in c["groups"]:
                    al = c["groups"][group]["acceptance_length"]
                    out.append({"target": f"{method} acceptance length >= 1.8 at K=4 ({group} "
                                          "prompts)", "k": 4, "value": al, "met": al >= 1.8})
        for group, label in (("chat", "chat"), ("other", "chat/other")):
            b = best(method, group)
            if b:
                s = b["groups"][group]["speedup"]
                out.append({"target": f"{method} at its best K faster than plain on {label} "
                                      "prompts", "k": b["k"], "value": s, "met": s > 1.0})
    return out


def render(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"Drafters end to end: {result['model']} float32, split deployment on loopback "
        f"(verifier {cfg['verifier_threads']} thread, each drafter {cfg['drafter_threads']} "
        f"thread, own processes), {result['device_name']} x{result['cpus']}, torch "
        f"{result['torch']}; greedy, single stream, up to {cfg['max_tokens']} tokens, "
        f"draft deadline {cfg['draft_deadline_ms']:.0f} ms; {cfg['num_prompts']} prompts "
        f"({cfg['num_copy_heavy']} copy-heavy); load average {result['load_average_1min'][0]} -> "
        f"{result['load_average_1min'][1]}.",
        "",
        "AL = acceptance length; tok/s = decode tokens/s (prefill excluded); x = speedup over "
        "plain decoding of the same prompts in the same run; wait = draft wait per decode step; "
        "step / wall = the verifier's step time (wait included) / the client's time per decode step.",
        "",
        "| method | K | copy-heavy AL | tok/s | x | chat/other AL | tok/s | x | all AL | x "
        "| identical | TTFT ms | wait ms | step / wall ms | late / empty steps |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["summary"]:
        g = row["groups"]
        cells = []
        for group in ("copy_heavy", "other"):
            a = g.get(group)
            cells.append("| | " if a is None else
                         (f"{a['acceptance_length']:.2f} | " if row["method"] != "plain" else "- | ")
                         + (f"{a['decode_tok_s']:.1f} | {a['speedup']:.2f}x" if a else ""))
        a = g["all"]
        al = f"{a['acceptance_length']:.2f}" if row["method"] != "plain" else "-"
        ident = f"{a['identical']}/{a['prompts']}" + (f" ({a['near_ties']} near ties)"
                                                      if a["near_ties"] else "")
        lines.append(f"| {row['method']} | {row['k'] or '-'} | {cells[0]} | {cells[1]} | {al} | "
                     f"{a['speedup']:.2f}x | {ident} | {a['ttft_ms_mean']:.0f} | "
                     f"{a['draft_wait_ms_per_step']:.1f} | {a['step_ms_per_step']:.1f} / "
                     f"{a['wall_ms_per_step']:.1f} | {a['late_steps']} / {a['empty_steps']} |")
    speculative = [row for row in result["summary"] if row.get("categories")
                   and row["method"] != "plain"]
    if speculative:
        categories = list(speculative[0]["categories"])
        lines += ["", "Acceptance length by prompt category (bench/prompts.py; prompts in "
                  "brackets):", "",
                  "| method | K | " + " | ".join(
                      f"{c} ({speculative[0]['categories'][c]['prompts']})" for c in categories)
                  + " |", "|---|---|" + "---|" * len(categories)]
        for row in speculative:
            lines.append(f"| {row['method']} | {row['k']} | " + " | ".join(
                f"{row['categories'][c]['acceptance_length']:.2f}" if c in row["categories"]
                else "" for c in categories) + " |")
    lines += ["", "Targets:", ""]
    for t in result["targets"]:
        lines.append(f"- {t['target']}: {t['value']:.2f} at K={t['k']} -> "
                     + ("met" if t["met"] else "NOT met"))
    pipe = result.get("pipelining")
    if pipe:
        lines += [
            "", f"Pipelined drafting (draft_model drafters in the benchmark process, 1 thread; "
            f"'truncated' = the target's first {pipe['draft_layers']} of 30 layers, 'oracle' = "
            f"the target as its own draft; {len(pipe['prompts'])} prompts, up to "
            f"{pipe['max_tokens']} tokens, draft deadline {pipe['deadline_ms']:.0f} ms; "
            "saved = the drafter's count of draft time its hits did ahead; wait cut = the "
            "verifier's draft wait per step, pipelining off minus on, i.e. what really left the "
            "critical path):", "",
            "| draft | K | hit rate | hits / bets | saved ms/step | predraft ms/step | wait cut "
            "ms/step | draft wait ms/step on vs off | tok/s on vs off | AL | identical |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in pipe["rows"]:
            on, off = r["pipelined"], r["sync"]
            lines.append(f"| {r['draft']} | {r['k']} | {r['hit_rate']:.2f} | {r['hits']} / "
                         f"{r['hits'] + r['misses']} | {r['saved_ms_per_step']:.1f} | "
                         f"{r['predraft_ms_per_step']:.1f} | {r['wait_reduction_ms_per_step']:.1f} | "
                         f"{on['draft_wait_ms_per_step']:.1f} vs "
                         f"{off['draft_wait_ms_per_step']:.1f} | {on['decode_tok_s']:.1f} vs "
                         f"{off['decode_tok_s']:.1f} | {on['acceptance_length']:.2f} | "
                         f"{r['identical']}/{len(pipe['prompts'])} |")
    lines += ["", "Notes:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def device_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def select_prompts(spec: str | None) -> list[Prompt]:
    if not spec:
        return list(PROMPTS)
    wanted = spec.split(",")
    chosen = [p for p in PROMPTS if p.name in wanted or p.category in wanted]
    unknown = set(wanted) - {p.name for p in chosen} - {p.category for p in chosen}
    if unknown:
        raise SystemExit(f"--prompts: unknown names or categories: {', '.join(sorted(unknown))}")
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target directory (default: the prepared default model)")
    ap.add_argument("--head", type=Path, default=HEAD, help="EAGLE-3 head directory")
    ap.add_argument("--methods", default="ngram,eagle3,eagle3_lookup",
                    help="drafters to run (ngram, eagle3, eagle3_tree = eagle3 proposing token "
                         "trees, eagle3_lookup = eagle3 as deployed, draft_model = a truncated "
                         "target)")
    ap.add_argument("--ks", default="2,4,6")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", help="prompt names or categories, comma-separated (default: all)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per cell and prompt; the fastest counts")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    ap.add_argument("--verifier-threads", type=int, default=1)
    ap.add_argument("--drafter-threads", type=int, default=1)
    ap.add_argument("--draft-deadline-ms", type=float, default=100.0,
                    help="the verifier's draft deadline (its default)")
    ap.add_argument("--draft-layers", type=int, default=6,
                    help="layers of the truncated target used as draft model")
    ap.add_argument("--pipeline-prompts", default="bug_fix_off_by_one,chat_learn_guitar")
    ap.add_argument("--pipeline-ks", default="2,4")
    ap.add_argument("--pipeline-max-tokens", type=int, default=48)
    ap.add_argument("--pipeline-deadline-ms", type=float, default=1000.0,
                    help="draft deadline for the pipelining runs: the oracle draft is as slow "
                         "as the target, and a late proposal would hide what pipelining saves")
    ap.add_argument("--no-pipelining", action="store_true", help="skip the pipelining measurement")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 prompts, K 2 and 4, 24 tokens; writes nothing unless --out")
    ap.add_argument("--out", type=Path, help="JSON path (default: bench/results/drafters.json; "
                                             "the table goes next to it as .md)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.ks, args.max_tokens = args.prompts or QUICK_PROMPTS, "2,4", 24
        args.pipeline_prompts, args.pipeline_ks, args.pipeline_max_tokens = QUICK_PROMPTS, "2", 16
    methods = [m for m in args.methods.split(",") if m]
    if unknown := [m for m in methods if m not in METHODS]:
        ap.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    ks = [int(k) for k in args.ks.split(",")]
    args.pipeline_ks = [int(k) for k in args.pipeline_ks.split(",")]
    prompts = select_prompts(args.prompts)
    pipeline_prompts = select_prompts(args.pipeline_prompts)

    target = Path(args.model) if args.model else prepare_default_model()
    tok = Tokenizer.from_dir(target)
    ids = {p.name: tok.apply_chat_template(list(p.messages)) for p in PROMPTS}
    deployed = [x for flag in DEPLOYED_EAGLE3_FLAGS for x in (flag, service_flag("eagle3", flag))]
    tree_width = service_flag("eagle3", "--tree-width")
    drafter_argv = {
        "ngram": ["--method", "ngram", "--target", str(target)],
        "eagle3": ["--method", "eagle3", "--model", str(args.head), "--target", str(target)],
        "eagle3_tree": ["--method", "eagle3", "--model", str(args.head), "--target", str(target),
                        "--tree-width", tree_width],
        "eagle3_lookup": ["--method", "eagle3", "--model", str(args.head), "--target",
                          str(target), *deployed],
    }
    if "draft_model" in methods:
        drafter_argv["draft_model"] = ["--method", "draft_model", "--target", str(target), "--model",
                                       str(truncated_copy(target, args.draft_layers))]
    drafter_argv = {m: a for m, a in drafter_argv.items() if m in methods}
    cells = [(m, k) for m in methods for k in ks]

    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    print(f"starting verifier + drafters ({', '.join(methods)}) ...", flush=True)
    deployment = Deployment(args, target, drafter_argv)
    try:
        print(f"serving; {len(prompts)} prompts x {1 + len(cells)} cells", flush=True)
        records = sweep(deployment.stub, prompts, ids, cells, args, tok)
    finally:
        deployment.close()
    pipe = None
    if not args.no_pipelining:
        print("pipelining: draft_model drafters in process ...", flush=True)
        pipe = pipelining(args, target, pipeline_prompts, ids)

    summary = summarise(records, prompts, cells)
    notes = [
        "Plain decoding is the same verifier with method NONE (1 thread); speculation adds a "
        "drafter process with its own thread (and core), as the split deployment gives a "
        "drafter its own device. Both cores are shared with other work on this machine.",
        "Outputs stop at EOS or the token limit (same for every method, since greedy output "
        "is the same); speedup compares decode time of the same tokens.",
        "draft_model is left out of the main table by default: no smaller SmolLM2 exists "
        "offline, and a layer-truncated target is a poor draft (docs/design.md section 6); "
        "`--methods draft_model` adds one (the first --draft-layers layers). It is used below "
        "for pipelining, the only method that supports it.",
        "'late / empty steps': steps run without drafts that the verifier labels DEADLINE; "
        "late ones waited out the deadline, empty ones did not (verifiers before commit "
        "a697400 also report a drafter that answers in time with no draft, e.g. no n-gram "
        "match, as DEADLINE).",
        f"eagle3_lookup is eagle3 as compose.yaml deploys it: `{' '.join(deployed)}` (prompt "
        "lookup where the context repeats an n-gram, the head elsewhere; head chains end "
        "before a draft it is less sure of; token trees where the head drafts alone).",
        "eagle3 does not pipeline (DrafterInfo.supports_pipelining is false): its next block "
        "needs the target's hidden states of the accepted tokens, which a bet does not have.",
        f"eagle3_tree is the head alone with `--tree-width {tree_width}` (as deployed): greedy "
        "requests get token trees of K tokens (the head's chain plus its next choices at each "
        "depth, the K with the highest path probability), verified in one forward of K + 1 tokens under "
        "tree attention; K counts every tree token, so a tree costs what a chain of K costs.",
    ]
    result = {
        "bench": "drafters",
        "model": target.name,
        "head": args.head.name,
        "device_name": device_name(),
        "machine": platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - t0, 1),
        "load_average_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "config": {
            "methods": methods, "ks": ks, "max_tokens": args.max_tokens,
            "repeats": args.repeats, "ignore_eos": args.ignore_eos, "dtype": "float32",
            "verifier_threads": args.verifier_threads, "drafter_threads": args.drafter_threads,
            "draft_deadline_ms": args.draft_deadline_ms,
            "num_prompts": len(prompts), "num_copy_heavy": sum(p.copy_heavy for p in prompts),
            "prompts": [p.name for p in prompts],
            "prompt_tokens": {p.name: len(ids[p.name]) for p in prompts},
            "order": "per prompt: plain and every (method, K) in an order rotated by one per prompt",
        },
        "summary": summary,
        "targets": targets(summary),
        "pipelining": pipe,
        "notes": notes,
        "runs": records,
    }
    table = render(result)
    print()
    print(table, end="")
    out = args.out or (None if args.quick else RESULTS / "drafters.json")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text(table)
        print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
