#!/usr/bin/env bash
# `fastdiff bench` runs on the lent GPU, one after another, each a fresh process (so a later run of the same
# model sees the Triton kernel cache and the engine's tuning cache that an earlier one filled: "warm").
#   bash scripts/gpu_bench.sh "--batch 1 --name bench-ddpm-cifar10-b1" "--batch 256 --name ..."
# Each argument is one bench's flags; JSON (and --plot PNGs) land in $OUT. Carry .whl (diffusers) with the call.
source "$(dirname "$0")/gpu_env.sh"
for flags in "$@"; do
    echo "== fastdiff bench $flags"
    start=$(date +%s)
    # shellcheck disable=SC2086  # each argument is a list of flags
    python3 -m fastdiff.cli bench --out-dir "$OUT" $flags 2>&1 | tee -a "$OUT/bench.log" | grep -v "^\s*$" | tail -n 14
    echo "   ($(( $(date +%s) - start )) s)"
done
