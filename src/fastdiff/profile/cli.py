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
    seed_int,
)

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``profile`` subcommand (sets ``func=run_profile_cli``)."""
    add_command(subparsers, "profile", add_arguments)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fastdiff profile`` (sets ``func=run_profile_cli``). Imports ``profile.report`` (and torch)
    for the backend names. The counts are checked by ``profile.report.validate``, before any loading."""
    from fastdiff.profile.report import BACKENDS

    p.description = (
        "Profile one model on each backend in one process and write DIR/report.md, DIR/report.json and "
        "PNG charts: time per op class, weight load to first step (sync copy, async copy, the engine's early "
        "start), latency, peak memory, NVML power and energy per image, and a roofline against ceilings this "
        "command measures. On the CPU: the eager backend, times from time.perf_counter."
    )
    p.add_argument("--model", default="ddpm-cifar10", help="preset name or model directory")
    p.add_argument("--batch", type=int, default=1, help="images per batch")
    p.add_argument("--sampler", default="ddpm", choices=SAMPLERS, help="sampler of the profiled loop")
    p.add_argument("--steps", type=int, default=1000, help="steps of one end-to-end sample (per-image numbers)")
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
    p.add_argument("--loads", type=int, default=20, help="fresh weight loads per mode for load-to-first-step")
    p.add_argument("--timed-steps", type=int, default=20, help="steps per timed run (scaled to --steps)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per backend (median reported)")
    p.add_argument(
        "--energy-seconds", type=finite_nonnegative_float, default=5.0, help="length of each NVML energy window"
    )
    p.add_argument("--top", type=positive_int, default=10, help="costliest kernels listed per backend")
    p.add_argument("--seed", type=seed_int, default=0, help="first seed (image k uses seed+k)")
    p.add_argument("--out", type=Path, required=True, help="output folder (report.md, report.json, *.png)")
    p.set_defaults(func=run_profile_cli)


def run_profile_cli(args: argparse.Namespace) -> int:
    import torch

    from fastdiff.profile.report import BACKENDS, ProfileConfig, markdown_report, run_profile, write_report

    check_output_location(args.out, "--out", folder=True)
    check_seed_range(args.seed, args.batch)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    dtype = args.dtype if args.dtype != "auto" else ("fp16" if cuda else "fp32")
    backends = BACKENDS if args.backends == "auto" and cuda else ("eager",) if args.backends == "auto" else None
    backends = backends or tuple(b for b in args.backends.split(",") if b)
    cfg = ProfileConfig(
        model=args.model, batch=args.batch, sampler=args.sampler, steps=args.steps, dtype=dtype, device=device,
        backends=backends, loads=args.loads, timed_steps=args.timed_steps, repeats=args.repeats,
        energy_seconds=args.energy_seconds, seed=args.seed, top=args.top,
    )  # fmt: skip
    result = run_profile(cfg)
    written = write_report(result, args.out)
    print(markdown_report(result))
    log.info("wrote %s", ", ".join(str(p) for p in written))
    return 0
