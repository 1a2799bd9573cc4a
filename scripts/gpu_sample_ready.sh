#!/usr/bin/env bash
# One GPU call: how long `fastdiff sample` of the bundled model (make sample's first command: fashion-mnist, 36
# images, DPM-Solver++ 20) takes from the command's start to its PNG on disk, in fresh processes: one with empty
# Triton and fastdiff caches (cold), then WARM (3) with the caches it filled. Each run's wall time and the PNG's digest
# go to $OUT/sample-ready-<gpu>.json as soon as the run ends (FASTDIFF_GIT_SHA names the commit).
source "$(dirname "$0")/gpu_env.sh"
caches=$(mktemp -d)
export TRITON_CACHE_DIR="$caches/triton" FASTDIFF_CACHE_DIR="$caches/fastdiff" TORCHINDUCTOR_CACHE_DIR="$caches/inductor"
args=(--sampler dpmsolver++ --steps 20 --batch 36)
python3 - "$OUT/sample-ready-$gpu.json" "${WARM:-3}" "${args[@]}" <<'EOF'
import hashlib, json, subprocess, sys, tempfile, time
from pathlib import Path
from fastdiff.bench.env import environment
out, warm, args = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
runs = []
for k, mode in enumerate(["cold"] + ["warm"] * warm):
    png = Path(tempfile.mkdtemp()) / "grid.png"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "fastdiff.cli", "sample", *args, "--out", str(png)],
                          capture_output=True, text=True, timeout=240)
    wall = time.perf_counter() - start
    digest = hashlib.sha256(png.read_bytes()).hexdigest()[:16] if png.exists() else None
    runs.append({"mode": mode, "wall_s": round(wall, 3), "rc": proc.returncode, "png_digest": digest,
                 "log_tail": (proc.stdout + proc.stderr).splitlines()[-2:]})
    print(runs[-1], flush=True)
    record = {"what": "fastdiff sample (make sample's first command) from the command's start to its PNG on disk, "
                      "fresh processes: the first with empty caches, the others with the caches it filled",
              "command": ["fastdiff", "sample", *args], "env": environment(), "runs": runs}
    out.write_text(json.dumps(record, indent=1) + "\n")
EOF
