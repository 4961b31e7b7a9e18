"""A whole deployment in one process on loopback, for gateway tests: drafter
services, verifier replicas and the gateway (REST + gRPC), over a tiny
float64 target that uses the default model's tokenizer, so text compares
exactly with plain greedy decoding."""

from __future__ import annotations

from pathlib import Path

import torch

from drafter.method import DrafterInfo, DraftMethod
from drafter.ngram import NgramMethod
from drafter.service import serve as serve_drafter
from gateway.core import Gateway, GatewayConfig
from gateway.replicas import ReplicaPool
from gateway.service import serve as serve_gateway
from specdec.generate import greedy_generate
from specdec.models import LlamaForCausalLM
from specdec.pb import common_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.structured import Grammars
from specdec.tls import TlsConfig, open_channel
from specdec.tokenizer import Tokenizer
from tests.loop_thread import LoopThread
from tests.tiny import tiny_llama
from tests.verifier.test_service import OracleMethod
from verifier.drafter_client import DrafterClient, TargetInfo
from verifier.drafting import DrafterPool
from verifier.engine import Engine, EngineConfig
from verifier.service import VerifierServicer
from verifier.service import serve as serve_verifier

K_MAX = 8
MAX_LEN = 512
MODEL_NAME = "tiny-smollm2-tokenizer"


def tiny_target(tokenizer: Tokenizer) -> LlamaForCausalLM:
    return tiny_llama(tokenizer.vocab_size, seed=3, max_len=MAX_LEN)


class OracleDraftModel(OracleMethod):
    """Drafts the target's own greedy continuation, posing as a draft model."""

    name = "draft_model"

    def info(self) -> DrafterInfo:
        return DrafterInfo(method=common_pb2.SPEC_METHOD_DRAFT_MODEL,
                           vocab_size=self.model.config.vocab_size,
                           max_num_speculative_tokens=K_MAX)


def default_drafters(model: LlamaForCausalLM) -> dict[str, DraftMethod]:
    vocab = model.config.vocab_size
    return {"ngram": NgramMethod(vocab_size=vocab, max_num_speculative_tokens=K_MAX),
            "draft_model": OracleDraftModel(model)}


class Replica:
    def __init__(self, loop: LoopThread, model: LlamaForCausalLM, eos: frozenset[int],
                 drafter_ports: dict[str, int], max_num_seqs: int = 16,
                 grammars: Grammars | None = None, port: int = 0, token: str | None = None,
                 tls: TlsConfig | None = None, speculation_controller: bool = True,
                 disable_queue_size: int | None = None):
        cfg = model.config
        target = TargetInfo(cfg.vocab_size, "", cfg.hidden_size, cfg.num_layers)
        clients = [DrafterClient(name, f"127.0.0.1:{port}", target, backoff_s=(0.05, 0.2),
                                 token=token, tls=tls)
                   for name, port in drafter_ports.items()]
        self.pool = DrafterPool(clients, K_MAX, 2000.0)
        engine = Engine(model, EngineConfig(max_num_seqs=max_num_seqs, max_model_len=MAX_LEN,
                                            block_size=16, num_kv_blocks=600,
                                            max_num_speculative_tokens=K_MAX,
                                            speculation_controller=speculation_controller,
                                            disable_queue_size=disable_queue_size),
                        self.pool, eos)
        self.servicer = VerifierServicer(engine, self.pool, target, model_name=MODEL_NAME,
                                         default_num_speculative_tokens=4, grammars=grammars)
        self.service = loop.run(serve_verifier(self.servicer, f"127.0.0.1:{port}", token=token,
                                               tls=tls))
        for c in clients:
            assert c.wait_available(10), c.error
        self.address = f"127.0.0.1:{self.service.port}"
        self._channel = open_channel(self.address, tls)
        self.stub = verifier_pb2_grpc.VerifierStub(self._channel)

    def load(self) -> verifier_pb2.LoadReport:
        return self.stub.Load(verifier_pb2.LoadRequest(), timeout=5)

    def stop(self, loop: LoopThread, grace_s: float = 1.0) -> None:
        self._channel.close()
        loop.run(self.service.stop(grace_s))


