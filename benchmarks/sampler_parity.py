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
from fastdiff.devices import resolve_dtype
from fastdiff.models import load_unet
from fastdiff.pipelines import sample_loop
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
def diffusers_loop(model, saved: dict, sampler: str, steps: int, x_t: torch.Tensor) -> torch.Tensor:
    """diffusers' pipeline loop: ``from_config(saved)``, ``x_T · init_noise_sigma``, default ``step`` arguments."""
    import diffusers

    sched = getattr(diffusers, SAMPLER_SCHEDULERS[sampler]).from_config(saved)
    sched.set_timesteps(steps, device=x_t.device)
    x = x_t * sched.init_noise_sigma
    for t in sched.timesteps:
        x = sched.step(model(sched.scale_model_input(x, t), t.reshape(1).expand(len(x))), t, x).prev_sample
    return x.clamp(-1, 1)


def tf32_convs(enabled: bool) -> None:
    """PyTorch runs fp32 convolutions in TF32 by default on Ampere+; references here run true fp32."""
    torch.backends.cudnn.allow_tf32 = enabled


def compare(label, reference_model, unet, saved, cases, engine, dtypes, batch, device) -> list[dict]:
    """Rows of PSNR vs the diffusers loop around ``reference_model`` (true fp32) for every case."""
    schedule = ScheduleConfig.from_diffusers(saved)
    cfg = unet.config
    size = cfg.sample_size if isinstance(cfg.sample_size, int) else cfg.sample_size[0]
    seeds = seed_tensor(range(batch), device)
    x_t = initial_noise(seeds, (cfg.in_channels, size, size), device)
    rows = []
    for case in cases.split(","):
        name, steps = case.split(":")
        tf32_convs(False)
        ref = diffusers_loop(reference_model, saved, name, int(steps), x_t)
        sampler = make_sampler(name, schedule, int(steps), device=device)
        outputs = {("eager", "fp32"): sample_loop(unet, sampler, x_t, seeds, torch.float32)}
        tf32_convs(True)  # the conditioning floor: the same diffusers loop with PyTorch's default TF32 convs
        outputs["diffusers (TF32 convs)", "fp32"] = diffusers_loop(reference_model, saved, name, int(steps), x_t)
        for dtype in dtypes.split(",") if engine is not None else []:
            outputs["engine", dtype] = engine.sample(unet, sampler, x_t, seeds, resolve_dtype(dtype)).clamp(-1, 1)
        for (backend, dtype), out in outputs.items():
            row = {"model": label, "sampler": name, "steps": int(steps), "backend": backend, "dtype": dtype,
                   "psnr_db_vs_diffusers_fp32": float(psnr(out.float(), ref).mean()),
                   "max_abs_diff": float((out.float() - ref).abs().max())}  # fmt: skip
            rows.append(row)
            log.info("%s", row)
    return rows


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

    engine = Engine(args.device) if args.device == "cuda" else None
    torch.manual_seed(0)
    config = {k: v for k, v in vars(DDPM_PRESETS["ddpm-cifar10"]).items() if not k.startswith("_")}
    reference_unet = diffusers.UNet2DModel(**config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        reference_unet.save_pretrained(tmp)
        (Path(tmp) / "scheduler_config.json").write_text(json.dumps(GOOGLE_DDPM_CIFAR10_SCHEDULER))
        reference_unet.to(args.device)
        unet = load_unet(tmp, device=args.device)  # the saved directory, as a user loads it
        rows = compare(
            "ddpm-cifar10 (random weights)",
            lambda x, t: reference_unet(x, t).sample,
            unet,
            GOOGLE_DDPM_CIFAR10_SCHEDULER,
            args.cases,
            engine,
            args.dtypes,
            args.batch,
            args.device,
        )
    # The bundled trained model: a ConvNeXt U-Net (no diffusers class), so diffusers' scheduler loop runs around
    # fastdiff's own fp32 model; the comparison is then of the sampler loops (and the engine's numerics).
    fmnist = load_unet("fashion-mnist", device=args.device)
    rows += compare("fashion-mnist (trained, bundled)", fmnist, fmnist, fmnist.scheduler_config, args.cases, engine,
                    args.dtypes, args.batch, args.device)  # fmt: skip
    result = {
        "schema": "fastdiff.sampler_parity/1",
        "env": environment(),
        "config": {"models": ["ddpm-cifar10 (random weights, torch.manual_seed(0), google/ddpm-cifar10-32 scheduler "
                   "config)", "fashion-mnist (bundled, its own scheduler config)"], "batch": args.batch,
                   "reference": "diffusers' scheduler, default step, true fp32 (TF32 convolutions off)"},
        "results": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print("| model | sampler | steps | backend | dtype | PSNR vs diffusers fp32 (dB) | max abs diff |")
    print("| --- | --- | ---: | --- | --- | ---: | ---: |")
    for r in rows:
        print(f"| {r['model']} | {r['sampler']} | {r['steps']} | {r['backend']} | {r['dtype']} | "
              f"{r['psnr_db_vs_diffusers_fp32']:.1f} | {r['max_abs_diff']:.2e} |")  # fmt: skip


if __name__ == "__main__":
    main()
