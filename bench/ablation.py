"""Prove or prune the verifier's speculation controller (verifier/engine/speculation.py):
the controller whole, then with each of its mechanisms turned off alone, against the
drafter at static K and plain decoding, on the same requests.

Our engine runs in this process, configured from compose.yaml's x-local verifier
command exactly as `make run` starts it, with the drafter as the service `make run`
starts (on a free port, through the same gRPC client the verifier uses): the
controller and every step it prices are the verifier's, without the gateway and HTTP
around them, so one engine serves every configuration in turn and the configurations
alternate cell by cell (their order rotates per repeat) on one warm drafter. Each
controller configuration keeps its own controller, warm across its cells as a
running verifier's is.

A cell is N = max(3C, --requests) greedy requests of a prompt set, C in flight at all
times, at most --max-tokens tokens each. Reported per cell: output tokens/s over the
cell's wall time, tokens per step, and replies equal to plain decoding's; the table
gives each configuration's median tok/s and its ratio to plain and to the whole
controller (paired within a repeat, median over repeats).

    .venv/bin/python -m bench.ablation [--method ngram] [--prompt-sets chat,open] \\
        [--concurrency 1,4,16] [--repeats 2] [--out PATH]

writes bench/results/speculation_ablation.json and .md (or PATH and its .md).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    raise SystemExit("run as a module from the repository root: python -m bench.ablation")

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench import fair
from bench.drafters import device_name
from bench.serving import (
    PROMPT_SETS,
    RESULTS,
    _until_eos,
    prompts_by_name,
    workload,
)
from specdec.launch import (
    EAGLE3_HEAD,
    LocalService,
    LocalStack,
    free_port,
    local_services,
    on_free_ports,
)
from specdec.models.prepare import prepare_default_model
from train.inprocess import InProcessProposer
from verifier.engine.speculation import ControllerConfig, SpeculationController

# Configuration -> (static K or None for the controller, the controller's config).
# K = 0 is plain decoding; the controller's requests have the deployment's bound.
WHOLE = ControllerConfig()
# The mechanisms the controller keeps (bench/results/speculation_ablation.md also
# measured three it no longer has: probing plain steps, a bound on the rows priced past
# those measured, and plain prefill steps, none of which paid beyond the noise).
ABLATIONS = {
    "no per-request rates": dataclasses.replace(WHOLE, request_rates=False),
    "no redraft": dataclasses.replace(WHOLE, redraft=False),
    "no wait pricing": dataclasses.replace(WHOLE, price_wait=False),
}
CONFIGS: dict[str, tuple[int | None, ControllerConfig | None]] = {
    "plain": (0, None), "K=1": (1, None), "K=2": (2, None), "K=4": (4, None),
    "controller": (None, WHOLE), **{n: (None, c) for n, c in ABLATIONS.items()}}
# The same configurations with the drafter's bets on outcomes (DraftBet) left untaken:
# every drafting step waits for the drafter's answer, as before bets.
NO_BETS = {"K=2 no bets": "K=2", "controller no bets": "controller"}
CONFIGS.update({n: CONFIGS[base] for n, base in NO_BETS.items()})
# The same configurations against a variant of the drafter: a second instance of its
# service started with flags added (`min2` matches n-grams of two tokens or more, which
# lets the ngram drafter answer every outcome ahead in one table, DraftTable), or
# (None) its method run inside this process by an engine of its own, without the wire.
VARIANTS: dict[str, tuple[str, ...] | None] = {"min2": ("--ngram-min", "2"), "in process": None}
VARIANT_OF = {f"{base} {v}": v for v in VARIANTS for base in ("K=2", "K=4", "controller")}
CONFIGS.update({n: CONFIGS[n.removesuffix(" " + v)] for n, v in VARIANT_OF.items()})

class Bench:
    """One engine as the verifier runs it, with the `method` drafter service."""

    def __init__(self, method: str, log_dir: Path, variants: set[str] = frozenset()):
        from specdec.models import load_model
        from specdec.tokenizer import Tokenizer, model_fingerprint
        from verifier.__main__ import drafter_pool, engine_config, parse_args
        from verifier.drafter_client import TargetInfo
        from verifier.engine import Engine

        model_dir = prepare_default_model()
        env = {"SPECDEC_MODEL_ROOT": str(model_dir.parent), "SPECDEC_MODEL": model_dir.name,
               "EAGLE3_HEAD": str(EAGLE3_HEAD), **os.environ}
        services, _ = on_free_ports(local_services(environ=env))
        verifier = next(s for s in services if s.name == "verifier")
        args = parse_args(list(verifier.argv[1:]))
        args.drafter = [(n, a) for n, a in args.drafter if n == method]
        if not args.drafter:
            raise SystemExit(f"x-local runs no {method} drafter")
        (drafter,) = [s for s in services if s.name == method]
        extra = [_variant(drafter, v) for v in sorted(variants) if VARIANTS[v] is not None]
        args.drafter += [(s.name, s.health) for s in extra]
        self.stack = LocalStack([drafter, *extra], log_dir,
                                log=lambda s: print("  " + s, flush=True))
        self.stack.start(timeout_s=600)
        if args.threads:
            torch.set_num_threads(args.threads)
        self.model = load_model(model_dir, dtype=args.dtype, device=args.device or "cpu",
                                attention=args.attention)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        cfg = self.model.config
        target = TargetInfo(cfg.vocab_size, model_fingerprint(model_dir)[1], cfg.hidden_size,
                            cfg.num_layers)
        self.pool = drafter_pool(args, target, os.environ.get("SPECDEC_INTERNAL_TOKEN") or None,
                                 None)
        self.pool.start_all()
        if not all(c.wait_available(120) for c in self.pool.clients.values()):
            raise RuntimeError(f"the {method} drafter is not reachable (log {log_dir})")
        self.engine = Engine(self.model, engine_config(args), self.pool,
                             self.tokenizer.eos_token_ids)
        # Variants drafting in this process: an engine each, the model shared.
        self.engines = {v: Engine(self.model, engine_config(args),
                                  InProcessProposer(_method_of(drafter),
                                                    args.max_num_speculative_tokens),
                                  self.tokenizer.eos_token_ids)
                        for v in variants if VARIANTS[v] is None}
        self.method, self.bound = method, args.num_speculative_tokens
        self.controllers = {name: SpeculationController(c) for name, (_, c) in CONFIGS.items()
                            if c is not None}
        self._ids: dict[str, list[int]] = {}
        self._counter = iter(range(10**9))

    def close(self) -> None:
        self.pool.close()
        self.stack.stop()

    def cell(self, config: str, prompts: list, c: int, max_tokens: int) -> dict:
        from specdec.sampling import SamplingParams
        from verifier.engine import Request

        k, _ = CONFIGS[config]
        variant = VARIANT_OF.get(config)
        drafter = self.method if variant is None or variant in self.engines else \
            f"{self.method}-{variant}"
        if variant is not None and variant not in self.engines and \
                drafter not in self.pool.clients:
            # Run on the remote engine, its requests would name a drafter the pool
            # lacks and decode plain.
            raise ValueError(f"{config}: this bench was built without the {variant!r} variant")
        engine = self.engines.get(variant, self.engine)
        engine.controller = self.controllers.get(config)
        clients = list(self.pool.clients.values())
        for client in clients:
            client.use_bets = config not in NO_BETS
        bets0 = [(cl.bet_lookups, cl.bet_hits) for cl in clients]
        pending, order, out = list(prompts), [], {}
        step_log: list[tuple[int, float, float]] = []
        times0 = dataclasses.replace(engine.times)
        t0 = time.perf_counter()
        while pending or engine.has_work():
            while pending and engine.num_running + engine.num_waiting < c:
                p = pending.pop(0)
                ids = self._ids.setdefault(p.name,
                                           self.tokenizer.apply_chat_template(list(p.messages)))
                r = Request(f"r{next(self._counter)}", ids, max_tokens, SamplingParams(temperature=0.0),
                            num_speculative_tokens=self.bound if k is None else k,
                            drafter=None if k == 0 else drafter, auto_k=k is None)
                order.append(r.request_id)
                out[r.request_id] = []
                engine.add_request(r)
            rows0, wait0 = engine.times.rows, engine.times.draft_wait_ms
            s0 = time.perf_counter()
            outs = engine.step()
            ms = 1e3 * (time.perf_counter() - s0)
            if engine.times.rows > rows0:  # (rows fed, ms without the drafters' wait, wait)
                wait = engine.times.draft_wait_ms - wait0
                step_log.append((engine.times.rows - rows0, ms - wait, wait))
            for o in outs:
                out[o.request_id] += o.new_token_ids
        wall = time.perf_counter() - t0
        tm = engine.times
        steps, rows = tm.steps - times0.steps, tm.rows - times0.rows
        tokens = sum(len(v) for v in out.values())
        eos = self.tokenizer.eos_token_ids
        lookups = sum(cl.bet_lookups - b[0] for cl, b in zip(clients, bets0, strict=True))
        hits = sum(cl.bet_hits - b[1] for cl, b in zip(clients, bets0, strict=True))
        return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "steps": steps,
                "rows_per_step": rows / steps, "tokens_per_step": (tm.tokens - times0.tokens) / steps,
                "draft_wait_ms": (tm.draft_wait_ms - times0.draft_wait_ms) / steps,
                "draft_wait_median_ms": statistics.median(w for _, _, w in step_log),
                "bet_lookups": lookups, "bet_hits": hits,
                "replies": [_until_eos(out[r], eos) for r in order], "step_log": step_log}


def _variant(service: LocalService, variant: str) -> LocalService:
    """The drafter service on a port of its own, with the variant's flags added."""
    port = free_port()
    argv = list(service.argv)
    argv[argv.index("--port") + 1] = str(port)
    return LocalService(f"{service.name}-{variant}", (*argv, *VARIANTS[variant]),
                        f"127.0.0.1:{port}", service.depends_on, service.health_tls)


