#!/usr/bin/env bash
# `fastdiff profile` runs on the lent GPU, one after another, each a fresh process; the report folders come back
# as one archive ($OUT/profiles.tgz: a call returns at most 8 files).
#   TESTS="tests/profile" bash scripts/gpu_profile.sh "ddpm-cifar10-b1-h100:--batch 1" "NAME:FLAGS" ...
# Each argument is NAME:FLAGS (NAME = the report folder). TESTS (optional) runs pytest first. Carry .whl.
source "$(dirname "$0")/gpu_env.sh"
mkdir -p "$OUT/reports"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
if [ -n "${TESTS:-}" ]; then
    # shellcheck disable=SC2086  # a list of test paths
    timeout "${TEST_SECONDS:-200}" python3 -m pytest -q -p no:cacheprovider $TESTS 2>&1 | tee "$OUT/gpu-tests.log" \
        | grep -E "passed|failed|FAILED|ERROR|Error" | tail -20
fi
for spec in "$@"; do
    name=${spec%%:*} flags=${spec#*:}
    echo "== fastdiff profile $flags -> $name"
    start=$(date +%s)
    # shellcheck disable=SC2086  # each argument's flags are a list
    timeout "${PROFILE_SECONDS:-400}" python3 -m fastdiff.cli profile --out "$OUT/reports/$name" $flags 2>&1 \
        | tee -a "$OUT/profile.log" | grep -E "^(\| (class|end|kernels|engine|eager|compile|sync|async|early)|\*\*|INFO fastdiff.profile)" | cut -c1-220
    echo "   ($(( $(date +%s) - start )) s)"
done
tar -C "$OUT/reports" -czf "$OUT/profiles.tgz" . && rm -rf "$OUT/reports"
