"""Triton kernels tested on CPU under Triton's interpreter.

Triton decorates its own library (tl.max, ...) when first imported, so interpret mode
must be on before any `import triton` in the process, and in a full test run something
(torch._dynamo, via transformers) imports it long before a test module. Without CUDA a
module's kernel tests therefore run in a child pytest that starts with
TRITON_INTERPRET=1; in the parent they skip, marked `needs_triton`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TRITON_RUNS_HERE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(
    not TRITON_RUNS_HERE, reason="no CUDA: runs in a child with TRITON_INTERPRET=1")


def run_interpreted(test_file: str, select: str, passed: int, timeout_s: float = 900) -> None:
    """Run the tests of test_file that `select` (pytest's -k) picks under the interpreter,
    and assert that exactly `passed` of them passed and none was skipped."""
    if TRITON_RUNS_HERE:
        pytest.skip("the kernels run in this process")
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file,
         "-k", select],
        cwd=Path(__file__).parents[1], env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True, text=True, timeout=timeout_s)
    summary = child.stdout.splitlines()[-1] if child.stdout else ""
    assert child.returncode == 0 and f"{passed} passed" in summary \
        and "skipped" not in summary, child.stdout[-4000:] + child.stderr[-4000:]
