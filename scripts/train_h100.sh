#!/usr/bin/env bash
# Train the default "fashion-mnist" ConvNeXt U-Net on one H100 inside one 10-minute device call, export the EMA
# weights in fp16 and copy the results to $OUT (at most 8 files: the device tool's limit).
#
#   bash scripts/train_h100.sh            (from the repository root; carry .data/fashion-mnist)
#
# Needs the Fashion-MNIST idx .gz files in .data/fashion-mnist/. Training stops cleanly after MAX_MINUTES with a
# checkpoint in RUN_DIR; a later call that still finds RUN_DIR resumes it (a warm machine only: the ~80 MB
# checkpoint is too big to carry or to come back through $OUT).
# Every setting below can be overridden from the environment, e.g. for a CPU dry run:
#   DEVICE=cpu SAMPLE_DTYPE=fp32 DATA=/usr/share/datasets/fashion-mnist RUN_DIR=/tmp/dry MAX_MINUTES=0.3 \
#   BATCH=8 SAMPLE_EVERY=5 NUM_SAMPLES=4 SAMPLE_STEPS=3 bash scripts/train_h100.sh
# EXTRA_ARGS passes more `fastdiff train` flags, e.g. EXTRA_ARGS="--compile" or "--no-channels-last".
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_DIR=${RUN_DIR:-runs/fashion-mnist}
EXPORT_DIR=${EXPORT_DIR:-$RUN_DIR/export}
OUT=${OUT:-$RUN_DIR/out}
DATA=${DATA:-.data/fashion-mnist}
DEVICE=${DEVICE:-cuda}
SAMPLE_DTYPE=${SAMPLE_DTYPE:-fp16}
MAX_MINUTES=${MAX_MINUTES:-7.5}
STEPS=${STEPS:-40000}
BATCH=${BATCH:-256}
LR=${LR:-5e-4}
SAMPLE_EVERY=${SAMPLE_EVERY:-2000}
NUM_SAMPLES=${NUM_SAMPLES:-64}
SAMPLE_STEPS=${SAMPLE_STEPS:-50}
read -r -a EXTRA <<<"${EXTRA_ARGS:-}"

export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT/fashion-mnist"
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; fi
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'

python3 -m fastdiff.cli train \
    --model fashion-mnist --data "$DATA" --out "$RUN_DIR" --device "$DEVICE" \
    --steps "$STEPS" --max-minutes "$MAX_MINUTES" --batch "$BATCH" --lr "$LR" --warmup 500 \
    --ema-decay 0.9995 --grad-clip 1.0 --weight-decay 0.01 --prediction v_prediction --schedule cosine \
    --sample-every "$SAMPLE_EVERY" --num-samples "$NUM_SAMPLES" --sample-steps "$SAMPLE_STEPS" \
    --checkpoint-every 2000 --log-every 50 --no-progress \
    --export "$EXPORT_DIR" --export-dtype fp16 "${EXTRA[@]}"

# The exported model must load and sample through the public path (fp16, DDIM 50 steps on the GPU).
python3 -m fastdiff.cli sample --model "$EXPORT_DIR" --device "$DEVICE" --dtype "$SAMPLE_DTYPE" \
    --batch "$NUM_SAMPLES" --steps "$SAMPLE_STEPS" \
    --no-progress --out "$OUT/export_samples.png"

cp "$EXPORT_DIR"/* "$OUT/fashion-mnist/"
cp "$RUN_DIR/summary.json" "$RUN_DIR/loss.jsonl" "$OUT/"
if [ -f "$RUN_DIR/loss.png" ]; then cp "$RUN_DIR/loss.png" "$OUT/"; fi
latest=$(find "$RUN_DIR/samples" -name 'step_*.png' | sort | tail -n 1)
if [ -n "$latest" ]; then cp "$latest" "$OUT/samples.png"; fi
python3 - "$RUN_DIR/summary.json" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
keys = ("step", "epoch", "stopped", "steps_this_run", "seconds_this_run", "images_per_s", "final_loss", "params")
print(json.dumps({k: s[k] for k in keys}))
EOF
ls -la "$OUT" "$OUT/fashion-mnist"
