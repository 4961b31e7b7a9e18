"""Projections of the few rows of a decode or verify step on CPU, through a
small AVX-512 (or AVX2 + FMA) kernel (small_rows_gemm.c) built here on first use.

MKL and oneDNN lose 1.4-1.9x between 1 and 5 input rows on the default
model's shapes (see the C file), so a K = 4 verify step cost 1.4x a decode
step although both stream the same weights once. The kernel streams each
weight row once for all rows; its rows are batch-invariant (a row's output
does not depend on what else is in the call).

The shared library is compiled with the system C compiler (`$CC`, else gcc or
cc) for this CPU (-march=native) into the cache, keyed by the source, the
compiler and the CPU's flags. Without a compiler, on a CPU with neither AVX-512
nor AVX2 and FMA, or with SPECDEC_SMALL_ROWS_GEMM=0, `available()` is False and
callers keep torch's kernels; `unavailable_reason()` says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from specdec.models.prepare import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("small_rows_gemm.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
ENV_SWITCH = "SPECDEC_SMALL_ROWS_GEMM"
ENV_MAX_ROWS = "SPECDEC_SMALL_ROWS_MAX"

_reason: str | None = None


def _cpuinfo(field: str) -> str:
    """The value of the first `field` line of /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == field:
                return value.strip()
    except OSError:
        pass
    return ""


def _cpu_flags() -> str:
    return _cpuinfo("flags")


def _cpu_vendor() -> str:
    return _cpuinfo("vendor_id")


def max_rows() -> int:
    """Rows up to which the kernel beats oneDNN's packed weight on this CPU, and the
    most it takes in one pass over the weight; more run in blocked passes
    (SPECDEC_SMALL_ROWS_MAX overrides). A pass over the weight holds 16 rows with
    AVX-512 and 12 with AVX2, but past 12 rows the 16-row tiles are one column
    wide, and only an Intel core with full-width AVX-512 units still wins there.
    Measured (one layer's projections and the lm_head of SmolLM2-135M, 2 threads,
    small-rows / packed ms): Intel Xeon 12 / 16 rows 27.7 / 35.9 against 38.5 /
    41.3; AMD EPYC with AVX-512 (double-pumped) 12 / 14 / 16 rows 5.3 / 9.3 / 12.5
    against 5.4 / 5.8 / 6.0; AMD EPYC with AVX2, 16 rows in two passes tie."""
    override = os.environ.get(ENV_MAX_ROWS)
    if override:
        if not override.isdigit() or int(override) < 1:
            raise ValueError(f"{ENV_MAX_ROWS} must be a positive integer, got {override!r}")
        return int(override)
    if _vector_isa() == "avx512f" and _cpu_vendor() == "GenuineIntel":
        return 16
    return 12


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and (path := shutil.which(name)):
            return path
    return None


def prefetch_hint() -> str:
    """How the kernel's single passes ask for the next tile's weight rows: past the
    caches on AMD (non-temporal: the whole model streams through them every step),
    into L2 elsewhere, where a non-temporal prefetch fills L1 alone and the rows are
    pushed out before they are read (a decode step 2.1x slower on an Intel Xeon;
    the numbers are in the C file)."""
    return "_MM_HINT_NTA" if _cpu_vendor() == "AuthenticAMD" else "_MM_HINT_T1"


def _build(source: Path, cc: str, defines: dict[str, str]) -> Path:
    """Compile a kernel's C source into the cache (once per source, compiler, CPU and
    defines)."""
    flags = [*FLAGS, *(f"-D{name}={value}" for name, value in sorted(defines.items()))]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join(
        [source.read_text(), cc, version, " ".join(flags), _cpu_flags()]).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"{source.stem}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name, then renamed: concurrent builders never
    # load a half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *flags, str(source), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{Path(cc).name} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load(source: Path, switch: str,
         defines: dict[str, str] | None = None) -> tuple[ctypes.CDLL | None, str | None]:
    """A kernel's library built for this CPU (with `defines` as -D flags), or None and
    why not: turned off by `switch`=0, a CPU with neither AVX-512F nor AVX2 and FMA,
    no compiler, or a failed build."""
    if os.environ.get(switch, "1") == "0":
        return None, f"turned off by {switch}=0"
    if not _vector_isa():
        return None, "this CPU has neither AVX-512F nor AVX2 and FMA"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (set CC, or install gcc)"
    try:
        return ctypes.CDLL(str(_build(source, cc, defines or {}))), None
    except (OSError, RuntimeError) as e:
        return None, f"could not build or load the kernel: {e}"


@functools.cache
def _one_pass_max() -> int:
    return max_rows()


@functools.cache
def _kernel():
    """The C function, or None (with the reason in _reason, logged once)."""
    global _reason
    lib, _reason = load(SOURCE, ENV_SWITCH, {"PREFETCH_HINT": prefetch_hint()})
    if lib is None:
        log.warning("small-rows GEMM off, CPU projections use torch's kernels: %s", _reason)
        return None
    return gemm(lib)


def gemm(lib: ctypes.CDLL):
    """The kernel's entry point in a library load() built, its arguments declared:
    (x, w, b or None, y, M, N, K, threads, rows of one pass) as data pointers and ints."""
    fn = lib.small_rows_gemm
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int, ctypes.c_int64]
    fn.restype = None
    return fn


def _vector_isa() -> str | None:
    """The instruction set the kernel is built for on this CPU, or None."""
    flags = set(_cpu_flags().split())
    if "avx512f" in flags:
        return "avx512f"
    if {"avx2", "fma"} <= flags:
        return "avx2"
    return None


def available() -> bool:
    return _kernel() is not None


def unavailable_reason() -> str | None:
    _kernel()
    return _reason


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for float32 CPU tensors: x [M, K], weight [N, K], bias [N] -> [M, N],
    any M: up to max_rows() rows in one pass over the weight, more in blocked passes,
    each row's bits the same either way. Call only when available()."""
    fn = _kernel()
    if fn is None:
        raise RuntimeError(f"the small-rows GEMM is off: {_reason}")
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"small-rows GEMM takes 2-D float32, got x {x.dtype} {tuple(x.shape)}, "
                         f"weight {weight.dtype}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns, weight {weight.shape[1]}")
    x = x.contiguous()
    weight = weight.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if m:
        fn(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
           y.data_ptr(), m, n, x.shape[1], torch.get_num_threads(), _one_pass_max())
    return y
