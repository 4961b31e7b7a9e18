"""`specdec-verifier` / `python -m verifier`: the target model behind the Verifier gRPC API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from pathlib import Path

from specdec import tls
from specdec.server import (
    INTERNAL_TOKEN_ENV,
    add_open_access_argument,
    host_port,
    internal_open_access_refusal,
    serve_until_signal,
)

log = logging.getLogger("verifier")


def parse_drafter(spec: str) -> tuple[str, str]:
    """NAME=HOST:PORT (NAME conventionally the method, e.g. ngram=127.0.0.1:50061)."""
    name, sep, address = spec.partition("=")
    if not sep or not name or ":" not in address:
        raise argparse.ArgumentTypeError(f"--drafter wants NAME=HOST:PORT, got {spec!r}")
    return name, address


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec-verifier", description=__doc__)
    p.add_argument("--model", help="Hugging Face model directory (default: the prepared default model)")
    p.add_argument("--engine", default="specdec", choices=["specdec", "vllm"],
                   help="the target's engine: ours, or vLLM's (installed beside: make vllm-venv) "
                        "with our drafters as its proposer")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="vLLM engine: devices the target is split over")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.0,
                   help="vLLM engine: size the KV cache as vLLM does, by this fraction of the "
                        "device's memory (default: from --kv-cache-tokens)")
    p.add_argument("--host", default="127.0.0.1")
    add_open_access_argument(p, f"${INTERNAL_TOKEN_ENV} or mutual TLS")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--drafter", action="append", type=parse_drafter, default=[],
                   metavar="NAME=HOST:PORT", help="a drafter service; repeat for several")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-speculative-tokens", type=int, default=8)
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="K for requests that do not choose one")
    p.add_argument("--draft-deadline-ms", type=float, default=100.0,
                   help="a proposal later than this runs the step with K=0")
    p.add_argument("--max-num-waiting", type=int, default=256,
                   help="requests queued beyond the running batch; past it new ones are "
                   "refused with RESOURCE_EXHAUSTED (the gateway's 429); 0 = no limit")
    p.add_argument("--draft-bets", action=argparse.BooleanOptionalAction, default=True,
                   help="take a drafter's bet on a step's outcome as the next step's drafts "
                   "without waiting for its answer (DraftBet; --no-draft-bets always waits)")
    p.add_argument("--drafter-liveness-s", type=float, default=10.0,
                   help="a drafter that answers no proposal request for this long is cut off "
                   "and reconnected (its sequences run with K=0 meanwhile)")
    p.add_argument("--kv-cache-tokens", type=int, default=0,
                   help="KV cache capacity in tokens (default: max-num-seqs x max-model-len / 2)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--device", help="torch device of the target (default cpu); with --engine "
                                     "vllm, the platform vLLM runs on (checked)")
    p.add_argument("--attention", default="sdpa")
    p.add_argument("--no-cuda-graphs", "--enforce-eager", dest="cuda_graphs", action="store_false",
                   help="on a GPU, run every step eagerly instead of replaying CUDA graphs")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="reuse the KV cache of full blocks shared with earlier requests "
                        "(automatic prefix caching)")
    p.add_argument("--speculative-disable-queue-size", type=int, default=None, metavar="N",
                   help="steps taken while this verifier holds more than N requests (running "
                        "and waiting) draft nothing; reported as queue_size (default: never)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grace-s", type=float, default=10.0, help="shutdown grace period")
    p.add_argument("--step-timeout-s", type=float, default=60.0,
                   help="a step running longer than this means the engine is stuck: health goes "
                        "NOT_SERVING, requests in flight end with UNAVAILABLE (to resume on "
                        "another replica) and the process exits with status 3 (0 = no limit)")
    tls.add_server_arguments(p, os.environ, what="the Verifier API")
    return p


# Flags one engine alone reads -> (that engine, values that ask nothing of the other).
# Given to the other engine they are refused rather than ignored; compose's verifier
# command passes --threads and --tensor-parallel-size to both engines, at those values.
ENGINE_FLAGS: dict[str, tuple[str, tuple]] = {
    "--attention": ("specdec", ()),
    "--block-size": ("specdec", ()),
    "--step-timeout-s": ("specdec", ()),
    "--threads": ("specdec", (0,)),
    "--tensor-parallel-size": ("vllm", (1,)),
    "--gpu-memory-utilization": ("vllm", ()),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; exits 2 naming a flag the chosen engine does not read."""
    parser = build_parser()
    # Explicit flags are told from defaults by a value no flag can take.
    unset = object()
    dests = {flag: flag[2:].replace("-", "_") for flag in ENGINE_FLAGS}
    args = parser.parse_args(argv, argparse.Namespace(**dict.fromkeys(dests.values(), unset)))
    for flag, (engine, neutral) in ENGINE_FLAGS.items():
        value = getattr(args, dests[flag])
        if value is unset:
            setattr(args, dests[flag], parser.get_default(dests[flag]))
        elif engine != args.engine and value not in neutral:
            parser.error(f"{flag} does not apply to --engine {args.engine}")
    return args