class GatewayStack:
    def __init__(self, loop: LoopThread, model: LlamaForCausalLM, tokenizer_dir: Path, *,
                 replicas: int = 1, drafters: dict[str, DraftMethod] | None = None,
                 grpc_port: int = 0,
                 token: str | None = None, tls: TlsConfig | None = None,
                 internal_tls: TlsConfig | None = None, speculation_controller: bool = True,
                 disable_queue_size: int | None = None, **config):
        """tls: the gateway's REST and gRPC API; internal_tls: every internal service's
        (it serves with it and presents it, as SPECDEC_INTERNAL_TLS_* make them do)."""
        self.loop = loop
        self.model = model
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        self.methods = default_drafters(model) if drafters is None else drafters
        self.drafter_services = {name: loop.run(serve_drafter(m, "127.0.0.1:0", token,
                                                              internal_tls))
                                 for name, m in self.methods.items()}
        ports = {name: s.port for name, s in self.drafter_services.items()}
        self.grammars = Grammars(self.tokenizer.hf, model.config.vocab_size,
                                 self.tokenizer.eos_token_ids)
        self.replicas = [Replica(loop, model, self.tokenizer.eos_token_ids, ports,
                                 grammars=self.grammars, token=token, tls=internal_tls,
                                 speculation_controller=speculation_controller,
                                 disable_queue_size=disable_queue_size)
                         for _ in range(replicas)]
        pool = ReplicaPool([r.address for r in self.replicas], poll_interval_s=0.1, token=token,
                           tls=internal_tls)
        self.gateway = Gateway(GatewayConfig(model_name=MODEL_NAME, **config), self.tokenizer,
                               pool)
        self.service = loop.run(serve_gateway(self.gateway, "127.0.0.1", 0,
                                                  f"127.0.0.1:{grpc_port}", tls))
        scheme = "https" if tls is not None else "http"
        self.base_url = f"{scheme}://127.0.0.1:{self.service.http_port}/v1"
        self.grpc_address = f"127.0.0.1:{self.service.grpc_port}"
        self._more: list = []  # add_gateway's services

    def add_gateway(self, **config) -> str:
        """Another gateway over the same verifiers (as a deployment with several has);
        its REST base URL. Stopped with the stack."""
        pool = ReplicaPool([r.address for r in self.replicas], poll_interval_s=0.1)
        gateway = Gateway(GatewayConfig(model_name=MODEL_NAME, **config), self.tokenizer, pool)
        service = self.loop.run(serve_gateway(gateway, "127.0.0.1", 0, "127.0.0.1:0", None))
        self._more.append(service)
        return f"http://127.0.0.1:{service.http_port}/v1"

    def close(self) -> None:
        for service in self._more:
            self.loop.run(service.stop(1.0))
        self.loop.run(self.service.stop(1.0))
        for r in self.replicas:
            r.stop(self.loop)
        for s in self.drafter_services.values():
            self.loop.run(s.stop(0.5))

    def chat_ids(self, content: str) -> list[int]:
        return self.tokenizer.apply_chat_template([{"role": "user", "content": content}])

    def reference(self, prompt: list[int], max_tokens: int) -> tuple[str, list[int]]:
        """Plain greedy decoding of the target: (text as the gateway renders it, ids)."""
        with torch.no_grad():
            ids = greedy_generate(self.model, [prompt], max_tokens)[0]
        eos = self.tokenizer.eos_token_ids
        for i, t in enumerate(ids):
            if t in eos:
                ids = ids[: i + 1]
                break
        full = self.tokenizer.decode(prompt + ids)
        return full[len(self.tokenizer.decode(prompt)):], ids
