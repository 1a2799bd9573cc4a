#!/usr/bin/env bash
# `fastdiff serve` under load on the lent GPU: one server, `fastdiff loadtest` at K = 1, 8, 64 clients and at 2x
# overload (twice the requests the server can hold: max batch + queue), a batched-vs-solo byte check, then
# sequential batch-1 sampling through the pipeline as the baseline. One results JSON lands in $OUT.
#   bash scripts/gpu_serve_loadtest.sh        (repo root on the GPU machine; carry .whl)
# The GPU machine has no network: if fastapi/uvicorn/httpx are not installed there, carry their wheels in .whl/,
# downloaded for its Python (3.12) here:
#   pip download -d .whl --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 fastapi uvicorn httpx
# Settings (environment): MODEL (ddpm-cifar10: random weights), DTYPE (fp16, engine backend), SAMPLER (ddim),
# STEPS (20), MAX_BATCH (64), MAX_WAIT_MS (5), QUEUE_SIZE (128), BUCKETS (empty: every batch runs at MAX_BATCH;
# e.g. 1,8,64), REQUESTS_K1 (64), REQUESTS (1024), OVERLOAD_REQUESTS (2048), BASELINE_IMAGES (64), PORT (8765),
# DEVICE (cuda). A CPU dry run: DEVICE=cpu MODEL=fashion-mnist DTYPE=fp32 STEPS=2 MAX_BATCH=4 QUEUE_SIZE=4
#   REQUESTS_K1=4 REQUESTS=8 OVERLOAD_REQUESTS=32 BASELINE_IMAGES=4 OUT=/tmp/serve-dry bash scripts/gpu_serve_loadtest.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${MODEL:-ddpm-cifar10}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-fp16}
SAMPLER=${SAMPLER:-ddim}
STEPS=${STEPS:-20}
MAX_BATCH=${MAX_BATCH:-64}
MAX_WAIT_MS=${MAX_WAIT_MS:-5}
QUEUE_SIZE=${QUEUE_SIZE:-128}
BUCKETS=${BUCKETS:-}
REQUESTS_K1=${REQUESTS_K1:-64}
REQUESTS=${REQUESTS:-1024}
OVERLOAD_REQUESTS=${OVERLOAD_REQUESTS:-2048}
BASELINE_IMAGES=${BASELINE_IMAGES:-64}
PORT=${PORT:-8765}
URL="http://127.0.0.1:$PORT"
OVERLOAD_K=$(( 2 * (MAX_BATCH + QUEUE_SIZE) ))

site=$(mktemp -d)
work=$(mktemp -d)
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" .whl/*.whl
fi
export PYTHONPATH="src:$site" PYTHONUNBUFFERED=1
python3 -c "import fastapi, uvicorn, httpx" || { echo "fastapi, uvicorn or httpx missing: carry wheels (header)"; exit 2; }
if command -v nvidia-smi >/dev/null; then nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; fi

bucket_flags=()
[ -n "$BUCKETS" ] && bucket_flags=(--batch-buckets "$BUCKETS")
echo "== fastdiff serve $MODEL $DTYPE, $SAMPLER $STEPS steps, max batch $MAX_BATCH, buckets ${BUCKETS:-$MAX_BATCH}"
start=$(date +%s)
python3 -m fastdiff.cli serve --model "$MODEL" --device "$DEVICE" --dtype "$DTYPE" --sampler "$SAMPLER" --steps "$STEPS" \
    --max-batch "$MAX_BATCH" --max-wait-ms "$MAX_WAIT_MS" --queue-size "$QUEUE_SIZE" "${bucket_flags[@]}" \
    --warmup --port "$PORT" >"$OUT/serve.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null' EXIT
python3 - "$URL" "$server" <<'EOF' || { tail -n 30 "$OUT/serve.log"; exit 1; }
import os, sys, time, httpx
url, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 400
while time.monotonic() < deadline:
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
sys.exit("the server did not come up in 400 s")
EOF
echo "   server ready after $(( $(date +%s) - start )) s (warm-up included)"

run_load() {  # name concurrency requests [seed]
    echo "== loadtest $1: K=$2, $3 requests"
    python3 -m fastdiff.cli loadtest --url "$URL" --concurrency "$2" --requests "$3" --seed "${4:-0}" \
        --out "$work/$1.json" 2>&1 | tail -n 3
}
run_load k1 1 "$REQUESTS_K1"
run_load k8 8 "$REQUESTS" 100000
run_load k64 64 "$REQUESTS" 200000

