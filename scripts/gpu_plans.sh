#!/usr/bin/env bash
# One GPU call: the cold start with the shipped plan compiled in this process against forked workers (ddpm-cifar10 b1,
# fresh processes, images compared), then kernel plans for the presets made by `fastdiff tune` from empty caches
# (benchmarks/tune_presets.py). Results and the plan file under $OUT.   JOBS="model:batch[:guidance[:dtype]] ..."
# SKIP_AB=1 skips the cold-start comparison; SHARED=1 lets the jobs share one set of caches (a plan file in fewer minutes).
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ -z "${SKIP_AB:-}" ]; then
  for w in 1 16; do
    FASTDIFF_COMPILE_WORKERS=$w timeout 200 python3 benchmarks/ready.py --model ddpm-cifar10 --batch 1 --cold 1 --warm 1 \
      --out "$OUT/ready-ddpm-cifar10-b1-workers$w-$gpu.json" 2>&1 | tail -n 4
  done
fi
timeout "${TUNE_TIMEOUT:-420}" python3 benchmarks/tune_presets.py --plan "$OUT/plan-$gpu.json" \
  --out "$OUT/tune-presets-$gpu.json" --budget-s "${BUDGET:-380}" ${SHARED:+--shared-caches} \
  ${JOBS:-ddpm-cifar10:1 fashion-mnist:36 fashion-mnist:1 fashion-mnist-t2i:80:3 fashion-mnist-t2i:1:3 sd15:1}
