"""``fastdiff train``: train a ConvNeXt U-Net on Fashion-MNIST, resume, and export the EMA weights;
``fastdiff train text-to-image``: the two-stage Stable Diffusion-format recipe (``fastdiff.train.text_to_image``).

Importing this module imports no torch; adding the flags does (their defaults live in the trainers' configs)."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from fastdiff.atomic import check_output_location
from fastdiff.cli_args import HelpFormatter, add_command, add_flags_later, positive_float, seed_int
from fastdiff.errors import FastdiffError

log = logging.getLogger(__name__)

EXPORT_DTYPES = ("fp16", "bf16", "fp32")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` command to the ``fastdiff`` parser."""
    add_command(subparsers, "train", add_arguments)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fastdiff train`` and its ``text-to-image`` recipe (sets ``func=run_train``)."""
    from fastdiff.data import DEFAULT_DATA_DIR
    from fastdiff.train.trainer import PREDICTIONS, SCHEDULES, TrainConfig

    defaults = TrainConfig()
    p.description = (
        "Train a ConvNeXt U-Net on the Fashion-MNIST train split with AdamW and an EMA of the "
        "weights. Writes checkpoint.pt, loss.jsonl, loss.png, summary.json and samples/step_XXXXXX.png (EMA "
        "model, DDIM) to --out; running again with the same --out resumes exactly where the last run stopped "
        "(--export writes the EMA weights as a model directory for 'fastdiff sample --model DIR')."
    )
    p.add_argument("--model", default=defaults.model, help="ConvNeXt preset to train (architecture)")
    p.add_argument(
        "--data",
        type=Path,
        default=DEFAULT_DATA_DIR,
        help="folder with the Fashion-MNIST idx .gz files (the default is where apt-get install "
        "dataset-fashion-mnist puts them)",
    )
    p.add_argument("--out", type=Path, default=defaults.out_dir, help="run folder (checkpoint, logs, samples)")
    p.add_argument("--steps", type=int, default=defaults.max_steps, help="total optimizer steps, over all resumes")
    p.add_argument(
        "--max-minutes",
        type=positive_float,
        default=None,
        help="stop cleanly with a checkpoint after this many minutes (resume with the same --out)",
    )
    p.add_argument("--batch", type=int, default=defaults.batch_size, help="images per step")
    p.add_argument("--lr", type=positive_float, default=defaults.lr, help="AdamW peak learning rate")
    p.add_argument("--warmup", type=int, default=defaults.warmup_steps, help="linear learning-rate warm-up steps")
    p.add_argument("--weight-decay", type=float, default=defaults.weight_decay, help="AdamW weight decay (matrices)")
    p.add_argument("--ema-decay", type=float, default=defaults.ema_decay, help="EMA decay (warmed up as (1+n)/(10+n))")
    p.add_argument("--grad-clip", type=float, default=defaults.grad_clip, help="gradient-norm clip (0 = off)")
    p.add_argument("--prediction", default=defaults.prediction, choices=PREDICTIONS, help="training target")
    p.add_argument(
        "--schedule",
        default=defaults.schedule,
        choices=tuple(SCHEDULES),
        help="noise schedule (cosine or linear)",
    )
    p.add_argument("--hflip", action="store_true", help="random horizontal flips")
    p.add_argument("--limit-images", type=int, default=None, help="train on the first N images only")
    p.add_argument(
        "--sample-every",
        type=int,
        default=defaults.sample_every,
        help="steps between sample grids (0 = never)",
    )
    p.add_argument("--sample-steps", type=int, default=defaults.sample_steps, help="DDIM steps of the sample grids")
    p.add_argument("--num-samples", type=int, default=defaults.num_samples, help="images per sample grid")
    p.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every, help="steps between checkpoints")
    p.add_argument("--log-every", type=int, default=defaults.log_every, help="steps between loss-log lines")
    p.add_argument("--seed", type=seed_int, default=defaults.seed, help="seed of initialisation, data order and noise")
    p.add_argument("--device", default=defaults.device, help="auto (GPU if present, else CPU), cpu, cuda or cuda:N")
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 on CUDA (default: bf16 autocast)")
    p.add_argument("--no-channels-last", action="store_true", help="keep NCHW tensors on CUDA (default: channels_last)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (compile time counts)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--export", type=Path, default=None, help="after training, write the EMA model directory here")
    p.add_argument("--export-dtype", default="fp16", choices=EXPORT_DTYPES, help="precision of exported weights")
    p.set_defaults(func=run_train)
    recipes = p.add_subparsers(
        dest="recipe",
        metavar="RECIPE",
        title="other recipes",
        description="text-to-image: the Stable Diffusion-format model of Fashion-MNIST "
        "('fastdiff train text-to-image --help')",
    )
    register_text_to_image(recipes)


def run_train(args: argparse.Namespace) -> int:
    """Train (or resume) from parsed arguments, then export if asked; returns the exit code."""
    from fastdiff.devices import resolve_dtype
    from fastdiff.train.trainer import TrainConfig, export_model, train

    if args.export is not None and args.export.resolve() == args.out.resolve():
        raise FastdiffError(f"--export must be another folder than --out ({args.out})")
    check_output_location(args.out, "--out", folder=True)
    if args.export is not None:
        check_output_location(args.export, "--export", folder=True)
    config = TrainConfig(
        model=args.model,
        prediction=args.prediction,
        schedule=args.schedule,
        lr=args.lr,
        warmup_steps=args.warmup,
        batch_size=args.batch,
        weight_decay=args.weight_decay,
        ema_decay=args.ema_decay,
        grad_clip=args.grad_clip,
        max_steps=args.steps,
        max_minutes=args.max_minutes,
        sample_every=args.sample_every,
        sample_steps=args.sample_steps,
        num_samples=args.num_samples,
        checkpoint_every=args.checkpoint_every,
        log_every=args.log_every,
        seed=args.seed,
        data_dir=args.data,
        limit_images=args.limit_images,
        hflip=args.hflip,
        out_dir=args.out,
        device=args.device,
        bf16=not args.no_bf16,
        channels_last=not args.no_channels_last,
        compile=args.compile,
        progress=not args.no_progress,
    )
    summary = train(config)
    brief = {k: summary[k] for k in ("step", "stopped", "final_loss", "images_per_s", "samples", "loss_curve")}
    log.info("summary: %s", json.dumps(brief))
    if args.export is not None:
        export_model(args.out, args.export, dtype=resolve_dtype(args.export_dtype))
    return 0


TEXT_TO_IMAGE_STAGES = ("vae", "unet", "all")
COMMON_FLAGS = {
    "steps": "max_steps",
    "max_seconds": "max_seconds",
    "batch": "batch_size",
    "lr": "lr",
    "warmup": "warmup_steps",
    "min_lr_ratio": "min_lr_ratio",
    "weight_decay": "weight_decay",
    "grad_clip": "grad_clip",
    "limit_images": "limit_images",
    "log_every": "log_every",
}
"""text-to-image flag dest -> config field, for flags whose default depends on the stage (None = the stage's)."""
STAGE_FLAGS = {
    "vae": {"kl_weight": "kl_weight", "eval_images": "eval_images", "fd_images": "fd_images"},
    "unet": {
        "vae": "vae_dir",
        "ema_decay": "ema_decay",
        "prompt_dropout": "prompt_dropout",
        "min_snr_gamma": "min_snr_gamma",
        "eval_per_class": "eval_per_class",
        "eval_steps": "eval_steps",
        "grid_per_prompt": "grid_per_prompt",
        "init_from": "init_from",
    },
}
"""Flags of one stage only (dest -> config field)."""


def register_text_to_image(subparsers: argparse._SubParsersAction) -> None:
    """Add ``fastdiff train text-to-image``: the two-stage Stable Diffusion recipe on Fashion-MNIST (its flags
    when it is used: they import ``fastdiff.train.text_to_image``)."""
    p = subparsers.add_parser(
        "text-to-image",
        help="train a Stable Diffusion-format text-to-image model on Fashion-MNIST (two stages)",
        formatter_class=HelpFormatter,
    )
    add_flags_later(p, add_text_to_image_arguments)


def add_text_to_image_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fastdiff train text-to-image`` (sets ``func=run_text_to_image``)."""
    from fastdiff.data import DEFAULT_DATA_DIR
    from fastdiff.train.text_to_image import PRESETS, UNetStageConfig, VAEStageConfig

    vae, unet = VAEStageConfig(), UNetStageConfig()

    def both(name: str) -> str:
        a, b = getattr(vae, name), getattr(unet, name)
        return f"(default: {a})" if a == b else f"(default: {a} for the vae stage, {b} for the unet stage)"

    p.description = (
        "Train a text-to-image model of Fashion-MNIST in Stable Diffusion's own directory format, in "
        "two stages. '--stage all' runs both in one command: the vae stage into --vae (default: OUT-vae; skipped "
        "when that folder holds a finished one), then the unet stage into OUT; --steps, --max-seconds, --batch "
        "and the other shared flags apply to each stage. '--stage vae' trains the AutoencoderKL (32x32x1 <-> the "
        "preset's latents, 16x16x4 by default), sets its scaling_factor from the latent std and writes OUT/vae/ "
        "with summary.json (test PSNR, reconstruction FD-FMNIST), loss.jsonl and reconstructions.png. "
        "'--stage unet --vae VAE_OUT' trains a CLIP text encoder and the UNet2DConditionModel on the latents "
        "(epsilon, SD's scaled-linear schedule, 10% empty prompts for guidance, EMA) and writes OUT as a "
        "StableDiffusionPipeline directory (fp16 safetensors) for 'fastdiff sample --model OUT --prompt ...' "
        "and diffusers, with summary.json (classifier accuracy of its samples), loss.jsonl and samples.png. Each "
        "stage stops at --steps or --max-seconds, whichever comes first (the learning rate's cosine follows "
        "that budget); OUT is written all or nothing. --pause-after stops a run early with a checkpoint that the same "
        "command resumes from."
    )
    p.add_argument(
        "--stage", required=True, choices=TEXT_TO_IMAGE_STAGES, help="which networks to train (all: both stages)"
    )
    p.add_argument("--out", type=Path, required=True, help="output folder (replaced all or nothing)")
    p.add_argument(
        "--vae",
        type=Path,
        default=None,
        help="unet stage: the vae stage's --out folder (required); all: where the vae stage writes (default: OUT-vae)",
    )
    p.add_argument("--preset", default=vae.preset, choices=tuple(PRESETS), help="architecture (tiny: smoke tests)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA_DIR, help="folder with the Fashion-MNIST idx .gz files")
    p.add_argument("--steps", type=int, default=None, help=f"most optimizer steps {both('max_steps')}")
    p.add_argument(
        "--max-seconds",
        type=positive_float,
        default=None,
        help="stop training this many seconds after the stage starts (data loading included; saving and "
        "sampling come after); resuming a paused stage with another value sets a new total for the stage",
    )
    p.add_argument("--batch", type=int, default=None, help=f"images per step {both('batch_size')}")
    p.add_argument("--lr", type=positive_float, default=None, help=f"AdamW peak learning rate {both('lr')}")
    p.add_argument("--warmup", type=int, default=None, help=f"linear warm-up steps {both('warmup_steps')}")
    p.add_argument("--min-lr-ratio", type=float, default=None, help=f"final lr / peak lr {both('min_lr_ratio')}")
    p.add_argument("--weight-decay", type=float, default=None, help=f"AdamW weight decay {both('weight_decay')}")
    p.add_argument("--grad-clip", type=float, default=None, help=f"gradient-norm clip, 0 = off {both('grad_clip')}")
    p.add_argument("--limit-images", type=int, default=None, help="train on the first N images only")
    p.add_argument("--log-every", type=int, default=None, help=f"steps between loss records {both('log_every')}")
    p.add_argument("--kl-weight", type=float, default=None, help=f"vae stage: KL weight (default: {vae.kl_weight})")
    p.add_argument("--eval-images", type=int, default=None, help="vae stage: test images for the PSNR (default: all)")
    p.add_argument(
        "--fd-images",
        type=int,
        default=None,
        help=f"vae stage: training images whose reconstructions get an FD-FMNIST, 0 = none (default: {vae.fd_images})",
    )
    p.add_argument(
        "--init-from",
        default=None,
        metavar="MODEL",
        help="unet stage: start the U-Net and text encoder from this text-to-image pipeline (a directory, or the "
        "bundled fashion-mnist-t2i) instead of a fresh initialisation, to train a model that exists for longer; "
        "--vae defaults to its VAE",
    )
    p.add_argument("--ema-decay", type=float, default=None, help=f"unet stage: EMA decay (default: {unet.ema_decay})")
    p.add_argument(
        "--prompt-dropout",
        type=float,
        default=None,
        help=f"unet stage: fraction of empty prompts (default: {unet.prompt_dropout})",
    )
    p.add_argument(
        "--min-snr-gamma",
        type=float,
        default=None,
        help=f"unet stage: loss weight min(SNR, gamma)/SNR, 0 = plain MSE (default: {unet.min_snr_gamma})",
    )
    p.add_argument(
        "--eval-per-class",
        type=int,
        default=None,
        help=f"unet stage: images per class sampled for the classifier accuracy, 0 = none "
        f"(default: {unet.eval_per_class})",
    )
    p.add_argument(
        "--eval-steps",
        type=int,
        default=None,
        help=f"unet stage: sampler steps of the evaluation (default: {unet.eval_steps})",
    )
    p.add_argument(
        "--grid-per-prompt",
        type=int,
        default=None,
        help=f"unet stage: samples.png images per class, 0 = none (default: {unet.grid_per_prompt})",
    )
    p.add_argument(
        "--pause-after",
        type=positive_float,
        default=None,
        help="stop this run SECONDS after it starts and write OUT.checkpoint.pt; the same command resumes from it "
        "and trains as if it had never paused (for machines that lend time in slices); a paused run exits 0 and "
        "says so in its last log line",
    )
    p.add_argument("--seed", type=seed_int, default=vae.seed, help="seed of initialisation, data order and noise")
    p.add_argument("--device", default=vae.device, help="auto (GPU if present, else CPU), cpu, cuda or cuda:N")
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 on CUDA (default: bf16 autocast)")
    p.add_argument("--no-channels-last", action="store_true", help="keep NCHW tensors on CUDA")
    p.add_argument("--compile", action="store_true", help="torch.compile (falls back to eager if it fails)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run_text_to_image)


def stage_settings(args: argparse.Namespace, stage: str) -> dict:
    """The config fields of ``stage`` ("vae" or "unet") that the flags set (the others keep the stage's defaults)."""
    fields = {**COMMON_FLAGS, **STAGE_FLAGS[stage]}
    kwargs = {field: getattr(args, dest) for dest, field in fields.items() if getattr(args, dest) is not None}
    kwargs.update(
        out_dir=args.out,
        preset=args.preset,
        data_dir=args.data,
        seed=args.seed,
        device=args.device,
        bf16=not args.no_bf16,
        channels_last=not args.no_channels_last,
        compile=args.compile,
        progress=not args.no_progress,
        pause_after_s=args.pause_after,
    )
    return kwargs


def run_both_stages(args: argparse.Namespace) -> int:
    """``--stage all``: the vae stage into ``--vae`` (default OUT-vae) unless a finished one is there, then the unet
    stage on it into OUT. Both stages' settings are checked before either starts; ``--pause-after`` counts from the
    command's start, so a paused run of either stage resumes when the same command runs again."""
    import dataclasses
    import time

    from fastdiff.models.clip_tokenizer import import_tokenizers
    from fastdiff.train.text_to_image import UNetStageConfig, VAEStageConfig, train_text_to_image, train_vae
    from fastdiff.train.text_to_image.config import validate_stage

    start = time.perf_counter()
    vae_out = args.vae if args.vae is not None else args.out.with_name(args.out.name + "-vae")
    check_output_location(vae_out, "--vae", folder=True)
    if vae_out.resolve() == args.out.resolve():
        raise FastdiffError(f"--out must be another folder than --vae ({vae_out})")
    vae_config = VAEStageConfig(**{**stage_settings(args, "vae"), "out_dir": vae_out})
    unet_config = UNetStageConfig(**{**stage_settings(args, "unet"), "vae_dir": vae_out})
    for config in (vae_config, unet_config):
        validate_stage(config)
    import_tokenizers()
    if (vae_out / "summary.json").is_file() and (vae_out / "vae").is_dir():
        log.info("vae stage: %s holds a finished one, used as it is (delete it to train it again)", vae_out)
    else:
        summary = train_vae(vae_config)
        if summary["stopped"] == "paused":
            log.info("paused in the vae stage at step %d: run the same command again to go on", summary["step"])
            return 0
        log.info("vae stage: %s", json.dumps({k: summary.get(k) for k in VAE_SUMMARY_KEYS}))
    pause = None if args.pause_after is None else args.pause_after - (time.perf_counter() - start)
    if pause is not None and pause <= 0:
        log.info("paused after the vae stage: run the same command again for the unet stage")
        return 0
    summary = train_text_to_image(dataclasses.replace(unet_config, pause_after_s=pause))
    if summary["stopped"] == "paused":
        log.info("paused in the unet stage at step %d: run the same command again to go on", summary["step"])
        return 0
    log.info("summary: %s", json.dumps({k: summary.get(k) for k in UNET_SUMMARY_KEYS}))
    return 0


VAE_SUMMARY_KEYS = (
    "step", "stopped", "train_seconds", "final_loss", "psnr_db", "psnr_db_28", "fd_fmnist_reconstructions",
    "scaling_factor",
)  # fmt: skip
UNET_SUMMARY_KEYS = ("step", "stopped", "train_seconds", "final_loss", "model_bytes", "eval")


def run_text_to_image(args: argparse.Namespace) -> int:
    """Run one stage of the text-to-image recipe, or both (``--stage all``), from parsed arguments; returns the exit
    code."""
    from fastdiff.train.text_to_image import UNetStageConfig, VAEStageConfig, train_text_to_image, train_vae

    check_output_location(args.out, "--out", folder=True)
    stage = args.stage
    for other, flags in STAGE_FLAGS.items():
        if other == stage or stage == "all":
            continue
        for dest in flags:
            if getattr(args, dest) is not None:
                raise FastdiffError(f"--{dest.replace('_', '-')} applies to --stage {other} only")
    if stage == "all" and args.init_from is not None:
        raise FastdiffError("--init-from goes on from a pipeline and its VAE: use it with --stage unet, not all")
    if stage == "all":
        return run_both_stages(args)
    if args.init_from is not None:  # a bundled pipeline's name or a directory (recorded as given: a name stays a name)
        args.vae = args.vae if args.vae is not None else args.init_from  # its own VAE unless --vae says otherwise
    kwargs = stage_settings(args, stage)
    if stage == "vae":
        summary, keys = train_vae(VAEStageConfig(**kwargs)), VAE_SUMMARY_KEYS
    else:
        summary, keys = train_text_to_image(UNetStageConfig(**kwargs)), UNET_SUMMARY_KEYS
    if summary["stopped"] == "paused":
        log.info("paused at step %d: run the same command again to go on from %s", summary["step"],
                 summary["checkpoint"])  # fmt: skip
        return 0
    log.info("summary: %s", json.dumps({k: summary.get(k) for k in keys}))
    return 0
