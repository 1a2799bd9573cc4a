#!/usr/bin/env bash
# One H100 call: the GPU test suite (fp16/bf16 kernels, CUDA graphs) and the kernel benchmark.
#   bash scripts/gpu_check.sh   (repo root on the GPU machine; carry .whl for diffusers; results under $OUT)
# TESTS picks test paths, TEST_SECONDS / BENCH_SECONDS bound each part, KERNEL_BENCH=0 skips the benchmark.
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
timeout "${TEST_SECONDS:-260}" python3 -m pytest -q -n 8 -p no:cacheprovider ${TESTS:-tests} 2>&1 \
    | tee "$OUT/gpu-tests.log" | grep -E "passed|failed|FAILED|ERROR|Error" | tail -40
[ "${KERNEL_BENCH:-1}" = 1 ] || exit 0
timeout "${BENCH_SECONDS:-280}" python3 benchmarks/kernels.py --out "$OUT/kernels-h100.json" --dtype fp16 \
    2>&1 | tee "$OUT/kernels.log" | tail -40
