"""The README's examples work: its curl, `openai` and SDK code blocks run, as a user
would run them, against the stack as `make run` starts it (on free ports, substituted
into the examples) and each returns text."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.model]

ROOT = Path(__file__).resolve().parent.parent
REST, GRPC = "127.0.0.1:8000", "127.0.0.1:50050"  # where `make run` serves
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def example(lang: str, marker: str) -> str:
    """The README's one `lang` code block that contains `marker`."""
    found = [code for fence, code in _FENCE.findall((ROOT / "README.md").read_text())
             if fence == lang and marker in code]
    assert len(found) == 1, f"expected one {lang} block with {marker!r}, found {len(found)}"
    return found[0]


def on_stack(code: str, stack) -> str:
    assert REST in code or GRPC in code, "the example does not address the stock stack"
    return code.replace(REST, stack.address(8000)).replace(GRPC, stack.grpc_address)


def run(argv: list[str]) -> str:
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


def test_examples_are_found():
    assert "make run" in example("bash", "make test")
    for lang, marker in (("bash", "curl "), ("python", "from openai"),
                         ("python", "from specdec.client")):
        assert REST in example(lang, marker) or GRPC in example(lang, marker)


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl_example(local_stack):
    reply = json.loads(run(["bash", "-c", on_stack(example("bash", "curl "), local_stack)]))
    assert reply["choices"][0]["message"]["content"].strip()
    assert reply["spec_decode"]["method"] == "ngram"


def test_openai_example(local_stack):
    code = on_stack(example("python", "from openai"), local_stack)
    assert run([sys.executable, "-c", code]).strip()


def test_sdk_example(local_stack):
    code = on_stack(example("python", "from specdec.client"), local_stack)
    # A chat reply, then a streamed completion.
    assert len(run([sys.executable, "-c", code]).strip().splitlines()) >= 2
