"""`specdec` command line: model preparation and a terminal chat."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from specdec.models.prepare import default_model_dir, prepare_default_model


def _model_dir(arg: str | None) -> Path:
    """--model DIR if given, else the prepared default model (prepared on demand)."""
    if arg:
        return Path(arg)
    return prepare_default_model()


def cmd_prepare_model(args: argparse.Namespace) -> int:
    dest = Path(args.dest) if args.dest else default_model_dir()
    t0 = time.perf_counter()
    path = prepare_default_model(dest, force=args.force)
    print(f"default model ready at {path} ({time.perf_counter() - t0:.1f} s)")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    import torch

    from specdec.detokenizer import IncrementalDetokenizer
    from specdec.generate import greedy_stream
    from specdec.models import load_model
    from specdec.tokenizer import Tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = _model_dir(args.model)
    tokenizer = Tokenizer.from_dir(model_dir)
    model = load_model(model_dir, dtype=args.dtype)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    t0 = time.perf_counter()
    n = 0
    for step in greedy_stream(model, [prompt], args.max_tokens, tokenizer.eos_token_ids):
        n += 1
        piece = detok.add([step[0]])
        if args.stream:
            print(piece, end="", flush=True)
    tail = detok.flush()
    print(tail if args.stream else detok.text)
    dt = time.perf_counter() - t0
    print(f"[{len(prompt)} prompt + {n} generated tokens in {dt:.2f} s, greedy, {args.dtype}, {model_dir}]", file=sys.stderr)
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    from specdec.server import check_health
    from specdec.tls import client_from_args

    try:
        tls = client_from_args(args)
    except ValueError as e:
        print(f"specdec health: {e}", file=sys.stderr)
        return 2
    ok = check_health(args.address, args.service, args.timeout, tls)
    if not ok:
        print(f"{args.address}: not serving", file=sys.stderr)
    return 0 if ok else 1


def cmd_up(args: argparse.Namespace) -> int:
    from specdec.launch import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare-model", help="dequantize the default model into the cache")
    p.add_argument("--dest", help=f"output directory (default: {default_model_dir()})")
    p.add_argument("--force", action="store_true", help="prepare again even if present")
    p.set_defaults(func=cmd_prepare_model)

    p = sub.add_parser("chat", help="greedy chat reply from the target model, in the terminal")
    p.add_argument("prompt")
    p.add_argument("--model", help="Hugging Face model directory (default: the prepared default)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("health", help="exit 0 when a service's gRPC health check is SERVING "
                       "(the compose healthchecks use it); over the internal TLS when "
                       "SPECDEC_INTERNAL_TLS_* are set")
    p.add_argument("address", help="HOST:PORT")
    p.add_argument("--service", default="", help="service name (default: the whole server)")
    p.add_argument("--timeout", type=float, default=2.0)
    from specdec import tls

    tls.add_client_arguments(p, os.environ)
    p.set_defaults(func=cmd_health)

    from specdec import launch

    p = sub.add_parser("up", help="start the compose.yaml topology as local processes (the "
                       "embedded default: CPU, ngram and EAGLE-3 drafters); Ctrl-C stops it")
    launch.add_arguments(p)
    p.set_defaults(func=cmd_up)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
