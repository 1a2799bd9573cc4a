"""``fastdiff bench``: every system on the same model, weights, seeds and x_T, in one process and run."""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from fastdiff.bench.energy import EnergyMeter
from fastdiff.bench.env import environment, gpu_slug
from fastdiff.bench.ops import engine_op_table
from fastdiff.bench.roofline import measure_ceilings
from fastdiff.bench.systems import COMPILE_CONFIGS, CompileSystem, DiffusersSystem, EagerSystem, EngineSystem, System
from fastdiff.devices import DTYPES, synchronize, time_ms
from fastdiff.engine.kernel_plan import KernelPlan
from fastdiff.errors import FastdiffError
from fastdiff.models import PRESETS, load_unet
from fastdiff.pipelines.base import nonfinite_message
from fastdiff.quality.psnr import psnr
from fastdiff.samplers import ScheduleConfig, check_cache_interval, initial_noise, make_sampler, seed_tensor

log = logging.getLogger(__name__)

SCHEMA = "fastdiff.bench/1"
ALL_SYSTEMS = (
    "eager-fp32",
    "diffusers-fp32",
    "eager-fp16",
    "diffusers-fp16",
    "compile-fp16",
    "compile+autotune-fp16",
    "diffusers+compile-fp16",
    "engine-fp16",
    "engine-bf16",
    "engine-fp8",
)
OPTIONAL_SYSTEMS = tuple(f"{name}-fp16" for name in COMPILE_CONFIGS if f"{name}-fp16" not in ALL_SYSTEMS)
"""Systems that run only when named in ``--systems``: the torch.compile configurations not in the default set."""


@dataclass
class BenchConfig:
    model: str = "ddpm-cifar10"
    batch: int = 1
    sampler: str = "ddpm"
    steps: int = 1000
    timed_steps: int = 100
    """Steps timed per repeat (ms/step is the same for every step of a loop); the full-loop numbers scale it."""
    repeats: int = 3
    quality_sampler: str = "dpmsolver++"
    quality_steps: int = 20
    """The paired-quality run. Not DDIM: on random weights its default loop (the model's own eps next to a clipped
    x0) amplifies rounding until pixels saturate, so two true-fp32 runs of diffusers itself differ by 10-20 dB
    (benchmarks/results/sampler-parity-*.json); DPM-Solver++ is well conditioned there."""
    energy_seconds: float = 5.0
    systems: tuple[str, ...] = ALL_SYSTEMS
    seed: int = 0
    device: str = "cuda"
    cache_interval: int = 1
    """Step caching (``fastdiff.models.step_cache``) in the eager and engine systems: a full U-Net forward every
    N-th step (1: off); torch.compile and diffusers run every step in full. Each row's ``extra`` says which."""
    plan: KernelPlan | None = None
    """The kernel plan the engine systems take (``--plan``; None: the shipped or cached one, else they tune)."""
    op_table: bool = True
    """On CUDA, each engine row's ``extra["op_table"]`` (``fastdiff.bench.ops``: every op's time, FLOPs, bytes and %
    of the ceilings, kernels per step), against ceilings measured once per run (the result's ``ceilings``)."""


@dataclass
class Row:
    system: str
    dtype: str
    ms_per_step: float | None = None
    s_per_image: float | None = None
    images_per_s: float | None = None
    time_to_ready_s: float | None = None
    peak_mem_mb: float | None = None
    energy_j_per_image: float | None = None
    avg_power_w: float | None = None
    psnr_db: float | None = None
    max_abs_diff: float | None = None
    notes: str = ""
    error: str | None = None
    extra: dict = field(default_factory=dict)


def seeded_model_factory(model: str, seed: int) -> Callable[[], nn.Module]:
    """A fresh fp32 CPU copy of ``model`` per call, the same random weights every time when the preset has none."""

    def make_model() -> nn.Module:
        torch.manual_seed(seed)
        return load_unet(model, device="cpu", dtype=torch.float32)

    return make_model


