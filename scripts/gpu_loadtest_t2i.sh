#!/usr/bin/env bash
# `fastdiff serve` with Stable Diffusion 1.5 (512x512, DDIM 20, guidance 7.5) under `fastdiff loadtest`, against a
# plain reference server (benchmarks/serve_reference.py: diffusers with the U-Net torch.compiled, one request at a
# time, the same routes and JSON), both loading ONE random-weight SD 1.5 directory written here. One GPU call:
#   FASTDIFF_GIT_SHA=<sha> bash scripts/gpu_loadtest_t2i.sh      (repo root on the GPU machine; carry .whl: diffusers)
# Steps, each under its own timeout and all within BUDGET_S (540 s; what is left when one overruns is skipped and
# the result says so):
#   1. the random SD 1.5 directory (fp16 safetensors) and a file of 100 prompts;
#   2. the engine's own end-to-end time for one image: the pipeline fastdiff serve loads, called directly
#      (sequential batch-1 calls, prompt to PIL image; PNG encoding timed apart);
#   3. fastdiff serve --warmup (engine, fp16, max batch 8 images = 16 U-Net rows, batches run at 1 or 8):
#      loadtest at 1, 8 and 32 clients, then 2x overload (2 x (max batch + queue) clients) and 4 requests after it;
#      the server's RSS and GPU memory sampled when ready, before and after the overload, and at the end;
#   4. the reference server: the same loadtests at 1, 8 and 32 clients, memory when ready and at the end;
#   5. $OUT/serve-loadtest-sd15-t2i-<gpu>.json: both systems, the direct time, environment() (FASTDIFF_GIT_SHA)
#      and the issue's targets (32 clients: >= 3x the reference's images/s; 1 client: p50 within 10 % of the direct
#      time; overload: every request answered 200 or 429, healthy after, memory flat).
# Expected on an H100: about 7 minutes (SD directory ~40 s, direct calls ~45 s, engine warm-up at 4 batch sizes
# ~1-2 min, reference compile ~1.5 min, load ~2 min). Also in $OUT: both servers' logs, the engine's final
# /metrics and the prompts. GPU only (DEVICE, DTYPE, SD_DIR, COMPILE and the
# sizes below exist to dry-run the flow on a tiny model, not as a CPU fallback).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
[ -n "${FASTDIFF_GIT_SHA:-}" ] || echo "warning: FASTDIFF_GIT_SHA is unset: the result will name the tree's HEAD or none" >&2
BUDGET_S=${BUDGET_S:-540}
DEVICE=${DEVICE:-cuda}; DTYPE=${DTYPE:-fp16}
SD_DIR=${SD_DIR:-}                      # empty: write a random sd15 directory under $WORK
STEPS=${STEPS:-20}; GUIDANCE=${GUIDANCE:-7.5}
PAD_WAIT=${PAD_WAIT:-0.1}  # serve --pad-wait: a batch that would run padded waits up to this fraction of a run
MAX_BATCH=${MAX_BATCH:-8}; BUCKETS=${BUCKETS:-1,8}  # the batch sizes the shipped sd15 plans cover (others tune)
MAX_WAIT_MS=${MAX_WAIT_MS:-5}; QUEUE_SIZE=${QUEUE_SIZE:-32}
COMPILE=${COMPILE:-1}                   # the reference's U-Net under torch.compile
REQUESTS_K1=${REQUESTS_K1:-16}; REQUESTS_K8=${REQUESTS_K8:-64}; REQUESTS_K32=${REQUESTS_K32:-128}
REF_REQUESTS_K1=${REF_REQUESTS_K1:-16}; REF_REQUESTS_K8=${REF_REQUESTS_K8:-32}; REF_REQUESTS_K32=${REF_REQUESTS_K32:-64}
OVERLOAD_K=${OVERLOAD_K:-$(( 2 * (MAX_BATCH + QUEUE_SIZE) ))}; OVERLOAD_REQUESTS=${OVERLOAD_REQUESTS:-$(( 2 * OVERLOAD_K ))}
DIRECT_IMAGES=${DIRECT_IMAGES:-16}
PORT=${PORT:-8765}; REF_PORT=${REF_PORT:-8766}
URL="http://127.0.0.1:$PORT"; REF_URL="http://127.0.0.1:$REF_PORT"
start_all=$(date +%s); deadline=$(( start_all + BUDGET_S ))
work=$(mktemp -d); site=$(mktemp -d)
skipped=()

