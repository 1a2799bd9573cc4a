#!/usr/bin/env bash
# One GPU call: how long `fastdiff sample` of the bundled model (make sample's first command: fashion-mnist, 36
# images, DPM-Solver++ 20) takes from the command's start to its PNG on disk, in fresh processes: one with empty
# Triton and fastdiff caches (cold), then WARM (3) with the caches it filled. Each run's wall time, the PNG's digest
# and its log lines (-v) timed from its start go to $OUT/sample-ready-<gpu>.json as soon as the run ends
# (FASTDIFF_GIT_SHA names the commit), with what python, `import torch` and CUDA's start cost alone (floors_s).
# Python bytecode as on a pip install: a bytecode folder of the measurement's own, primed by one untimed import
# (the lent machines set PYTHONDONTWRITEBYTECODE: every process would compile torch's source, ~2-3 s; BYTECODE=as-set
# measures that instead), as benchmarks/ready.py does.
source "$(dirname "$0")/gpu_env.sh"
caches=$(mktemp -d)
export TRITON_CACHE_DIR="$caches/triton" FASTDIFF_CACHE_DIR="$caches/fastdiff" TORCHINDUCTOR_CACHE_DIR="$caches/inductor"
BYTECODE=${BYTECODE:-cached}
if [ "$BYTECODE" = cached ]; then
    unset PYTHONDONTWRITEBYTECODE
    export PYTHONPYCACHEPREFIX="$caches/pycache"
    python3 -c "import torch, triton, fastdiff.cli, fastdiff.engine, fastdiff.pipelines, fastdiff.images"
fi
args=(--sampler dpmsolver++ --steps 20 --batch 36)
BYTECODE_MODE=$BYTECODE python3 - "$OUT/sample-ready-$gpu.json" "${WARM:-3}" "${args[@]}" <<'EOF'
import hashlib, json, os, subprocess, sys, tempfile, time
from pathlib import Path
from fastdiff.bench.env import environment
out, warm, args = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]

def timed(command):
    """Wall seconds, return code and the timeline: each output line with the second it was printed at."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    timeline = [[round(time.perf_counter() - start, 3), line.rstrip()[:200]] for line in proc.stdout]
    rc = proc.wait(timeout=240)
    return time.perf_counter() - start, rc, timeline

floors = {}  # what any torch program on this machine pays before fastdiff does anything
for name, code in (("python", "pass"), ("import_torch", "import torch"),
                   ("import_torch_cuda_init", "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()")):
    floors[name] = round(min(timed([sys.executable, "-c", code])[0] for _ in range(3)), 3)
print(floors, flush=True)
runs = []
for mode in ["cold"] + ["warm"] * warm:
    png = Path(tempfile.mkdtemp()) / "grid.png"
    wall, rc, timeline = timed([sys.executable, "-m", "fastdiff.cli", "-v", "sample", *args, "--out", str(png)])
    digest = hashlib.sha256(png.read_bytes()).hexdigest()[:16] if png.exists() else None
    runs.append({"mode": mode, "wall_s": round(wall, 3), "rc": rc, "png_digest": digest, "timeline": timeline[:400]})
    print({key: value for key, value in runs[-1].items() if key != "timeline"}, timeline[-2:], flush=True)
    record = {"what": "fastdiff sample (make sample's first command) from the command's start to its PNG on disk, "
                      "fresh processes: the first with empty caches, the others with the caches it filled; "
                      "timeline: each log line (-v) with the second it was printed at; floors_s: the fastest of 3 "
                      "fresh processes doing only that",
              "command": ["fastdiff", "sample", *args], "env": environment(), "floors_s": floors,
              "python_bytecode": os.environ.get("BYTECODE_MODE"), "runs": runs}
    out.write_text(json.dumps(record, indent=1) + "\n")
EOF
