"""compose.yaml is the one list of services: the local launcher reads it, and
every command in it is valid for the CLI it calls. The launcher starts a service
again when it exits at start; once up, it restarts one that exits after a
backoff that doubles, and one whose health check keeps failing."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import pytest
import yaml

from drafter.__main__ import build_parser as drafter_parser
from gateway.__main__ import build_parser as gateway_parser
from specdec import tls
from specdec.launch import (
    COMPOSE_FILE,
    VLLM_PYTHON_ENV,
    LocalService,
    LocalStack,
    RestartPolicy,
    command_environ,
    command_line,
    interpolate,
    local_services,
    service_flag,
    taken_ports,
    vllm_cpu_binding,
)
from specdec.server import check_health
from tests.ports import free_port
from verifier.__main__ import build_parser as verifier_parser

PARSERS = {"specdec-drafter": drafter_parser, "specdec-verifier": verifier_parser,
           "specdec-gateway": gateway_parser}
ENV = {"SPECDEC_MODEL_ROOT": "/m", "SPECDEC_MODEL": "target", "EAGLE3_HEAD": "/h"}


def test_interpolate():
    env = {"A": "1", "EMPTY": ""}
    assert interpolate("x${A}y$A", env) == "x1y1"
    assert interpolate("${B:-d}|${EMPTY:-d}|${EMPTY-d}|${B-d}", env) == "d|d||d"
    assert interpolate("$$A ${A:-z}", env) == "$A 1"
    assert interpolate("${B}", env) == ""


def test_local_services_from_compose():
    services = local_services(environ=ENV)
    names = [s.name for s in services]
    assert set(names) == {"ngram", "suffix", "eagle3", "verifier", "gateway"}
    # Dependencies first.
    assert names.index("verifier") > max(names.index(d) for d in ("ngram", "suffix", "eagle3"))
    assert names.index("gateway") > names.index("verifier")
    by_name = {s.name: s for s in services}
    verifier = by_name["verifier"].argv
    # Service hostnames became loopback; x-local.env replaced the GPU defaults.
    assert "ngram=127.0.0.1:50061" in verifier and "eagle3=127.0.0.1:50063" in verifier
    assert "suffix=127.0.0.1:50064" in verifier
    assert verifier[verifier.index("--device") + 1] == "cpu"
    assert verifier[verifier.index("--model") + 1] == "/m/target"
    assert by_name["gateway"].argv[by_name["gateway"].argv.index("--verifier") + 1] == \
        "127.0.0.1:50051"
    assert by_name["eagle3"].argv[by_name["eagle3"].argv.index("--model") + 1] == "/h"
    assert by_name["eagle3"].argv[by_name["eagle3"].argv.index("--lookup-min") + 1] == "2"
    assert by_name["eagle3"].argv[by_name["eagle3"].argv.index("--min-confidence") + 1] == "0.3"
    assert {s.name: s.health for s in services} == {
        "ngram": "127.0.0.1:50061", "suffix": "127.0.0.1:50064", "eagle3": "127.0.0.1:50063",
        "verifier": "127.0.0.1:50051", "gateway": "127.0.0.1:50050"}
    gw = by_name["gateway"].argv
    assert gw[gw.index("--speculative-method") + 1] == "ngram"  # x-local.env's, not eagle3
    assert verifier[verifier.index("--max-num-seqs") + 1] == "16"
    # The environment wins over x-local.env and over the file's defaults.
    again = local_services(environ={**ENV, "SPECDEC_METHOD": "eagle3",
                                    "VERIFIER_MAX_NUM_SEQS": "32"})
    by_name = {s.name: s for s in again}
    gw, verifier = by_name["gateway"].argv, by_name["verifier"].argv
    assert gw[gw.index("--speculative-method") + 1] == "eagle3"
    assert verifier[verifier.index("--max-num-seqs") + 1] == "32"


def test_the_verifier_on_vllm_runs_on_vllms_interpreter(tmp_path: Path, monkeypatch):
    """SPECDEC_ENGINE=vllm: compose's verifier command asks for vLLM's engine, which the
    launcher starts on vLLM's own interpreter; ours otherwise, and a clear error where
    vLLM's environment is missing."""
    verifier = {s.name: s for s in local_services(
        environ={**ENV, "SPECDEC_ENGINE": "vllm", "VERIFIER_TP": "2"})}["verifier"].argv
    assert verifier[verifier.index("--engine") + 1] == "vllm"
    assert verifier[verifier.index("--tensor-parallel-size") + 1] == "2"
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(python))
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert command_line(verifier) == [str(python), "-m", "verifier", *verifier[1:]]
    # vLLM's environment's Intel OpenMP is preloaded, as vLLM's CPU guide asks.
    assert command_environ(verifier).get("LD_PRELOAD") is None
    (tmp_path / "venv" / "lib").mkdir()
    (tmp_path / "venv" / "lib" / "libiomp5.so").touch()
    assert command_environ(verifier)["LD_PRELOAD"] == str(tmp_path / "venv" / "lib" /
                                                          "libiomp5.so")
    # numba on its own thread pool, which vLLM's ngram cannot shrink torch's through,
    # unless the environment names one.
    monkeypatch.delenv("NUMBA_THREADING_LAYER", raising=False)
    assert command_environ(verifier)["NUMBA_THREADING_LAYER"] == "workqueue"
    monkeypatch.setenv("NUMBA_THREADING_LAYER", "tbb")
    assert command_environ(verifier)["NUMBA_THREADING_LAYER"] == "tbb"
    # vLLM's CPU threads: bound by the operator for a tensor-parallel group (TP 2 here);
    # for one engine, on every core this process may use, none reserved, unless the
    # environment binds them.
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in command_environ(verifier)
    one = {s.name: s for s in local_services(
        environ={**ENV, "SPECDEC_ENGINE": "vllm"})}["verifier"].argv
    assert command_environ(one)["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert command_environ(one)["VLLM_CPU_OMP_THREADS_BIND"] == vllm_cpu_binding(
        os.sched_getaffinity(0))["VLLM_CPU_OMP_THREADS_BIND"]
    assert vllm_cpu_binding([3, 0, 1, 2, 6, 8, 7]) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0-3,6-8", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert command_environ(one)["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in command_environ(one)
    plain = {s.name: s for s in local_services(environ=ENV)}["verifier"].argv
    assert plain[plain.index("--engine") + 1] == "specdec"
    assert command_line(plain)[0].endswith("specdec-verifier")
    assert command_environ(plain) is None
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="make vllm-venv"):
        command_line(verifier)


