#!/usr/bin/env bash
# The CUDA backend's check on one lent GPU (issue 21), in one command of under 10 minutes.
#
#   scripts/gpu_check.sh prepare   # here (network to the package index): the few wheels the
#                                  # GPU machine lacks (it has torch, triton, transformers and
#                                  # no network) go to .gpu_wheels/ (git-ignored)
#   scripts/gpu_check.sh run       # on the GPU machine, from the repo root, with .gpu_wheels
#                                  # carried; results under $OUT (default ./gpu-out)
#
# run: the Triton kernel tests compiled for the GPU (the same files CI runs in Triton's
# interpreter), the `cuda`-marked tests, then `tokenmill bench gpu`: greedy fidelity vs HF
# transformers on the GPU (float32, bfloat16), batch-1 decode vs the HBM floor with CUDA
# graphs and eager, throughput at 64 and 256 sequences vs HF generate(), on SmolLM2 and
# Llama-3-8B shapes (random weights), bf16 and FP8.
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=.gpu_wheels

case "${1:-}" in
prepare)
    mkdir -p "$wheels"
    pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --implementation cp -d "$wheels" \
        msgpack==1.1.2 Jinja2==3.1.6 MarkupSafe==3.0.4 pytest==9.0.3 iniconfig==2.3.1 pluggy==1.7.0
    ls -la "$wheels"
    ;;
run)
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    pip install --quiet --no-deps --no-index "$wheels"/*.whl 2>&1 | tail -2
    nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv | tee "$out/gpu.txt"
    python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$out/gpu.txt"
    # 1. kernels and the end-to-end path, compiled (no TRITON_INTERPRET on a GPU machine)
    timeout 180 python -m pytest -q -p no:cacheprovider \
        tests/layers/test_triton_attention.py tests/layers/test_triton_ops.py \
        tests/layers/quant/test_triton_gemm.py tests/runner/test_triton_backend.py \
        2>&1 | tee "$out/tests.txt" | tail -15
    timeout 60 python -m pytest -q -p no:cacheprovider -m cuda tests/layers tests/runner tests/sample \
        2>&1 | tee -a "$out/tests.txt" | tail -5
    # 2. fidelity, latency vs the HBM floor, throughput vs HF (JSON under $out)
    timeout 330 python -m tokenmill.entrypoints.cli bench gpu --json "$out/bench_gpu.json" \
        2>&1 | tee "$out/bench.txt" | tail -60
    ;;
*)
    echo "usage: $0 prepare|run" >&2
    exit 2
    ;;
esac
