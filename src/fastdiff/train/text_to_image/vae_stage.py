"""Stage 1: the VAE (``train_vae``), its loss, its latents (``encode_batches``, which stage 2 also uses) and
its reconstruction PSNR.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fastdiff.atomic import write_folder_atomic
from fastdiff.bench.env import environment
from fastdiff.devices import synchronize
from fastdiff.errors import FastdiffError
from fastdiff.images import make_grid, save_png_atomic, to_pil
from fastdiff.models.autoencoder_kl import AutoencoderKL
from fastdiff.train.text_to_image.config import IMAGE_SIZE, VAEStageConfig, check_stage, resolve_preset
from fastdiff.train.text_to_image.files import (
    LOSS_CURVE_NAME,
    LOSS_LOG_NAME,
    SAVE_DTYPE,
    SUMMARY_NAME,
    folder_bytes,
    round_to,
    write_diffusers_model,
)
from fastdiff.train.text_to_image.loop import (
    Budget,
    LossLog,
    StageCheckpoint,
    check_images,
    epoch_batches,
    load_split,
    maybe_compile,
    num_params,
    run_budgeted_loop,
    setup_device,
)
from fastdiff.train.trainer import param_groups, plot_loss_curve

log = logging.getLogger(__name__)


def vae_loss(
    encode: Callable[[torch.Tensor], Any],
    decode: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    kl_weight: float,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """L1 + L2 reconstruction (per pixel) of decode(a posterior sample) + ``kl_weight`` x KL(posterior || N(0, I))
    summed over each image's latents and divided by its pixels (SD's weighting against a per-pixel sum)."""
    posterior = encode(x)
    mean, logvar = posterior.mean, posterior.logvar
    noise = torch.randn(mean.shape, generator=generator, device=x.device, dtype=mean.dtype)
    recon = decode(mean + posterior.std * noise).float()
    l1 = (recon - x).abs().mean()
    l2 = (recon - x).pow(2).mean()
    mean, logvar = mean.float(), logvar.float()
    kl = 0.5 * (mean.pow(2) + logvar.exp() - 1 - logvar).flatten(1).sum(1).mean() / x[0].numel()
    return {"loss": l1 + l2 + kl_weight * kl, "l1": l1, "l2": l2, "kl": kl}


@torch.no_grad()
def encode_batches(
    vae: AutoencoderKL, images: torch.Tensor, device: torch.device, batch: int = 1000
) -> tuple[torch.Tensor, torch.Tensor]:
    """Posterior (mean, std) of ``images``, each fp32 [N, latent_channels, h, w] on ``device``."""
    means, stds = [], []
    for i in range(0, images.shape[0], batch):
        posterior = vae.encode(images[i : i + batch].to(device, torch.float32))
        means.append(posterior.mean.float())
        stds.append(posterior.std.float())
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def reconstruction_psnr(vae: AutoencoderKL, images: torch.Tensor, device: torch.device) -> dict[str, float]:
    """Mean PSNR (dB, data range 2 for [-1, 1]) of decode(posterior mean) on the whole 32x32 image and on the
    28x28 Fashion-MNIST area inside the padding."""
    from fastdiff.quality.psnr import psnr

    full, inner, pad = [], [], (IMAGE_SIZE - 28) // 2
    for i in range(0, images.shape[0], 1000):
        x = images[i : i + 1000].to(device, torch.float32)
        recon = vae.decode(vae.encode(x).mean).float().clamp(-1, 1)
        full.append(psnr(recon, x).cpu())
        crop = (slice(None), slice(None), slice(pad, pad + 28), slice(pad, pad + 28))
        inner.append(psnr(recon[crop], x[crop]).cpu())
    return {"psnr_db": round(float(torch.cat(full).mean()), 3), "psnr_db_28": round(float(torch.cat(inner).mean()), 3)}


@torch.no_grad()
def reconstruction_fd(vae: AutoencoderKL, images: torch.Tensor, device: torch.device, data_dir: Path | None) -> float:
    """FD-FMNIST of decode(posterior mean) of ``images`` (clamped) against the Fashion-MNIST test set: the floor of
    every sampler on this VAE's latents (the real training images score about 0.3)."""
    from fastdiff.quality.classifier import fd_fmnist

    recon = torch.cat([
        vae.decode(vae.encode(images[i : i + 1000].to(device, torch.float32)).mean).float().clamp(-1, 1).cpu()
        for i in range(0, images.shape[0], 1000)
    ])  # fmt: skip
    return round(fd_fmnist(recon, "test", data_dir=data_dir, device=device), 4)


