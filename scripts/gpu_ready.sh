#!/usr/bin/env bash
# One GPU call: kernel plans made by `fastdiff tune` from empty caches (the cold, no-plan time), then time to ready
# and first image in fresh processes with that plan (cold caches and warm), and the images' bytes compared across
# the processes. Plans and results under $OUT.   bash scripts/gpu_ready.sh   (MODEL, BATCHES, READY_BATCH, WARM)
source "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
MODEL=${MODEL:-ddpm-cifar10}
plan="$OUT/plan-$MODEL-$gpu.json"
tmp=$(mktemp -d)
for b in ${BATCHES:-1 256}; do  # cold, no plan: every candidate compiled and timed
  start=$(date +%s.%N)
  TRITON_CACHE_DIR=$tmp/triton FASTDIFF_CACHE_DIR=$tmp/fastdiff timeout 400 \
    python3 -m fastdiff.cli tune --model "$MODEL" --batch "$b" --out "$plan" 2>&1 | tail -n 3
  echo "tune $MODEL batch $b: $(awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {print b - a}') s (Triton cache warm after the first batch)"
done
for b in ${READY_BATCH:-256}; do
  timeout 400 python3 benchmarks/ready.py --model "$MODEL" --batch "$b" --plan "$plan" --cold 1 --warm "${WARM:-3}" \
    --out "$OUT/ready-$MODEL-b$b-$gpu.json" 2>&1 | tail -n 40
done
