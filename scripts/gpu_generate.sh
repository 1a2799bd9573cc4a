#!/usr/bin/env bash
# Bulk generation on one host with 2 GPUs: `fastdiff generate` of MODEL (default ddpm-cifar10) with one GPU, then
# under `torchrun --nproc-per-node 2` (NCCL, NVLink multicast off), the same seeds; checks that both folders hold the
# same bytes and writes $OUT/generate-$MODEL-2gpu.json (GPUs, versions, git sha, images/s, speed-up). A text-to-image
# MODEL (fashion-mnist-t2i, sd15, sd21) samples a prompts file of NUM_IMAGES lines (the ten Fashion-MNIST classes in
# turn) at GUIDANCE (3), as `generate --prompts`.
#   bash scripts/gpu_generate.sh     (repo root on the 2-GPU machine; carry .whl if the tree needs diffusers)
# ddpm-cifar10 ships no weights: the model is RANDOM (initialised from a fixed seed, the same on every rank), so
# the images are noise; the work per image, hence the throughput, and the byte-identity do not depend on weights.
# A short run first fills the Triton and engine caches, so neither timed run pays for compiling kernels.
# NUM_IMAGES (default 65536: about 60 s on one GPU), BATCH (256), SAMPLER (ddim), STEPS (20), DTYPE (fp16),
# FORMAT (png) override the settings; WORK is where the image folders go (not $OUT: too many files). PLAN: a kernel
# plan file every run takes (--plan); REPEAT=1 runs the one-GPU generate twice (two processes, same GPU, compared
# as "one_gpu_repeat": separates "processes differ" from "GPU counts differ"), REPEAT=cuda:1 runs the second one on
# the other GPU (cuda:0 against cuda:1); SKIP_WRITER_BENCH=1 skips the host
# writers' bench; FASTDIFF_WRITER=processes is passed on to generate (and recorded).
# Then the sampler alone on one GPU (same settings, no files: "sampler_only_images_per_s_1gpu", and generate's
# fraction of it), and scripts/bench_writer.py times the host's PNG writers alone (no GPU): the old per-file
# fsync writer, generate's UnitWriter at 1, 2, 4 threads and a process pool, as "host_writers" (images/s).
source "$(dirname "$0")/gpu_env.sh"
WORK=${WORK:-/tmp/fastdiff-generate}
NUM_IMAGES=${NUM_IMAGES:-65536} BATCH=${BATCH:-256} SAMPLER=${SAMPLER:-ddim} STEPS=${STEPS:-20}
DTYPE=${DTYPE:-fp16} FORMAT=${FORMAT:-png} MODEL=${MODEL:-ddpm-cifar10} GUIDANCE=${GUIDANCE:-3}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
rm -rf "$WORK" && mkdir -p "$WORK"

flags=(--model "$MODEL" --sampler "$SAMPLER" --steps "$STEPS" --dtype "$DTYPE" --batch "$BATCH"
       --format "$FORMAT" --shard-size 4096 --no-progress)
[ -n "${PLAN:-}" ] && flags+=(--plan "$PLAN")
PROMPTS=""
case "$MODEL" in *t2i*|sd15|sd21)  # text-to-image: a prompts file, the ten Fashion-MNIST classes in turn
    PROMPTS="$WORK/prompts.txt"
    python3 -c "import sys
names = ('t-shirt', 'pair of trousers', 'pullover', 'dress', 'coat', 'sandal', 'shirt', 'sneaker', 'bag', 'ankle boot')
sys.stdout.write(''.join(f'a photo of a {names[i % 10]}\n' for i in range(int(sys.argv[1]))))" "$NUM_IMAGES" > "$PROMPTS"
    flags+=(--prompts "$PROMPTS" --guidance "$GUIDANCE");;
esac
echo "== warm-up: $((BATCH * 4)) images on one GPU"
python3 -m fastdiff.cli generate "${flags[@]}" --num-images $((BATCH * 4)) --out-dir "$WORK/warm" 2>&1 | tail -n 3
echo "== one GPU: $NUM_IMAGES images"
python3 -m fastdiff.cli generate "${flags[@]}" --num-images "$NUM_IMAGES" --out-dir "$WORK/one" --device cuda:0 \
    2>&1 | tee "$OUT/generate-1gpu.log" | tail -n 3
REPEAT=${REPEAT:-0}; [ "$REPEAT" = 1 ] && REPEAT=cuda:0
if [ "$REPEAT" != 0 ]; then
    echo "== one GPU again (a second process, $REPEAT): $NUM_IMAGES images"
    python3 -m fastdiff.cli generate "${flags[@]}" --num-images "$NUM_IMAGES" --out-dir "$WORK/one-again" \
        --device "$REPEAT" 2>&1 | tail -n 1
fi
echo "== torchrun --nproc-per-node 2: $NUM_IMAGES images"
python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m fastdiff.cli generate "${flags[@]}" \
    --num-images "$NUM_IMAGES" --out-dir "$WORK/two" 2>&1 | tee "$OUT/generate-2gpu.log" | tail -n 3

echo "== the sampler alone on one GPU: $NUM_IMAGES images, no files (what generate's host side must keep up with)"
MODEL="$MODEL" PROMPTS="$PROMPTS" GUIDANCE="$GUIDANCE" SAMPLER="$SAMPLER" STEPS="$STEPS" DTYPE="$DTYPE" \
    BATCH="$BATCH" NUM_IMAGES="$NUM_IMAGES" python3 - \
    > "$OUT/sampler-only.json" <<'PY' || echo '{"sampler_only_images_per_s": null}' > "$OUT/sampler-only.json"
