"""``fastdiff profile``: the CLI front of profile.report (imported when the command is used, not with this
module)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from fastdiff.atomic import check_output_location
from fastdiff.cli_args import (
    SAMPLERS,
    add_command,
    check_seed_range,
    finite_nonnegative_float,
    positive_int,
    resolve_dtype_choice,
    seed_int,
)

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``profile`` subcommand (sets ``func=run_profile_cli``)."""
    add_command(subparsers, "profile", add_arguments)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fastdiff profile`` (sets ``func=run_profile_cli``). Imports ``profile.report`` (and torch)
    for the backend names. The counts and the flags that do not apply to the model's kind are checked by
    ``profile.config.resolve_config`` and ``validate``, before any loading."""
    from fastdiff.profile.config import DEFAULT_GUIDANCE, DEFAULT_PROMPT, TEXT_DEFAULTS, UNCONDITIONAL_DEFAULTS
    from fastdiff.profile.report import BACKENDS

    uncond, text = UNCONDITIONAL_DEFAULTS, TEXT_DEFAULTS
    p.description = (
        "Profile one model on each backend in one process and write DIR/report.md, DIR/report.json and "
        "PNG charts: time per op class, weight load to first step (sync copy, async copy, the engine's early "
        "start), latency, peak memory, NVML power and energy per image, and a roofline against ceilings this "
        "command measures. On the CPU: the eager backend, times from time.perf_counter. "
        "Text-to-image models (sd15, sd21: random weights; fashion-mnist-t2i; a Stable Diffusion pipeline directory "
        "with model_index.json): the U-Net step by op class with each class's achieved TFLOP/s and GB/s, the time "
        "of one image split into text encoder, U-Net loop and VAE decode, load to first image, peak memory, energy "
        "and a roofline, on the backends eager, compile (torch.compile of the U-Net) and engine."
    )
    p.add_argument(
        "--model", default="ddpm-cifar10",
        help="unconditional preset or U-Net directory, or a text-to-image model: sd15, sd21, fashion-mnist-t2i or a "
        "pipeline directory",
    )  # fmt: skip
    p.add_argument("--batch", type=int, default=1, help="images per batch (text-to-image: prompts)")
    p.add_argument(
        "--sampler", default=None, choices=SAMPLERS,
        help=f"sampler of the profiled loop (default: {uncond['sampler']}; text-to-image: {text['sampler']})",
    )  # fmt: skip
    p.add_argument(
        "--steps", type=int, default=None,
        help=f"steps of one end-to-end sample, per-image numbers (default: {uncond['steps']}; text-to-image: "
        f"{text['steps']})",
    )  # fmt: skip
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "fp16", "bf16", "fp32"),
        help="precision (auto: fp16 on CUDA, fp32 on the CPU)",
    )
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cuda or cpu")
    p.add_argument(
        "--backends", default="auto",
        help=f"comma-separated, from {', '.join(BACKENDS)} (auto: all on CUDA, eager on the CPU)",
    )  # fmt: skip
    p.add_argument(
        "--loads", type=int, default=None,
        help="fresh weight loads: per mode for load-to-first-step, or per backend for a text-to-image model's "
        f"load-to-first-image, its first one included (default: {uncond['loads']}; text-to-image: {text['loads']})",
    )  # fmt: skip
    p.add_argument(
        "--timed-steps", type=int, default=None,
        help=f"unconditional models only: steps per timed run, scaled to --steps (default: {uncond['timed_steps']}); "
        "a text-to-image model's timed runs are whole images",
    )  # fmt: skip
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per backend (median reported; text-to-image: images)"
    )
    p.add_argument(
        "--energy-seconds", type=finite_nonnegative_float, default=5.0, help="length of each NVML energy window"
    )
    p.add_argument("--top", type=positive_int, default=10, help="costliest kernels listed per backend")
    p.add_argument("--seed", type=seed_int, default=0, help="first seed (image k uses seed+k)")
    text_group = p.add_argument_group("text-to-image models only (refused for unconditional ones)")
    text_group.add_argument(
        "--guidance", type=finite_nonnegative_float, default=None,
        help=f"classifier-free guidance scale (default: {DEFAULT_GUIDANCE}); above 1 the U-Net runs on 2x the batch "
        "([uncond; cond] text states), 1 or less: the conditional model alone",
    )  # fmt: skip
    text_group.add_argument(
        "--height", type=positive_int, default=None,
        help="image height in pixels, a multiple of 8 (default: the model's: 512 for sd15, 768 for sd21, 32 for "
        "fashion-mnist-t2i)",
    )  # fmt: skip
    text_group.add_argument(
        "--width", type=positive_int, default=None, help="image width in pixels (default: the model's, as --height)"
    )
    text_group.add_argument(
        "--prompt", default=None,
        help=f"the prompt of every image (default: {DEFAULT_PROMPT!r}; padded to the text encoder's 77 tokens, so "
        "its words do not change the time)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="output folder (report.md, report.json, *.png)")
    p.set_defaults(func=run_profile_cli)


def run_profile_cli(args: argparse.Namespace) -> int:
    import torch

    from fastdiff.profile.config import resolve_config
    from fastdiff.profile.report import BACKENDS, ProfileConfig, markdown_report, run_profile, write_report

    check_output_location(args.out, "--out", folder=True)
    check_seed_range(args.seed, args.batch)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    dtype = resolve_dtype_choice(args.dtype, device)
    backends = BACKENDS if args.backends == "auto" and cuda else ("eager",) if args.backends == "auto" else None
    backends = backends or tuple(b for b in args.backends.split(",") if b)
    cfg = ProfileConfig(
        model=args.model, batch=args.batch, sampler=args.sampler, steps=args.steps, dtype=dtype, device=device,
        backends=backends, loads=args.loads, timed_steps=args.timed_steps, repeats=args.repeats,
        energy_seconds=args.energy_seconds, seed=args.seed, top=args.top, guidance=args.guidance,
        height=args.height, width=args.width, prompt=args.prompt,
    )  # fmt: skip
    resolve_config(cfg)  # flags that do not apply to the model's kind: one line, before any loading
    result = run_profile(cfg)
    written = write_report(result, args.out)
    print(markdown_report(result))
    log.info("wrote %s", ", ".join(str(p) for p in written))
    return 0
