"""Paired quality of fastdiff's samplers against diffusers' default loops, as users run them.

A random ``UNet2DModel`` at the google/ddpm-cifar10-32 config is saved with the scheduler config that checkpoint
ships (``clip_sample: true``, no ``timestep_spacing``) and loaded as any local model is (``load_unet`` +
``ScheduleConfig.from_diffusers``). diffusers runs the same weights in fp32 with ``Scheduler.from_config(saved)``
and ``step`` with default arguments (its pipelines' own loop); fastdiff runs the engine (fp16 / bf16) or its eager
loop. Both start from the same unit-variance x_T. Deterministic samplers only (stochastic ones draw different
noise by design).

    PYTHONPATH=src python benchmarks/sampler_parity.py --device cuda --out benchmarks/results/sampler-parity-h100.json
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path

import torch

from fastdiff.bench.env import environment
from fastdiff.models import load_unet
from fastdiff.pipeline import resolve_dtype, sample_loop
from fastdiff.quality.psnr import psnr
from fastdiff.samplers import SAMPLER_SCHEDULERS, ScheduleConfig, initial_noise, make_sampler, seed_tensor

log = logging.getLogger("sampler_parity")

GOOGLE_DDPM_CIFAR10_SCHEDULER = {
    "_class_name": "DDPMScheduler",
    "_diffusers_version": "0.1.1",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "clip_sample": True,
    "num_train_timesteps": 1000,
    "trained_betas": None,
    "variance_type": "fixed_small",
}
CASES = "ddim:100,ddim:20,dpmsolver++:20,unipc:20,euler:20"


@torch.no_grad()
def diffusers_loop(unet, saved: dict, sampler: str, steps: int, x_t: torch.Tensor) -> torch.Tensor:
    import diffusers

    sched = getattr(diffusers, SAMPLER_SCHEDULERS[sampler]).from_config(saved)
    sched.set_timesteps(steps, device=x_t.device)
    x = x_t * sched.init_noise_sigma
    for t in sched.timesteps:
        x = sched.step(unet(sched.scale_model_input(x, t), t).sample, t, x).prev_sample
    return x.clamp(-1, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--cases", default=CASES, help="sampler:steps,...")
    p.add_argument("--dtypes", default="fp16,bf16")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import diffusers

    from fastdiff.engine import Engine
    from fastdiff.models.ddpm_unet import DDPM_PRESETS

    torch.manual_seed(0)
    config = {k: v for k, v in vars(DDPM_PRESETS["ddpm-cifar10"]).items() if not k.startswith("_")}
    reference_unet = diffusers.UNet2DModel(**config).eval()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        reference_unet.save_pretrained(tmp)
        (Path(tmp) / "scheduler_config.json").write_text(json.dumps(GOOGLE_DDPM_CIFAR10_SCHEDULER))
        reference_unet.to(args.device)
        unet = load_unet(tmp, device=args.device)  # the saved directory, as a user loads it
        schedule = ScheduleConfig.from_diffusers(unet.scheduler_config)
        engine = Engine(args.device) if args.device == "cuda" else None
        seeds = seed_tensor(range(args.batch), args.device)
        x_t = initial_noise(seeds, (3, 32, 32), args.device)
        for case in args.cases.split(","):
            name, steps = case.split(":")
            ref = diffusers_loop(reference_unet, GOOGLE_DDPM_CIFAR10_SCHEDULER, name, int(steps), x_t)
            sampler = make_sampler(name, schedule, int(steps), device=args.device)
            outputs = {("eager", "fp32"): sample_loop(unet, sampler, x_t, seeds, torch.float32)}
            for dtype in args.dtypes.split(",") if engine is not None else []:
                outputs["engine", dtype] = engine.sample(unet, sampler, x_t, seeds, resolve_dtype(dtype)).clamp(-1, 1)
            for (backend, dtype), out in outputs.items():
                row = {"sampler": name, "steps": int(steps), "backend": backend, "dtype": dtype,
                       "psnr_db_vs_diffusers_fp32": float(psnr(out.float(), ref).mean()),
                       "max_abs_diff": float((out.float() - ref).abs().max())}  # fmt: skip
                rows.append(row)
                log.info("%s", row)
    result = {
        "schema": "fastdiff.sampler_parity/1",
        "env": environment(),
        "config": {"model": "ddpm-cifar10 (random weights, torch.manual_seed(0))", "batch": args.batch,
                   "scheduler_config": GOOGLE_DDPM_CIFAR10_SCHEDULER, "reference": "diffusers fp32, default step"},
        "results": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| sampler | steps | backend | dtype | PSNR vs diffusers fp32 (dB) | max abs diff |")
    print("| --- | ---: | --- | --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['sampler']} | {r['steps']} | {r['backend']} | {r['dtype']} | "
              f"{r['psnr_db_vs_diffusers_fp32']:.1f} | {r['max_abs_diff']:.2e} |")  # fmt: skip


if __name__ == "__main__":
    main()