import json, os, time

import torch

from fastdiff.pipelines import Pipeline

batch, count = int(os.environ["BATCH"]), int(os.environ["NUM_IMAGES"])
torch.manual_seed(0)  # random weights, as generate's RANDOM_INIT_SEED
pipe = Pipeline.from_pretrained(os.environ["MODEL"], device="cuda:0", dtype=os.environ["DTYPE"],
                                sampler=os.environ["SAMPLER"], steps=int(os.environ["STEPS"]))
prompts = open(os.environ["PROMPTS"]).read().splitlines() if os.environ["PROMPTS"] else None


def sample(first: int, n: int) -> None:
    if prompts is None:
        pipe(batch_size=n, seeds=first, output_type="tensor", progress=False)
    else:  # generate's chunk: image i is prompt line i with seed i
        pipe(prompts[first : first + n], guidance_scale=float(os.environ["GUIDANCE"]), seeds=first,
             output_type="tensor", progress=False)


for _ in range(3):
    sample(0, batch)
torch.cuda.synchronize()
start = time.perf_counter()
for first in range(0, count, batch):
    sample(first, min(batch, count - first))
torch.cuda.synchronize()
print(json.dumps({"sampler_only_images_per_s": round(count / (time.perf_counter() - start), 1)}))
PY
cat "$OUT/sampler-only.json"

if [ "${SKIP_WRITER_BENCH:-0}" != 1 ]; then
    echo "== host PNG writers alone (scripts/bench_writer.py)"
    python3 scripts/bench_writer.py --images 8192 --batch "$BATCH" --repeats 2 --dir "$WORK" 2>&1 \
        | tee "$OUT/bench-writer.log" | tail -n 1 > "$OUT/bench-writer.json"
fi

REPEAT="$REPEAT" MODEL="$MODEL" PROMPTS="$PROMPTS" GUIDANCE="$GUIDANCE" python3 - "$WORK" "$OUT/generate-$MODEL-2gpu.json" \
    "$OUT/bench-writer.json" "$OUT/sampler-only.json" <<'EOF'
import hashlib, json, os, sys
from pathlib import Path

import torch

from fastdiff.bench.env import environment

work, out, writers, sampler = (Path(arg) for arg in sys.argv[1:5])


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def count_lines(path: str) -> int:
    return len(Path(path).read_text().splitlines())


host_writers = read_json(writers)
sampler_only = (read_json(sampler) or {}).get("sampler_only_images_per_s")


def digests(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.iterdir()
        if p.suffix in (".png", ".npz")
    }


one, two = digests(work / "one"), digests(work / "two")
s1, s2 = (json.loads((work / run / "summary.json").read_text()) for run in ("one", "two"))
for summary in (s1, s2):
    del summary["out_dir"]  # a path on the GPU machine
manifest = json.loads((work / "one" / "manifest.json").read_text())
differ = sorted(name for name in one.keys() | two.keys() if one.get(name) != two.get(name))
repeat = None
if (work / "one-again").is_dir():
    again = digests(work / "one-again")
    repeat_differ = sorted(name for name in one.keys() | again.keys() if one.get(name) != again.get(name))
    repeat = {"device": os.environ["REPEAT"], "files_compared": len(again), "files_differing": len(repeat_differ), "first_differing": repeat_differ[:10]}
result = {
    "env": environment(),
    "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    "model": os.environ["MODEL"] + (" (random weights: the preset ships none)"
                                    if os.environ["MODEL"] in ("ddpm-cifar10", "sd15", "sd21") else ""),
    "prompts": {"lines": count_lines(os.environ["PROMPTS"]), "guidance": float(os.environ["GUIDANCE"])}
    if os.environ["PROMPTS"] else None,
    "settings": {
        "num_images": s1["num_images"],
        "batch": s1["batch"],
        **{k: manifest[k] for k in ("sampler", "steps", "dtype", "image_size", "format", "fastdiff_version")},
    },
    "images_per_s_1gpu": s1["images_per_s"],
    "images_per_s_2gpu": s2["images_per_s"],
    "speedup": round(s2["images_per_s"] / s1["images_per_s"], 3),
    "sampler_only_images_per_s_1gpu": sampler_only,
    "generate_vs_sampler_1gpu": round(s1["images_per_s"] / sampler_only, 3) if sampler_only else None,
    "identical_files": not differ and len(one) > 0,
    "files_compared": len(one),
    "files_differing": len(differ),
    "first_differing": differ[:10],
    "one_gpu_repeat": repeat,
    "plan": os.path.basename(os.environ.get("PLAN", "")) or None,
    "writer": os.environ.get("FASTDIFF_WRITER") or "threads",
    "host_writers": host_writers,
    "one_gpu": s1,
    "two_gpus": s2,
}
out.write_text(json.dumps(result, indent=2) + "\n")
keys = ("gpus", "images_per_s_1gpu", "images_per_s_2gpu", "speedup", "sampler_only_images_per_s_1gpu",
        "generate_vs_sampler_1gpu", "identical_files", "files_compared")
print(json.dumps({k: result[k] for k in keys}))
EOF