def build_system(
    name: str,
    make_model: Callable[[], nn.Module],
    device: torch.device,
    warmup_x: torch.Tensor,
    schedule: ScheduleConfig | None = None,
    cache_interval: int = 1,
    plan: KernelPlan | None = None,
) -> System:
    """The system ``name`` ("<kind>-<dtype>", e.g. "engine-fp16") on ``make_model()``'s weights (step caching every
    ``cache_interval`` steps where the system has it: eager and engine)."""
    kind, _, dtype_name = name.rpartition("-")
    if name == "engine-fp8":  # fp16 activations, e4m3 convs after each GroupNorm (fastdiff.engine.fp8)
        return EngineSystem(make_model, torch.float16, device, warmup_x, cache_interval, fp8=True, plan=plan)
    if dtype_name not in DTYPES:
        raise FastdiffError(f"unknown bench system {name!r}: choose from {', '.join(ALL_SYSTEMS + OPTIONAL_SYSTEMS)}")
    dtype = DTYPES[dtype_name]
    if kind == "eager":
        return EagerSystem(make_model, dtype, device, cache_interval)
    if kind in COMPILE_CONFIGS:
        return CompileSystem(make_model, dtype, device, warmup_x, config_name=kind)
    if kind == "diffusers":
        return DiffusersSystem(make_model, dtype, device, schedule)
    if kind == "diffusers+compile":
        return DiffusersSystem(make_model, dtype, device, schedule, compile_warmup=warmup_x)
    if kind == "engine":
        return EngineSystem(make_model, dtype, device, warmup_x, cache_interval, plan=plan)
    raise FastdiffError(f"unknown bench system {name!r}: choose from {', '.join(ALL_SYSTEMS + OPTIONAL_SYSTEMS)}")


def skip_reason(name: str, device: torch.device, model_class: str) -> str | None:
    """Why a system cannot run here (None if it can)."""
    if device.type != "cuda" and name not in ("eager-fp32", "diffusers-fp32"):
        return "needs CUDA"
    if device.type != "cuda" and name == "eager-fp16":
        return "fp16 on CPU is not a meaningful baseline"
    if name == "engine-fp8" and torch.cuda.get_device_capability(device)[0] < 9:
        return "fp8 convs need a Hopper-class GPU"
    if name.startswith("diffusers"):
        if model_class != "DDPMUNet":
            return "diffusers has no equivalent of this model"
        try:
            import diffusers  # noqa: F401
        except ImportError:
            return "diffusers not installed"
    if name.startswith("engine"):
        try:
            from fastdiff.engine import Engine  # noqa: F401
        except ImportError:
            return "engine not available"
    return None


