"""One text-to-image image split over GPUs against one GPU: time per image and PSNR. ``--split patch`` (default): the
latent's rows (``--patch-parallel``, eager backend); ``--split guidance``: the two guidance halves
(``--guidance-parallel``; ``--backend engine`` gathers them inside the engine's captured loop).

    python benchmarks/patch_parallel.py --model sd15 --size 1024 --work W one          # one GPU: W/one.pt + timing
    torchrun --nproc-per-node 2 benchmarks/patch_parallel.py --model sd15 --size 1024 --work W split
    python benchmarks/patch_parallel.py --model sd15 --size 1024 --work W report --out result.json

The same prompt, seeds, sampler and steps each time (eager backend, as patch-parallel runs; the presets' random
weights when no weights exist). ``split`` runs the warm-up counts of ``--warmups`` (synchronous steps before the
exchanges go stale; ``--steps`` means always synchronous) and saves rank 0's images; ``report`` compares each with
the one-GPU images (PSNR over [-1, 1] images, peak 2) and writes the timings, the environment and the git sha.
Timings: a warm-up call, then the median of ``--repeats`` calls (CUDA-synchronised wall time per call). The same
calls at half the steps split each time into a per-step part (U-Net and sampler step) and the rest (text, VAE decode,
host): per step = (t(steps) - t(steps/2)) / (steps - steps/2).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def timed_calls(pipe, call: dict, repeats: int) -> tuple[list[float], object]:
    from fastdiff.devices import synchronize

    images = pipe(**call)  # warm-up: allocator, cuDNN / cuBLAS plans
    times = []
    for _ in range(repeats):
        synchronize(pipe.device)
        start = time.perf_counter()
        images = pipe(**call)
        synchronize(pipe.device)
        times.append(time.perf_counter() - start)
    return times, images


def profile_call(pipe, call: dict, path: Path) -> None:
    """One more call under the PyTorch profiler: the 30 ops of most GPU time, as its table, into ``path``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pipe(**call)
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("one", "split", "report"))
    p.add_argument("--model", default="sd15")
    p.add_argument("--size", type=int, default=1024, help="image height and width (pixels)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sampler", default="ddim")
    p.add_argument("--guidance", type=float, default=7.5)
    p.add_argument("--prompt", default="a lighthouse on a cliff at sunset, oil painting")
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--device", default="cuda", help="cuda (rank r: GPU r), or cpu to dry-run the flow (gloo)")
    p.add_argument("--split", choices=("patch", "guidance"), default="patch")
    p.add_argument("--backend", choices=("eager", "engine"), default="eager", help="both the one-GPU and split runs")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmups", default="4,20", help="comma-separated synchronous step counts to run")
    p.add_argument("--work", type=Path, required=True, help="folder for the images and timings")
    p.add_argument("--out", type=Path, default=None, help="report: the result JSON")
    p.add_argument("--profile", type=Path, default=None, help="one / split: one more call profiled, its op table here")
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.mode == "report":
        return report(args)

    import torch

    import fastdiff

    call = dict(prompt=args.prompt, guidance_scale=args.guidance, seeds=0, steps=args.steps, sampler=args.sampler,
                height=args.size, width=args.size, output_type="tensor", progress=False)  # fmt: skip
    if args.mode == "one":
        pipe = fastdiff.Pipeline.from_pretrained(args.model, device=args.device, dtype=args.dtype, backend=args.backend)
        times, images = timed_calls(pipe, call, args.repeats)
        half, _ = timed_calls(pipe, {**call, "steps": args.steps // 2}, args.repeats)
        if args.profile:
            profile_call(pipe, call, args.profile)
        torch.save(images.cpu(), args.work / "one.pt")
        (args.work / "one.json").write_text(json.dumps({"seconds": times, "seconds_half_steps": half}))
        return None
    import torch.distributed as dist

    device = args.device
    if device == "cuda":
        device = f"cuda:{os.environ['LOCAL_RANK']}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device != "cpu" else "gloo")
    try:
        pipe = fastdiff.Pipeline.from_pretrained(args.model, device=device, dtype=args.dtype, backend=args.backend)
        runs, runs_half = {}, {}
        if args.split == "guidance":
            pipe.split_guidance()
        for warmup in (int(w) for w in args.warmups.split(",")) if args.split == "patch" else (0,):
            if args.split == "patch":
                pipe.split_patches(warmup=warmup)
            times, images = timed_calls(pipe, call, args.repeats)
            runs_half[warmup], _ = timed_calls(pipe, {**call, "steps": args.steps // 2}, args.repeats)
            if args.profile and dist.get_rank() == 0:
                profile_call(pipe, call, args.profile.with_name(f"{args.profile.stem}-warmup{warmup}.txt"))
            elif args.profile:
                pipe(**call)  # the other ranks take part in rank 0's profiled call
            runs[warmup] = times
            if dist.get_rank() == 0:
                torch.save(images.cpu(), args.work / f"split-warmup{warmup}.pt")
        if dist.get_rank() == 0:
            (args.work / "split.json").write_text(
                json.dumps({"world": dist.get_world_size(), "seconds": runs, "seconds_half_steps": runs_half})
            )
    finally:
        dist.destroy_process_group()
    return None


def report(args: argparse.Namespace) -> None:
    import torch

    from fastdiff.atomic import write_text_atomic
    from fastdiff.bench.env import environment

    one = json.loads((args.work / "one.json").read_text())
    split = json.loads((args.work / "split.json").read_text())
    alone = torch.load(args.work / "one.pt").double()
    t_one = statistics.median(one["seconds"])

    def parts(t: float, halves: list[float] | None) -> dict:
        """The per-step and fixed parts of a call of median ``t`` from its half-step calls (runs before the
        half-step timings have none)."""
        if not halves:
            return {}
        step = (t - statistics.median(halves)) / (args.steps - args.steps // 2)
        return {"step_ms": round(step * 1e3, 3), "fixed_ms": round((t - args.steps * step) * 1e3, 2)}

    rows = []
    for warmup, times in split["seconds"].items():
        images = torch.load(args.work / f"split-warmup{warmup}.pt").double()
        mse = (images - alone).square().mean().item()
        t = statistics.median(times)
        psnr = 10 * torch.log10(torch.tensor(4 / mse)).item() if mse > 0 else float("inf")
        rows.append({
            "warmup_steps": int(warmup), "seconds_median": round(t, 4), "seconds": times,
            "speedup": round(t_one / t, 3), "psnr_db": round(psnr, 2),
            "max_abs": round((images - alone).abs().max().item(), 4),
            **parts(t, split.get("seconds_half_steps", {}).get(warmup)),
        })  # fmt: skip
    result = {
        "what": "one text-to-image image split over GPUs (patch: the latent's rows, --patch-parallel; guidance: the "
        "two guidance halves, --guidance-parallel; warmup_steps 0 for guidance) against one GPU on the same backend: "
        "median seconds per image and PSNR of the split image against the one-GPU image",
        "env": environment(),
        "model": args.model,
        "random_weights": args.model in ("sd15", "sd21"),
        "settings": {
            "size": args.size,
            "steps": args.steps,
            "sampler": args.sampler,
            "guidance": args.guidance,
            "dtype": args.dtype,
            "repeats": args.repeats,
            "prompt": args.prompt,
        },  # fmt: skip
        "processes": split["world"],
        "split_kind": args.split,
        "backend": args.backend,
        "one_gpu_seconds_median": round(t_one, 4),
        "one_gpu_seconds": one["seconds"],
        "one_gpu": parts(t_one, one.get("seconds_half_steps")),
        "split": rows,
    }
    text = json.dumps(result, indent=1) + "\n"
    if args.out is not None:
        write_text_atomic(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