budget() {  # the timeout of a step: $1 seconds, or what is left of the budget (20 s kept for the result)
    local want=$1 left=$(( deadline - $(date +%s) - 20 ))
    (( left < want )) && want=$left
    echo $(( want < 1 ? 1 : want ))  # never 0: timeout 0 would mean no limit
}
elapsed() { echo "[$(( $(date +%s) - start_all )) s]"; }

if compgen -G ".whl/*.whl" >/dev/null; then
    timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl
fi
export PYTHONPATH="src:$site" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
python3 -c "import fastapi, uvicorn, httpx, diffusers, transformers" \
    || { echo "fastapi, uvicorn, httpx, diffusers or transformers missing: carry their wheels in .whl/"; exit 2; }
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; fi

# ---- 1. the model directory and the prompts
python3 - "$work/prompts.txt" <<'EOF'
import sys
subjects = ["an astronaut", "a red fox", "a lighthouse", "a bowl of ramen", "an old sailing ship", "a cat in a hat",
            "a mountain village", "a vintage car", "a robot gardener", "a city street at night"]
styles = ["oil painting", "watercolor", "studio photograph", "pencil sketch", "isometric render", "ukiyo-e print",
          "film still", "pixel art", "in the style of a children's book", "golden hour photograph"]
prompts = [f"{subject}, {style}" for style in styles for subject in subjects]
assert len(set(prompts)) == 100
open(sys.argv[1], "w").write("\n".join(prompts) + "\n")
EOF
cp "$work/prompts.txt" "$OUT/prompts.txt"
RANDOM_WEIGHTS=0
if [ -z "$SD_DIR" ]; then
    SD_DIR="$work/sd15-random"; RANDOM_WEIGHTS=1
    echo "== $(elapsed) writing a random SD 1.5 directory (fp16 safetensors)"
    timeout "$(budget 180)" python3 benchmarks/serve_reference.py write-sd "$SD_DIR" --preset sd15 --seed 0 2>&1 | tail -n 2 \
        || { echo "could not write the SD directory"; exit 1; }
fi
[ -f "$SD_DIR/model_index.json" ] || { echo "no pipeline directory at $SD_DIR"; exit 1; }

# ---- 2. the engine's own end-to-end time for one image (no server)
echo "== $(elapsed) direct pipeline calls, one image each ($DIRECT_IMAGES images)"
timeout "$(budget 240)" python3 - "$SD_DIR" "$DEVICE" "$DTYPE" "$STEPS" "$GUIDANCE" "$DIRECT_IMAGES" "$work/prompts.txt" \
    "$work/direct.json" <<'EOF' 2>&1 | grep -v -i "warn" | tail -n 3
import json, statistics, sys, time
from fastdiff.images import png_bytes
from fastdiff.pipelines import Pipeline
sd, device, dtype, steps, guidance, count, prompts_path, out = sys.argv[1:9]
steps, guidance, count = int(steps), float(guidance), int(count)
prompts = open(prompts_path).read().split("\n")[:-1]
start = time.perf_counter()
pipe = Pipeline.from_pretrained(sd, device=device, dtype=dtype, sampler="ddim", steps=steps)  # as fastdiff serve
load_s = time.perf_counter() - start
def call(k):  # the arguments fastdiff serve's batcher passes for a batch of one request
    return pipe(prompt=[prompts[k % len(prompts)]], negative_prompt=[""], guidance_scale=[guidance],
                num_images_per_prompt=1, seeds=[k], steps=steps, sampler="ddim", output_type="pil", progress=False)
start = time.perf_counter()
call(0)  # builds the engine for batch 1, captures its graphs
first_s = time.perf_counter() - start
call(1)
latencies, encode = [], []
start = time.perf_counter()
for k in range(count):
    t0 = time.perf_counter()
    image = call(100 + k)[0]
    t1 = time.perf_counter()
    png_bytes(image, {"prompt": prompts[k % len(prompts)], "seed": 100 + k, "steps": steps})
    latencies.append((t1 - t0) * 1000)
    encode.append((time.perf_counter() - t1) * 1000)
