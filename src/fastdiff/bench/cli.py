"""``fastdiff bench``: the CLI front of bench.runner (imported when the command is used, not with this module)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from fastdiff.atomic import AtomicOutputs, check_output_location, write_text_atomic
from fastdiff.cli_args import (
    SAMPLERS,
    add_command,
    add_plan_argument,
    check_seed_range,
    finite_nonnegative_float,
    positive_int,
    seed_int,
)
from fastdiff.errors import FastdiffError

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``bench`` subcommand (sets ``func=run_bench_cli``)."""
    add_command(subparsers, "bench", add_arguments)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fastdiff bench`` (sets ``func=run_bench_cli``). Imports ``bench.runner`` (and torch) for the
    system names."""
    from fastdiff.bench.runner import ALL_SYSTEMS, OPTIONAL_SYSTEMS

    p.description = (
        "Run every system on the same model, weights, seeds and x_T in one process: ms/step, "
        "s/image, images/s, time-to-ready, peak GPU memory, NVML energy per image, and paired PSNR vs "
        "eager-fp32. Writes a JSON result and prints a Markdown table. With a Stable Diffusion preset "
        "(--model sd15 or sd21: random weights) it runs the text-to-image systems instead: diffusers' "
        "StableDiffusionPipeline eager and with a compiled U-Net, fastdiff eager and engine; 512x512 images, DDIM, "
        "guidance 7.5, end-to-end and per-U-Net-step times, memory and PSNR vs diffusers fp32. The same for a "
        "text-to-image model (fashion-mnist-t2i, or a diffusers pipeline directory) at its own image size."
    )
    p.add_argument(
        "--model",
        default="ddpm-cifar10",
        help="preset name or model directory; sd15, sd21, fashion-mnist-t2i or a pipeline directory: text-to-image",
    )
    p.add_argument("--batch", type=positive_int, default=1, help="images per batch")
    p.add_argument(
        "--sampler",
        default=None,
        choices=SAMPLERS,
        help="sampler whose loop is timed (default ddpm; text-to-image: ddim)",
    )
    p.add_argument(
        "--steps", type=positive_int, default=None, help="steps of a full sampling run (default 1000; SD: 20)"
    )
    p.add_argument("--timed-steps", type=positive_int, default=100, help="steps timed per repeat (scaled to --steps)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed repeats (median reported)")
    p.add_argument(
        "--quality-sampler", default="dpmsolver++", choices=SAMPLERS, help="sampler of the paired-quality run"
    )
    p.add_argument("--quality-steps", type=positive_int, default=20, help="steps of the paired-quality run")
    p.add_argument(
        "--energy-seconds", type=finite_nonnegative_float, default=5.0, help="length of the NVML energy window"
    )
    p.add_argument(
        "--systems",
        default=",".join(ALL_SYSTEMS),
        help="comma-separated systems to run. Optional ones, run only when named: "
        f"{', '.join(OPTIONAL_SYSTEMS)} (the engine with GroupNorm folded into the convs; more torch.compile "
        "configurations). compile* systems are torch.compile of fastdiff's model: compile = mode reduce-overhead, "
        "+autotune = max-autotune (minutes to compile), +freeze = Inductor freezing, +cl = channels-last weights. "
        "× fastest compile is against the fastest compile* or diffusers+compile row of the run",
    )
    p.add_argument("--device", default="cuda", help="cuda or cpu")
    p.add_argument(
        "--cache-interval",
        type=int,
        default=1,
        metavar="N",
        help="step caching (DeepCache) in fastdiff's eager and engine systems: the whole U-Net every N-th step, its "
        "shallow path in between (1 = off; torch.compile and diffusers always run every step in full)",
    )
    p.add_argument(
        "--op-table",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on CUDA, each engine system's per-op table in the JSON (time, FLOPs, bytes, TFLOP/s, GB/s and %% of the "
        "bf16 matmul and copy ceilings, measured once per run; kernels per step), its slowest ops printed: about a "
        "second per engine system",
    )
    p.add_argument("--seed", type=seed_int, default=0, help="first seed (image k uses seed+k)")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"), help="where the JSON goes")
    p.add_argument("--name", default=None, help="result file name stem (default: model-batch-sampler)")
    p.add_argument("--plot", action="store_true", help="also save a bar chart PNG next to the JSON")
    add_plan_argument(p)
    p.set_defaults(func=run_bench_cli)


def run_text_to_image_cli(args: argparse.Namespace) -> int:
    from fastdiff.bench.runner import ALL_SYSTEMS
    from fastdiff.bench.text_to_image import T2I_SYSTEMS, TextToImageBenchConfig, run_text_to_image_bench
    from fastdiff.pipelines.base import load_plan

    plan = load_plan(args.plan)  # a bad plan file fails before anything loads
    if args.sampler not in (None, "ddim"):
        raise FastdiffError(f"the text-to-image bench runs DDIM (DDIMScheduler); got --sampler {args.sampler}")
    systems = T2I_SYSTEMS if args.systems == ",".join(ALL_SYSTEMS) else tuple(s for s in args.systems.split(",") if s)
    cfg = TextToImageBenchConfig(
        model=args.model, batch=args.batch, steps=args.steps or 20, repeats=args.repeats, systems=systems,
        seed=args.seed, device=args.device, cache_interval=args.cache_interval, plan=plan,
    )  # fmt: skip
    path = args.out_dir / f"{args.name or f't2i-bench-{args.model}-b{args.batch}'}.json"
    check_output_location(path, "--out-dir")

    def save(result: dict) -> None:  # after every system: a long run that is cut short keeps what it measured
        write_text_atomic(path, json.dumps(result, indent=1) + "\n")

    result = run_text_to_image_bench(cfg, on_row=save)
    for row in result["results"]:
        print(json.dumps({k: v for k, v in row.items() if k != "extra"}))
    log.info("wrote %s", path)
    return 0


def run_bench_cli(args: argparse.Namespace) -> int:
    from fastdiff.bench.report import markdown_table, op_tables_markdown, plot_result
    from fastdiff.bench.runner import ALL_SYSTEMS, OPTIONAL_SYSTEMS, BenchConfig, result_path, run_bench
    from fastdiff.models.stable_diffusion import SD_PRESETS
    from fastdiff.pipelines.base import load_plan
    from fastdiff.pipelines.text_to_image import is_text_to_image_dir
    from fastdiff.samplers import check_cache_interval

    check_cache_interval(args.cache_interval, "--cache-interval")
    check_output_location(args.out_dir, "--out-dir", folder=True)
    check_seed_range(args.seed, args.batch)
    if args.model in SD_PRESETS or is_text_to_image_dir(args.model):
        return run_text_to_image_cli(args)
    args.steps = args.steps or 1000
    args.sampler = args.sampler or "ddpm"

    systems = tuple(s for s in args.systems.split(",") if s)
    unknown = [s for s in systems if s not in ALL_SYSTEMS + OPTIONAL_SYSTEMS]
    if unknown:
        raise FastdiffError(f"unknown system {unknown[0]!r}: choose from {', '.join(ALL_SYSTEMS + OPTIONAL_SYSTEMS)}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (the chart is drawn after the run: say so now)
        except ImportError:
            raise FastdiffError("--plot needs matplotlib: pip install 'fastdiff[bench]'") from None
    cfg = BenchConfig(
        model=args.model,
        batch=args.batch,
        sampler=args.sampler,
        steps=args.steps,
        timed_steps=args.timed_steps,
        repeats=args.repeats,
        quality_sampler=args.quality_sampler,
        quality_steps=args.quality_steps,
        energy_seconds=args.energy_seconds,
        systems=systems,
        seed=args.seed,
        device=args.device,
        cache_interval=args.cache_interval,
        op_table=args.op_table,
        plan=load_plan(args.plan),
    )
    result = run_bench(cfg)
    path = result_path(result, args.out_dir, args.name)

    def plot(tmp: Path) -> None:  # matplotlib picks the format by suffix: draw to NAME.png, then move it to tmp
        drawn = tmp.with_name(tmp.name + ".png")
        try:
            plot_result(result, drawn)
            os.replace(drawn, tmp)
        finally:
            drawn.unlink(missing_ok=True)

    try:
        with AtomicOutputs() as outputs:  # the JSON and its chart: both or neither
            if args.plot:
                outputs.add(path.with_suffix(".png"), plot)
            outputs.add(path, lambda tmp: tmp.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8"))
    except OSError as exc:
        raise FastdiffError(f"nothing written: cannot write {exc.filename or path}: {exc.strerror or exc}") from None
    print(markdown_table(result))
    ops = op_tables_markdown(result)
    if ops:
        print(f"\n{ops}")
    log.info("wrote %s", path)
    return 0
