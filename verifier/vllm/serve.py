"""`specdec-verifier --engine vllm`: the Verifier API on vLLM's async engine.

The verifier's own flags keep their meaning where vLLM has one (max-num-seqs,
max-model-len, max-num-batched-tokens, dtype, prefix caching, eager, seed); the KV cache
is sized from --kv-cache-tokens (or --gpu-memory-utilization, vLLM's way), and
--tensor-parallel-size spreads the target over devices; --device, when given, must name
the platform vLLM was built for (it places its ranks itself); flags our engine alone
reads are refused (verifier/__main__.py). Drafters are the proposer's
(verifier/vllm/proposer.py), configured through vLLM's additional config; the engine
core, a process vLLM spawns, builds it.

The watchdog (verifier/watchdog.py) reads vLLM's engine as it reads ours: once the
engine core dies (or AsyncLLM's output loop), health goes NOT_SERVING, requests in
flight end with UNAVAILABLE and the process exits with status 3 for its supervisor to
restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdec.server import INTERNAL_TOKEN_ENV, host_port, serve_until_signal
from specdec.tls import TlsConfig

log = logging.getLogger("verifier")

PROPOSER = "verifier.vllm.RemoteProposer"
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(slots=True)
class EngineLiveness:
    """vLLM's AsyncLLM as the watchdog reads an engine: failed for good once `errored`
    (its engine core process died, or its output loop ended). No step times: vLLM steps
    in its engine core, out of this process's sight."""

    engine: Any  # vllm.v1.engine.async_llm.AsyncLLM
    step_started: float | None = None

    @property
    def fatal(self) -> BaseException | None:
        return self.engine.dead_error if self.engine.errored else None


def check_device(device: str | None, platform: str) -> None:
    """--device on vLLM's engine (None: not given) may only name vLLM's platform
    (`current_platform.device_type`), without an index: vLLM places its ranks itself."""
    if device is not None and device != platform:
        raise SystemExit(f"--device {device}: vLLM here runs on {platform!r} and places its "
                         f"ranks itself (choose GPUs with CUDA_VISIBLE_DEVICES)")


def engine_args(args: argparse.Namespace, model_dir: Path, proposer: dict) -> dict:
    """AsyncEngineArgs' keywords for the verifier's command line."""
    from transformers import AutoConfig

    from verifier.vllm.worker import WORKER_EXTENSION

    if args.dtype not in _ITEMSIZE:
        raise SystemExit(f"--dtype {args.dtype}: vLLM runs float32, bfloat16 or float16")
    kwargs = dict(
        model=str(model_dir), dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_num_seqs),
        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
        enforce_eager=not args.cuda_graphs, disable_log_stats=False,
        worker_extension_cls=WORKER_EXTENSION, additional_config=proposer,
        # vLLM's own per-request count of drafts, on each request's final output.
        per_request_spec_decode_metrics="summary")
    if args.drafter:
        kwargs["speculative_config"] = {"method": "custom_class", "model": PROPOSER,
                                        "num_speculative_tokens": args.max_num_speculative_tokens}
    if args.gpu_memory_utilization:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        # [2 (K and V), layers, kv heads, head dim] per token, split over the TP ranks.
        hf = AutoConfig.from_pretrained(model_dir)
        heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kv_tokens = args.kv_cache_tokens or max(args.max_num_seqs * args.max_model_len // 2,
                                                args.max_model_len)
        per_token = 2 * hf.num_hidden_layers * heads * head_dim * _ITEMSIZE[args.dtype]
        kwargs["kv_cache_memory_bytes"] = kv_tokens * per_token // args.tensor_parallel_size
    return kwargs


async def serve(args: argparse.Namespace, server_tls: TlsConfig | None,
                drafter_tls: TlsConfig | None) -> int:
    """drafter_tls: unused here; the proposer, in vLLM's engine process, reads the same
    environment (TlsConfig.from_env)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    from specdec.models.prepare import prepare_default_model
    from verifier.service import exit_process
    from verifier.service import serve as serve_verifier
    from verifier.vllm.proposer import ProposerConfig, target_info
    from verifier.vllm.service import EngineLoad, LoadLogger, VllmVerifierServicer

    check_device(args.device, current_platform.device_type)
    model_dir = Path(args.model) if args.model else prepare_default_model()
    config = ProposerConfig(drafters=dict(args.drafter), draft_deadline_ms=args.draft_deadline_ms,
                            num_speculative_tokens=args.num_speculative_tokens,
                            drafter_liveness_s=args.drafter_liveness_s,
                            draft_bets=args.draft_bets,
                            speculation_controller=True,
                            disable_queue_size=args.speculative_disable_queue_size)
    load = EngineLoad()
    engine = AsyncLLM.from_engine_args(
        AsyncEngineArgs(**engine_args(args, model_dir, config.to_additional_config())),
        stat_loggers=[lambda vllm_config, index: LoadLogger(vllm_config, index, load=load)])
    vllm_config = engine.vllm_config
    cache = vllm_config.cache_config
    servicer = VllmVerifierServicer(
        engine, config, target_info(vllm_config.model_config), model_name=model_dir.name,
        max_model_len=vllm_config.model_config.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_speculative_tokens=args.max_num_speculative_tokens if args.drafter else 0,
        block_size=cache.block_size, num_kv_blocks=cache.num_gpu_blocks or 0, load=load,
        max_num_waiting=args.max_num_waiting)
    token = os.environ.get(INTERNAL_TOKEN_ENV) or None

    def terminate(code: int) -> None:
        # The watchdog tripped: no engine process may outlive this one (an engine core
        # left running when the output loop failed would hold its device).
        servicer.close()
        exit_process(code)

    service = await serve_verifier(servicer, f"{args.host}:{args.port}",
                                   watched=EngineLiveness(engine), terminate=terminate,
                                   token=token, tls=server_tls)
    log.info("verifier (vLLM, tensor parallel %d) serving %s on %s (drafters: %s)",
             args.tensor_parallel_size, model_dir.name, host_port(f"{args.host}:{service.port}"),
             ", ".join(f"{n}={a}" for n, a in args.drafter) or "none")
    try:
        await serve_until_signal(service.grpc, args.grace_s,
                                 drain=lambda: servicer.drain(args.grace_s * 0.6))
    finally:
        service.watchdog.stop()  # a shut-down engine reads as errored: no failure
        await asyncio.to_thread(servicer.close)
    return 0
