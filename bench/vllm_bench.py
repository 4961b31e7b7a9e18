"""`make run` against `vllm serve` under `vllm bench serve`, the load generator vLLM's
users compare servers with: its random and prefix-repetition datasets and our chat
prompts as its custom dataset, --backend openai-chat, C requests in flight, greedy.

Fair by construction (bench/fair.py): a run on a busy machine refuses to record; vLLM
runs at the fastest CPU thread binding this run measures (or the environment's);
servers alternate repeat by repeat (ABBA...), a fresh server each turn; and the
ratios pair configuration with configuration (plain with plain, ngram K=4 with its
ngram K=4, our default's dynamic K with its dynamic SD).

What `vllm bench serve` does not measure is kept here: whether each reply equals ours
without speculation (its --save-detailed texts), and the acceptance it reads from
each server's `vllm:spec_decode_*` metrics, which ours exports under vLLM's names.
bench.serving keeps the per-step breakdown and the in-process engine.

    .venv/bin/python -m bench.vllm_bench [--quick] [--repeats N] [--out PATH]

writes bench/results/vllm_bench.json (every run's `vllm bench serve` result, less its
per-request lists) and its .md table.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    raise SystemExit("run as a module from the repository root: python -m bench.vllm_bench")

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from bench import fair, serving
from bench.drafters import device_name
from bench.peers import PEERS_PYTHON, vllm_unavailable
from specdec.launch import vllm_environ
from specdec.models.prepare import cache_dir, prepare_default_model

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
# Ours: configuration -> what --extra-body adds to every request (ours takes the policy
# per request: one stack serves them all).
OURS = {"plain": {"speculative": {"method": "none"}},
        "ngram K=4": {"speculative": {"method": "ngram", "num_speculative_tokens": 4}},
        "default": {}}
# vLLM's: configuration -> its --speculative-config (a server each).
VLLM = {n: serving.VLLM[n] for n in ("plain", "ngram K=4", "ngram dynamic")}
DEFAULT_CONFIGS = {"ours": ["plain", "default"], "vllm": ["plain", "ngram dynamic"]}
PREFIXES = 4  # prefix repetition: distinct shared prefixes


def datasets(max_tokens: int, chat: Path) -> dict[str, list[str]]:
    """Dataset -> its `vllm bench serve` arguments."""
    return {
        "random": ["--dataset-name", "random", "--random-input-len", "256",
                   "--random-output-len", str(max_tokens)],
        "prefix repetition": ["--dataset-name", "prefix_repetition",
                              "--prefix-repetition-prefix-len", "256",
                              "--prefix-repetition-suffix-len", "64",
                              "--prefix-repetition-num-prefixes", str(PREFIXES),
                              "--prefix-repetition-output-len", str(max_tokens), "--ignore-eos"],
        # Replies end where the model ends them, as users' do.
        "chat": ["--dataset-name", "custom", "--dataset-path", str(chat), "--skip-chat-template",
                 "--disable-shuffle", "--custom-output-len", str(max_tokens)],
    }


def chat_dataset(path: Path, requests: int) -> Path:
    """Our chat prompts of one user turn as `vllm bench serve`'s custom dataset (one
    {"prompt": ...} a line; it sends each as one user message), cycled to `requests`
    lines so that none is drawn twice at random."""
    prompts = [p for p in serving.prompts_by_name() if len(p.messages) == 1]
    lines = [json.dumps({"prompt": prompts[i % len(prompts)].messages[0]["content"]})
             for i in range(requests)]
    path.write_text("\n".join(lines) + "\n")
    return path


def num_prompts(dataset: str, c: int, requests: int) -> int:
    """At least `requests` and three waves of C; prefix repetition draws a whole number of
    requests per prefix."""
    n = max(requests, serving.WAVES * c)
    return -(-n // PREFIXES) * PREFIXES if dataset == "prefix repetition" else n


def bench_argv(base: str, tokenizer: Path, dataset_args: list[str], n: int, c: int,
               extra: dict, result: Path) -> list[str]:
    """`vllm bench serve`'s arguments for one cell."""
    argv = ["--backend", "openai-chat", "--base-url", base, "--endpoint", "/v1/chat/completions",
            "--tokenizer", str(tokenizer), *dataset_args, "--num-prompts", str(n),
            "--max-concurrency", str(c), "--request-rate", "inf", "--temperature", "0",
            "--num-warmups", "1", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--save-result", "--save-detailed",
            "--result-dir", str(result.parent), "--result-filename", result.name,
            "--disable-tqdm"]
    if extra:
        argv += ["--extra-body", json.dumps(extra)]
    return argv