def train_vae(
    config: VAEStageConfig,
    train_images: torch.Tensor | None = None,
    test_images: torch.Tensor | None = None,
) -> dict:
    """Stage 1: train the VAE, set its ``scaling_factor``, measure test PSNR and write ``config.out_dir``
    (``vae/``, summary.json, loss.jsonl, loss.png, reconstructions.png) all or nothing; returns the summary.

    ``train_images`` / ``test_images`` ([N, 1, 32, 32] in [-1, 1]) replace the Fashion-MNIST splits.
    """
    start = time.perf_counter()
    check_stage(config)
    preset = resolve_preset(config.preset)
    device, use_bf16, memory_format = setup_device(config)
    if train_images is None:
        train_images, _ = load_split(config, "train")
    if test_images is None:
        test_images, _ = load_split(config, "test")
    check_images(train_images, "training images")
    check_images(test_images, "test images")
    if config.limit_images is not None:
        train_images = train_images[: config.limit_images]
    if config.eval_images is not None:
        test_images = test_images[: config.eval_images]
    if train_images.shape[0] < config.batch_size:
        raise FastdiffError(f"batch size {config.batch_size} is larger than the {train_images.shape[0]} images")
    images = train_images.to(device, torch.float32).contiguous(memory_format=memory_format)

    torch.manual_seed(config.seed)
    vae = AutoencoderKL(preset.vae).to(device, memory_format=memory_format).train()
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(param_groups(vae, config.weight_decay), lr=config.lr, **fused)
    data_rng = torch.Generator().manual_seed(config.seed)
    noise_rng = torch.Generator(device=device).manual_seed(config.seed + 1)
    log.info(
        "vae stage: %.2f M params on %d images, batch %d, on %s%s",
        num_params(vae) / 1e6,
        images.shape[0],
        config.batch_size,
        device,
        " (bf16 autocast)" if use_bf16 else "",
    )
    fns = {"encode": maybe_compile(vae.encode, config.compile), "decode": maybe_compile(vae.decode, config.compile)}

    def losses(x: torch.Tensor) -> dict[str, torch.Tensor]:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            return vae_loss(fns["encode"], fns["decode"], x, config.kl_weight, noise_rng)

    def train_step(x: torch.Tensor) -> dict[str, torch.Tensor]:
        values = losses(x)
        values["loss"].backward()
        max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
        values["grad_norm"] = torch.nn.utils.clip_grad_norm_(vae.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return values

    def eager() -> None:
        optimizer.zero_grad(set_to_none=True)
        fns.update(encode=vae.encode, decode=vae.decode)

    checkpoint = StageCheckpoint(config, "vae", {"vae": vae}, optimizer, noise_rng, images.shape[0])
    resumed = checkpoint.load()
    first = resumed["step"] if resumed else 0
    budget = Budget(config, start, resumed["budget"] if resumed else None)
    batches = epoch_batches(images.shape[0], config.batch_size, data_rng, device, skip=first)
    loss_log = LossLog(config, "vae")
    if resumed:
        loss_log.resume(resumed["records"], first)
    step, stopped = run_budgeted_loop(
        config,
        budget,
        loss_log,
        optimizer,
        lambda: images[next(batches)],
        train_step,
        eager,
        None,
        first,
        start,
        noise_rng,
    )
    synchronize(device)
    if stopped == "paused":
        return {"stage": "vae", "step": step, "stopped": stopped, "checkpoint": str(checkpoint.save(step, budget,
                loss_log.records))}  # fmt: skip
    train_seconds = budget.trained_s()

    vae = round_to(vae.eval(), SAVE_DTYPE)
    scaling = torch.Generator(device=device).manual_seed(config.seed + 2)
    mean, std = encode_batches(vae, images[: config.scaling_images], device)
    latents = mean + std * torch.randn(mean.shape, generator=scaling, device=device)
    latent_std, latent_mean = float(latents.std()), float(latents.mean())
    vae.config = dataclasses.replace(vae.config, scaling_factor=round(1.0 / latent_std, 5))
    quality = reconstruction_psnr(vae, test_images, device)
    if config.fd_images:
        quality["fd_fmnist_reconstructions"] = reconstruction_fd(
            vae, train_images[: config.fd_images], device, config.data_dir
        )
    shown = test_images[:16].to(device)
    with torch.no_grad():
        recon = vae.decode(vae.encode(shown).mean).float().clamp(-1, 1)
    summary = {
        "stage": "vae",
        "preset": config.preset,
        "step": step,
        "stopped": stopped,
        "train_seconds": round(train_seconds, 3),
        "images_per_s": round(step * config.batch_size / train_seconds, 1) if step else None,
        "final_loss": loss_log.final_loss(),
        **quality,
        "test_images": int(test_images.shape[0]),
        "scaling_factor": vae.config.scaling_factor,
        "latent_mean": round(latent_mean, 5),
        "latent_std": round(latent_std, 5),
        "latent_shape": list(mean.shape[1:]),
        "params": num_params(vae),
        "settings": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
        "env": environment(),
    }

    def fill(tmp: Path) -> None:
        write_diffusers_model(tmp / "vae", vae, "AutoencoderKL", SAVE_DTYPE)
        summary["vae_bytes"] = folder_bytes(tmp / "vae")
        summary["seconds"] = round(time.perf_counter() - start, 3)
        (tmp / LOSS_LOG_NAME).write_text(loss_log.jsonl())
        plot_loss_curve(loss_log.records, tmp / LOSS_CURVE_NAME)
        save_png_atomic(make_grid(to_pil(torch.cat([shown, recon]).cpu()), nrow=16), tmp / "reconstructions.png")
        (tmp / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")

    write_folder_atomic(config.out_dir, fill)
    checkpoint.remove()
    log.info(
        "vae stage: %d steps (%s) in %.0f s, test PSNR %.2f dB (%.2f dB on the 28x28 area), reconstruction "
        "FD-FMNIST %s, scaling_factor %.5f; wrote %s",
        step,
        stopped,
        train_seconds,
        quality["psnr_db"],
        quality["psnr_db_28"],
        quality.get("fd_fmnist_reconstructions", "not measured"),
        vae.config.scaling_factor,
        config.out_dir,
    )
    return summary
