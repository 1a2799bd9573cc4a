"""``fastdiff tune``: make a kernel plan on purpose (``fastdiff.engine.kernel_plan``).

The engine builds the model's fused forwards at one batch and size on this GPU, times every op's candidate kernels
(ignoring any plan it would otherwise use) and writes the choice as a plan file: give it to ``--plan`` on the
commands that sample (or ``Pipeline.from_pretrained(..., plan=)``) and the engine compiles only those kernels and
times nothing; the same plan gives the same kernels, and so the same bytes, in every process.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from fastdiff.cli_args import DEFAULT_GUIDANCE, DEFAULT_MODEL, finite_nonnegative_float, positive_int
from fastdiff.errors import FastdiffError

if TYPE_CHECKING:
    from fastdiff.engine.kernel_plan import KernelPlan

log = logging.getLogger(__name__)

TUNE_DTYPES = ("fp16", "bf16", "fp32", "fp8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fastdiff tune`` (sets ``func=run_tune``)."""
    p.description = (
        "Time every op's candidate kernels for one model, batch and size on this GPU and write the choice as a "
        "kernel plan (JSON). Commands that sample take it with --plan: the engine then compiles only the kernels "
        "it names and times nothing, and the same plan gives the same images in every process. An existing plan "
        "file at --out keeps its other entries."
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name or model directory (as fastdiff sample)")
    p.add_argument("--batch", type=positive_int, default=1, help="images per call (per prompt: text-to-image)")
    p.add_argument("--height", type=positive_int, default=None, help="text-to-image: image height (default: model's)")
    p.add_argument("--width", type=positive_int, default=None, help="text-to-image: image width (default: model's)")
    p.add_argument(
        "--guidance",
        type=finite_nonnegative_float,
        default=DEFAULT_GUIDANCE,
        help="text-to-image: the guidance the plan is for (> 1: the U-Net runs on twice the batch)",
    )
    p.add_argument("--dtype", default="fp16", choices=TUNE_DTYPES, help="engine precision")
    p.add_argument("--device", default="cuda", help="cuda or cuda:N (the plan is for this GPU's model)")
    p.add_argument("--out", type=Path, required=True, help="the plan file to write (JSON)")
    p.set_defaults(func=run_tune)


def run_tune(args: argparse.Namespace) -> int:
    from fastdiff.atomic import check_output_location
    from fastdiff.engine.kernel_plan import KernelPlan

    if args.out.suffix.lower() != ".json":
        raise FastdiffError(f"--out must be a .json file, got {args.out}")
    if not str(args.device).startswith("cuda"):
        raise FastdiffError(f"fastdiff tune times kernels on a CUDA GPU: --device {args.device} is not one")
    check_output_location(args.out, "--out")
    existing = KernelPlan.load(args.out) if args.out.exists() else None

    return make_plan(args, existing)


def make_plan(args: argparse.Namespace, existing: KernelPlan | None) -> int:
    """``fastdiff tune``'s work once its flags are checked: tune, then write the plan."""
    import torch

    from fastdiff.engine.kernel_plan import KernelPlan
    from fastdiff.pipelines import Pipeline, TextToImagePipeline

    if not torch.cuda.is_available():
        raise FastdiffError("fastdiff tune needs a CUDA GPU: none is available")
    pipe = Pipeline.from_pretrained(
        args.model, device=args.device, dtype=args.dtype, sampler="ddim", steps=2, backend="engine", tune="always"
    )
    if existing is not None and existing.gpu != pipe.engine.gpu:
        raise FastdiffError(f"{args.out} is a plan for {existing.gpu}, not this GPU ({pipe.engine.gpu})")
    if isinstance(pipe, TextToImagePipeline):
        pipe([""], guidance_scale=args.guidance, height=args.height, width=args.width,
             num_images_per_prompt=args.batch, output_type="tensor", progress=False)  # fmt: skip
    else:
        if args.height is not None or args.width is not None:
            raise FastdiffError("--height/--width are for text-to-image models (a pixel U-Net has its own size)")
        pipe(batch_size=args.batch, output_type="tensor", progress=False)
    plan = existing or KernelPlan(pipe.engine.gpu)
    for structure, entry in pipe.engine.used_plan.entries.items():
        plan.add(structure, entry)
    plan.save(args.out)
    timings = pipe.engine.timings
    log.info(
        "wrote %s: %d entries for %s (%s); tuning took %.1f s",
        args.out,
        len(pipe.engine.used_plan.entries),
        args.model,
        pipe.engine.gpu,
        sum(v for k, v in timings.items() if k.endswith("_autotune_s")),
    )
    return 0