wall = time.perf_counter() - start - sum(encode) / 1000
q = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else latencies * 99
record = {"images": count, "wall_s": round(wall, 4), "images_per_s": round(count / wall, 3), "load_s": round(load_s, 2),
          "first_call_s": round(first_s, 3), "backend": str(getattr(pipe, "backend", "")),
          "latency_ms": {"p50": round(statistics.median(latencies), 3), "p95": round(q[94], 3), "p99": round(q[98], 3),
                         "min": round(min(latencies), 3)},
          "png_encode_ms_p50": round(statistics.median(encode), 3),
          "what": "TextToImagePipeline call, prompt to PIL image, one image (batch 1), as fastdiff serve loads it; "
                  "the PNG encoding that a server adds is png_encode_ms_p50"}
json.dump(record, open(out, "w"), indent=1)
print("  ", record)
EOF

wait_ready() {  # url pid seconds log
    timeout "$3" python3 - "$1" "$2" <<'EOF' || { echo "   not ready:"; tail -n 20 "$4"; return 1; }
import os, sys, time, httpx
url, pid = sys.argv[1], int(sys.argv[2])
while True:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited")
    try:
        if httpx.get(f"{url}/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.HTTPError:
        pass
    time.sleep(1)
EOF
}
sample_memory() {  # name url pid
    timeout 60 python3 -c "import json, sys; from fastdiff.serve.loadtest import sample_memory as s; \
json.dump(s(sys.argv[1], int(sys.argv[2])), open(sys.argv[3], 'w'))" "$2" "$3" "$work/$1.json" 2>/dev/null \
        || echo "   memory sample $1 failed"
}
run_load() {  # name url concurrency requests seed [timeout]
    local t; t=$(budget "${6:-150}")
    if (( t < 5 )); then echo "   $1 skipped: out of budget"; skipped+=("$1"); return; fi
    echo "== $(elapsed) loadtest $1: $3 clients, $4 requests"
    timeout "$t" python3 -m fastdiff.cli loadtest --url "$2" --concurrency "$3" --requests "$4" --seed "$5" \
        --prompts "$work/prompts.txt" --timeout 240 --out "$work/$1.json" 2>&1 | tail -n 2 | cut -c1-300
}
stop_server() {  # pid
    kill "$1" 2>/dev/null
    for _ in $(seq 30); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
    kill -9 "$1" 2>/dev/null; wait "$1" 2>/dev/null
}

# ---- 3. fastdiff serve
echo "== $(elapsed) fastdiff serve: $DTYPE, ddim $STEPS, guidance $GUIDANCE, max batch $MAX_BATCH, run sizes $BUCKETS"
ready_start=$(date +%s)
python3 -m fastdiff.cli serve --model "$SD_DIR" --device "$DEVICE" --dtype "$DTYPE" --sampler ddim --steps "$STEPS" \
    --guidance "$GUIDANCE" --max-batch "$MAX_BATCH" --batch-buckets "$BUCKETS" --max-wait-ms "$MAX_WAIT_MS" \
    --queue-size "$QUEUE_SIZE" --pad-wait "$PAD_WAIT" --warmup --port "$PORT" >"$OUT/serve-engine.log" 2>&1 &
server=$!
ref=
trap 'kill "$server" 2>/dev/null; [ -n "$ref" ] && kill "$ref" 2>/dev/null' EXIT
if wait_ready "$URL" "$server" "$(budget 300)" "$OUT/serve-engine.log"; then
    echo "$(( $(date +%s) - ready_start ))" >"$work/engine_ready_s"
    echo "   ready after $(cat "$work/engine_ready_s") s (warm-up included)"
    sample_memory engine-mem-ready "$URL" "$server"
    run_load k1 "$URL" 1 "$REQUESTS_K1" 0
    run_load k8 "$URL" 8 "$REQUESTS_K8" 100000
    run_load k32 "$URL" 32 "$REQUESTS_K32" 200000
    sample_memory engine-mem-before-overload "$URL" "$server"
    run_load overload "$URL" "$OVERLOAD_K" "$OVERLOAD_REQUESTS" 300000 200
    sleep 2
    sample_memory engine-mem-after-overload "$URL" "$server"
    run_load after_overload "$URL" 1 4 400000 60
    sample_memory engine-mem-end "$URL" "$server"
    timeout 10 python3 -c "import httpx, sys; print(httpx.get(sys.argv[1] + '/metrics', timeout=5).text)" "$URL" \
        >"$OUT/serve-engine-metrics.txt" 2>/dev/null
else
    skipped+=(engine)
fi
stop_server "$server"

# ---- 4. the reference server
compile_flag=(); [ "$COMPILE" = 1 ] || compile_flag=(--no-compile)
echo "== $(elapsed) reference server: diffusers, $DTYPE, DDIM $STEPS, compiled U-Net: $COMPILE"
ready_start=$(date +%s)
python3 benchmarks/serve_reference.py serve --model "$SD_DIR" --device "$DEVICE" --dtype "$DTYPE" --steps "$STEPS" \
    --guidance "$GUIDANCE" --max-images "$MAX_BATCH" --port "$REF_PORT" "${compile_flag[@]}" >"$OUT/serve-reference.log" 2>&1 &
ref=$!
if wait_ready "$REF_URL" "$ref" "$(budget 300)" "$OUT/serve-reference.log"; then
    echo "$(( $(date +%s) - ready_start ))" >"$work/reference_ready_s"
    echo "   ready after $(cat "$work/reference_ready_s") s (compile and warm-up included)"
    sample_memory reference-mem-ready "$REF_URL" "$ref"
    run_load ref_k1 "$REF_URL" 1 "$REF_REQUESTS_K1" 0
    run_load ref_k8 "$REF_URL" 8 "$REF_REQUESTS_K8" 100000
    run_load ref_k32 "$REF_URL" 32 "$REF_REQUESTS_K32" 200000 200
    sample_memory reference-mem-end "$REF_URL" "$ref"
else
    skipped+=(reference)
fi
stop_server "$ref"
trap - EXIT

# ---- 5. the result
echo "== $(elapsed) result"
SKIPPED="${skipped[*]:-}" python3 - "$work" "$OUT" <<EOF
import json, os, pathlib, sys
from fastdiff.bench.env import environment, gpu_slug
from fastdiff.serve.loadtest import memory_growth
work, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def read(name):
    path = work / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
def number(name):
    try:
        return int((work / name).read_text())
    except (OSError, ValueError):
        return None
env = environment()
buckets = [int(b) for b in "$BUCKETS".split(",") if b]
engine = {name: read(name) for name in ("k1", "k8", "k32", "overload", "after_overload")}
reference = {name: read(f"ref_{name}") for name in ("k1", "k8", "k32")}
direct = read("direct")
memory = {name: read(f"engine-mem-{name}") for name in ("ready", "before-overload", "after-overload", "end")}
ref_memory = {name: read(f"reference-mem-{name}") for name in ("ready", "end")}
def growth(a, b):
    return memory_growth(a, b) if a and b else None
FLAT_MIB = 64
"""Memory counts as flat when no figure (RSS, GPU of the process or device, torch reserved) grew more than this."""
def flat(g):
    return None if g is None else all(v <= FLAT_MIB for v in g.values())
def ips(r):
    return r["images_per_s"] if r and r.get("ok") else None
ratios = {f"k{k}": (round(ips(engine[f"k{k}"]) / ips(reference[f"k{k}"]), 3)
                    if ips(engine[f"k{k}"]) and ips(reference[f"k{k}"]) else None) for k in (1, 8, 32)}
k1_p50 = (engine["k1"] or {}).get("latency_ms", {}).get("p50")
one_image = (direct or {}).get("latency_ms", {}).get("p50")
p50_ratio = round(k1_p50 / one_image, 3) if k1_p50 and one_image else None
png_ms = (direct or {}).get("png_encode_ms_p50")
p50_vs_png = round(k1_p50 / (one_image + png_ms), 3) if k1_p50 and one_image and png_ms else None
"""The server's p50 against the engine's image *and its PNG* (what a response must carry): queue, HTTP, JSON."""
over, after = engine["overload"], engine["after_overload"]
overload_growth = growth(memory["before-overload"], memory["after-overload"])
run_growth = growth(memory["ready"], memory["end"])
overload_ok = (None if not over else
               bool(over["all_answered"] and over["healthy_after"] and after and after["ok"] == after["requests"]))
def met(value, ok):
    return None if value is None else bool(ok)
targets = {
    "k32_images_per_s_vs_reference": {"value": ratios["k32"], "target": ">= 3", "met": met(ratios["k32"], (ratios["k32"] or 0) >= 3)},
    "k1_p50_vs_engine_one_image": {"value": p50_ratio, "k1_p50_ms": k1_p50, "engine_one_image_ms": one_image,
                                   "png_encode_ms": png_ms, "vs_one_image_plus_png": p50_vs_png,
                                   "target": "<= 1.10", "met": met(p50_ratio, (p50_ratio or 9) <= 1.10)},
    "overload_nothing_lost": {"clients": $OVERLOAD_K, "requests": $OVERLOAD_REQUESTS,
                              "status_counts": over and over["status_counts"], "lost": over and over["lost"],
                              "healthy_after": over and over["healthy_after"],
                              "after_overload_ok": after and f"{after['ok']} of {after['requests']}",
                              "met": overload_ok},
    "memory_flat": {"overload_growth": overload_growth, "run_growth": run_growth, "tolerance_mib": FLAT_MIB,
                    "met": flat(overload_growth)},
}
record = {
    "schema": "fastdiff.serve-loadtest-t2i/1",
    "env": env,
    "what": "fastdiff loadtest against fastdiff serve (engine) and a reference server (diffusers "
            "StableDiffusionPipeline, DDIMScheduler, U-Net torch.compile reduce-overhead, one request at a time, "
            "benchmarks/serve_reference.py) on one random-weight SD 1.5 directory; one image per request, prompts "
            "drawn round-robin from 100",
    "model": {"name": "sd15", "random_weights": $RANDOM_WEIGHTS == 1, "directory": "$SD_DIR",
              "size": [512, 512], "prompts": 100},
    "server": {"model": "sd15", "device": "$DEVICE", "dtype": "$DTYPE", "sampler": "ddim", "steps": $STEPS,
               "guidance": $GUIDANCE, "max_batch": $MAX_BATCH, "max_wait_ms": $MAX_WAIT_MS, "pad_wait": $PAD_WAIT, "queue_size": $QUEUE_SIZE,
               "batch_buckets": buckets, "ready_s": number("engine_ready_s")},
    "loadtests": {k: v for k, v in engine.items() if v is not None},
    "memory": memory,
    "batched_vs_solo": {"byte_identical": None, "requests": 0, "images_per_request": 0,
                        "note": "not checked: batches run at several sizes, which need not give the same bytes"},
    "baseline_sequential_batch1": direct,
    "reference": {
        "server": {"system": "diffusers StableDiffusionPipeline + DDIMScheduler", "device": "$DEVICE",
                   "dtype": "$DTYPE", "steps": $STEPS, "guidance": $GUIDANCE, "compiled_unet": "$COMPILE" == "1",
                   "concurrency": "one request at a time", "ready_s": number("reference_ready_s")},
        "loadtests": {k: v for k, v in reference.items() if v is not None},
        "memory": ref_memory,
    },
    "images_per_s_vs_reference": ratios,
    "targets": targets,
    "skipped": os.environ["SKIPPED"].split(),
    "wall_s": $(( $(date +%s) - start_all )),
}
path = out / f"serve-loadtest-sd15-t2i-{gpu_slug(env['gpu'])}.json"
path.write_text(json.dumps(record, indent=1) + "\n")
print("wrote", path)
for system, runs in (("engine", engine), ("reference", reference)):
    for name, r in runs.items():
        if r:
            print(f"  {system:9s} {name:14s} K={r['concurrency']:3d} {r['images_per_s']:8.2f} img/s  p50 "
                  f"{r['latency_ms']['p50']} p99 {r['latency_ms']['p99']} ms  {r['status_counts']} lost {r['lost']}")
print("  direct one image:", direct and direct["latency_ms"])
for name, t in targets.items():
    print(f"  target {name}: {t.get('value', '')} met={t['met']}")
EOF
