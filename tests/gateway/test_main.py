"""The gateway as a process in front of real processes (verifier on the default
model, ngram and EAGLE-3 drafters): health, text identical to plain greedy
decoding with speculation off and with each drafter, and a clean SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx2
import openai
import pytest

from specdec.client import Client
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
HEAD = REPO / "drafter" / "weights" / "smollm2-135m-eagle3"
PROMPTS = ["Give me three tips for writing clear commit messages.",
           "Repeat after me exactly: the cat sat on the mat, the cat sat on the mat."]
MAX_TOKENS = 40


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, *args], cwd=REPO, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)


def _same_greedy(plain, other) -> bool:
    """Token-identical, or diverging first where the target's top-2 are a near tie
    (float32 verify and decode passes may break such ties differently)."""
    for i, (a, b) in enumerate(zip(plain.token_ids, other.token_ids, strict=False)):
        if a != b:
            top = plain.logprobs[i].top_logprobs
            return top[0].logprob - top[1].logprob < 1e-4
    return plain.token_ids == other.token_ids


@pytest.mark.slow
@pytest.mark.model
def test_gateway_process_over_real_services(smollm2_dir, tmp_path):
    ports = {name: free_port() for name in ("ngram", "eagle3", "verifier", "http", "grpc")}
    procs = [
        _spawn(["-m", "drafter", "--method", "ngram", "--target", str(smollm2_dir),
                "--port", str(ports["ngram"])], tmp_path / "ngram.log"),
        _spawn(["-m", "drafter", "--method", "eagle3", "--model", str(HEAD),
                "--target", str(smollm2_dir), "--port", str(ports["eagle3"])],
               tmp_path / "eagle3.log"),
        _spawn(["-m", "verifier", "--model", str(smollm2_dir), "--port", str(ports["verifier"]),
                "--max-num-seqs", "4", "--max-model-len", "512", "--threads", "1",
                "--drafter", f"ngram=127.0.0.1:{ports['ngram']}",
                "--drafter", f"eagle3=127.0.0.1:{ports['eagle3']}"], tmp_path / "verifier.log"),
    ]
    gateway = _spawn(["-m", "gateway", "--model", str(smollm2_dir), "--served-model-name",
                      "smollm2", "--verifier", f"127.0.0.1:{ports['verifier']}",
                      "--port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
                      "--profile", str(tmp_path / "none.json")], tmp_path / "gateway.log")
    logs = lambda: "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"  # noqa: E731
                             for p in sorted(tmp_path.glob("*.log")))
    try:
        # A --profile that does not exist is refused at start, naming the file.
        assert gateway.wait(60) != 0
        assert "none.json" in (tmp_path / "gateway.log").read_text()
        gateway = _spawn(["-m", "gateway", "--model", str(smollm2_dir), "--served-model-name",
                          "smollm2", "--verifier", f"127.0.0.1:{ports['verifier']}",
                          "--port", str(ports["http"]), "--grpc-port", str(ports["grpc"])],
                         tmp_path / "gateway.log")
        base = f"http://127.0.0.1:{ports['http']}"
        deadline = time.monotonic() + 180
        while True:
            try:
                health = httpx2.get(base + "/health", timeout=2)
                if health.status_code == 200:
                    break
            except httpx2.HTTPError:
                pass
            assert time.monotonic() < deadline, logs()
            assert gateway.poll() is None, logs()
            time.sleep(0.5)
        # Both drafters must be connected before their methods are compared.
        while True:
            models = httpx2.get(base + "/v1/models", timeout=5).json()
            with Client(f"127.0.0.1:{ports['grpc']}") as c:
                probe = c.generate("x", max_tokens=2, speculative={"method": "eagle3"})
            if probe.spec_decode.disabled_reason is None:
                break
            assert time.monotonic() < deadline, logs()
            time.sleep(0.5)
        assert models["data"][0]["id"] == "smollm2"
        # vLLM's card: root is where the model comes from (`vllm bench serve` reads it)
        assert Path(models["data"][0]["root"]).is_dir() and models["data"][0]["parent"] is None

        with Client(f"127.0.0.1:{ports['grpc']}") as client:
            for prompt in PROMPTS:
                messages = [{"role": "user", "content": prompt}]
                plain = client.chat(messages, max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
                                    speculative={"method": "none"})
                assert plain.usage.completion_tokens > 0
                for method in ("ngram", "eagle3"):
                    out = client.chat(messages, max_tokens=MAX_TOKENS, temperature=0,
                                      speculative={"method": method, "num_speculative_tokens": 3})
                    assert _same_greedy(plain, out), (method, plain.text, out.text)
                    assert out.spec_decode.method == method and out.spec_decode.num_drafts > 0
        oa = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        chunks = oa.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": PROMPTS[1]}], temperature=0,
            max_tokens=MAX_TOKENS, stream=True, extra_body={"speculative": {"method": "ngram"}})
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        with Client(f"127.0.0.1:{ports['grpc']}") as client:
            ref = client.chat([{"role": "user", "content": PROMPTS[1]}], max_tokens=MAX_TOKENS,
                              temperature=0, speculative={"method": "ngram"})
        assert text == ref.text

        gateway.send_signal(signal.SIGTERM)
        assert gateway.wait(30) == 0, logs()
    finally:
        for p in [gateway, *procs]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [gateway, *procs]:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def test_no_unauthenticated_gateway_beyond_loopback():
    from specdec.server import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5")
    assert not is_loopback("gateway.example")
    env = {k: v for k, v in os.environ.items()
           if k not in ("SPECDEC_API_KEY", "SPECDEC_ALLOW_UNAUTHENTICATED")}
    out = subprocess.run([sys.executable, "-m", "gateway", "--host", "0.0.0.0", "--port", "0"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "refusing to serve on 0.0.0.0 without authentication" in out.stderr
    assert "--api-key" in out.stderr and "--allow-unauthenticated" in out.stderr
    # Behind a container port: the address the host publishes it on is what counts.
    out = subprocess.run([sys.executable, "-m", "gateway", "--host", "127.0.0.1", "--port", "0",
                          "--published-host", "10.0.0.5"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "refusing to serve on 10.0.0.5" in out.stderr
