"""The ``fastdiff`` command line: sample, generate, train, fid, bench, profile, serve, loadtest, export. User
errors: one line, exit code 2, before any model loads.

Building the parser imports no torch: a command's module (and its flags) load only when that command runs or
shows its help (``fastdiff.cli_args.COMMANDS``), and ``sample`` imports torch inside ``run_sample``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastdiff.cli_args import (
    COMMANDS,
    DEFAULT_GUIDANCE,
    DEFAULT_MODEL,
    DTYPE_CHOICES,
    DTYPE_HELP,
    FULL_GUIDANCE,
    KARRAS_SAMPLERS,
    SAMPLER_SCHEDULERS,
    SAMPLERS,
    CommandParser,
    add_command,
    add_plan_argument,
    check_guidance_interval,
    check_seed_range,
    finite_nonnegative_float,
    positive_int,
    resolve_dtype_choice,
    seed_int,
)
from fastdiff.errors import FastdiffError
from fastdiff.version import __version__

if TYPE_CHECKING:
    import torch

log = logging.getLogger("fastdiff")

SAMPLE_MEMORY_FACTOR = 128
"""A lower bound on the memory one image takes while it is sampled, in fp32 copies of the image (the sampler's
state and the U-Net's activations): 450 to 940 copies measured for the bundled presets on the CPU; 128 leaves
room for slimmer models, so that ``--batch`` refuses only batches that cannot fit."""


def add_sample_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fastdiff sample`` (sets ``func=run_sample``)."""
    p.description = (
        "Generate images with a U-Net and a sampler; writes a PNG grid (and optionally one PNG per "
        "image). Image k uses seed SEED+k, so an image depends on its seed only, not on the batch size. A "
        "text-to-image model (fashion-mnist-t2i or a Stable Diffusion directory) needs --prompt; with several "
        "--prompt, each prompt is one grid row of --batch images. Each PNG holds its generation "
        "parameters as JSON in its 'parameters' text chunk. The grid and the --save-dir images are written "
        "together or not at all."
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="preset name (fashion-mnist, ddpm-cifar10, ddpm-celebahq-256, convnext-cifar10, convnext-64), a "
        "local diffusers/fastdiff model directory (config.json + weights, or a unet/ subfolder), the bundled "
        "text-to-image preset fashion-mnist-t2i (Fashion-MNIST class prompts, e.g. --prompt 'ankle boot' "
        "--guidance 3) or a diffusers StableDiffusionPipeline directory (model_index.json; text-to-image)",
    )
    p.add_argument(
        "--sampler",
        default="ddim",
        choices=SAMPLERS,
        help="sampling algorithm; each equals a diffusers scheduler's default loop: "
        + ", ".join(f"{name} = {cls}" for name, cls in SAMPLER_SCHEDULERS.items())
        + " (algorithm_type sde-dpmsolver++ for dpmsolver++_sde)",
    )
    p.add_argument(
        "--karras",
        action="store_true",
        default=None,
        help=f"Karras et al. sigma spacing (use_karras_sigmas; {', '.join(KARRAS_SAMPLERS)}); default: as the "
        "model's scheduler config says",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="number of denoising steps (default: 100; 50 for a text-to-image model)",
    )
    p.add_argument("--batch", type=positive_int, default=16, help="number of images (of each prompt, with --prompt)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the first image (image k uses SEED+k)")
    p.add_argument("--eta", type=finite_nonnegative_float, default=0.0, help="DDIM noise scale (0 = deterministic)")
    p.add_argument(
        "--cache-interval",
        type=int,
        default=1,
        metavar="N",
        help="step caching (DeepCache): the whole U-Net every N-th step, in between only its shallowest level on "
        "the deep features kept from the last full step (faster, approximate; 1 = off)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help=DTYPE_HELP + "; pixel and text-to-image U-Nets",
    )
    p.add_argument("--device", default="auto", help="auto (GPU if present, else CPU), cpu, cuda or cuda:N")
    add_plan_argument(p)
    p.add_argument("--out", type=Path, default=Path("samples/grid.png"), help="output PNG grid")
    p.add_argument(
        "--save-dir",
        type=Path,
        default=None,
        help="also write each image here, named by its seed in six digits (seed 42: 000042.png)",
    )
    p.add_argument("--nrow", type=positive_int, default=None, help="images per grid row (default: about square)")
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="text prompt (text-to-image models only); repeat it for several prompts: one grid row of --batch "
        "images each (--nrow defaults to --batch), image k of prompt p uses seed SEED + p x BATCH + k",
    )
    p.add_argument("--negative-prompt", default=None, help="what to steer away from (classifier-free guidance)")
    p.add_argument(
        "--guidance",
        type=finite_nonnegative_float,
        default=None,
        help="classifier-free guidance scale, >= 0; <= 1 turns guidance off, as in diffusers (default: 7.5)",
    )
    p.add_argument(
        "--guidance-interval",
        nargs=2,
        type=float,
        metavar=("START", "STOP"),
        default=None,
        help="guide only steps int(START x STEPS) .. int(STOP x STEPS) - 1, the others on the prompt alone "
        "(diffusers' ClassifierFreeGuidance start/stop; default 0 1: every step)",
    )
    p.add_argument(
        "--guidance-parallel",
        action="store_true",
        default=None,
        help="run the two guidance halves of each U-Net call on two processes (launch with torchrun "
        "--nproc-per-node 2: one GPU each, cuda:LOCAL_RANK; gloo on the CPU); both give the same images, rank 0 "
        "writes them. On CUDA the engine gathers the halves inside its captured loop",
    )
    p.add_argument(
        "--patch-parallel",
        action="store_true",
        default=None,
        help="split the latent's rows over the processes of a torchrun launch (--nproc-per-node N: one GPU each; "
        "gloo on the CPU): each runs the U-Net on its band (DistriFusion); after --patch-warmup synchronous steps "
        "the other bands' activations are one step old, which changes the image slightly. All give the same "
        "images, rank 0 writes them. Eager backend",
    )
    p.add_argument(
        "--patch-warmup",
        type=positive_int,
        default=None,
        help="synchronous steps before --patch-parallel's exchanges go stale (default 4; >= --steps: the one-process "
        "image, up to rounding)",
    )
    size_help = "image {}, a multiple of 8 (default: the model's sample size x the VAE's scale factor, 8 for SD)"
    p.add_argument("--height", type=positive_int, default=None, help=size_help.format("height"))
    p.add_argument("--width", type=positive_int, default=None, help=size_help.format("width"))
    p.add_argument(
        "--init-image",
        type=Path,
        default=None,
        help="image-to-image: start from this image (its sides multiples of 8; the output takes its size)",
    )
    p.add_argument(
        "--strength",
        type=float,
        default=None,
        help="how far --init-image is noised, in (0, 1]: int(steps x strength) steps run (default: 0.6)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(func=run_sample)


def memory_bytes(device: torch.device) -> int:
    """Memory the samples can use: free memory of a CUDA device, else the machine's physical memory."""
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_batch_fits(batch: int, sample_shape: tuple[int, ...], device: torch.device) -> None:
    """Raise a FastdiffError if ``batch`` images of ``sample_shape`` cannot fit in the device's memory (at
    ``SAMPLE_MEMORY_FACTOR`` fp32 copies of each image)."""
    per_image = 4 * math.prod(sample_shape) * SAMPLE_MEMORY_FACTOR
    memory = memory_bytes(device)
    if batch * per_image > memory:
        size = "x".join(map(str, sample_shape))
        raise FastdiffError(
            f"--batch {batch} cannot fit in memory: sampling needs at least {per_image / 2**20:.2f} MiB per {size} "
            f"image, {batch * per_image / 2**30:.1f} GiB in all, and {device} has {memory / 2**30:.1f} GiB (at most "
            f"{memory // per_image} images could fit): sample fewer per run, with other --seed values"
        )


TEXT_FLAGS = (
    "negative_prompt", "guidance", "guidance_interval", "height", "width", "init_image", "strength",
    "guidance_parallel", "patch_parallel", "patch_warmup",
)  # fmt: skip
"""``fastdiff sample`` flags that only apply with --prompt."""
DEFAULT_STRENGTH = 0.6


def check_text_flags(args: argparse.Namespace) -> Any:
    """--prompt and its flags against the kind of model (before any work); returns the opened --init-image."""
    from PIL import Image

    from fastdiff.pipelines.text_to_image import check_size, check_strength, is_text_to_image_dir

    if args.prompt is None:
        for name in TEXT_FLAGS:
            if getattr(args, name) is not None:
                raise FastdiffError(f"--{name.replace('_', '-')} needs --prompt")
        if is_text_to_image_dir(args.model):
            raise FastdiffError(f"{args.model} is a text-to-image model: give --prompt")
        return None
    if not is_text_to_image_dir(args.model):
        raise FastdiffError(
            f"--prompt needs a text-to-image model (fashion-mnist-t2i or a diffusers pipeline directory with "
            f"model_index.json); "
            f"{args.model} is unconditional"
        )
    check_size(args.height, args.width)
    if args.guidance_interval is not None:
        args.guidance_interval = check_guidance_interval(args.guidance_interval, "--guidance-interval")
    if args.init_image is None:
        if args.strength is not None:
            raise FastdiffError("--strength needs --init-image")
        return None
    if args.height is not None or args.width is not None:
        raise FastdiffError("--height/--width do not apply with --init-image: the output takes the image's size")
    check_strength(DEFAULT_STRENGTH if args.strength is None else args.strength)
    try:
        with Image.open(args.init_image) as opened:
            image = opened.convert("RGB")
    except (OSError, ValueError) as exc:
        raise FastdiffError(f"cannot read --init-image {args.init_image}: {exc}") from None
    if image.width % 8 or image.height % 8:
        size = f"{image.width}x{image.height}"
        raise FastdiffError(f"--init-image {args.init_image} is {size}: its sides must be multiples of 8")
    return image


def run_sample(args: argparse.Namespace) -> int:
    from fastdiff.atomic import check_output_location
    from fastdiff.samplers import check_cache_interval

    if args.out.suffix.lower() != ".png":
        raise FastdiffError(f"--out must be a .png file, got {args.out}")
    check_cache_interval(args.cache_interval, "--cache-interval")
    check_seed_range(args.seed, args.batch * len(args.prompt or [None]))
    check_output_location(args.out, "--out")
    if args.save_dir is not None:
        check_output_location(args.save_dir, "--save-dir", folder=True)
    init_image = check_text_flags(args)
    if args.patch_warmup is not None and not args.patch_parallel:
        raise FastdiffError("--patch-warmup needs --patch-parallel")
    if args.guidance_parallel and args.patch_parallel:
        raise FastdiffError("--guidance-parallel and --patch-parallel do not combine: use one")
    split = "--guidance-parallel" if args.guidance_parallel else "--patch-parallel" if args.patch_parallel else None
    device, backend, rank = args.device, None, 0
    if split is not None:
        device, rank = start_parallel(args, split, init_image.height if init_image is not None else args.height)
        backend = "eager" if args.patch_parallel else None  # the engine splits guidance in its captured loop
    args.dtype = resolve_dtype_choice(args.dtype, device)
    try:
        return sample_and_write(args, init_image, device, backend, rank)
    finally:
        if split is not None:
            import torch.distributed as dist

            dist.destroy_process_group()


def sample_and_write(args: argparse.Namespace, init_image: Any, device: str, backend: str | None, rank: int) -> int:
    """``fastdiff sample`` after its checks: load, sample, write (rank 0 only under --guidance-parallel or
    --patch-parallel)."""
    from fastdiff.atomic import AtomicOutputs
    from fastdiff.images import make_grid, png_writer
    from fastdiff.pipelines import Pipeline

    pipe = Pipeline.from_pretrained(
        args.model, device=device, dtype=args.dtype, sampler=args.sampler, steps=args.steps, karras=args.karras,
        plan=args.plan, backend=backend,
    )  # fmt: skip
    if args.guidance_parallel:
        pipe.split_guidance()
    if args.patch_parallel:
        from fastdiff.pipelines.patch_parallel import DEFAULT_WARMUP

        pipe.split_patches(warmup=args.patch_warmup or DEFAULT_WARMUP)
    params: dict[str, Any] = {
        "model": str(args.model),
        "sampler": args.sampler,
        "steps": pipe.steps,
        "eta": args.eta,
        "dtype": args.dtype,
    }
    if args.karras:
        params["karras"] = True
    if args.cache_interval > 1:
        params["cache_interval"] = args.cache_interval
    start = time.perf_counter()
    if args.prompt is None:
        check_batch_fits(args.batch, pipe.sample_shape, pipe.device)
        images = pipe(
            batch_size=args.batch,
            seeds=args.seed,
            eta=args.eta,
            progress=not args.no_progress,
            cache_interval=args.cache_interval,
        )
    else:
        height, width = (init_image.height, init_image.width) if init_image else (args.height, args.width)
        count = args.batch * len(args.prompt)
        check_batch_fits(count, pipe.latent_shape(height, width), pipe.device)
        guidance = DEFAULT_GUIDANCE if args.guidance is None else args.guidance
        strength = DEFAULT_STRENGTH if args.strength is None else args.strength
        prompt = args.prompt[0] if len(args.prompt) == 1 else args.prompt
        params.update(prompt=prompt, negative_prompt=args.negative_prompt or "", guidance=guidance)
        interval = args.guidance_interval or FULL_GUIDANCE
        if interval != FULL_GUIDANCE:
            params["guidance_interval"] = list(interval)
        if init_image is not None:
            params.update(init_image=str(args.init_image), strength=strength)
        images = pipe(
            args.prompt,
            negative_prompt=args.negative_prompt,
            guidance_scale=guidance,
            height=height,
            width=width,
            num_images_per_prompt=args.batch,
            seeds=args.seed,
            image=init_image,
            strength=strength,
            eta=args.eta,
            progress=not args.no_progress and rank == 0,
            cache_interval=args.cache_interval,
            guidance_interval=interval,
        )
        params.update(width=images[0].width, height=images[0].height)
    if args.guidance_parallel:
        params["guidance_parallel"] = True
    if args.patch_parallel:
        import torch.distributed as dist

        warmup = pipe.patch_split.warmup
        params["patch_parallel"] = {"processes": dist.get_world_size(), "warmup_steps": warmup}
    if (args.guidance_parallel or args.patch_parallel) and rank != 0:  # all ranks hold the same images
        return 0
    seconds = time.perf_counter() - start
    if pipe.plan_digest is not None:  # the engine's kernels: equal digests, equal kernels
        params["kernel_plan"] = pipe.plan_digest
    prompts = args.prompt or [None]
    seeds = [args.seed + k for k in range(args.batch * len(prompts))]
    nrow = args.nrow or (args.batch if len(prompts) > 1 else None)
    grid = make_grid(images, nrow=nrow)
    try:
        with AtomicOutputs() as outputs:  # the images and the grid: all written, or none
            if args.save_dir is not None:
                for k, (seed, image) in enumerate(zip(seeds, images, strict=True)):
                    own = params if len(prompts) == 1 else {**params, "prompt": prompts[k // args.batch]}
                    outputs.add(args.save_dir / f"{seed:06d}.png", png_writer(image, {**own, "seed": seed}))
            outputs.add(args.out, png_writer(grid, {**params, "seeds": seeds}))
    except OSError as exc:
        where = exc.filename or args.out
        raise FastdiffError(f"nothing written: cannot write {where}: {exc.strerror or exc}") from None
    log.info(
        "wrote %s: %d images, %s %d steps on %s (%s) in %.1f s",
        args.out,
        len(seeds),
        args.sampler,
        pipe.steps,
        pipe.device,
        args.dtype,
        seconds,
    )
    return 0


PARALLEL_TIMEOUT_S = 600
"""How long a --guidance-parallel or --patch-parallel rank waits for the others in a collective (all load the model
first)."""


def start_parallel(args: argparse.Namespace, split: str, height: int | None) -> tuple[str, int]:
    """Checks for --guidance-parallel or --patch-parallel (``split``; before loading; ``height``: the image's, None
    for the model's default), then this process's device
    (``cuda:LOCAL_RANK`` when --device is auto and a GPU is present) and the joined torch.distributed group (NCCL on
    GPUs, gloo on the CPU); returns (device, rank)."""
    if split == "--guidance-parallel":
        from fastdiff.pipelines.guidance_parallel import check_launch

        check_launch()
        guidance = DEFAULT_GUIDANCE if args.guidance is None else args.guidance
        if guidance <= 1:
            raise FastdiffError(f"--guidance-parallel splits classifier-free guidance: --guidance {guidance} is off")
    else:
        from fastdiff.pipelines.patch_parallel import check_launch as check_patch_launch
        from fastdiff.pipelines.patch_parallel import check_size_before_loading

        check_size_before_loading(str(args.model), height, check_patch_launch())
    if args.cache_interval > 1:
        raise FastdiffError(f"{split} runs every step in full: drop --cache-interval")
    import datetime

    import torch.distributed as dist

    from fastdiff.devices import rank_device

    device = rank_device(args.device, split)
    timeout = datetime.timedelta(seconds=PARALLEL_TIMEOUT_S)
    dist.init_process_group("nccl" if device != "cpu" else "gloo", timeout=timeout)
    return device, dist.get_rank()


def build_parser(complete: bool = False) -> argparse.ArgumentParser:
    """The ``fastdiff`` parser. A command's flags are added when it is parsed or its help is shown (its module
    imported then, not here); ``complete``: add every command's flags now."""
    parser = CommandParser(
        prog="fastdiff",
        description="Fast diffusion U-Net sampling on the GPU, measured against diffusers and torch.compile. "
        "Run 'fastdiff COMMAND --help' for the flags of each command.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    parser.add_argument("-q", "--quiet", action="store_true", help="log only warnings and errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        add_command(sub, name, add_sample_arguments if name == "sample" else None)
    if complete:
        for command in sub.choices.values():
            command.complete()
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