def _method_of(service: LocalService):
    """The draft method the drafter service's command builds."""
    from drafter.__main__ import build_method, build_parser

    return build_method(build_parser().parse_args(list(service.argv[1:])))


def priced(by_config: dict[str, list[dict]]) -> dict[str, list[float]]:
    """Each cell's tok/s with every step priced at the median time of all steps of its
    row count in all the cells at this concurrency (all configurations, all repeats),
    plus the drafters' wait it measured: what its choices cost, with the machine's
    drift between cells (up to 25 % on this shared machine) taken out."""
    times: dict[int, list[float]] = {}
    for reps in by_config.values():
        for cell in reps:
            for rows, ms, _ in cell["step_log"]:
                times.setdefault(rows, []).append(ms)
    price = {rows: statistics.median(ms) for rows, ms in times.items()}
    return {name: [1e3 * cell["tokens"] / sum(price[rows] + wait
                                               for rows, _, wait in cell["step_log"])
                   for cell in reps]
            for name, reps in by_config.items()}


def summarise(cells: dict) -> dict:
    """cells[set][C][config] = [cell per repeat] -> per (set, C, config): median tok/s
    measured and priced (see `priced`), the median over repeats of each one's ratio to
    plain and to the whole controller (paired within a repeat), replies equal to
    plain's."""
    out: dict = {}
    for pset, by_c in cells.items():
        for c, by_config in by_c.items():
            plain = by_config["plain"]
            measured = {n: [r["tok_s"] for r in v] for n, v in by_config.items()}
            at_price = priced(by_config)
            for name, reps in by_config.items():
                def ratio(values, ref, name=name):
                    if ref not in values:
                        return None
                    return statistics.median(a / b for a, b in
                                             zip(values[name], values[ref], strict=False))
                same = sum(a == b for rep, ref in zip(reps, plain, strict=False)
                           for a, b in zip(rep["replies"], ref["replies"], strict=True))
                total = sum(len(rep["replies"]) for rep in reps)
                out.setdefault(pset, {}).setdefault(c, {})[name] = {
                    "tok_s": statistics.median(measured[name]),
                    "vs_plain": ratio(measured, "plain"),
                    "vs_controller": ratio(measured, "controller"),
                    "priced_tok_s": statistics.median(at_price[name]),
                    "priced_vs_plain": ratio(at_price, "plain"),
                    "priced_vs_controller": ratio(at_price, "controller"),
                    "tokens_per_step": statistics.median(r["tokens_per_step"] for r in reps),
                    "draft_wait_ms": statistics.median(r["draft_wait_ms"] for r in reps),
                    "draft_wait_median_ms": statistics.median(r["draft_wait_median_ms"]
                                                              for r in reps),
                    "bet_hit_rate": (sum(r["bet_hits"] for r in reps)
                                     / max(1, sum(r["bet_lookups"] for r in reps))),
                    "rows_per_step": statistics.median(r["rows_per_step"] for r in reps),
                    "vs_plain_each": [a / b for a, b in
                                      zip(measured[name], measured["plain"], strict=False)],
                    "same": f"{same}/{total}"}
    return out