def run_bench(cfg: BenchConfig) -> dict:
    """Measure every system of ``cfg.systems``; returns the JSON-ready result."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FastdiffError("bench on cuda asked for but no CUDA GPU is available (use --device cpu)")
    if cfg.timed_steps <= 0 or cfg.steps <= 0 or cfg.batch <= 0:
        raise FastdiffError("steps, timed steps and batch must be positive")
    check_cache_interval(cfg.cache_interval)
    probe = load_unet(cfg.model, device="cpu")
    model_class = type(probe).__name__
    random_weights = cfg.model in PRESETS and getattr(probe, "scheduler_config", None) is None
    schedule = ScheduleConfig.from_diffusers(getattr(probe, "scheduler_config", None))
    cfg_in = probe.config
    shape = (cfg_in.in_channels, cfg_in.sample_size, cfg_in.sample_size)
    del probe

    sampler = make_sampler(cfg.sampler, schedule, cfg.steps, device=device)
    q_sampler = make_sampler(cfg.quality_sampler, schedule, cfg.quality_steps, device=device)
    seeds = seed_tensor(range(cfg.seed, cfg.seed + cfg.batch), device)
    timed = min(cfg.timed_steps, cfg.steps)
    x_t = initial_noise(seeds, shape, device)

    meter = EnergyMeter(device.index or 0) if device.type == "cuda" else None
    idle_w = meter.idle_watts() if meter is not None and meter.available else None
    engines = [n for n in cfg.systems if n.startswith("engine") and skip_reason(n, device, model_class) is None]
    ceilings = measure_ceilings(device) if cfg.op_table and engines else None  # for the engine rows' op tables
    rows: list[Row] = []
    reference: torch.Tensor | None = None  # eager fp32: fastdiff's own loop
    diffusers_reference: torch.Tensor | None = None  # diffusers fp32: the scheduler users run, default options
    for name in cfg.systems:
        dtype_name = name.rpartition("-")[2]
        row = Row(system=name.rpartition("-")[0], dtype=dtype_name)
        reason = skip_reason(name, device, model_class)
        if reason is not None:
            row.error = f"skipped: {reason}"
            rows.append(row)
            log.info("%s: %s", name, row.error)
            continue
        try:
            system = build_system(
                name, seeded_model_factory(cfg.model, cfg.seed), device, x_t, schedule, cfg.cache_interval, cfg.plan
            )
            row.extra["cache_interval"] = system.cache_interval
            measure_system(row, system, cfg, device, sampler, q_sampler,
                           x_t, seeds, timed, meter, idle_w)  # fmt: skip
            if ceilings is not None and isinstance(system, EngineSystem):
                row.extra["op_table"] = measure_op_table(system, sampler, x_t, seeds, ceilings)
            final = row.extra.pop("final").clamp(-1, 1)
            row.error = nonfinite_message(final)  # its times stay in the JSON, but a broken image is no result
            if row.error is not None:
                log.warning("%s: %s", name, row.error)
            else:
                if name == "eager-fp32":
                    reference = final
                elif reference is not None:
                    row.psnr_db = float(psnr(final, reference).mean())
                    row.max_abs_diff = float((final - reference).abs().max())
                if name == "diffusers-fp32":
                    diffusers_reference = final
                elif diffusers_reference is not None:
                    row.extra["psnr_vs_diffusers_fp32_db"] = float(psnr(final, diffusers_reference).mean())
        except Exception as exc:  # a baseline that fails here is reported, not fatal
            log.exception("%s failed", name)
            row.error = error_line(exc)
            row.extra.pop("final", None)
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "schema": SCHEMA,
        "env": environment(),
        "config": {
            **asdict(cfg),
            "model_class": model_class,
            "random_weights": random_weights,
            "timed_steps": timed,
            "idle_watts": idle_w,
        },  # fmt: skip
        "ceilings": ceilings,
        "results": [asdict(r) for r in rows],
    }


def measure_energy(system, meter: EnergyMeter, x_t, seeds, sampler, timed: int, ms_step: float, seconds: float,
                   device: torch.device) -> int:  # fmt: skip
    """Run ``timed``-step loops for at least ``seconds`` (from the measured ``ms_step``) inside ``meter``; returns
    the steps run (``meter.joules``/``meter.seconds`` hold the window)."""
    runs = max(1, math.ceil(seconds * 1e3 / (ms_step * timed)))
    with meter:
        for _ in range(runs):
            system.run(x_t, seeds, sampler, timed)
        synchronize(device)
    return runs * timed


def measure_system(row, system, cfg, device, sampler, q_sampler, x_t, seeds, timed, meter, idle_w):
    """Fill ``row`` with time-to-ready, ms/step, memory, energy and the quality-run output (``extra["final"]``)."""
    row.notes = system.notes
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    system.prepare()
    synchronize(device)
    row.time_to_ready_s = time.perf_counter() - t0
    row.extra.update(system.facts)
    system.run(x_t, seeds, sampler, min(3, timed))  # warm-up (kernels compiled, caches hot)
    synchronize(device)
    times = [time_ms(lambda: system.run(x_t, seeds, sampler, timed), device) for _ in range(cfg.repeats)]
    ms_step = statistics.median(times) / timed
    row.ms_per_step = ms_step
    row.s_per_image = ms_step * cfg.steps / 1e3 / cfg.batch
    row.images_per_s = 1.0 / row.s_per_image
    if meter is not None and meter.available:
        steps_done = measure_energy(system, meter, x_t, seeds, sampler, timed, ms_step, cfg.energy_seconds, device)
        row.avg_power_w = meter.joules / meter.seconds
        row.energy_j_per_image = meter.joules / steps_done * cfg.steps / cfg.batch
        row.extra["energy_window_s"] = meter.seconds
        row.extra["idle_watts"] = idle_w
    row.extra["final"] = system.run(x_t, seeds, q_sampler, q_sampler.num_steps).float().cpu()
    if device.type == "cuda":
        row.peak_mem_mb = torch.cuda.max_memory_allocated() / 2**20


def measure_op_table(system: EngineSystem, sampler, x_t, seeds, ceilings: dict) -> dict:
    """The engine system's per-op table (``fastdiff.bench.ops.engine_op_table``), measured after the row's timings
    and peak memory so it changes neither; ``{"unavailable": error}`` if it fails (the row's numbers stand)."""
    try:
        return engine_op_table(system, sampler, x_t, seeds, ceilings)
    except Exception as exc:  # a diagnostic that fails is reported, not fatal to the row
        log.exception("the op table of %s failed", system.name)
        return {"unavailable": error_line(exc)}


def error_line(exc: Exception) -> str:
    """An exception as one line for the JSON: its type and the first line of its message (300 characters)."""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def result_path(result: dict, out_dir: Path, name: str | None = None) -> Path:
    cfg = result["config"]
    gpu = gpu_slug(result["env"]["gpu"])
    date = result["env"]["date"][:10]
    name = name or f"{cfg['model']}-b{cfg['batch']}-{cfg['sampler']}{cfg['steps']}"
    return out_dir / f"{name}-{gpu}-{date}.json"
