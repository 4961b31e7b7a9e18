"""`specdec-drafter` / `python -m drafter`: serve one draft method over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

from drafter import registry
from drafter.method import DraftMethod
from drafter.service import serve
from specdec import tls
from specdec.server import (
    INTERNAL_TOKEN_ENV,
    add_open_access_argument,
    internal_open_access_refusal,
    serve_until_signal,
)

log = logging.getLogger("drafter")

# Method options of the command line -> the constructor keyword they set. Each method
# takes the keywords its constructor names; giving it another one is an error.
_METHOD_OPTIONS = {
    "model": "model_dir",
    "max_num_speculative_tokens": "max_num_speculative_tokens",
    "ngram_min": "min_n",
    "ngram_max": "max_n",
    "dtype": "dtype",
    "device": "device",
    "num_kv_blocks": "num_kv_blocks",
    "max_model_len": "max_model_len",
    "sample_drafts": "sample",
    "lookup_min": "lookup_min_n",
    "lookup_max": "lookup_max_n",
    "min_confidence": "min_confidence",
    "tree_width": "tree_width",
    "cuda_graphs": "cuda_graphs",
    "suffix_max_depth": "max_depth",
    "suffix_max_cached_requests": "max_cached_requests",
    "suffix_max_cached_nodes": "max_cached_nodes",
    "suffix_max_spec_factor": "max_spec_factor",
    "suffix_max_spec_offset": "max_spec_offset",
    "suffix_min_token_prob": "min_token_prob",
}
# Options whose flag is not "--" + the option's name.
_FLAGS = {"cuda_graphs": "--no-cuda-graphs"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec-drafter", description=__doc__)
    parser.add_argument("--method", required=True, choices=registry.method_names(),
                        help="draft method")
    parser.add_argument("--model", metavar="DIR",
                        help="draft model or head (Hugging Face directory), for methods with one")
    parser.add_argument("--target", metavar="DIR",
                        help="target model directory: its tokenizer fingerprint is reported to "
                             "verifiers (without it, ngram matches any tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    add_open_access_argument(parser, f"${INTERNAL_TOKEN_ENV} or mutual TLS")
    parser.add_argument("--port", type=int, default=50061,
                        help="port to bind, 0 = any free port (default %(default)s)")
    parser.add_argument("--max-num-speculative-tokens", type=int, metavar="K",
                        help="largest K a proposal can have (method default: 8)")
    parser.add_argument("--ngram-min", type=int, metavar="N", help="shortest n-gram to match")
    parser.add_argument("--ngram-max", type=int, metavar="N", help="longest n-gram to match")
    parser.add_argument("--lookup-min", type=int, metavar="N",
                        help="eagle/eagle3: draft by prompt lookup where the context's last N or "
                             "more tokens occurred before, by the head elsewhere (0 = the head "
                             "alone, the default)")
    parser.add_argument("--lookup-max", type=int, metavar="N",
                        help="eagle/eagle3: longest n-gram lookup matches (default 4)")
    parser.add_argument("--min-confidence", type=float, metavar="P",
                        help="eagle/eagle3: end a head chain before a draft the head gives a "
                             "probability below P, after the first (default 0: K drafts)")
    parser.add_argument("--tree-width", type=int, metavar="W",
                        help="eagle/eagle3: propose token trees to greedy requests: the head's "
                             "chain plus up to W - 1 alternatives at each depth, the K most "
                             "probable tokens of them (default 1: chains)")
    parser.add_argument("--suffix-max-depth", type=int, metavar="D",
                        help="suffix: longest token run the trees count, i.e. longest match "
                             "plus draft before a re-match (default 24)")
    parser.add_argument("--suffix-max-cached-requests", type=int, metavar="N",
                        help="suffix: past replies kept in the global tree (default 100; 0 = "
                             "the request's own context only)")
    parser.add_argument("--suffix-max-cached-nodes", type=int, metavar="N",
                        help="suffix: nodes of every tenant's tree of past replies at most, "
                             "oldest replies out first (about 270 bytes a node; default "
                             "250000, about 64 MiB)")
    parser.add_argument("--suffix-max-spec-factor", type=float, metavar="F",
                        help="suffix: at most F x match length draft tokens (default 1.0)")
    parser.add_argument("--suffix-max-spec-offset", type=float, metavar="N",
                        help="suffix: ... plus N (default 2)")
    parser.add_argument("--suffix-min-token-prob", type=float, metavar="P",
                        help="suffix: end a draft where its estimated probability falls below "
                             "P (default 0.3)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16", "float64"),
                        help="dtype of the draft model's weights (method default: float32)")
    parser.add_argument("--device", help="torch device of the draft model, e.g. cuda:1 "
                                         "(method default: cpu)")
    parser.add_argument("--num-kv-blocks", type=int, metavar="N",
                        help="draft model KV cache size in blocks of 16 tokens")
    parser.add_argument("--max-model-len", type=int, metavar="N",
                        help="longest context to draft for (default: the draft model's)")
    parser.add_argument("--sample-drafts", action="store_true", default=None,
                        help="sample drafts from q for requests with temperature > 0 and send "
                             "q along (default: greedy drafts)")
    parser.add_argument("--no-cuda-graphs", "--enforce-eager", dest="cuda_graphs",
                        action="store_const", const=False, default=None,
                        help="draft_model on a GPU: run every draft step eagerly instead of "
                             "replaying CUDA graphs")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0 = torch's default)")
    parser.add_argument("--grace-s", type=float, default=5.0,
                        help="on SIGTERM, seconds open streams get to finish (default %(default)s)")
    tls.add_server_arguments(parser, os.environ, what="the Drafter API")
    return parser


def build_method(args: argparse.Namespace) -> DraftMethod:
    """The chosen method with the options given; ValueError says which option is wrong."""
    accepted = set(registry.method_options(args.method))
    kwargs: dict[str, Any] = {}
    for option, keyword in _METHOD_OPTIONS.items():
        value = getattr(args, option)
        if value is None:
            continue
        if keyword not in accepted:
            flag = _FLAGS.get(option, "--" + option.replace("_", "-"))
            raise ValueError(f"{flag} does not apply to method {args.method!r}")
        kwargs[keyword] = value
    if args.target is not None:
        if not Path(args.target).is_dir():
            raise ValueError(f"--target {args.target}: not a directory")
        if "target_dir" in accepted:  # the method checks its own model against the target
            kwargs["target_dir"] = args.target
        else:
            kwargs.update(_target_fingerprint(args.target))
    return registry.create(args.method, **kwargs)


def _target_fingerprint(target: str) -> dict[str, Any]:
    # Imported here: transformers is slow to import and only --target needs it.
    from specdec.tokenizer import model_fingerprint

    try:
        vocab_size, tokenizer_hash = model_fingerprint(target)
    except (OSError, ValueError) as e:
        raise ValueError(f"--target {target}: cannot load its tokenizer: {e}") from None
    return {"vocab_size": vocab_size, "tokenizer_hash": tokenizer_hash}


async def _run(method: DraftMethod, address: str, grace_s: float,
               server_tls: tls.TlsConfig | None) -> None:
    service = await serve(method, address, token=os.environ.get(INTERNAL_TOKEN_ENV) or None,
                          tls=server_tls)
    host = address.rsplit(":", 1)[0]
    log.info("drafter %s serving on %s:%d", method.name, host, service.port)
    await serve_until_signal(service, grace_s)
    log.info("drafter stopped")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has printed the usage and the error
        return e.code if isinstance(e.code, int) else 2
    if not 0 <= args.port <= 65535:
        parser.print_usage(sys.stderr)
        print(f"specdec-drafter: error: --port {args.port} is not in 0..65535", file=sys.stderr)
        return 2
    if args.threads < 0:
        parser.print_usage(sys.stderr)
        print(f"specdec-drafter: error: --threads {args.threads} is negative", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        server_tls = tls.server_from_args(args)
    except ValueError as e:
        parser.print_usage(sys.stderr)
        print(f"specdec-drafter: error: {e}", file=sys.stderr)
        return 2
    if (refusal := internal_open_access_refusal("specdec-drafter", args, server_tls,
                                                "verifiers")) is not None:
        print(refusal, file=sys.stderr)
        return 2
    try:
        method = build_method(args)
    except ValueError as e:
        parser.print_usage(sys.stderr)
        print(f"specdec-drafter: error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    host = f"[{args.host}]" if ":" in args.host else args.host  # IPv6 literal
    try:
        import uvloop
    except ImportError:
        run = asyncio.run
    else:
        run = uvloop.run
    try:
        run(_run(method, f"{host}:{args.port}", args.grace_s, server_tls))
    except OSError as e:  # the address is taken or cannot be bound
        log.error("%s", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