def run_bench(python: Path, cells: list[tuple[dict, list[str]]], work: Path, log: Path,
              timeout_s: float) -> list[dict]:
    """Every cell's `vllm bench serve` in one process on vLLM's interpreter: each cell's
    description with its result JSON (None where the run wrote none)."""
    runs = work / "runs.json"
    runs.write_text(json.dumps([argv for _, argv in cells]))
    env = {**vllm_environ(python), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    with log.open("a") as out:
        subprocess.run([str(python), "-m", "bench.vllm_cli", str(runs)], cwd=ROOT, env=env,
                       stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    got = []
    for cell, argv in cells:
        if cell["config"] == "warm-up":
            continue
        path = Path(argv[argv.index("--result-dir") + 1]) / argv[argv.index("--result-filename") + 1]
        got.append({**cell, "result": json.loads(path.read_text()) if path.exists() else None})
    return got


# A warm-up pass before each dataset and C: the same requests, one token each.
WARM = {"max_completion_tokens": 1}


def session_cells(system: str, configs: dict[str, dict], args, base: str, model_dir: Path,
                  work: Path, rep: int) -> list[tuple[dict, list[str]]]:
    """One server's cells: every dataset x C x configuration, the configurations' order
    rotating per repeat. Each dataset and C starts with the same requests cut to one
    token (WARM, unmeasured): a server's prefix cache then holds the prompts before any
    configuration is measured, where the first configuration to run would otherwise
    pay every prompt's prefill and the others find it cached."""
    cells = []
    names = list(configs)
    for dataset, dargs in datasets(args.max_tokens, work / "chat.jsonl").items():
        for c in args.concurrency:
            n = num_prompts(dataset, c, args.requests)
            shift = rep % len(names)
            for config in ["warm-up", *names[shift:], *names[:shift]]:
                name = f"{system}-{config}-{dataset}-{c}-{rep}".replace(" ", "_")
                cell = {"system": system, "config": config, "dataset": dataset,
                        "concurrency": c, "repeat": rep}
                extra = WARM if config == "warm-up" else configs[config]
                argv = bench_argv(base, model_dir, dargs, n, c, extra, work / f"{name}.json")
                cell["command"] = "vllm bench serve " + " ".join(
                    a if not a.startswith(str(work)) else Path(a).name for a in argv)
                cells.append((cell, argv))
    return cells


def run_ours(args, model_dir: Path, work: Path, log_dir: Path, rep: int) -> list[dict]:
    configs = {n: OURS[n] for n in args.configs["ours"]}
    methods = {e["speculative"]["method"] for e in configs.values() if e}
    with serving.our_stack("ours", model_dir, log_dir, methods) as (base, _, _, startup):
        print(f"ours: serving after {startup:.0f} s", flush=True)
        cells = session_cells("ours", configs, args, base.removesuffix("/v1"), model_dir,
                              work, rep)
        return run_bench(args.python, cells, work, log_dir / "vllm-bench.log",
                         args.timeout_s)


def run_vllm(args, model_dir: Path, work: Path, log_dir: Path, rep: int) -> list[dict]:
    got = []
    for config in args.configs["vllm"]:
        log = log_dir / f"vllm-{config.replace(' ', '').replace('=', '')}.log"
        with serving.vllm_server(args.python, model_dir, log, VLLM[config], args.timeout_s,
                                 args.vllm_binding) as (base, _, startup):
            print(f"vllm {config}: serving after {startup:.0f} s", flush=True)
            cells = session_cells("vllm", {config: {}}, args, base.removesuffix("/v1"),
                                  model_dir, work, rep)
            got += run_bench(args.python, cells, work, log_dir / "vllm-bench.log",
                             args.timeout_s)
    return got


# -- the table ---------------------------------------------------------------------

# Kept of each `vllm bench serve` result: its summary, not its per-request lists.
PER_REQUEST = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts",
               "errors")
RATIOS = (("plain", "ours plain", "vllm plain"),
          ("ngram K=4", "ours ngram K=4", "vllm ngram K=4"),
          ("dynamic K: our default / its dynamic SD", "ours default", "vllm ngram dynamic"))


def summarise(runs: list[dict]) -> dict:
    """(dataset, C) -> row -> the median-throughput repeat's numbers, with failed requests
    over all repeats and replies equal to ours plain's (same dataset, C and repeat)."""
    plain = {(r["dataset"], r["concurrency"], r["repeat"]): r["result"].get("generated_texts")
             for r in runs if r["system"] == "ours" and r["config"] == "plain" and r["result"]}
    out: dict = {}
    for r in runs:
        key = (r["dataset"], r["concurrency"])
        row = out.setdefault(key, {}).setdefault(f"{r['system']} {r['config']}",
                                                 {"runs": [], "failed": 0, "same": [0, 0]})
        res = r["result"]
        if res is None:
            row["failed"] += num_prompts(r["dataset"], r["concurrency"], 0)
            continue
        row["runs"].append(res)
        row["failed"] += res["failed"]
        ref, texts = plain.get((*key, r["repeat"])), res.get("generated_texts")
        if ref and texts:
            row["same"][0] += sum(a == b for a, b in zip(texts, ref, strict=True))
            row["same"][1] += len(texts)
    for rows in out.values():
        for row in rows.values():
            if row["runs"]:
                runs_ = sorted(row["runs"], key=lambda x: x["output_throughput"])
                m = runs_[len(runs_) // 2]
                row.update({k: m.get(k) for k in (
                    "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                    "median_itl_ms", "p99_itl_ms", "spec_decode_acceptance_length", "completed")})
                row["tok_s_runs"] = [round(x["output_throughput"], 2) for x in row["runs"]]
            del row["runs"]
    return {f"{d}|{c}": rows for (d, c), rows in out.items()}


def render(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"`make run` against `vllm serve` under `vllm bench serve` (vLLM {result['vllm']}): "
        f"SmolLM2-135M-Instruct float32 on {result['device_name']} x{result['cpus']}; "
        f"--backend openai-chat, greedy (--temperature 0), up to {cfg['max_tokens']} output "
        f"tokens, at least {cfg['requests']} requests and {serving.WAVES} waves of C a cell; "
        f"median of {cfg['repeats']} repeat(s), servers alternating; load average "
        f"{result['load_average_1min'][0]} -> {result['load_average_1min'][1]}; "
        f"{result['wall_s'] / 60:.1f} min.", "",
        "vLLM's thread binding: " + fair.describe(result["vllm_binding"])
        + fair.binding_note(result) + "; numba's threads NUMBA_THREADING_LAYER="
        + str(result.get("vllm_numba_layer")) + ".", "",
        "tok/s = its output throughput; TTFT, TPOT (time per output token after the first) "
        "and ITL (between streamed chunks) in ms; AL = acceptance length from the server's "
        "`vllm:spec_decode_*` metrics; failed = requests `vllm bench serve` counted failed, "
        "all repeats; same = replies equal to ours plain's.", ""]
    if result.get("busy"):
        lines += [f"**Not a clean run**: {result['busy']}", ""]
    summary = result["summary"]
    for key in sorted(summary, key=lambda k: (k.split("|")[0], int(k.split("|")[1]))):
        dataset, c = key.split("|")
        lines += [f"{dataset}, C={c}:", "",
                  "| system | tok/s | TTFT p50 | TTFT p99 | TPOT p50 | ITL p50 | AL | failed "
                  "| same |", "|---|---|---|---|---|---|---|---|---|"]
        for name, x in summary[key].items():
            if x.get("output_throughput") is None:
                lines.append(f"| {name} | no result | | | | | | {x['failed']} | |")
                continue
            same = f"{x['same'][0]}/{x['same'][1]}" if x["same"][1] else "-"
            lines.append(
                f"| {name} | {x['output_throughput']:.1f} | {x['median_ttft_ms']:.0f} | "
                f"{x['p99_ttft_ms']:.0f} | {x['median_tpot_ms']:.1f} | "
                f"{x['median_itl_ms']:.1f} | "
                f"{serving._fmt(x.get('spec_decode_acceptance_length'), '.2f')} | "
                f"{x['failed']} | {same} |")
        lines.append("")
    cs = sorted({int(k.split("|")[1]) for k in summary})
    names = sorted({k.split("|")[0] for k in summary})
    lines += ["Ratios, configuration to configuration (tok/s, same dataset and C):", "",
              "| ratio | dataset | " + " | ".join(f"C={c}" for c in cs) + " |",
              "|---|---|" + "---|" * len(cs)]
    for label, ours, theirs in RATIOS:
        for d in names:
            row = []
            for c in cs:
                rows = summary.get(f"{d}|{c}", {})
                a = rows.get(ours, {}).get("output_throughput")
                b = rows.get(theirs, {}).get("output_throughput")
                row.append(f"{a / b:.2f}" if a and b else "-")
            if any(x != "-" for x in row):
                lines.append(f"| {label} | {d} | " + " | ".join(row) + " |")
    lines += ["", "Commands (each cell's, as `vllm bench serve` runs it; BASE the server, "
              "DIR the model's directory):", ""]
    seen = set()
    for r in result["runs"]:
        cmd = r["command"]
        if (r["system"], r["config"], r["dataset"]) in seen:
            continue
        seen.add((r["system"], r["config"], r["dataset"]))
        lines.append(f"- {r['system']} {r['config']}, {r['dataset']}: `{cmd}`")
    return "\n".join(lines) + "\n"


def _strip(runs: list[dict], model_dir: Path) -> list[dict]:
    """The runs as recorded: no per-request lists, no machine-local paths."""
    out = []
    for r in runs:
        res = None if r["result"] is None else {k: v for k, v in r["result"].items()
                                               if k not in PER_REQUEST}
        cmd = r["command"].replace(str(model_dir), "DIR")
        out.append({**r, "result": res, "command": cmd})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=serving._ints, default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=16, help="requests per cell at least")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    for system, configs in (("ours", OURS), ("vllm", VLLM)):
        ap.add_argument(f"--{system}", type=lambda s: s.split(","),
                        default=DEFAULT_CONFIGS[system],
                        help=f"comma-separated, of {', '.join(configs)} (default "
                             f"{','.join(DEFAULT_CONFIGS[system])})")
    ap.add_argument("--systems", default="ours,vllm")
    ap.add_argument("--vllm-binding", dest="vllm_binding_name", default="search",
                    choices=["search", *fair.vllm_bindings()])
    ap.add_argument("--allow-busy", action="store_true")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: C=2, 4 requests, 8 tokens, one repeat, no binding search")
    ap.add_argument("--peers-python", type=Path, default=PEERS_PYTHON)
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--out", type=Path, default=RESULTS / "vllm_bench.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests, args.max_tokens, args.repeats = [2], 4, 8, 1
        args.vllm_binding_name = "vLLM's default"
    systems = args.systems.split(",")
    args.configs = {"ours": args.ours, "vllm": args.vllm}
    for system, known in (("ours", OURS), ("vllm", VLLM)):
        if unknown := [n for n in args.configs[system] if n not in known]:
            ap.error(f"--{system}: unknown configuration(s) {', '.join(unknown)}")
    args.python = args.peers_python
    if (why := vllm_unavailable(args.python)) is not None:
        raise SystemExit(f"`vllm bench serve` cannot run: {why}")

    busy = None if args.quick else fair.refuse_if_busy(args.allow_busy)
    t0 = time.perf_counter()
    load0 = round(os.getloadavg()[0], 2)
    model_dir = prepare_default_model()
    log_dir = cache_dir() / "logs" / "bench-vllm-bench"
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir / "vllm-bench.log").write_text("")
    binding = None
    args.vllm_binding = {}
    if "vllm" in systems:
        binding = serving.search_vllm_binding(
            argparse.Namespace(peers_python=str(args.python), vllm_timeout_s=args.timeout_s,
                               vllm_binding_name=args.vllm_binding_name,
                               vllm_binding_mode="plain", max_tokens=args.max_tokens),
            model_dir, serving.prompts_by_name(), log_dir)
        args.vllm_binding = binding["env"]
    runs: list[dict] = []
    turns = {"ours": run_ours, "vllm": run_vllm}
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        work = Path(tmp)
        chat_dataset(work / "chat.jsonl", max(args.requests, serving.WAVES * max(args.concurrency)))
        for rep in range(args.repeats):
            for system in systems if rep % 2 == 0 else systems[::-1]:
                runs += turns[system](args, model_dir, work, log_dir, rep)
        summary = summarise(runs)
    result = {
        "bench": "vllm_bench", "model": "SmolLM2-135M-Instruct", "device_name": device_name(),
        "machine": platform.machine(), "cpus": os.cpu_count(),
        "python": platform.python_version(), "vllm": serving._peer_version(args.python),
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.vllm_bench " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "wall_s": round(time.perf_counter() - t0, 1),
        "load_average_1min": [load0, round(os.getloadavg()[0], 2)], "busy": busy,
        "config": {"concurrency": args.concurrency, "requests": args.requests,
                   "max_tokens": args.max_tokens, "repeats": args.repeats,
                   "systems": systems, "configs": args.configs,
                   "vllm_args": list(serving.VLLM_ARGS),
                   "vllm_speculative_config": {n: VLLM[n] for n in args.configs["vllm"]}},
        "vllm_binding": args.vllm_binding, "vllm_binding_search": binding,
        "vllm_numba_layer": vllm_environ(args.python)["NUMBA_THREADING_LAYER"],
        "summary": summary, "runs": _strip(runs, model_dir),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    table = render(result)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    if failed := sum(row["failed"] for rows in summary.values() for row in rows.values()):
        raise SystemExit(f"{failed} requests failed (see {log_dir / 'vllm-bench.log'})")


if __name__ == "__main__":
    main()
