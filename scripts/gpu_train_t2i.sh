#!/usr/bin/env bash
# One stage of the text-to-image recipe (`fastdiff train text-to-image`) on the lent GPU, inside one call of at
# most ~9 minutes; what comes back lands in $OUT (at most 8 files of at most 16 MiB: folders travel as split tars).
#
#   bash scripts/gpu_train_t2i.sh vae     (carry .data: Fashion-MNIST in .data/fashion-mnist)
#       -> $OUT/t2i-vae.tar.00 (the stage folder: vae/, summary.json, loss.jsonl, loss.png, reconstructions.png),
#          $OUT/t2i-vae.json (the log), $OUT/t2i-vae.txt (the output), $OUT/t2i-vae-reconstructions.png
#   here:  mkdir -p .data && cat t2i-vae.tar.* | tar -xf - -C .data        (gives .data/t2i-vae/)
#   bash scripts/gpu_train_t2i.sh unet    (carry .data: .data/fashion-mnist and .data/t2i-vae; or retrain only the
#       U-Net and text encoder on the shipped VAE: VAE=src/fastdiff/weights/fashion-mnist-t2i)
#       -> $OUT/t2i-pipeline.tar.00, .01 (the StableDiffusionPipeline directory t2i-pipeline/), $OUT/t2i-unet.json,
#          $OUT/t2i-unet.txt, $OUT/t2i-samples.png
#   here:  cat t2i-pipeline.tar.* | tar -xf - -C DEST                      (gives DEST/t2i-pipeline/)
#
# $OUT/t2i-STAGE.json: the stage's summary.json (losses, PSNR or classifier accuracy, seconds, sizes, settings,
# GPU, torch version, git sha from FASTDIFF_GIT_SHA) with the command, its exit code and wall time.
# Settings (environment): MAX_SECONDS (training budget of the stage, from its start; default 440), POST_SECONDS
# (default 80: after MAX_SECONDS + POST_SECONDS the command is interrupted, so that whatever it wrote still comes
# back: the unet stage writes its pipeline before it samples it), STEPS (default 100000: the time budget ends the
# run, the learning rate's cosine follows it), BATCH (256 vae, 512 unet), PRESET
# (fashion-mnist), DATA (.data/fashion-mnist, else /usr/share/datasets/fashion-mnist), VAE (.data/t2i-vae),
# RUN_DIR (/tmp/t2i), DEVICE (cuda), EXTRA_ARGS (more flags, e.g. "--compile" or "--lr 1e-3").
# PAUSE_AFTER=S: a stage longer than one call: it pauses S seconds after its start (checkpoint next to RUN_DIR/NAME)
# and the same command in the next call resumes it (keep RUN_DIR in a git-ignored folder of the repository, e.g.
# .data/t2i-run, so that it stays on the warm machine; MAX_SECONDS is then the whole stage's budget).
# A CPU dry run: DEVICE=cpu PRESET=tiny MAX_SECONDS=20 BATCH=32 EXTRA_ARGS="--limit-images 2000 --eval-images 500"
#   OUT=/tmp/t2i-dry bash scripts/gpu_train_t2i.sh vae   (and for unet: EXTRA_ARGS="--limit-images 2000
#   --eval-per-class 5" VAE=/tmp/t2i/t2i-vae)
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:-}
case "$STAGE" in
    vae) NAME=t2i-vae DEFAULT_BATCH=256 ;;
    unet) NAME=t2i-pipeline DEFAULT_BATCH=512 ;;
    *) echo "usage: bash scripts/gpu_train_t2i.sh vae|unet" >&2; exit 2 ;;
esac
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DATA=${DATA:-.data/fashion-mnist}
[ -f "$DATA/train-images-idx3-ubyte.gz" ] || DATA=/usr/share/datasets/fashion-mnist
VAE=${VAE:-.data/t2i-vae}
RUN_DIR=${RUN_DIR:-/tmp/t2i}
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-fashion-mnist}
MAX_SECONDS=${MAX_SECONDS:-440}
POST_SECONDS=${POST_SECONDS:-80}
STEPS=${STEPS:-100000}
BATCH=${BATCH:-$DEFAULT_BATCH}
read -r -a EXTRA <<<"${EXTRA_ARGS:-}"

export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; fi
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
mkdir -p "$RUN_DIR"
stage_out="$RUN_DIR/$NAME"
cmd=(python3 -m fastdiff.cli train text-to-image --stage "$STAGE" --out "$stage_out" --preset "$PRESET" --data "$DATA"
     --device "$DEVICE" --steps "$STEPS" --max-seconds "$MAX_SECONDS" --batch "$BATCH" --no-progress)
[ "$STAGE" = unet ] && cmd+=(--vae "$VAE")
cmd+=("${EXTRA[@]}")
limit=$((${MAX_SECONDS%.*} + POST_SECONDS))
if [ -n "${PAUSE_AFTER:-}" ]; then
    cmd+=(--pause-after "$PAUSE_AFTER")
    limit=$((${PAUSE_AFTER%.*} + POST_SECONDS))
fi
echo "== ${cmd[*]}"
start=$(date +%s.%N)
timeout -s INT -k 15 "$limit" "${cmd[@]}" 2>&1 | tee "$OUT/t2i-$STAGE.txt"
rc=${PIPESTATUS[0]}
wall=$(python3 -c "import time; print(round(time.time() - $start, 1))")

if [ -f "$stage_out/summary.json" ]; then
    tar -cf - -C "$RUN_DIR" "$NAME" | split -b 15m -d - "$OUT/$NAME.tar."
    if [ "$STAGE" = vae ]; then cp "$stage_out/reconstructions.png" "$OUT/t2i-vae-reconstructions.png"; fi
    if [ "$STAGE" = unet ] && [ -f "$stage_out/samples.png" ]; then cp "$stage_out/samples.png" "$OUT/t2i-samples.png"; fi
fi
python3 - "$stage_out/summary.json" "$OUT/t2i-$STAGE.json" "$rc" "$wall" "${cmd[*]}" <<'EOF'
import json, sys
from pathlib import Path

from fastdiff.bench.env import environment

summary_path, out, rc, wall, command = sys.argv[1:]
summary = json.loads(Path(summary_path).read_text()) if Path(summary_path).is_file() else None
record = {"command": command, "exit_code": int(rc), "wall_s": float(wall), "env": environment(), "summary": summary}
Path(out).write_text(json.dumps(record, indent=1) + "\n")
keys = ("step", "stopped", "train_seconds", "images_per_s", "final_loss", "psnr_db", "psnr_db_28", "scaling_factor",
        "model_bytes", "eval")
print(json.dumps({"exit_code": int(rc), "wall_s": float(wall), **{k: summary[k] for k in keys if summary and k in summary}}))
EOF
ls -la "$OUT"
exit "$rc"
