"""FD-FMNIST of the shipped model for several samplers, next to the train-vs-test floor.

    PYTHONPATH=src python benchmarks/fd_fmnist.py --model fashion-mnist --n 10000 --device cuda \
        --data .data/fashion-mnist --out benchmarks/results/fd-fmnist-<gpu>.json --grid samples.png

Images b = 0..n-1 use seed b, for every sampler. "sample_seconds" times the n samples on a prepared pipeline
(weights loaded, kernels compiled, graphs captured by one untimed batch); "ready_seconds" is that preparation.
A config "sampler:steps:N" samples with step caching (``cache_interval`` N: the whole U-Net every N-th step, its
shallow path in between; ``fastdiff.models.step_cache``), for a speed vs FD table:

    --configs ddim:20,ddim:20:2,ddim:20:3,ddim:20:5,dpmsolver++:20,dpmsolver++:20:2,dpmsolver++:20:3

``--dtype`` (fp32, fp16, bf16 or fp8) goes to ``Pipeline.from_pretrained``; ``--dtype fp8`` measures the engine's
fp8 mode (fp16 activations, e4m3 convs after each GroupNorm; Hopper GPUs): its FD next to a ``--dtype fp16`` run is
the quality cost of fp8.

Writes the JSON (with env) after every config and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from fastdiff.bench.env import environment
from fastdiff.data import load_fashion_mnist
from fastdiff.images import make_grid, save_png_atomic, to_pil
from fastdiff.pipelines import Pipeline
from fastdiff.quality.classifier import fd_fmnist, load_classifier

log = logging.getLogger("fd_fmnist")
CONFIGS = "dpmsolver++:10,dpmsolver++:20,unipc:10,unipc:20,euler:10,euler:20,ddim:20,ddim:100,ddpm:1000"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def generate(pipe: Pipeline, n: int, batch: int, cache_interval: int) -> torch.Tensor:
    chunks = []
    for start in range(0, n, batch):
        size = min(batch, n - start)
        images = pipe(batch_size=size, seeds=start, output_type="tensor", progress=False, cache_interval=cache_interval)
        chunks.append(images.float().cpu())
    return torch.cat(chunks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="fashion-mnist")
    p.add_argument("--n", type=int, default=10000)
    p.add_argument("--batch", type=int, default=2500)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="fp16", help="fp32, fp16, bf16 or fp8 (the engine's fp8 mode)")
    p.add_argument("--data", type=Path, default=None)
    p.add_argument("--configs", default=CONFIGS, help="sampler:steps[:cache_interval],...")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--grid", type=Path, default=None, help="PNG grid of the first 64 images of each config")
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                   help="also FD(train n vs test), the floor (reads the train split; else null)")  # fmt: skip
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    if device == "auto":
        device = "cpu"
    load_classifier(None, device)
    floor = None
    if args.floor:
        train, _ = load_fashion_mnist("train", args.data)
        perm = torch.randperm(train.shape[0], generator=torch.Generator().manual_seed(0))[: args.n]
        floor = fd_fmnist(train[perm], "test", data_dir=args.data, device=device)
        log.info("floor: FD(train %d vs test) = %.3f", args.n, floor)
    rows: list[dict] = []
    result = {
        "schema": "fastdiff.fd_fmnist/2",
        "env": environment(),
        "config": {
            "model": args.model,
            "n": args.n,
            "dtype": args.dtype,
            "batch": args.batch,
            "seeds": f"0..{args.n - 1}",
        },  # fmt: skip
        "floor_train_vs_test": floor,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for spec in args.configs.split(","):
        sampler, steps, *cache = spec.split(":")
        cache_interval = int(cache[0]) if cache else 1
        t0 = time.perf_counter()
        pipe = Pipeline.from_pretrained(args.model, device=device, dtype=args.dtype, sampler=sampler, steps=int(steps))
        generate(pipe, min(args.batch, args.n), args.batch, cache_interval)  # load + capture
        _sync(device)
        ready_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        images = generate(pipe, args.n, args.batch, cache_interval)
        _sync(device)
        seconds = time.perf_counter() - t0
        fd = fd_fmnist(images, "test", data_dir=args.data, device=device)
        rows.append({"sampler": sampler, "steps": int(steps), "cache_interval": cache_interval, "fd_fmnist": fd,
                     "sample_seconds": seconds, "ready_seconds": ready_s, "backend": pipe.backend})  # fmt: skip
        log.info("%s: FD-FMNIST %.3f (%.1f s for %d images)", spec, fd, seconds, args.n)
        if args.grid is not None:
            grid = make_grid(to_pil(images[:64]), nrow=8)
            suffix = f"-cache{cache_interval}" if cache_interval > 1 else ""
            save_png_atomic(grid, args.grid.with_name(f"{args.grid.stem}-{sampler}{steps}{suffix}.png"))
        args.out.write_text(json.dumps(result, indent=1) + "\n")  # after every config: a cut run keeps its rows
    print(f"| sampler | steps | cache interval | FD-FMNIST ({args.n} samples vs test) | seconds ({args.dtype}, "
          f"{rows[0]['backend']}) |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        cells = (r["sampler"], r["steps"], r["cache_interval"], f"{r['fd_fmnist']:.2f}", f"{r['sample_seconds']:.1f}")
        print("| " + " | ".join(map(str, cells)) + " |")
    if floor is not None:
        print(f"| train set (floor) | — | — | {floor:.2f} | — |")


if __name__ == "__main__":
    main()
