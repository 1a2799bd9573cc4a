"""``fastdiff train``: train a ConvNeXt U-Net on Fashion-MNIST, resume, and export the EMA weights."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from fastdiff.cli import HelpFormatter
from fastdiff.errors import FastdiffError

log = logging.getLogger(__name__)

EXPORT_DTYPES = ("fp16", "bf16", "fp32")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` command to the ``fastdiff`` parser."""
    from fastdiff.train.data import DEFAULT_DATA_DIR
    from fastdiff.train.trainer import PREDICTIONS, SCHEDULES, TrainConfig

    defaults = TrainConfig()
    p = subparsers.add_parser(
        "train",
        help="train a ConvNeXt U-Net on Fashion-MNIST (resumable) and export it",
        description="Train a ConvNeXt U-Net on the Fashion-MNIST train split with AdamW and an EMA of the "
        "weights. Writes checkpoint.pt, loss.jsonl, loss.png, summary.json and samples/step_XXXXXX.png (EMA "
        "model, DDIM) to --out; running again with the same --out resumes exactly where the last run stopped "
        "(--export writes the EMA weights as a model directory for 'fastdiff sample --model DIR').",
        formatter_class=HelpFormatter,
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
        type=float,
        default=None,
        help="stop cleanly with a checkpoint after this many minutes (resume with the same --out)",
    )
    p.add_argument("--batch", type=int, default=defaults.batch_size, help="images per step")
    p.add_argument("--lr", type=float, default=defaults.lr, help="AdamW peak learning rate")
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
    p.add_argument("--seed", type=int, default=defaults.seed, help="seed of initialisation, data order and noise")
    p.add_argument("--device", default=defaults.device, help="auto (GPU if present, else CPU), cpu, cuda or cuda:N")
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 on CUDA (default: bf16 autocast)")
    p.add_argument("--no-channels-last", action="store_true", help="keep NCHW tensors on CUDA (default: channels_last)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (compile time counts)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--export", type=Path, default=None, help="after training, write the EMA model directory here")
    p.add_argument("--export-dtype", default="fp16", choices=EXPORT_DTYPES, help="precision of exported weights")
    p.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    """Train (or resume) from parsed arguments, then export if asked; returns the exit code."""
    from fastdiff.devices import resolve_dtype
    from fastdiff.train.trainer import TrainConfig, export_model, train

    if args.export is not None and args.export.resolve() == args.out.resolve():
        raise FastdiffError(f"--export must be another folder than --out ({args.out})")
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