def engine_config(args: argparse.Namespace):
    """Our engine's EngineConfig from the command line."""
    from verifier.engine import EngineConfig

    kv_tokens = args.kv_cache_tokens or max(args.max_num_seqs * args.max_model_len // 2,
                                            args.max_model_len)
    return EngineConfig(
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        block_size=args.block_size, num_kv_blocks=math.ceil(kv_tokens / args.block_size),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_speculative_tokens=args.max_num_speculative_tokens, seed=args.seed,
        cuda_graphs=args.cuda_graphs, enable_prefix_caching=args.enable_prefix_caching,
        disable_queue_size=args.speculative_disable_queue_size)


def drafter_pool(args: argparse.Namespace, target, token: str | None,
                 drafter_tls: tls.TlsConfig | None):
    """The proposer over the command line's --drafter services (not yet started)."""
    from verifier.drafter_client import DrafterClient
    from verifier.drafting import DrafterPool

    return DrafterPool([DrafterClient(name, addr, target, liveness_s=args.drafter_liveness_s,
                                      token=token, tls=drafter_tls, use_bets=args.draft_bets)
                        for name, addr in args.drafter],
                       args.max_num_speculative_tokens, args.draft_deadline_ms)


async def _serve(args: argparse.Namespace, server_tls: tls.TlsConfig | None,
                 drafter_tls: tls.TlsConfig | None) -> int:
    import torch

    from specdec.models import load_model
    from specdec.models.prepare import prepare_default_model
    from specdec.structured import Grammars
    from specdec.tokenizer import Tokenizer, model_fingerprint
    from verifier.drafter_client import TargetInfo
    from verifier.engine import Engine
    from verifier.service import VerifierServicer, exit_process, serve
    from verifier.worker import EngineThread

    model_dir = Path(args.model) if args.model else prepare_default_model()
    engine_thread = EngineThread()  # the model is loaded, and later stepped, there

    def load():
        if args.threads:
            torch.set_num_threads(args.threads)
        return load_model(model_dir, dtype=args.dtype, device=args.device or "cpu",
                          attention=args.attention)

    model = engine_thread.call(load)
    tokenizer = Tokenizer.from_dir(model_dir)
    _, digest = model_fingerprint(model_dir)
    cfg = model.config
    engine_cfg = engine_config(args)
    target = TargetInfo(cfg.vocab_size, digest, cfg.hidden_size, cfg.num_layers)
    # One shared token for the internal APIs (unset: none): this verifier requires it
    # and presents it to its drafters.
    token = os.environ.get(INTERNAL_TOKEN_ENV) or None
    pool = drafter_pool(args, target, token, drafter_tls)
    engine = engine_thread.call(lambda: Engine(model, engine_cfg, pool, tokenizer.eos_token_ids))
    servicer = VerifierServicer(engine, pool, target, model_name=model_dir.name,
                                default_num_speculative_tokens=args.num_speculative_tokens,
                                engine_thread=engine_thread,
                                grammars=Grammars(tokenizer.hf, cfg.vocab_size,
                                                  tokenizer.eos_token_ids),
                                max_num_waiting=args.max_num_waiting)
    service = await serve(servicer, f"{args.host}:{args.port}",
                          step_timeout_s=args.step_timeout_s, terminate=exit_process,
                          token=token, tls=server_tls)
    log.info("verifier serving %s on %s (drafters: %s)", model_dir.name,
             host_port(f"{args.host}:{service.port}"),
             ", ".join(f"{n}={a}" for n, a in args.drafter) or "none")
    await serve_until_signal(service.grpc, args.grace_s, drain=lambda: servicer.drain(args.grace_s * 0.6))
    service.watchdog.stop()
    await asyncio.to_thread(servicer.close)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        server_tls = tls.server_from_args(args)
        drafter_tls = tls.TlsConfig.from_env()  # this verifier's side of its drafter links
    except ValueError as e:
        print(f"specdec-verifier: {e}", file=sys.stderr)
        return 2
    if (refusal := internal_open_access_refusal("specdec-verifier", args, server_tls,
                                                "gateways")) is not None:
        print(refusal, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve = _serve
    if args.engine == "vllm":  # imports vLLM, which only its own environment has
        from verifier.vllm.serve import serve
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(args, server_tls, drafter_tls))
    return uvloop.run(serve(args, server_tls, drafter_tls))


if __name__ == "__main__":
    sys.exit(main())
