#!/usr/bin/env bash
# The checks and benchmarks that need a CUDA GPU, in one go:
#   bash bench/gpu.sh OUT_DIR [MODEL_DIR]
# from the repository root, with a python3 that has torch (CUDA), triton,
# protobuf, grpcio, grpcio-health-checking and opentelemetry-api (the versions
# pyproject.toml names; the serving stack's other packages are not needed).
# MODEL_DIR: a directory with the default model's config.json (default: the
# prepared default model); its shapes are timed with random weights, so a GPU
# machine needs no copy of the weights. Writes into OUT_DIR:
#   env.txt                 GPU, driver, torch and triton versions
#   gpu_check/gpu_check.{json,md}  bench.gpu_check first, within GPU_CHECK_BUDGET_S seconds
#                           (default 450): step times per fused configuration against the
#                           bandwidth floor, kernels, accuracy, speculative decoding,
#                           draft step, a torch.compile baseline, the sampler
#   gpu_tests.txt           pytest of every `gpu` test and the Triton kernel on CUDA
#   verifier_cuda.{json,md} bench.verifier on the default model's shapes, bfloat16
#   verifier_cuda_1b.{json,md}  the same on a random 1.1B-parameter model
# Each part runs on when an earlier one fails; the exit status is the worst.
set -u
out=${1:?usage: bash bench/gpu.sh OUT_DIR [MODEL_DIR]}
model=${2:-}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    $py -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda,
"triton", triton.__version__)'
} >"$out/env.txt" 2>&1 || status=1
cat "$out/env.txt"

# The most measurements per minute of GPU first: a lent GPU may not last past it.
$py -m bench.gpu_check --out "$out/gpu_check" --budget-s "${GPU_CHECK_BUDGET_S:-450}" || status=1

{
    # The files that hold them: collecting the gateway's tests would need the
    # whole serving stack.
    $py -m pytest -v -p no:cacheprovider -m gpu tests/verifier/test_cuda_graphs.py \
        tests/verifier/test_rejection.py tests/verifier/test_engine_distribution.py \
        tests/drafter/test_draft_model_graphs.py tests/drafter/test_eagle.py \
        tests/verifier/test_service.py tests/verifier/test_drafter_client.py || exit 1
    $py -m pytest -v -p no:cacheprovider tests/verifier/test_rejection.py \
        -k "triton_kernel_equals_reference and not interpreted"
} 2>&1 | tee "$out/gpu_tests.txt"
[ "${PIPESTATUS[0]}" = 0 ] || status=1

model_args=(--random-weights)
[ -n "$model" ] && model_args+=(--model "$model")
$py -m bench.verifier --device cuda --dtype bfloat16 "${model_args[@]}" \
    --out "$out/verifier_cuda.json" || status=1
$py -m bench.verifier --device cuda --dtype bfloat16 --model random-1b \
    --out "$out/verifier_cuda_1b.json" || status=1
exit $status
