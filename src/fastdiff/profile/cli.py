"""``fastdiff profile``: the CLI front of profile.report."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from fastdiff.cli_args import HelpFormatter
from fastdiff.errors import FastdiffError
from fastdiff.profile.report import BACKENDS, ProfileConfig, markdown_report, run_profile, write_report

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "profile",
        help="op-class time breakdown, load-to-first-step, latency, memory, energy and roofline of one model",
        description="Profile one model on each backend in one process and write DIR/report.md, DIR/report.json and "
        "PNG charts: time per op class, weight load to first step (sync copy, async copy, the engine's early "
        "start), latency, peak memory, NVML power and energy per image, and a roofline against ceilings this "
        "command measures. On the CPU: the eager backend, times from time.perf_counter.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", default="ddpm-cifar10", help="preset name or model directory")
    p.add_argument("--batch", type=int, default=1, help="images per batch")
    p.add_argument("--sampler", default="ddpm", help="sampler of the profiled loop (any of fastdiff sample --sampler)")
    p.add_argument("--steps", type=int, default=1000, help="steps of one end-to-end sample (per-image numbers)")
    p.add_argument("--dtype", default="auto", help="fp16, bf16 or fp32 (auto: fp16 on CUDA, fp32 on the CPU)")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cuda or cpu")
    p.add_argument(
        "--backends", default="auto",
        help=f"comma-separated, from {', '.join(BACKENDS)} (auto: all on CUDA, eager on the CPU)",
    )  # fmt: skip
    p.add_argument("--loads", type=int, default=20, help="fresh weight loads per mode for load-to-first-step")
    p.add_argument("--timed-steps", type=int, default=20, help="steps per timed run (scaled to --steps)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per backend (median reported)")
    p.add_argument("--energy-seconds", type=float, default=5.0, help="length of each NVML energy window")
    p.add_argument("--top", type=int, default=10, help="costliest kernels listed per backend")
    p.add_argument("--seed", type=int, default=0, help="first seed (image k uses seed+k)")
    p.add_argument("--out", type=Path, required=True, help="output folder (report.md, report.json, *.png)")
    p.set_defaults(func=run_profile_cli)


def run_profile_cli(args: argparse.Namespace) -> int:
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    dtype = args.dtype if args.dtype != "auto" else ("fp16" if cuda else "fp32")
    backends = BACKENDS if args.backends == "auto" and cuda else ("eager",) if args.backends == "auto" else None
    backends = backends or tuple(b for b in args.backends.split(",") if b)
    if args.out.exists() and not args.out.is_dir():
        raise FastdiffError(f"--out {args.out} exists and is not a folder")
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
