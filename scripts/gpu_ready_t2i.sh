#!/usr/bin/env bash
# One GPU call: a text-to-image preset's kernel plan from empty caches (`fastdiff tune`, timed), then time to
# ready and first image in fresh processes on the engine with that plan and on torch.compile (reduce-overhead),
# cold and warm, images compared across processes. Results and the plan under $OUT.
#   MODEL=sd15 BATCH=1 GUIDANCE=7.5 RUNS_COLD=1 RUNS_WARM=1 bash scripts/gpu_ready_t2i.sh
source "$(dirname "$0")/gpu_env.sh"
MODEL=${MODEL:-sd15}; BATCH=${BATCH:-1}; GUIDANCE=${GUIDANCE:-7.5}
plan="$OUT/plan-$MODEL-b$BATCH-$gpu.json"
if [ -z "${SKIP_TUNE:-}" ]; then
  timeout "${TUNE_TIMEOUT:-300}" python3 benchmarks/tune_presets.py --plan "$plan" --budget-s 290 \
    --out "$OUT/tune-$MODEL-b$BATCH-$gpu.json" "$MODEL:$BATCH:$GUIDANCE" 2>&1 | tail -n 2 | cut -c1-400
fi
plan_flag=(); [ -f "$plan" ] && plan_flag=(--plan "$plan")
for system in ${SYSTEMS:-engine compile}; do
  flags=(); [ "$system" = engine ] && flags=("${plan_flag[@]}")
  timeout "${READY_TIMEOUT:-240}" python3 benchmarks/ready.py --model "$MODEL" --batch "$BATCH" --guidance "$GUIDANCE" \
    --system "$system" "${flags[@]}" --cold "${RUNS_COLD:-1}" --warm "${RUNS_WARM:-1}" \
    --out "$OUT/ready-$MODEL-b$BATCH-$system-$gpu.json" 2>&1 | grep -E "^(cold|warm) |differing|failed" | cut -c1-300
done
