#!/usr/bin/env bash
# One GPU call: the text-to-image recipe's VAE stage for several latent shapes at once (the presets of
# src/fastdiff/train/text_to_image/config.py), side by side on one GPU, each with its reconstruction FD-FMNIST (the
# floor no sampler on its latents can beat) and test PSNR in its summary.
#   FASTDIFF_GIT_SHA=<sha> bash scripts/gpu_vae_candidates.sh      (repo root on the GPU machine)
# PRESETS (default: the four fashion-mnist shapes), MAX_SECONDS (training budget of each, default 400), BATCH (256),
# DEVICE (cuda), DATA (.data/fashion-mnist, else /usr/share/datasets/fashion-mnist), EXTRA_ARGS (more flags for every run).
# Results under $OUT: vae-candidates.json (each stage's summary, the command, exit code, wall time, environment),
# vae-candidates.log (every run's output), vae-candidates.tar.NN (the stage folders, 15 MB pieces; here:
# cat vae-candidates.tar.* | tar -xf - -C DEST gives DEST/<preset>/vae/ ...).
source "$(dirname "$0")/gpu_env.sh"
PRESETS=${PRESETS:-fashion-mnist fashion-mnist-8x8x8 fashion-mnist-8x8x16 fashion-mnist-16x16x4}
DATA=${DATA:-.data/fashion-mnist}
[ -f "$DATA/train-images-idx3-ubyte.gz" ] || DATA=/usr/share/datasets/fashion-mnist
[ -f "$DATA/train-images-idx3-ubyte.gz" ] || { echo "no Fashion-MNIST in .data/fashion-mnist or $DATA" >&2; exit 2; }
RUN_DIR=$(mktemp -d)
read -r -a EXTRA <<<"${EXTRA_ARGS:-}"
export PYTHONUNBUFFERED=1
pids=()
for preset in $PRESETS; do
    cmd=(python3 -m fastdiff.cli train text-to-image --stage vae --out "$RUN_DIR/$preset" --preset "$preset"
         --data "$DATA" --device "${DEVICE:-cuda}" --steps 1000000 --max-seconds "${MAX_SECONDS:-400}" --batch "${BATCH:-256}"
         --no-progress "${EXTRA[@]}")
    echo "${cmd[*]}" > "$RUN_DIR/$preset.cmd"
    ( start=$(date +%s.%N); "${cmd[@]}" > "$RUN_DIR/$preset.log" 2>&1; echo "$? $(python3 -c "import time; print(round(time.time() - $start, 1))")" \
        > "$RUN_DIR/$preset.rc" ) &
    pids+=($!)
done
wait "${pids[@]}"
for preset in $PRESETS; do echo "== $preset"; tail -n 3 "$RUN_DIR/$preset.log"; done | tee "$OUT/vae-candidates.log" | cut -c1-400
python3 - "$RUN_DIR" "$OUT/vae-candidates.json" $PRESETS <<'EOF'
import json, sys
from pathlib import Path

from fastdiff.bench.env import environment

run_dir, out, presets = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
runs = {}
for preset in presets:
    rc, wall = (run_dir / f"{preset}.rc").read_text().split()
    summary = run_dir / preset / "summary.json"
    runs[preset] = {"command": (run_dir / f"{preset}.cmd").read_text().strip(), "exit_code": int(rc),
                    "wall_s": float(wall), "summary": json.loads(summary.read_text()) if summary.is_file() else None}
out.write_text(json.dumps({"what": "VAE stage per latent shape, trained side by side on one GPU", "env": environment(),
                           "runs": runs}, indent=1) + "\n")
keys = ("step", "psnr_db", "psnr_db_28", "fd_fmnist_reconstructions", "latent_shape", "vae_bytes")
for preset, run in runs.items():
    print(preset, run["exit_code"], {k: (run["summary"] or {}).get(k) for k in keys})
EOF
(cd "$RUN_DIR" && tar -cf - $PRESETS) | split -b 15m -d - "$OUT/vae-candidates.tar."
ls -la "$OUT"