echo "== batched vs solo bytes"
python3 - "$URL" "$work/identity.json" "$MAX_BATCH" "$QUEUE_SIZE" <<'EOF'
import json, sys, threading, time, httpx
url, out, max_batch, queue_size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
per, count = min(3, max_batch), min(16, queue_size)
bodies = [{"seeds": [7000 + per * k + j for j in range(per)]} for k in range(count)]
def post(client, body):
    while True:  # a 429 is retried: every request must be answered for the comparison
        response = client.post("/v1/images", json=body)
        if response.status_code != 429:
            response.raise_for_status()
            return response.json()
        time.sleep(0.05)
with httpx.Client(base_url=url, timeout=120) as client:
    solo = [post(client, b) for b in bodies]
results = [None] * count
barrier = threading.Barrier(count)
def send(k):
    barrier.wait()
    with httpx.Client(base_url=url, timeout=120) as client:
        results[k] = post(client, bodies[k])
threads = [threading.Thread(target=send, args=(k,)) for k in range(count)]
for t in threads: t.start()
for t in threads: t.join()
same = all(a["images"] == b["images"] for a, b in zip(solo, results))
record = {"requests": count, "images_per_request": per, "byte_identical": same,
          "solo_batch_images": max(r["timing"]["batch_images"] for r in solo),
          "concurrent_batch_images": max(r["timing"]["batch_images"] for r in results)}
json.dump(record, open(out, "w"))
print("  ", record)
EOF

run_load overload "$OVERLOAD_K" "$OVERLOAD_REQUESTS" 300000
python3 -c "import httpx, sys; print(httpx.get(sys.argv[1] + '/metrics', timeout=10).text)" "$URL" >"$OUT/serve-metrics.txt"
kill "$server"; wait "$server" 2>/dev/null
trap - EXIT

echo "== baseline: sequential batch-1 sampling through the pipeline"
python3 - "$MODEL" "$DEVICE" "$DTYPE" "$SAMPLER" "$STEPS" "$BASELINE_IMAGES" "$work/baseline.json" <<'EOF'
import json, statistics, sys, time
from fastdiff.pipelines import Pipeline
model, device, dtype, sampler = sys.argv[1:5]
steps, count, out = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
pipe = Pipeline.from_pretrained(model, device=device, dtype=dtype, sampler=sampler, steps=steps)
start = time.perf_counter()
pipe(batch_size=1, seeds=[0], output_type="pil", progress=False)  # captures the batch-1 graphs
first_s = time.perf_counter() - start
latencies = []
start = time.perf_counter()
for seed in range(count):
    t0 = time.perf_counter()
    pipe(batch_size=1, seeds=[seed], output_type="pil", progress=False)
    latencies.append((time.perf_counter() - t0) * 1000)
wall = time.perf_counter() - start
q = statistics.quantiles(latencies, n=100)
record = {"images": count, "wall_s": round(wall, 4), "images_per_s": round(count / wall, 3), "first_call_s": round(first_s, 3),
          "latency_ms": {"p50": round(statistics.median(latencies), 3), "p95": round(q[94], 3), "p99": round(q[98], 3)}}
json.dump(record, open(out, "w"))
print("  ", record)
EOF

python3 - "$work" "$OUT" <<EOF
import json, pathlib, sys
from fastdiff.bench.env import environment, gpu_slug
work, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
read = lambda name: json.loads((work / f"{name}.json").read_text()) if (work / f"{name}.json").exists() else None
env = environment()
buckets = "$BUCKETS"
record = {
    "schema": "fastdiff.serve-loadtest/1",
    "env": env,
    "server": {"model": "$MODEL", "device": "$DEVICE", "dtype": "$DTYPE", "sampler": "$SAMPLER", "steps": $STEPS, "max_batch": $MAX_BATCH,
               "max_wait_ms": $MAX_WAIT_MS, "queue_size": $QUEUE_SIZE,
               "batch_buckets": [int(b) for b in buckets.split(",")] if buckets else [$MAX_BATCH]},
    "loadtests": {name: read(name) for name in ("k1", "k8", "k64", "overload")},
    "batched_vs_solo": read("identity"),
    "baseline_sequential_batch1": read("baseline"),
}
tag = "-buckets-" + buckets.replace(",", "-") if buckets else ""
path = out / f"serve-loadtest-$MODEL{tag}-{gpu_slug(env['gpu'])}.json"
path.write_text(json.dumps(record, indent=1) + "\n")
print("wrote", path)
for name, r in record["loadtests"].items():
    if r:
        print(f"  {name:9s} K={r['concurrency']:4d} {r['images_per_s']:9.1f} img/s  p50 {r['latency_ms']['p50']} "
              f"p99 {r['latency_ms']['p99']} ms  ok {r['ok']} 429 {r['rejected_429']} err {r['errors']} "
              f"healthy {r['healthy_after']}")
EOF