def render(result: dict) -> str:
    lines = [f"Speculation controller ablation: {result['model']} float32 on {result['machine']} "
             f"({result['cpus']} cores, torch {result['versions']['torch']}); our engine in process "
             f"as `make run`'s verifier runs it, with the {result['method']} drafter service; "
             f"requests per cell max(3C, {result['config']['requests']}), greedy, up to "
             f"{result['config']['max_tokens']} tokens; median of {result['config']['repeats']} "
             f"repeats, configurations alternating; load average {result['load_before']:.2f} -> "
             f"{result['load_after']:.2f}; {result['wall_s'] / 60:.1f} min.", "",
             "Command: `" + result["command"] + "`", "",
             "Measured tok/s is output tokens over the cell's wall time; this machine drifts by "
             "up to 25 % between cells (cells whose choices were identical differ that much), "
             "so the second table prices each cell's steps at the median time of their row "
             "count over all cells at that concurrency, plus the drafter waits it measured: "
             "the cost of each configuration's choices, the drift taken out. same = replies "
             "equal to plain decoding's.", ""]
    for pset, by_c in result["summary"].items():
        cs = list(by_c)
        for title, key in (("measured", ""), ("priced at the run's step times", "priced_")):
            lines += [f"Prompt set `{pset}`, tok/s {title} (x plain / x the whole controller; "
                      "tokens per step):", "",
                      "| configuration | " + " | ".join(f"C={c}" for c in cs) + " | same |",
                      "|---|" + "---|" * len(cs) + "---|"]
            for name in CONFIGS:
                if name not in by_c[cs[0]]:
                    continue
                row = []
                for c in cs:
                    s = by_c[c][name]
                    rel = ("" if s[key + "vs_controller"] is None
                           else f" / {s[key + 'vs_controller']:.2f}")
                    row.append(f"{s[key + 'tok_s']:.1f} ({s[key + 'vs_plain']:.2f}{rel}; "
                               f"{s['tokens_per_step']:.2f})")
                same = [by_c[c][name]["same"] for c in cs]
                got = sum(int(x.split("/")[0]) for x in same)
                total = sum(int(x.split("/")[1]) for x in same)
                lines.append(f"| {name} | " + " | ".join(row) + f" | {got}/{total} |")
            lines.append("")
        lines += [f"Prompt set `{pset}`, the drafter's wait per step, median / mean ms, and "
                  "the share of drafting sequences whose drafts a bet gave (DraftBet):", "",
                  "| configuration | " + " | ".join(f"C={c}" for c in cs) + " |",
                  "|---|" + "---|" * len(cs)]
        for name in CONFIGS:
            if name == "plain" or name not in by_c[cs[0]]:
                continue
            lines.append(f"| {name} | " + " | ".join(
                f"{by_c[c][name]['draft_wait_median_ms']:.2f} / "
                f"{by_c[c][name]['draft_wait_ms']:.2f}; {by_c[c][name]['bet_hit_rate']:.0%}"
                for c in cs) + " |")
        lines.append("")
    lines += ["Ablations: " + "; ".join(
        f"`{n}` = ControllerConfig({', '.join(f'{f.name}=False' for f in dataclasses.fields(c) if getattr(c, f.name) is False)})"
        for n, c in ABLATIONS.items()) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="ngram")
    ap.add_argument("--prompt-sets", type=lambda s: s.split(","), default=["chat", "open"])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=8, help="requests per cell at least")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", type=lambda s: s.split(","), default=list(CONFIGS))
    ap.add_argument("--allow-busy", "--force", dest="force", action="store_true",
                    help="measure on a busy machine")
    ap.add_argument("--out", type=Path, default=RESULTS / "speculation_ablation.json")
    args = ap.parse_args(argv)
    unknown = set(args.configs) - set(CONFIGS) | set(args.prompt_sets) - set(PROMPT_SETS)
    if unknown or "plain" not in args.configs:
        raise SystemExit(f"unknown: {sorted(unknown)} (plain is always run)" if unknown
                         else "--configs must include plain")
    try:
        load = fair.wait_until_idle()
    except fair.Busy as e:
        if not args.force:
            raise SystemExit(str(e)) from None
        load = os.getloadavg()[0]
    t_start = time.perf_counter()
    variants = {VARIANT_OF[n] for n in args.configs if n in VARIANT_OF}
    flagged = sorted(v for v in variants if VARIANTS[v] is not None)
    if flagged and args.method != "ngram":
        raise SystemExit(f"the variants {flagged} are the ngram drafter's")
    bench = Bench(args.method, Path(tempfile.mkdtemp(prefix="ablation-")), variants)
    cells: dict = {}
    try:
        # Every prompt once first: the prefix cache then holds them all, so no
        # configuration pays a prompt's prefill that the next one finds cached.
        for pset in args.prompt_sets:
            bench.cell("plain", prompts_by_name(PROMPT_SETS[pset]), 4, 8)
            if args.method == "suffix":
                # Suffix drafts from the replies of finished requests, and every cell
                # repeats the same prompts: whichever configuration ran a prompt first
                # would draft from a colder tree than the rest. Each reply once first.
                for first in ["K=2"] + [f"K=2 {v}" for v in sorted(variants)]:
                    bench.cell(first, prompts_by_name(PROMPT_SETS[pset]), 4, args.max_tokens)
        warm = prompts_by_name(PROMPT_SETS[args.prompt_sets[0]])[:1]
        for name in args.configs:
            bench.cell(name, warm, 1, 8)
        for rep in range(args.repeats):
            for pset in args.prompt_sets:
                prompts = prompts_by_name(PROMPT_SETS[pset])
                for ci, c in enumerate(args.concurrency):
                    shift = (rep * len(args.concurrency) + ci) % len(args.configs)
                    for name in args.configs[shift:] + args.configs[:shift]:
                        got = bench.cell(name, workload(prompts, c, args.requests), c,
                                         args.max_tokens)
                        cells.setdefault(pset, {}).setdefault(str(c), {}).setdefault(
                            name, []).append(got)
                        print(f"  rep {rep} {pset:5s} C={c:3d} {name:24s} {got['tok_s']:7.1f} "
                              f"tok/s  {got['tokens_per_step']:.2f} tok/step", flush=True)
    finally:
        bench.close()
    # The configurations in the order given, every cell keyed likewise.
    cells = {p: {c: {n: by[n] for n in args.configs} for c, by in v.items()}
             for p, v in cells.items()}
    result = {
        "bench": "ablation", "model": "SmolLM2-135M-Instruct", "method": args.method,
        "machine": device_name(), "cpus": os.cpu_count(),
        "versions": {"torch": torch.__version__},
        "timestamp": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "python -m bench.ablation " + " ".join(argv if argv is not None
                                                          else sys.argv[1:]),
        "wall_s": time.perf_counter() - t_start, "load_before": load,
        "load_after": os.getloadavg()[0],
        "config": {"requests": args.requests, "max_tokens": args.max_tokens,
                   "repeats": args.repeats, "bound": bench.bound,
                   "ablations": {n: dataclasses.asdict(c) for n, c in ABLATIONS.items()}},
        "summary": summarise(cells),
        "cells": {p: {c: {n: [{k: v for k, v in r.items() if k not in ("replies", "step_log")}
                              for r in reps]
                          for n, reps in by.items()} for c, by in v.items()}
                  for p, v in cells.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    md = render(result)
    args.out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
