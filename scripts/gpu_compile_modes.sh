#!/usr/bin/env bash
# One GPU call: the cold start compiled two ways in the same run (ddpm-cifar10 batch 256, the shipped plan, fresh
# processes, images compared): kernels compiled in forked worker processes (the default, engine/compile_pool.py) and
# one after another in the process (FASTDIFF_COMPILE_WORKERS=1). Then `fastdiff tune` from empty caches with the
# workers (the cold, no-plan time: benchmarks/tune_presets.py), SD 1.5's cold and warm start with its shipped plan,
# and SD 1.5's plan at guidance 1 (the U-Net at one row: what guidance-parallel runs).
#   FASTDIFF_GIT_SHA=<sha> bash scripts/gpu_compile_modes.sh     (repo root on the GPU machine)
# Results under $OUT: ready-<model>-<mode>-<gpu>.json, tune-presets-ddpm-cifar10-b256-<gpu>.json,
# plan-sd15-guidance1-<gpu>.json and its log.
source "$(dirname "$0")/gpu_env.sh"
start=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - start )) s] $*"; }
ready() {  # mode, then ready.py's arguments
  local mode=$1; shift
  timeout 200 python3 benchmarks/ready.py "$@" --out "$OUT/ready-$mode-$gpu.json" >/tmp/ready-$mode.log 2>&1 \
    || tail -n 25 /tmp/ready-$mode.log
  grep -E "differing" /tmp/ready-$mode.log | cut -c1-300
  python3 -c "import json,sys; d=json.load(open(sys.argv[1]))
for m, v in d['modes'].items():
    s = v['summary']; print(m, s['runs'], {k: round(s[k]['mean'], 2) for k in ('import_s', 'first_forward_s', 'to_first_image_s', 'step_ms')}, s['kernels'][0])" \
    "$OUT/ready-$mode-$gpu.json" 2>&1 | tail -n 2
}
stamp "ddpm-cifar10 b256: workers (default)"
ready ddpm-cifar10-b256-workers --model ddpm-cifar10 --batch 256 --cold "${COLD:-2}" --warm 1
stamp "ddpm-cifar10 b256: serial"
FASTDIFF_COMPILE_WORKERS=1 ready ddpm-cifar10-b256-serial --model ddpm-cifar10 \
  --batch 256 --cold 1 --warm 0
stamp "tune ddpm-cifar10 b256 from empty caches (workers)"
timeout 200 python3 benchmarks/tune_presets.py --plan "$(mktemp -d)/plan.json" --budget-s 190 \
  --out "$OUT/tune-presets-ddpm-cifar10-b256-$gpu.json" ddpm-cifar10:256 2>&1 | tail -n 1 | cut -c1-300
[ "${SKIP_SD:-0}" = 1 ] && { stamp done; exit 0; }
stamp "sd15 b1 guidance 7.5: workers, shipped plan"
ready sd15-b1-workers --model sd15 --batch 1 --cold 1 --warm "${SD_WARM:-1}"
[ "${SKIP_SD_TUNE:-0}" = 1 ] && { stamp done; exit 0; }
stamp "tune sd15 b1 guidance 1 (the U-Net at one row)"
timeout 250 python3 -m fastdiff.cli tune --model sd15 --batch 1 --guidance 1 --out "$OUT/plan-sd15-guidance1-$gpu.json" \
  >"$OUT/tune-sd15-guidance1.log" 2>&1
echo "   rc=$?"; tail -n 1 "$OUT/tune-sd15-guidance1.log" | cut -c1-200
stamp done
