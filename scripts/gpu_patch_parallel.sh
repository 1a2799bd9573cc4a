#!/usr/bin/env bash
# One call on a 2-GPU host: one text-to-image image split over 2 GPUs by rows (--patch-parallel) against one GPU,
# at SD 1.5 1024x1024 and SD 2.1 768x768 (random weights: no SD weights exist here), DDIM 20, guidance 7.5, fp16,
# eager backend; warm-up 4 (stale exchanges after 4 synchronous steps) and 20 (always synchronous). Then SD 1.5 512
# guidance-parallel on the engine (the halves gathered by NCCL inside the captured loop) against one engine.
#   FASTDIFF_GIT_SHA=<sha> bash scripts/gpu_patch_parallel.sh     (repo root on the GPU machine)
# Results: $OUT/patch-parallel-<model>-<size>-<gpu>.json (benchmarks/patch_parallel.py report). PROFILE=1: the
# patch runs also write the PyTorch profiler's op table of one call (one GPU, and rank 0 of each split run).
# JOBS ("sd15:1024 sd21:768"; empty: none) chooses the patch runs, WARMUPS ("4,20") their synchronous steps; GUIDANCE=0 skips
# the guidance-parallel runs, GUIDANCE_JOBS ("sd15:512") chooses them.
source "$(dirname "$0")/gpu_env.sh"
for job in ${JOBS-sd15:1024 sd21:768}; do
    model=${job%%:*} size=${job##*:} work=$(mktemp -d)
    flags=(--model "$model" --size "$size" --work "$work" --repeats "${REPEATS:-3}" --warmups "${WARMUPS:-4,20}")
    one=() split=()
    [ "${PROFILE:-0}" = 1 ] && one=(--profile "$OUT/profile-$model-$size-one.txt") \
        && split=(--profile "$OUT/profile-$model-$size-split.txt")
    echo "== $model ${size}px: one GPU"
    timeout 240 python3 benchmarks/patch_parallel.py one "${flags[@]}" "${one[@]}" 2>&1 | tail -n 2
    echo "== $model ${size}px: two GPUs"
    timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/patch_parallel.py split \
        "${flags[@]}" "${split[@]}" 2>&1 | tail -n 2
    python3 benchmarks/patch_parallel.py report "${flags[@]}" --out "$OUT/patch-parallel-$model-$size-$gpu.json" \
        | python3 -c "import json,sys; d=json.load(sys.stdin); print(d['one_gpu_seconds_median'], d['split'])"
done
[ "${GUIDANCE:-1}" = 1 ] || exit 0
for job in ${GUIDANCE_JOBS:-sd15:512}; do
    model=${job%%:*} size=${job##*:} work=$(mktemp -d)
    flags=(--model "$model" --size "$size" --work "$work" --split guidance --backend engine --repeats "${REPEATS:-3}")
    echo "== $model ${size}px guidance-parallel on the engine: one GPU, then two"
    timeout 240 python3 benchmarks/patch_parallel.py one "${flags[@]}" 2>&1 | tail -n 2
    timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/patch_parallel.py split \
        "${flags[@]}" 2>&1 | tail -n 2
    python3 benchmarks/patch_parallel.py report "${flags[@]}" --out "$OUT/guidance-parallel-engine-$model-$size-$gpu.json" \
        | python3 -c "import json,sys; d=json.load(sys.stdin); print(d['one_gpu_seconds_median'], d['one_gpu'], d['split'])"
done
