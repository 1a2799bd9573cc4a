"""Stage 2: the CLIP text encoder and the U-Net on the stage-1 VAE's latents (``train_text_to_image``), then the
written pipeline sampled (``evaluate_pipeline``: samples.png, the classifier's accuracy, FD-FMNIST).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastdiff.atomic import write_folder_atomic, write_text_atomic
from fastdiff.bench.env import environment
from fastdiff.devices import synchronize
from fastdiff.errors import FastdiffError
from fastdiff.images import make_grid, save_png_atomic
from fastdiff.models.autoencoder_kl import autoencoder_kl_from_dir
from fastdiff.models.stable_diffusion import load_stable_diffusion, resolve_pipeline_dir
from fastdiff.models.unet_2d_condition import UNet2DConditionModel
from fastdiff.models.weights import load_state_dict_checked, read_json_object
from fastdiff.samplers import ScheduleConfig, alphas_cumprod
from fastdiff.train.text_to_image.config import (
    SCHEDULER_CONFIG,
    UNetStageConfig,
    check_stage,
    find_vae_dir,
    make_text_encoder,
    resolve_preset,
)
from fastdiff.train.text_to_image.files import LOSS_CURVE_NAME, LOSS_LOG_NAME, SAVE_DTYPE, SUMMARY_NAME, write_pipeline
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
from fastdiff.train.text_to_image.prompts import CLASS_NOUNS, build_tokenizer, canonical_prompts, prompt_table, tokenize
from fastdiff.train.text_to_image.vae_stage import encode_batches
from fastdiff.train.trainer import ema_update, param_groups, plot_loss_curve

log = logging.getLogger(__name__)

GRID_GUIDANCE = 7.5
"""Guidance of samples.png: ``fastdiff sample``'s default."""
EVAL_SEED = 10**6
"""Seed of the first evaluation image (the grid uses seeds from 0)."""
EMA_CONTINUED = 10**6
"""The EMA's update count when a stage goes on from a trained pipeline (``init_from``): past its warm-up, so the
average starts at the pipeline's weights at the full ``ema_decay``."""
FD_MIN_IMAGES = 500
"""FD-FMNIST is reported from this many generated images on (fewer give a biased, noisy distance)."""


@torch.no_grad()
def evaluate_pipeline(folder: Path, config: UNetStageConfig, device: torch.device) -> dict:
    """Sample the written pipeline (fp32 on the eager backend, the reference path; ``eval_sampler``,
    ``eval_steps``): samples.png (``grid_per_prompt`` images of each canonical prompt, one row per class, seeds
    from 0) and, for each ``eval_guidance``, the bundled classifier's accuracy on ``eval_per_class`` images per
    class (and FD-FMNIST against the test split)."""
    from fastdiff.pipelines.text_to_image import TextToImagePipeline
    from fastdiff.quality.classifier import classifier_accuracy, fd_fmnist, load_classifier

    pipe = TextToImagePipeline.from_pretrained(
        folder, device=device, dtype="fp32", sampler=config.eval_sampler, steps=config.eval_steps, backend="eager"
    )
    prompts = canonical_prompts()
    result: dict[str, Any] = {"sampler": config.eval_sampler, "steps": config.eval_steps, "prompts": prompts}
    if config.grid_per_prompt:
        n = config.grid_per_prompt
        images = pipe(prompts, num_images_per_prompt=n, seeds=0, guidance_scale=GRID_GUIDANCE, progress=False)
        params = {"prompts": prompts, "guidance": GRID_GUIDANCE, "sampler": config.eval_sampler}
        save_png_atomic(make_grid(images, nrow=n), folder / "samples.png", {**params, "steps": config.eval_steps})
        result["grid"] = {"file": "samples.png", "per_prompt": n, "guidance": GRID_GUIDANCE}
    if config.eval_per_class:
        n = config.eval_per_class
        classifier = load_classifier(device=device)
        labels = torch.arange(len(prompts)).repeat_interleave(n)
        result["per_class"] = n
        result["guidance"] = {}
        for guidance in config.eval_guidance:
            kwargs = dict(guidance_scale=guidance, output_type="tensor", progress=False)
            images = torch.cat(
                [
                    pipe(p, num_images_per_prompt=n, seeds=EVAL_SEED + k * n, **kwargs).float().cpu()
                    for k, p in enumerate(prompts)
                ]
            )
            record: dict[str, Any] = {"accuracy": round(classifier_accuracy(classifier, images, labels), 4)}
            if images.shape[0] >= FD_MIN_IMAGES:
                record["fd_fmnist"] = round(fd_fmnist(images, "test", data_dir=config.data_dir, device=device), 3)
            result["guidance"][str(guidance)] = record
            log.info("guidance %s: classifier accuracy %.3f %s", guidance, record["accuracy"], record)
    return result


