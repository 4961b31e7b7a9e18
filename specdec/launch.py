"""`specdec up` (`make run`): compose.yaml's topology as local processes.

compose.yaml is the one list of services. This reads it, keeps the services
named under its `x-local` key, and for each one takes the command, fills in
the compose variables (the environment first, then `x-local.env`, then the
file's own defaults), turns service hostnames into 127.0.0.1 (every service
listens on its own port, so loopback needs no other change), and uses the
service's healthcheck address to wait for it. Services start once the ones
they depend on are healthy, as with `condition: service_healthy`; one that
exits is restarted, as with `restart: unless-stopped`, after a backoff that
doubles while it keeps failing (RestartPolicy); one whose health check keeps
failing once it has passed (a hung service) is stopped and restarted the same
way, which compose leaves to an orchestrator; SIGINT/SIGTERM stops them all, in
reverse order, each with SIGTERM and its own grace period.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from specdec.server import check_health
from specdec.tls import TlsConfig, add_client_arguments, client_from_args

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "compose.yaml"
EAGLE3_HEAD = ROOT / "drafter" / "weights" / "smollm2-135m-eagle3"

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?-)([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose variable syntax: $VAR, ${VAR}, ${VAR:-default} (unset or empty),
    ${VAR-default} (unset only), and $$ for a literal $."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, default = m.group(2), m.group(3)
        value = env.get(name)
        if op == ":-" and not value:
            return default
        if op == "-" and value is None:
            return default
        return value or ""

    return _VAR.sub(sub, text)


@dataclass(frozen=True)
class LocalService:
    name: str
    argv: tuple[str, ...]
    health: str | None  # HOST:PORT its healthcheck asks
    depends_on: tuple[str, ...]
    health_tls: TlsConfig | None = None  # the TLS its healthcheck speaks


def _health(service: dict, env: Mapping[str, str]) -> tuple[str | None, TlsConfig | None]:
    """The HOST:PORT and TLS of the service's `specdec health` healthcheck, whose TLS
    flags default, as there, to the internal TLS variables."""
    test = (service.get("healthcheck") or {}).get("test") or []
    if isinstance(test, str) or "health" not in test or test.index("health") + 1 >= len(test):
        return None, None
    i = test.index("health")
    p = argparse.ArgumentParser(add_help=False)
    add_client_arguments(p, env)
    flags, _ = p.parse_known_args([interpolate(str(a), env) for a in test[i + 2:]])
    return interpolate(str(test[i + 1]), env), client_from_args(flags)


def local_services(compose_path: Path = COMPOSE_FILE,
                   environ: Mapping[str, str] | None = None) -> list[LocalService]:
    """The `x-local` services of `compose_path`, with commands ready to run here, in an
    order where every service comes after the ones it depends on."""
    doc = yaml.safe_load(compose_path.read_text())
    local = doc.get("x-local")
    if not local or not local.get("services"):
        raise ValueError(f"{compose_path}: no x-local.services to start locally")
    services = doc.get("services") or {}
    env = {k: str(v) for k, v in (local.get("env") or {}).items()}
    env.update(os.environ if environ is None else environ)
    names = list(local["services"])
    unknown = [n for n in names if n not in services]
    if unknown:
        raise ValueError(f"{compose_path}: x-local.services names unknown services {unknown}")
    # "name:port" of any service in the file is that port on loopback here.
    hosts = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, services)) + r"):(\d+)")
    out: dict[str, LocalService] = {}
    for name in names:
        svc = services[name]
        command = svc.get("command")
        if not isinstance(command, list) or not command:
            raise ValueError(f"{compose_path}: service {name} needs a command list")
        argv = tuple(hosts.sub(r"127.0.0.1:\2", interpolate(str(a), env)) for a in command)
        deps = svc.get("depends_on") or []
        deps = tuple(d for d in (deps if isinstance(deps, list) else deps.keys()) if d in names)
        health, health_tls = _health(svc, env)
        out[name] = LocalService(name, argv, health, deps, health_tls)
    ordered: list[LocalService] = []
    seen: set[str] = set()

    def visit(n: str, path: tuple[str, ...]) -> None:
        if n in seen:
            return
        if n in path:
            raise ValueError(f"{compose_path}: dependency cycle {' -> '.join((*path, n))}")
        for d in out[n].depends_on:
            visit(d, (*path, n))
        seen.add(n)
        ordered.append(out[n])

    for n in names:
        visit(n, ())
    return ordered


def service_flag(service: str, flag: str, compose_path: Path = COMPOSE_FILE) -> str:
    """The value `flag` has in the local command of `service`, as compose.yaml and its
    x-local.env give it (not the caller's environment): benchmarks run drafters with
    the options the deployment uses, from this one place."""
    svc = next((s for s in local_services(compose_path, {}) if s.name == service), None)
    if svc is None or flag not in svc.argv[:-1]:
        raise ValueError(f"{compose_path}: local service {service!r} has no {flag} value")
    return svc.argv[svc.argv.index(flag) + 1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing holds now. Fixed ports in Linux's ephemeral
    range (32768-60999) can be held for a moment by any client socket; ask the kernel."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PORT_FLAGS = ("--port", "--grpc-port")
_LOOPBACK = re.compile(r"127\.0\.0\.1:(\d+)")


def on_free_ports(services: list[LocalService]) -> tuple[list[LocalService], dict[int, int]]:
    """`services` with every port they bind or dial (`--port`, `--grpc-port`,
    127.0.0.1:PORT in arguments and health addresses) moved to a free one; and the map
    from compose.yaml's port to the one used here."""
    fixed: set[int] = set()
    for svc in services:
        for i, arg in enumerate(svc.argv):
            if i and svc.argv[i - 1] in _PORT_FLAGS:
                fixed.add(int(arg))
            fixed.update(int(p) for p in _LOOPBACK.findall(arg))
        if svc.health:
            fixed.update(int(p) for p in _LOOPBACK.findall(svc.health))
    ports: dict[int, int] = {}
    for port in sorted(fixed):
        new = free_port()
        while new in ports.values() or new in fixed:
            new = free_port()
        ports[port] = new

    def moved(text: str) -> str:
        return _LOOPBACK.sub(lambda m: f"127.0.0.1:{ports[int(m.group(1))]}", text)

    out = []
    for svc in services:
        argv = [str(ports[int(a)]) if i and svc.argv[i - 1] in _PORT_FLAGS else moved(a)
                for i, a in enumerate(svc.argv)]
        out.append(dataclasses.replace(svc, argv=tuple(argv),
                                       health=moved(svc.health) if svc.health else None))
    return out, ports


def taken_ports(services: list[LocalService], attempts: int = 3,
                wait_s: float = 1.0) -> list[tuple[str, str, int]]:
    """The (service, host, port) its --port or --grpc-port names that cannot be bound now,
    after `attempts` tries (a client socket may hold a port of the ephemeral range for a
    moment; a listening server holds it for good)."""
    wanted = []
    for svc in services:
        host = "127.0.0.1"
        if "--host" in svc.argv:
            host = svc.argv[svc.argv.index("--host") + 1]
        for i, arg in enumerate(svc.argv[:-1]):
            if arg in _PORT_FLAGS and int(svc.argv[i + 1]) > 0:
                wanted.append((svc.name, host, int(svc.argv[i + 1])))
    taken = wanted
    for attempt in range(attempts):
        taken = [w for w in taken if not _bindable(w[1], w[2])]
        if not taken or attempt == attempts - 1:
            break
        time.sleep(wait_s)
    return taken


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# vLLM's venv (`make vllm-venv`): `specdec-verifier --engine vllm` runs on its interpreter.
VLLM_PYTHON_ENV = "SPECDEC_VLLM_PYTHON"
VLLM_PYTHON = ROOT / ".venv-peers" / "bin" / "python"


def vllm_environ(python: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a process on vLLM's interpreter `python`, as vLLM's CPU guide
    asks: its environment's Intel OpenMP preloaded (without it vLLM warns, and
    speculative decoding on CPU loses much of its speed), tokenizers' own threads off.
    Harmless where the library is absent (a GPU build).

    numba gets its own thread pool (workqueue) unless the caller names one: its default
    OpenMP layer then shares the preloaded runtime with torch, and vLLM's ngram
    proposer, which sets numba's thread count to 1 around each lookup, leaves every
    forward after it on one thread (measured in vLLM's worker on 2 cores: one busy
    thread instead of two, its engine loop spinning on the other core;
    bench/results/serving_vllm_numba.md prices it)."""
    env = dict(os.environ if environ is None else environ, TOKENIZERS_PARALLELISM="false")
    env.setdefault("NUMBA_THREADING_LAYER", "workqueue")
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    preload = env.get("LD_PRELOAD", "")
    if iomp.exists() and str(iomp) not in preload.split(":"):
        env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), preload) if x)
    return env


def _is_vllm_verifier(argv: tuple[str, ...]) -> bool:
    name, *rest = argv
    return name == "specdec-verifier" and "--engine" in rest and \
        rest[rest.index("--engine") + 1:][:1] == ["vllm"]


def _vllm_python() -> Path:
    python = Path(os.environ.get(VLLM_PYTHON_ENV) or VLLM_PYTHON)
    if not python.exists():
        raise FileNotFoundError(f"{python}: no vLLM environment for --engine vllm "
                                f"(run `make vllm-venv`, or set {VLLM_PYTHON_ENV})")
    return python


# vLLM's CPU thread binding: its OpenMP threads' cores, and the cores kept for its
# engine loop.
VLLM_BINDING_VARS = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")


def vllm_cpu_binding(cpus: Iterable[int]) -> dict[str, str]:
    """vLLM's CPU thread binding for one engine on `cpus`: its OpenMP threads on all of
    them, none reserved for its engine loop. vLLM's default reserves a core for the loop,
    which on 2 cores leaves its forward one (bench/results/serving_vllm_engine_bound.md
    measures both)."""
    ranges = []
    # Consecutive cores share core - index: one "first-last" range each.
    for _, run in itertools.groupby(enumerate(sorted(set(cpus))), lambda ic: ic[1] - ic[0]):
        cores = [c for _, c in run]
        ranges.append(f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0]))
    return dict(zip(VLLM_BINDING_VARS, (",".join(ranges), "0"), strict=True))


def command_environ(argv: tuple[str, ...]) -> dict[str, str] | None:
    """The environment a compose command's process needs beyond this one's (None: this
    one's): vLLM's, for a verifier on vLLM's engine, bound to this process's CPUs
    (vllm_cpu_binding) unless the environment binds it already or it runs a tensor-
    parallel group (one binding a rank, which the operator gives)."""
    if not _is_vllm_verifier(argv):
        return None
    env = vllm_environ(_vllm_python())
    tp = argv[argv.index("--tensor-parallel-size") + 1] if "--tensor-parallel-size" in argv \
        else "1"
    if tp == "1" and not any(k in env for k in VLLM_BINDING_VARS):
        env.update(vllm_cpu_binding(os.sched_getaffinity(0)))
    return env


def command_line(argv: tuple[str, ...]) -> list[str]:
    """The process to start for a compose command: its console script from this
    installation, or for a verifier on vLLM's engine the module on vLLM's interpreter
    ($SPECDEC_VLLM_PYTHON, default .venv-peers), which has vLLM where this one has not."""
    name, *rest = argv
    if _is_vllm_verifier(argv):
        return [str(_vllm_python()), "-m", "verifier", *rest]
    return [_executable(name), *rest]


def _executable(name: str) -> str:
    # The console scripts of this installation first (the virtual environment's bin).
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name}: not installed (run `make install`)")
    return found


@dataclass(frozen=True)
class RestartPolicy:
    """How `LocalStack.supervise` restarts a service that exited or hangs.

    Each service's health check is its compose healthcheck (`specdec health
    HOST:PORT`, gRPC health; for the gateway that of its gRPC port, which is up while
    the gateway process is, whereas its HTTP /health answers 503 while no verifier is
    healthy, which no gateway restart would mend)."""

    backoff_s: tuple[float, float] = (1.0, 30.0)  # first delay before a restart, doubling to the cap
    # A service up this long is restarted after the first delay again: Docker's rule for
    # `restart: unless-stopped` (10 s). At 60 s, a verifier killed about once a minute in
    # the soak (bench/results/soak.md) was kept down 16 s at a time, its backoff never reset.
    reset_after_s: float = 10.0
    health_interval_s: float = 5.0  # between health checks of a running service (compose's)
    health_timeout_s: float = 3.0  # one check (compose's timeout)
    health_failures: int = 3  # failed checks in a row, after one passed, that restart it
    stop_grace_s: float = 5.0  # SIGTERM to SIGKILL for a service restarted as hung


@dataclass
class _Watch:
    """supervise's view of one service."""

    started: float  # time.monotonic() of its last start
    delay: float  # backoff before its next restart
    restart_at: float | None = None  # it is down, to be started then
    passed: bool = False  # a health check passed since its last start
    failures: int = 0  # failed health checks in a row since one passed
    next_check: float = 0.0


class LocalStack:
    def __init__(self, services: list[LocalService], log_dir: Path, log=print,
                 start_attempts: int = 3, restart: RestartPolicy = RestartPolicy()):
        self.services = services
        self.log_dir = log_dir
        self.log = log
        self.restart = restart
        # A service that exits before it is healthy is started again, as compose's
        # `restart: unless-stopped` would, up to this many starts in all. The local ports
        # (50050-50063) lie in Linux's ephemeral range (32768-60999): any client socket on
        # the host (a drafter stream of the verifier, a health check) can hold one as its
        # source port at the moment a service binds it, and a new start binds it once the
        # socket has moved on.
        self.start_attempts = start_attempts
        self.procs: dict[str, subprocess.Popen] = {}
        self._stopping = threading.Event()

    def _spawn(self, svc: LocalService) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        out = (self.log_dir / f"{svc.name}.log").open("a")
        argv = command_line(svc.argv)
        self.procs[svc.name] = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL,
                                                env=command_environ(svc.argv),
                                                start_new_session=True)

    def _wait_healthy(self, svc: LocalService, deadline: float) -> None:
        if svc.health is None:
            return
        starts = 1
        while not check_health(svc.health, timeout_s=1.0, tls=svc.health_tls):
            proc = self.procs[svc.name]
            if proc.poll() is not None:
                if starts >= self.start_attempts:
                    raise RuntimeError(
                        f"{svc.name} exited with code {proc.returncode} at start "
                        f"({starts} starts); see {self.log_dir / (svc.name + '.log')}")
                self.log(f"{svc.name} exited with code {proc.returncode} at start; "
                         f"starting it again")
                time.sleep(1.0)  # a short-lived holder of its port moves on
                self._spawn(svc)
                starts += 1
            if time.monotonic() > deadline or self._stopping.is_set():
                raise TimeoutError(f"{svc.name} not healthy at {svc.health}; see "
                                   f"{self.log_dir / (svc.name + '.log')}")
            time.sleep(0.25)

    def start(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        started: set[str] = set()
        for svc in self.services:
            for dep in svc.depends_on:
                if dep not in started:
                    self._wait_healthy(next(s for s in self.services if s.name == dep), deadline)
                    started.add(dep)
            self.log(f"starting {svc.name}: {' '.join(svc.argv)}")
            self._spawn(svc)
        for svc in self.services:
            if svc.name not in started:
                self._wait_healthy(svc, deadline)
        self.log("all services healthy")

    def supervise(self, stop: threading.Event, poll_s: float = 0.5) -> None:
        """Until `stop` is set, restart services that exit or whose health check fails
        `restart.health_failures` times in a row, each restart after a backoff."""
        now = time.monotonic()
        watches = {svc.name: _Watch(now, self.restart.backoff_s[0]) for svc in self.services}
        while not stop.wait(poll_s):
            for svc in self.services:
                if svc.name in self.procs:
                    self._watch(svc, watches[svc.name], time.monotonic())

    def _watch(self, svc: LocalService, w: _Watch, now: float) -> None:
        policy = self.restart
        if w.restart_at is not None:  # down, waiting out its backoff
            if now >= w.restart_at:
                self.log(f"starting {svc.name} again")
                self._spawn(svc)
                w.started, w.restart_at, w.passed, w.failures = now, None, False, 0
            return
        proc = self.procs[svc.name]
        if proc.poll() is not None:
            reason = f"exited with code {proc.returncode}"
        elif svc.health is not None and now >= w.next_check:
            w.next_check = now + policy.health_interval_s
            if check_health(svc.health, timeout_s=policy.health_timeout_s,
                            tls=svc.health_tls):
                w.passed, w.failures = True, 0
                return
            if w.passed:  # before its first pass it is starting (loading a model, say)
                w.failures += 1
            if w.failures < policy.health_failures:
                return
            reason = f"failed {w.failures} health checks in a row"
            self._terminate(svc, proc, policy.stop_grace_s)
        else:
            return
        if now - w.started >= policy.reset_after_s:
            w.delay = policy.backoff_s[0]
        self.log(f"{svc.name} {reason}; restarting in {w.delay:g} s")
        w.restart_at = now + w.delay
        w.delay = min(w.delay * 2, policy.backoff_s[1])

    def _terminate(self, svc: LocalService, proc: subprocess.Popen, grace_s: float) -> None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.log(f"{svc.name} did not stop within {grace_s:g} s; killing it")
            proc.kill()
            proc.wait()

    def stop(self, grace_s: float = 15.0) -> None:
        self._stopping.set()
        for svc in reversed(self.services):
            proc = self.procs.get(svc.name)
            if proc is None or proc.poll() is not None:
                continue
            self._terminate(svc, proc, grace_s)

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_arguments(p) -> None:
    p.add_argument("--compose-file", default=str(COMPOSE_FILE))
    from specdec.models.prepare import cache_dir

    p.add_argument("--log-dir", default=str(cache_dir() / "logs"))
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for health")


def run(args) -> int:
    from specdec.models.prepare import prepare_default_model

    model_dir = prepare_default_model()
    # Local stand-ins for the container paths (the user's environment still wins).
    environ = {"SPECDEC_MODEL_ROOT": str(model_dir.parent), "SPECDEC_MODEL": model_dir.name,
               "EAGLE3_HEAD": str(EAGLE3_HEAD), **os.environ}
    try:
        services = local_services(Path(args.compose_file), environ)
    except ValueError as e:  # a bad compose file, a TLS file missing
        print(f"specdec up: {e}", file=sys.stderr)
        return 1
    taken = taken_ports(services)
    if taken:
        names = ", ".join(f"{host}:{port} ({name})" for name, host, port in taken)
        print(f"specdec up: port(s) already in use: {names}. Is another `make run` up? Stop "
              f"it, or free the port(s).", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stack = LocalStack(services, Path(args.log_dir), log=lambda s: print(s, flush=True))
    try:
        stack.start(args.timeout)
    except (RuntimeError, TimeoutError, FileNotFoundError) as e:
        print(f"specdec up: {e}", file=sys.stderr)
        stack.stop()
        return 1
    gateway = next((s for s in services if s.name == "gateway"), None)
    port = "8000"
    if gateway is not None and "--port" in gateway.argv:
        port = gateway.argv[gateway.argv.index("--port") + 1]
    print(f"""
specdec is up: http://127.0.0.1:{port}/v1 (OpenAI-compatible), logs in {args.log_dir}

  curl -s http://127.0.0.1:{port}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"messages": [{{"role": "user", "content": "Rewrite in French: good morning, friends."}}],
         "max_tokens": 64, "speculative": {{"method": "ngram", "num_speculative_tokens": 4}}}}'

Ctrl-C stops everything.""", flush=True)
    try:
        stack.supervise(stop)
    finally:
        print("stopping ...", flush=True)
        stack.stop()
    return 0
