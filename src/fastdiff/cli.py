"""The ``fastdiff`` command line: sample, train, fid, bench, profile. User errors: one line, exit code 2."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from fastdiff.errors import FastdiffError

log = logging.getLogger("fastdiff")

DEFAULT_MODEL = "fashion-mnist"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def add_sample_parser(subparsers: argparse._SubParsersAction) -> None:
    from fastdiff.samplers import SAMPLERS

    p = subparsers.add_parser(
        "sample",
        help="generate images and write a PNG grid",
        description="Generate images with a U-Net and a sampler; writes a PNG grid (and optionally one PNG per "
        "image). Image k uses seed SEED+k, so an image depends on its seed only, not on the batch size.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="preset name (fashion-mnist, ddpm-cifar10, ddpm-celebahq-256, convnext-cifar10, convnext-64) or a "
        "local diffusers/fastdiff model directory (config.json + weights, or a unet/ subfolder)",
    )
    p.add_argument("--sampler", default="ddim", choices=SAMPLERS, help="sampling algorithm")
    p.add_argument("--steps", type=positive_int, default=100, help="number of denoising steps")
    p.add_argument("--batch", type=positive_int, default=16, help="number of images")
    p.add_argument("--seed", type=int, default=0, help="seed of the first image (image k uses SEED+k)")
    p.add_argument("--eta", type=float, default=0.0, help="DDIM noise scale (0 = deterministic)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "fp16", "bf16"), help="model precision")
    p.add_argument("--device", default="auto", help="auto (GPU if present, else CPU), cpu, cuda or cuda:N")
    p.add_argument("--out", type=Path, default=Path("samples/grid.png"), help="output PNG grid")
    p.add_argument("--save-dir", type=Path, default=None, help="also write each image as SEED.png here")
    p.add_argument("--nrow", type=int, default=None, help="images per grid row (default: about square)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run_sample)


def run_sample(args: argparse.Namespace) -> int:
    from fastdiff.images import make_grid, save_png_atomic
    from fastdiff.pipeline import Pipeline

    if args.out.suffix.lower() != ".png":
        raise FastdiffError(f"--out must be a .png file, got {args.out}")
    if args.eta < 0:
        raise FastdiffError(f"--eta must be >= 0, got {args.eta}")
    pipe = Pipeline.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, sampler=args.sampler, steps=args.steps
    )
    start = time.perf_counter()
    images = pipe(batch_size=args.batch, seeds=args.seed, eta=args.eta, progress=not args.no_progress)
    seconds = time.perf_counter() - start
    save_png_atomic(make_grid(images, nrow=args.nrow), args.out)
    if args.save_dir is not None:
        for k, image in enumerate(images):
            save_png_atomic(image, args.save_dir / f"{args.seed + k:06d}.png")
    log.info(
        "wrote %s: %d images, %s %d steps on %s (%s) in %.1f s",
        args.out,
        args.batch,
        args.sampler,
        args.steps,
        pipe.device,
        args.dtype,
        seconds,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastdiff",
        description="Fast diffusion U-Net sampling on the GPU, measured against diffusers and torch.compile. "
        "Run 'fastdiff COMMAND --help' for the flags of each command.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    parser.add_argument("-q", "--quiet", action="store_true", help="log only warnings and errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_sample_parser(sub)
    from fastdiff.bench.cli import register as register_bench
    from fastdiff.profile.cli import register as register_profile
    from fastdiff.quality.cli import register as register_quality
    from fastdiff.train.cli import register as register_train

    register_train(sub)
    register_quality(sub)
    register_bench(sub)
    register_profile(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except FastdiffError as exc:
        print(f"fastdiff: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fastdiff: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
