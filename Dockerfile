# Two images. `vllm`: the verifier on vLLM's engine (SPECDEC_ENGINE=vllm in compose.yaml),
# vLLM's own image with this project on top. `specdec` (the last stage, built by
# default): every service; compose.yaml picks the command.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

FROM ${VLLM_IMAGE} AS vllm
WORKDIR /app
# Without its dependencies: vLLM's image brings torch, grpcio, protobuf and transformers
# in versions our code runs with; the health service's package is the one it lacks.
COPY pyproject.toml README.md compose.yaml ./
COPY proto proto
COPY specdec specdec
COPY drafter drafter
COPY verifier verifier
COPY gateway gateway
RUN pip install --no-cache-dir --no-deps . && pip install --no-cache-dir grpcio-health-checking
# vLLM's image serves `vllm serve` as its entrypoint; compose gives the whole command.
ENTRYPOINT []
CMD ["specdec-verifier", "--help"]

# CUDA base so the verifier and the model drafters can use their GPU (the ngram drafter
# and the gateway run on CPU in the same image).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS specdec

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# Dependencies first, so code changes do not reinstall torch.
COPY pyproject.toml README.md ./
RUN mkdir -p specdec drafter verifier gateway \
    && touch specdec/__init__.py drafter/__init__.py verifier/__init__.py gateway/__init__.py \
    && pip install '.[gpu]' && pip uninstall -y specdec

COPY proto proto
COPY specdec specdec
COPY drafter drafter
COPY verifier verifier
COPY gateway gateway
COPY compose.yaml ./
RUN pip install --no-deps .

# Models come in as a volume (compose.yaml mounts $SPECDEC_MODELS at /models).
EXPOSE 8000 50050 50051 50061 50062 50063
CMD ["specdec-gateway", "--help"]