def start_from_pipeline(folder: Path, unet: UNet2DConditionModel, text_encoder: nn.Module) -> None:
    """Copy the U-Net's and the text encoder's weights of the pipeline directory ``folder`` into the fresh
    networks (fp16 files into fp32 parameters)."""
    trained = load_stable_diffusion(folder)
    for network, source, part in ((unet, trained.unet, "unet"), (text_encoder, trained.text_encoder, "text_encoder")):
        state = {k: v.float() for k, v in source.state_dict().items()}
        load_state_dict_checked(network, state, str(folder / part))
    log.info("unet stage: starting from the U-Net and text encoder of %s", folder)


def train_text_to_image(
    config: UNetStageConfig, images: torch.Tensor | None = None, labels: torch.Tensor | None = None
) -> dict:
    """Stage 2: train the text encoder and the U-Net on the latents of the stage-1 VAE, write the
    StableDiffusionPipeline directory ``config.out_dir`` (fp16, all or nothing, with loss.jsonl, loss.png and
    summary.json), then sample it (samples.png, accuracy and FD-FMNIST in summary.json); returns the summary.

    ``images`` ([N, 1, 32, 32] in [-1, 1]) and ``labels`` ([N], 0..9) replace the Fashion-MNIST train split.
    """
    start = time.perf_counter()
    check_stage(config)
    preset = resolve_preset(config.preset)
    device, use_bf16, memory_format = setup_device(config)
    vae_folder = find_vae_dir(config.vae_dir)
    vae = autoencoder_kl_from_dir(vae_folder, read_json_object(vae_folder / "config.json"))
    vae = vae.to(device, torch.float32).eval().requires_grad_(False)
    if images is None or labels is None:
        images, labels = load_split(config, "train")
    check_images(images, "training images")
    bad_values = labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < len(CLASS_NOUNS)
    if labels.shape != (images.shape[0],) or labels.is_floating_point() or bad_values:
        raise FastdiffError(f"labels must be [{images.shape[0]}] class indices 0..9, got shape {tuple(labels.shape)}")
    if config.limit_images is not None:
        images, labels = images[: config.limit_images], labels[: config.limit_images]
    if images.shape[0] < config.batch_size:
        raise FastdiffError(f"batch size {config.batch_size} is larger than the {images.shape[0]} images")
    latent_mean, latent_std = encode_batches(vae, images, device)
    scale = vae.config.scaling_factor
    labels = labels.to(device, torch.int64)

    tokenizer = build_tokenizer()
    prompts, prompt_labels = prompt_table()
    ids = tokenize(tokenizer, prompts).to(device)
    per_class = torch.bincount(torch.tensor(prompt_labels[:-1]), minlength=len(CLASS_NOUNS))
    counts = per_class.to(device)
    offsets = (torch.cumsum(per_class, 0) - per_class).to(device)
    empty = len(prompts) - 1

    torch.manual_seed(config.seed)
    text_encoder = make_text_encoder(preset, tokenizer).to(device).train()
    unet = UNet2DConditionModel(preset.unet)
    with torch.no_grad():  # start from a zero prediction: a random U-Net's output is only noise to unlearn
        unet.conv_out.weight.zero_()
        unet.conv_out.bias.zero_()
    ema_start = 0  # updates the EMA counts as done: its warm-up, (1 + n) / (10 + n), starts a fresh average
    if config.init_from is not None:  # go on from a trained pipeline (check_stage checked that it fits)
        start_from_pipeline(resolve_pipeline_dir(config.init_from), unet, text_encoder)
        ema_start = EMA_CONTINUED  # the pipeline's weights are an average already: no warm-up
    unet = unet.to(device, memory_format=memory_format).train()
    ema_unet = copy.deepcopy(unet).eval().requires_grad_(False)
    ema_text = copy.deepcopy(text_encoder).eval().requires_grad_(False)
    networks = nn.ModuleList([unet, text_encoder])
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(param_groups(networks, config.weight_decay), lr=config.lr, **fused)

    schedule = ScheduleConfig.from_diffusers(SCHEDULER_CONFIG)
    abar = alphas_cumprod(schedule).to(device, torch.float32)
    sqrt_abar, sqrt_one_minus = abar.sqrt(), (1 - abar).sqrt()
    snr = abar / (1 - abar)
    weights = snr.clamp(max=config.min_snr_gamma) / snr if config.min_snr_gamma > 0 else torch.ones_like(snr)
    timesteps = schedule.num_train_timesteps
    data_rng = torch.Generator().manual_seed(config.seed)
    noise_rng = torch.Generator(device=device).manual_seed(config.seed + 1)
    params = {"unet": num_params(unet), "text_encoder": num_params(text_encoder), "vae": num_params(vae)}
    log.info(
        "unet stage: U-Net %.2f M + text encoder %.2f M params on %d latents %s, %d prompts, batch %d, on %s%s",
        params["unet"] / 1e6,
        params["text_encoder"] / 1e6,
        images.shape[0],
        tuple(latent_mean.shape[1:]),
        len(prompts),
        config.batch_size,
        device,
        " (bf16 autocast)" if use_bf16 else "",
    )
    fns = {"unet": maybe_compile(unet, config.compile)}

    def train_step(idx: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = idx.shape[0]
        noise_shape = (batch, *latent_mean.shape[1:])
        sample = torch.randn(noise_shape, generator=noise_rng, device=device)
        z0 = (latent_mean[idx] + latent_std[idx] * sample) * scale
        y = labels[idx]
        pick = torch.rand(batch, generator=noise_rng, device=device)
        choice = offsets[y] + (pick * counts[y]).long().minimum(counts[y] - 1)
        dropped = torch.rand(batch, generator=noise_rng, device=device) < config.prompt_dropout
        choice = torch.where(dropped, torch.full_like(choice, empty), choice)
        t = torch.randint(0, timesteps, (batch,), generator=noise_rng, device=device)
        noise = torch.randn(noise_shape, generator=noise_rng, device=device)
        x_t = sqrt_abar[t].view(-1, 1, 1, 1) * z0 + sqrt_one_minus[t].view(-1, 1, 1, 1) * noise
        x_t = x_t.contiguous(memory_format=memory_format)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            states = text_encoder(ids[choice])[0]
            out = fns["unet"](x_t, t, states)
        mse = (out.float() - noise).pow(2).mean(dim=(1, 2, 3))
        loss = (weights[t] * mse).mean()
        loss.backward()
        max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(networks.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {"loss": loss.detach(), "mse": mse.mean().detach(), "grad_norm": grad_norm}

    def eager() -> None:
        optimizer.zero_grad(set_to_none=True)
        fns["unet"] = unet

    modules = {"unet": unet, "text_encoder": text_encoder, "ema_unet": ema_unet, "ema_text": ema_text}
    checkpoint = StageCheckpoint(config, "unet", modules, optimizer, noise_rng, images.shape[0])
    resumed = checkpoint.load()
    first = resumed["step"] if resumed else 0
    budget = Budget(config, start, resumed["budget"] if resumed else None)
    batches = epoch_batches(images.shape[0], config.batch_size, data_rng, device, skip=first)

    def after_step(step: int) -> None:
        ema_update(ema_unet, unet, config.ema_decay, step + ema_start)
        ema_update(ema_text, text_encoder, config.ema_decay, step + ema_start)

    loss_log = LossLog(config, "unet")
    if resumed:
        loss_log.resume(resumed["records"], first)
    step, stopped = run_budgeted_loop(
        config,
        budget,
        loss_log,
        optimizer,
        lambda: next(batches),
        train_step,
        eager,
        after_step,
        first,
        start,
        noise_rng,
    )
    synchronize(device)
    if stopped == "paused":
        return {"stage": "unet", "step": step, "stopped": stopped, "checkpoint": str(checkpoint.save(step, budget,
                loss_log.records))}  # fmt: skip
    train_seconds = budget.trained_s()

    summary: dict[str, Any] = {
        "stage": "unet",
        "preset": config.preset,
        "step": step,
        "stopped": stopped,
        "train_seconds": round(train_seconds, 3),
        "images_per_s": round(step * config.batch_size / train_seconds, 1) if step else None,
        "final_loss": loss_log.final_loss(),
        "params": params,
        "vae": str(vae_folder),
        "scaling_factor": scale,
        "num_images": int(images.shape[0]),
        "num_prompts": len(prompts) - 1,
        "vocab_size": len(tokenizer.get_vocab()),
        "settings": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
        "env": environment(),
    }

    def fill(tmp: Path) -> None:
        summary["bytes"] = write_pipeline(tmp, ema_unet, vae, ema_text, SAVE_DTYPE)
        summary["model_bytes"] = sum(summary["bytes"].values()) + (tmp / "model_index.json").stat().st_size
        (tmp / LOSS_LOG_NAME).write_text(loss_log.jsonl())
        plot_loss_curve(loss_log.records, tmp / LOSS_CURVE_NAME)
        summary["seconds"] = round(time.perf_counter() - start, 3)
        (tmp / SUMMARY_NAME).write_text(json.dumps(summary, indent=2) + "\n")

    out_dir = write_folder_atomic(config.out_dir, fill)
    checkpoint.remove()
    log.info(
        "unet stage: %d steps (%s) in %.0f s, final loss %s; wrote %s (%.1f MB of models)",
        step,
        stopped,
        train_seconds,
        summary["final_loss"],
        out_dir,
        summary["model_bytes"] / 1e6,
    )
    try:
        summary["eval"] = evaluate_pipeline(out_dir, config, device)
    except Exception as exc:  # the model is written and must outlive any failure to sample it: record why
        log.exception("sampling the written pipeline failed")
        summary["eval"] = {"error": f"{type(exc).__name__}: {exc}"}
    summary["seconds"] = round(time.perf_counter() - start, 3)
    write_text_atomic(out_dir / SUMMARY_NAME, json.dumps(summary, indent=2) + "\n")
    return summary