@pytest.mark.parametrize("local", [True, False], ids=["local", "compose-defaults"])
def test_every_command_parses_with_its_cli(local):
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    env = {**doc["x-local"]["env"], **ENV} if local else {}
    checked = 0
    for svc in doc["services"].values():
        command = svc.get("command")
        if not command or command[0] not in PARSERS:
            continue
        argv = [interpolate(str(a), env) for a in command[1:]]
        PARSERS[command[0]]().parse_args(argv)  # exits (SystemExit) on a bad option
        checked += 1
    assert checked == 6  # ngram, suffix, eagle3, draft_model, verifier, gateway


def test_service_flag_reads_the_local_command():
    assert service_flag("eagle3", "--lookup-min") == "2"
    assert service_flag("eagle3", "--tree-width") == "3"
    assert service_flag("verifier", "--max-num-seqs") == "16"  # x-local.env, not the default
    with pytest.raises(ValueError, match=r"local service 'ngram' has no --lookup-min value"):
        service_flag("ngram", "--lookup-min")
    with pytest.raises(ValueError, match=r"local service 'nope' has no --port value"):
        service_flag("nope", "--port")


def test_bad_compose_files_are_named(tmp_path: Path):
    f = tmp_path / "compose.yaml"
    f.write_text("services: {a: {command: [x]}}\n")
    with pytest.raises(ValueError, match="no x-local.services"):
        local_services(f, {})
    f.write_text("services: {a: {command: [x]}}\nx-local: {services: [a, b]}\n")
    with pytest.raises(ValueError, match=r"unknown services \['b'\]"):
        local_services(f, {})
    f.write_text("services: {a: {command: [x], depends_on: [b]}, b: {command: [y], depends_on: "
                 "{a: {condition: service_healthy}}}}\nx-local: {services: [a, b]}\n")
    with pytest.raises(ValueError, match="dependency cycle"):
        local_services(f, {})


