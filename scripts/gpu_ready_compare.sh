#!/usr/bin/env bash
# One GPU call: time to ready of this tree against a base commit's, in the same call (`benchmarks/ready.py`, engine,
# shipped plans, fresh processes), on one set of weights written once. The base's code travels in the git-ignored
# .data/base (its src/ without the bundled weights, and benchmarks/), made here with:
#   rm -rf .data/base && mkdir -p .data/base && git archive BASE src benchmarks ':(exclude)src/fastdiff/weights' \
#       ':(exclude)benchmarks/results' | tar -x -C .data/base
# then on the device (carry .whl and .data/base):
#   BASE_SHA=BASE MODEL=sd15 RUNS_COLD=1 RUNS_WARM=2 bash scripts/gpu_ready_compare.sh
# -> $OUT/ready-MODEL-bBATCH-engine-{this,base}-GPU.json. This tree runs first, then the base; ORDER=base-first turns
# that round (the first process on a fresh machine also warms the system C compiler's files).
source "$(dirname "$0")/gpu_env.sh"
MODEL=${MODEL:-sd15}; BATCH=${BATCH:-1}; BASE_SHA=${BASE_SHA:?the base commit, as the results should record it}
[ -d .data/base/src/fastdiff ] || { echo "no .data/base/src/fastdiff: make it with git archive (see the header)" >&2; exit 2; }
weights=${WEIGHTS_DIR:-$(mktemp -d)}  # WEIGHTS_DIR: keep them for a later command of the same call
run() {  # $1: this | base
  local root=. sha=${FASTDIFF_GIT_SHA:-} out="$OUT/ready-$MODEL-b$BATCH-engine-$1-$gpu.json"
  [ "$1" = base ] && root=.data/base sha=$BASE_SHA
  echo "== $1 ($sha)"
  (cd "$root" && FASTDIFF_GIT_SHA=$sha timeout "${READY_TIMEOUT:-280}" \
    python3 benchmarks/ready.py --model "$MODEL" --batch "$BATCH" --system engine --weights-dir "$weights" \
    --cold "${RUNS_COLD:-1}" --warm "${RUNS_WARM:-2}" --out "$out" ${READY_ARGS:-}) 2>&1 \
    | grep -E "^(cold|warm) |differing|failed" | cut -c1-250
}
if [ "${ORDER:-this-first}" = base-first ]; then run base; run this; else run this; run base; fi
