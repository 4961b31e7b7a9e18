"""The whole stack as `make run` starts it (compose.yaml's x-local services as real
processes on loopback), on ports the kernel hands out rather than compose.yaml's fixed
ones, so that tests run beside a `make run` that holds :8000, :50050, ... ."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import grpc

from specdec.launch import EAGLE3_HEAD, LocalStack, local_services, on_free_ports
from specdec.pb import verifier_pb2, verifier_pb2_grpc


@dataclasses.dataclass
class RunningStack:
    stack: LocalStack
    ports: dict[int, int]  # compose.yaml's port -> the port it runs on here

    @property
    def procs(self):
        return self.stack.procs

    def address(self, compose_port: int) -> str:
        return f"127.0.0.1:{self.ports[compose_port]}"

    @property
    def base_url(self) -> str:
        return f"http://{self.address(8000)}/v1"

    @property
    def grpc_address(self) -> str:
        return self.address(50050)

    @property
    def verifier_address(self) -> str:
        return self.address(50051)

    def load(self) -> verifier_pb2.LoadReport:
        with grpc.insecure_channel(self.verifier_address) as ch:
            return verifier_pb2_grpc.VerifierStub(ch).Load(verifier_pb2.LoadRequest(), timeout=5)

    def wait_drafters(self, names, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if set(names) <= {d.name for d in self.load().drafters if d.available}:
                return
            time.sleep(0.25)
        raise AssertionError(f"drafters {names} not available")


@contextmanager
def running_stack(model_dir: Path, log_dir: Path,
                  environ: Mapping[str, str] | None = None) -> Iterator[RunningStack]:
    """Start the stack the way `specdec up` does (same compose definitions and local
    stand-ins for the container paths), supervised, until the block ends."""
    env = {"SPECDEC_MODEL_ROOT": str(model_dir.parent), "SPECDEC_MODEL": model_dir.name,
           "EAGLE3_HEAD": str(EAGLE3_HEAD), "SPECDEC_THREADS": "1",
           **(os.environ if environ is None else environ)}
    services, ports = on_free_ports(local_services(environ=env))
    stop = threading.Event()
    s = LocalStack(services, log_dir, log=lambda _: None)
    try:
        s.start(timeout_s=300)
        threading.Thread(target=s.supervise, args=(stop, 0.2), daemon=True).start()
        running = RunningStack(s, ports)
        running.wait_drafters(("ngram", "suffix", "eagle3"))
        yield running
    finally:
        stop.set()
        s.stop()