# A service for LocalStack: it exits with code 3 while MARKER holds a positive count
# (counting it down), then serves gRPC health on PORT until stopped.
_FLAKY = """
import asyncio, sys
from pathlib import Path
from specdec.server import serve_until_signal, start_server
marker, port = Path(sys.argv[1]), sys.argv[2]
left = int(marker.read_text())
if left > 0:
    marker.write_text(str(left - 1))
    sys.exit(3)
async def main():
    await serve_until_signal(await start_server(f"127.0.0.1:{port}", lambda s: None, []))
asyncio.run(main())
"""


@pytest.mark.parametrize("failures,healthy", [(2, True), (3, False)])
def test_local_stack_starts_a_service_again_when_it_exits_at_start(tmp_path: Path, failures,
                                                                   healthy):
    marker = tmp_path / "left"
    marker.write_text(str(failures))
    port = free_port()
    svc = LocalService("flaky", ("python", "-c", _FLAKY, str(marker), str(port)),
                       f"127.0.0.1:{port}", ())
    logged: list[str] = []
    with LocalStack([svc], tmp_path / "logs", log=logged.append, start_attempts=3) as stack:
        if healthy:
            stack.start(timeout_s=60)
            assert check_health(f"127.0.0.1:{port}")
        else:
            with pytest.raises(RuntimeError, match=r"flaky exited with code 3 at start "
                                                   r"\(3 starts\); see .*flaky\.log"):
                stack.start(timeout_s=60)
    assert marker.read_text() == "0"
    assert sum("starting it again" in line for line in logged) == 2


def test_a_taken_port_is_named_before_anything_starts():
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        free = free_port()
        services = [LocalService("gateway", ("specdec-gateway", "--host", "127.0.0.1", "--port",
                                             str(port), "--grpc-port", str(free)), None, ()),
                    LocalService("ngram", ("specdec-drafter", "--port", str(free_port())),
                                 None, ())]
        assert taken_ports(services, wait_s=0.01) == [("gateway", "127.0.0.1", port)]
    assert taken_ports(services, wait_s=0.01) == []


def _supervised(stack: LocalStack, until, timeout_s: float = 30.0) -> bool:
    """Run stack.supervise on a thread until `until()` holds (or the timeout)."""
    stop = threading.Event()
    thread = threading.Thread(target=stack.supervise, args=(stop, 0.01))
    thread.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not until() and time.monotonic() < deadline:
            time.sleep(0.01)
        return until()
    finally:
        stop.set()
        thread.join(10)


def _spawn_times(stack: LocalStack) -> list[float]:
    times: list[float] = []
    spawn = stack._spawn

    def timed(svc):
        times.append(time.monotonic())
        spawn(svc)

    stack._spawn = timed
    return times


def _delays(logged: list[str]) -> list[float]:
    return [float(m.group(1)) for line in logged
            if (m := re.search(r"restarting in ([0-9.]+) s$", line))]


@pytest.mark.parametrize("lives_s,want", [(0.0, [0.05, 0.1, 0.2, 0.2, 0.2]),
                                          (0.5, [0.05, 0.05, 0.05])],
                         ids=["crash-loop", "reset-after-uptime"])
def test_supervise_restarts_an_exited_service_after_a_doubling_backoff(tmp_path: Path, lives_s,
                                                                        want):
    """A service that keeps exiting waits 0.05, 0.1, 0.2 (the cap), ... s before each
    start; one that stayed up past reset_after_s starts again after the first delay."""
    svc = LocalService("crashy", ("python", "-c", f"import time; time.sleep({lives_s}); "
                                                  f"raise SystemExit(3)"), None, ())
    logged: list[str] = []
    policy = RestartPolicy(backoff_s=(0.05, 0.2), reset_after_s=0.3)
    with LocalStack([svc], tmp_path / "logs", log=logged.append, restart=policy) as stack:
        stack.start(timeout_s=30)
        spawned = _spawn_times(stack)
        assert _supervised(stack, lambda: len(_delays(logged)) >= len(want))
    assert _delays(logged)[: len(want)] == want
    assert all(line.startswith("crashy exited with code 3; restarting in")
               for line in logged if "restarting in" in line)
    # Between two starts: the service's life, then the delay.
    assert len(spawned) >= len(want) - 1
    assert all(b - a >= lives_s + d for a, b, d in zip(spawned, spawned[1:], want[1:],
                                                       strict=False))


