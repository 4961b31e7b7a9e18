from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The suite's float32 exactness checks compare replies across schedules (plain,
# speculative, batched, served): they hold bit for bit in batch-invariant mode,
# which the stacks the tests start inherit. By default a step past
# SMALL_ROWS_MAX rows rounds differently and a near-tie may flip (linear.py);
# the tests of that default path set the mode themselves.
os.environ.setdefault("SPECDEC_BATCH_INVARIANT", "1")


@pytest.fixture(scope="session", autouse=True)
def _deterministic_threads():
    # The machines this runs on have 2 cores; oversubscription only adds noise.
    torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The prepared default model; `make test` prepares it first."""
    from specdec.models.prepare import default_model_dir

    path = default_model_dir()
    if not (path / "config.json").is_file():
        pytest.fail(f"default model not prepared at {path}: run `make model`")
    return path


@pytest.fixture(scope="session")
def local_stack(smollm2_dir, tmp_path_factory):
    """The stack as `make run` starts it, on free ports; one per session, shared by the
    tests that need it (tests/local_stack.py)."""
    from tests.local_stack import running_stack

    with running_stack(smollm2_dir, tmp_path_factory.mktemp("stack-logs")) as stack:
        yield stack


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """A throwaway CA with server and client certificates (tests/pki.py)."""
    from tests.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def loop():
    """An asyncio loop on a thread of its own, for the servers a test module starts."""
    from tests.loop_thread import LoopThread

    lt = LoopThread()
    yield lt
    lt.close()
