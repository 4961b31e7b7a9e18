"""What makes a comparison of servers fair on a shared machine, for bench.serving and
bench.vllm_bench: a run that starts on a busy machine refuses to record, and vLLM
runs at the best CPU thread binding found on this machine, searched by the run that
uses it and printed beside its table.

vLLM's CPU backend binds its OpenMP threads to cores and, by default, reserves a core
for its engine loop: on a 2-core machine its forward then gets one core while ours
gets two (measured here at C = 1 on chat prompts: 21.8 tok/s with its defaults, 27.4
unbound on two threads, 30.7 bound to both cores with none reserved).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping

from specdec.launch import VLLM_BINDING_VARS, vllm_cpu_binding

# A 1-minute load average above this share of the cores before a run starts means
# another job is using them: two CPU-bound servers, one measured while another
# process takes a core, differ by 25 % and more here.
BUSY_LOAD_PER_CPU = 0.5
# How long a run waits for the load to fall (the average decays over about a
# minute after a job ends) before it refuses.
IDLE_WAIT_S = 180.0
# vLLM's own variables that choose its CPU binding; set in the environment, they
# are taken as given and not searched.
BINDING_VARS = VLLM_BINDING_VARS


class Busy(RuntimeError):
    """The machine was busy before the run started: nothing would be worth recording."""


def wait_until_idle(cpus: int | None = None, wait_s: float = IDLE_WAIT_S,
                    loadavg: Callable[[], float] = lambda: os.getloadavg()[0],
                    sleep: Callable[[float], None] = time.sleep) -> float:
    """The 1-minute load average once it is under BUSY_LOAD_PER_CPU of the cores,
    waiting up to wait_s for it to fall; Busy, saying so, when it does not."""
    cpus = cpus or os.cpu_count() or 1
    limit = BUSY_LOAD_PER_CPU * cpus
    deadline = time.monotonic() + wait_s
    while (load := loadavg()) > limit:
        if time.monotonic() >= deadline:
            raise Busy(f"the machine is busy: 1-minute load average {load:.2f} on {cpus} "
                       f"cores (over {limit:.2f}) after waiting {wait_s:.0f} s; not recording "
                       "(--allow-busy records anyway, marked as such)")
        print(f"load average {load:.2f} on {cpus} cores: waiting for the machine to "
              "settle ...", flush=True)
        sleep(10.0)
    return load


def refuse_if_busy(allow_busy: bool) -> str | None:
    """wait_until_idle for a run that records: SystemExit saying why on a busy machine,
    or with allow_busy why the record is marked (None: the machine was idle)."""
    try:
        wait_until_idle()
    except Busy as e:
        if not allow_busy:
            raise SystemExit(str(e)) from None
        return str(e)
    return None


def vllm_bindings(cpus: int | None = None) -> dict[str, dict[str, str]]:
    """vLLM's CPU thread bindings worth trying: name -> its variables."""
    cpus = cpus or os.cpu_count() or 1
    return {
        "vLLM's default": {},
        f"unbound, {cpus} threads": {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                      "OMP_NUM_THREADS": str(cpus)},
        # The binding a verifier on vLLM's engine takes on all cores (specdec.launch).
        f"cores 0-{cpus - 1}, none reserved": vllm_cpu_binding(range(cpus)),
    }


def given_binding(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The binding the caller's environment sets, or None where it sets none."""
    env = os.environ if environ is None else environ
    given = {k: env[k] for k in (*BINDING_VARS, "OMP_NUM_THREADS") if k in env}
    return given if any(k in given for k in BINDING_VARS) else None


def best_binding(measure: Callable[[dict[str, str]], float],
                 candidates: dict[str, dict[str, str]] | None = None
                 ) -> tuple[str, dict[str, str], dict[str, float | str]]:
    """Each candidate binding measured once by measure(variables) -> tok/s (an exception:
    that binding failed, recorded with why): (the fastest's name, its variables, every
    candidate's tok/s or error)."""
    candidates = vllm_bindings() if candidates is None else candidates
    tried: dict[str, float | str] = {}
    for name, env in candidates.items():
        try:
            tried[name] = round(measure(env), 2)
        except Exception as e:  # noqa: BLE001 - a binding vLLM refuses is one not to pick
            tried[name] = f"failed: {e}"
        print(f"vLLM binding {name}: {tried[name]}", flush=True)
    ok = {n: v for n, v in tried.items() if isinstance(v, float)}
    if not ok:
        raise RuntimeError(f"vLLM started with no binding: {tried}")
    name = max(ok, key=ok.__getitem__)
    return name, candidates[name], tried


def numba_caveat(run: dict, vllm_modes: Iterable[str]) -> str | None:
    """A warning for a run whose vLLM ngram modes (of `vllm_modes`, its own, not ours as
    its proposer) ran before vLLM's processes got numba's own thread pool
    (launch.vllm_environ), or None."""
    if run.get("vllm_numba_layer", "omp") != "omp":
        return None
    crippled = sorted(m for m in vllm_modes if "ngram" in m and "remote" not in m)
    if not crippled:
        return None
    return (f"vLLM's {', '.join(crippled)} in this run had numba's OpenMP layer, which left "
            "vLLM's forward on one thread after each ngram lookup (its worker at one core): "
            "ratios to them may overstate ours (serving_vllm_numba.md prices it)")


def describe(env: Mapping[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in env.items()) or "vLLM's defaults"


# bench.serving's rows compared configuration to configuration: (label, ours, vLLM's),
# each the fastest row whose name starts so; best to best is of vLLM's own methods.
RATIOS = (("ours plain / vLLM plain", "ours plain", "vllm plain"),
          ("ngram K=4 / its ngram K=4", "ours ngram K=4", "vllm ngram K=4"),
          ("dynamic K: ours default / its dynamic SD", "ours default", "vllm ngram dynamic"),
          ("dynamic K on vLLM's engine: ours-vllm default / its dynamic SD",
           "ours-vllm default", "vllm ngram dynamic"),
          ("ours best / vLLM best (its own methods)", "ours ", "vllm "))


def binding_note(result: dict) -> str:
    """How a run chose vLLM's binding, with each candidate's tok/s where it searched."""
    b = result.get("vllm_binding_search")
    if not b:
        return ""
    if "searched" not in b:
        return f" ({b['chosen']})"
    return (f" (the fastest of those searched, {b['search']}: "
            + "; ".join(f"{n} {v if isinstance(v, str) else format(v, '.1f') + ' tok/s'}"
                        for n, v in b["searched"].items()) + ")")
