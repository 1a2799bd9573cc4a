#!/usr/bin/env bash
# One call on a 2-GPU host (or one GPU with SKIP_GENERATE=1): a kernel plan for ddpm-cifar10 made on this GPU model
# (`fastdiff tune`, batch 256 and 1; TUNE=0: the shipped plan), then whether the same seed gives the same bytes with
# it: fresh processes on one GPU (benchmarks/ready.py: cold and warm, images hashed), again with programmatic
# dependent launch off (FASTDIFF_PDL=0) when they differ, again with the first forward compiled in this process
# (FASTDIFF_COMPILE_WORKERS=1: cold time and bytes), and bulk generation on one GPU twice and on two GPUs
# (scripts/gpu_generate.sh with PLAN, REPEAT=1).
#   FASTDIFF_GIT_SHA=<sha> bash scripts/gpu_repeatable.sh      (repo root on the GPU machine)
# Results under $OUT: plan-<gpu>.json (to ship as src/fastdiff/engine/plans/<gpu>.json), tune-*.log,
# ready-*.json, generate-ddpm-cifar10-2gpu.json.
source "$(dirname "$0")/gpu_env.sh"
plan="$OUT/plan-$gpu.json"
start=$(date +%s)
plan_flag=()
if [ "${TUNE:-1}" = 1 ]; then
    echo "== tune ddpm-cifar10 batch 256 ($gpu)"
    timeout 200 python3 -m fastdiff.cli tune --model ddpm-cifar10 --batch 256 \
        --out "$plan" >"$OUT/tune-ddpm-cifar10-b256.log" 2>&1; echo "   rc=$? $(( $(date +%s) - start )) s"
    tail -n 1 "$OUT/tune-ddpm-cifar10-b256.log"
    plan_flag=(--plan "$plan")
fi
echo "== ready.py batch 256 with that plan: do fresh processes give the same bytes?"
timeout 200 python3 benchmarks/ready.py --model ddpm-cifar10 --batch 256 "${plan_flag[@]}" --cold 1 --warm 2 \
    --out "$OUT/ready-ddpm-cifar10-b256-$gpu.json" 2>&1 | tail -n 3
if python3 -c "import json,sys; sys.exit(json.load(open(sys.argv[1]))['images_differing_between_processes']['differing'] == 0)" \
    "$OUT/ready-ddpm-cifar10-b256-$gpu.json" 2>/dev/null; then
    echo "== they differ: again with FASTDIFF_PDL=0"
    FASTDIFF_PDL=0 timeout 150 python3 benchmarks/ready.py --model ddpm-cifar10 --batch 256 "${plan_flag[@]}" \
        --cold 1 --warm 1 --out "$OUT/ready-ddpm-cifar10-b256-no-pdl-$gpu.json" 2>&1 | tail -n 3
fi
echo "== ready.py batch 256, first forward compiled in this process (no workers)"
FASTDIFF_COMPILE_WORKERS=1 timeout 150 python3 benchmarks/ready.py --model ddpm-cifar10 --batch 256 "${plan_flag[@]}" \
    --cold 2 --warm 1 --out "$OUT/ready-ddpm-cifar10-b256-no-workers-$gpu.json" 2>&1 | tail -n 3
[ "${SKIP_GENERATE:-0}" = 1 ] && { echo "== [$(( $(date +%s) - start )) s] done"; exit 0; }
echo "== [$(( $(date +%s) - start )) s] generate: one GPU twice, two GPUs, with the plan"
PLAN="${plan_flag[1]:-}" REPEAT=1 SKIP_WRITER_BENCH=1 NUM_IMAGES=${NUM_IMAGES:-16384} timeout 280 bash scripts/gpu_generate.sh 2>&1 \
    | tail -n 8
left=$(( 560 - ($(date +%s) - start) ))
if (( left > 100 )) && [ "${TUNE:-1}" = 1 ]; then
    echo "== [$(( $(date +%s) - start )) s] tune ddpm-cifar10 batch 1"
    timeout $(( left - 10 )) python3 -m fastdiff.cli tune --model ddpm-cifar10 --batch 1 \
        --out "$plan" >"$OUT/tune-ddpm-cifar10-b1.log" 2>&1; echo "   rc=$?"; tail -n 1 "$OUT/tune-ddpm-cifar10-b1.log"
fi
echo "== [$(( $(date +%s) - start )) s] done"