# Serves gRPC health on PORT; while MARKER holds a positive count (counting it down),
# it turns NOT_SERVING after 0.3 s and stays up, as a hung service does.
_HANGS = """
import asyncio, sys
from pathlib import Path
from specdec.server import start_server
marker, port = Path(sys.argv[1]), sys.argv[2]
left = int(marker.read_text())
marker.write_text(str(max(left - 1, 0)))
async def main():
    service = await start_server(f"127.0.0.1:{port}", lambda s: None, [])
    if left > 0:
        await asyncio.sleep(0.3)
        await service.set_serving(False)
    await asyncio.Event().wait()
asyncio.run(main())
"""


def test_supervise_restarts_a_service_whose_health_check_keeps_failing(tmp_path: Path):
    marker = tmp_path / "left"
    marker.write_text("1")
    port = free_port()
    svc = LocalService("hung", ("python", "-c", _HANGS, str(marker), str(port)),
                       f"127.0.0.1:{port}", ())
    logged: list[str] = []
    policy = RestartPolicy(backoff_s=(0.05, 1.0), health_interval_s=0.05, health_timeout_s=1.0,
                           health_failures=3, stop_grace_s=2.0)
    with LocalStack([svc], tmp_path / "logs", log=logged.append, restart=policy) as stack:
        stack.start(timeout_s=60)
        first = stack.procs["hung"]
        assert _supervised(stack, lambda: stack.procs["hung"] is not first
                           and check_health(f"127.0.0.1:{port}"), timeout_s=60)
        assert first.poll() is not None  # stopped, not left running beside the new one
    assert "hung failed 3 health checks in a row; restarting in 0.05 s" in logged
    assert "starting hung again" in logged
    assert marker.read_text() == "0"


def test_a_service_not_yet_healthy_is_left_to_start(tmp_path: Path):
    """Failed health checks count only once one has passed: a service loading its
    model is not restarted for being slow."""
    svc = LocalService("slow", ("python", "-c", "import time; time.sleep(30)"),
                       f"127.0.0.1:{free_port()}", ())
    logged: list[str] = []
    policy = RestartPolicy(health_interval_s=0.02, health_timeout_s=0.05, health_failures=2)
    stack = LocalStack([svc], tmp_path / "logs", log=logged.append, restart=policy)
    with stack:
        stack._spawn(svc)
        proc = stack.procs["slow"]
        assert not _supervised(stack, lambda: False, timeout_s=0.5)  # about 20 checks
        assert stack.procs["slow"] is proc and proc.poll() is None
    assert not any("restarting" in line for line in logged)


# A service that serves gRPC health on PORT over the internal TLS of its environment.
_TLS = """
import asyncio, sys
from specdec.server import serve_until_signal, start_server
from specdec.tls import TlsConfig
async def main():
    await serve_until_signal(await start_server(f"127.0.0.1:{sys.argv[1]}", lambda s: None,
                                                [], tls=TlsConfig.from_env()))
asyncio.run(main())
"""


def test_local_stack_checks_health_over_the_internal_tls(tmp_path: Path, pki, monkeypatch):
    """The services inherit SPECDEC_INTERNAL_TLS_* (mutual TLS here); their health checks
    speak it, as compose.yaml's do, except the gateway's (--plaintext: its gRPC API has
    TLS only of its own); a plaintext check would never see a TLS service healthy."""
    env = {tls.CERT_ENV: str(pki.server_cert), tls.KEY_ENV: str(pki.server_key),
           tls.CA_ENV: str(pki.ca), tls.MTLS_ENV: "1"}
    by_name = {s.name: s for s in local_services(environ={**ENV, **env})}
    assert by_name["verifier"].health_tls == by_name["ngram"].health_tls == \
        tls.TlsConfig(str(pki.server_cert), str(pki.server_key), str(pki.ca))
    assert by_name["gateway"].health_tls is None
    assert all(s.health_tls is None for s in local_services(environ=ENV))

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    port = free_port()
    svc = LocalService("tls", ("python", "-c", _TLS, str(port)), f"127.0.0.1:{port}", (),
                       by_name["verifier"].health_tls)
    with LocalStack([svc], tmp_path / "logs", log=lambda _: None) as stack:
        stack.start(timeout_s=60)
        assert not check_health(f"127.0.0.1:{port}", timeout_s=1.0)
    plaintext = LocalService("tls", svc.argv, svc.health, ())
    with LocalStack([plaintext], tmp_path / "logs", log=lambda _: None) as stack:
        with pytest.raises(TimeoutError, match="tls not healthy"):
            stack.start(timeout_s=5)
