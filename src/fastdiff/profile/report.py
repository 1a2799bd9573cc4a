"""``fastdiff profile``: the measurement tables of one model from one command.

``run_profile(cfg)`` measures, in one process, for each backend (engine, eager, compile on CUDA; eager on the
CPU) on the same model, weights, seeds and x_T:

1. the time of one step by op class (``profile.breakdown``) next to the end-to-end step time, whose remainder is
   GPU idle time (launch gaps) or, on the CPU, host time outside ops;
2. weight load to first step: best / worst / average over fresh loads, synchronous copy vs asynchronous copy
   (pinned, ``non_blocking``) vs the engine's early start (``engine.weights.WeightStreamer``);
3. latency, peak memory (allocated, reserved, the engine's memory plan), weights vs activation bytes, average
   power and energy per image from NVML's energy counter, idle power measured and subtracted;
4. a roofline: FLOPs and bytes counted from shapes (``bench.counts``) for every kernel of one step, its time,
   and the measured ceilings of the device (``profile.roofline.measure_ceilings``).

``write_report(result, out_dir)`` writes ``report.json``, ``report.md`` and the PNG charts, all or nothing.

A text-to-image model (``profile.config.is_text_model``: sd15, sd21, fashion-mnist-t2i, a pipeline directory) is
profiled by ``profile.text_to_image`` (its own schema and Markdown; the same charts).
"""

from __future__ import annotations

import copy
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fastdiff.atomic import write_folder_atomic
from fastdiff.bench.breakdown import plot_breakdown, profile_breakdown, sampler_range
from fastdiff.bench.counts import Cost
from fastdiff.bench.energy import EnergyMeter
from fastdiff.bench.env import environment
from fastdiff.bench.ops import sampler_step_row, step_op_rows
from fastdiff.bench.roofline import measure_ceilings, plot_roofline
from fastdiff.bench.runner import build_system, measure_energy, seeded_model_factory
from fastdiff.bench.systems import System
from fastdiff.devices import DTYPES, synchronize, time_ms
from fastdiff.models import PRESETS, load_unet
from fastdiff.profile import text_to_image
from fastdiff.profile.config import BACKENDS, ProfileConfig, is_text_model, resolve_config, validate
from fastdiff.profile.config import elem_bytes as _elem_bytes
from fastdiff.profile.config import free as _free
from fastdiff.profile.kernels import POINT_KEYS, aten_kernel_rows, kernel_row, roofline_section
from fastdiff.profile.tables import breakdown_lines, ceilings_line, fmt, mib, roofline_lines
from fastdiff.samplers import Sampler, ScheduleConfig, initial_noise, make_sampler, seed_tensor, step_noise

log = logging.getLogger(__name__)

SCHEMA = "fastdiff.profile/1"
LOAD_MODES = ("sync", "async", "early-start")
__all__ = ["BACKENDS", "POINT_KEYS", "SCHEMA", "ProfileConfig", "aten_kernel_rows", "markdown_report",
           "roofline_section", "run_profile", "validate", "write_report"]  # fmt: skip


# ------------------------------------------------------------------------------------------------- backends
def _eager_step(model: nn.Module, dtype: torch.dtype, sampler: Sampler, x_t, seeds) -> Callable[[], None]:
    """One step of eager/compiled sampling per call (steps wrap around the sampler), sampler in its range."""
    x = x_t * sampler.init_scale
    state: dict[str, Any] = {"x": x, "sampler": sampler.new_state(x), "i": 0}
    batch = x_t.shape[0]

    @torch.no_grad()
    def step() -> None:
        i = state["i"] % sampler.num_steps
        out = model(state["x"].to(dtype), sampler.timesteps[i].expand(batch)).float()
        with sampler_range():
            noise = step_noise(seeds, i, tuple(x_t.shape[1:])) if sampler.noise_steps[i] else None
            state["x"] = sampler.step(i, state["x"], out, state["sampler"], noise)
        state["i"] += 1

    return step


def _engine_step(system: System, x_t, seeds) -> Callable[[], None]:
    """One non-graph step of the engine's prepared loop per call: the kernels its graph replays, launched from the
    host so that the profiler sees their launching ops."""
    loop = system.engine.current
    loop.load(x_t, seeds)
    return torch.no_grad()(loop.step)


def _fused_model(system: System):
    return next(iter(system.engine.step_models.values()))


def engine_kernel_rows(system: System) -> list:
    """Per-op rows of one engine step: every fused op's time with its chosen implementation (CUDA graph of
    repeated launches, see ``FusedModel.time_ops``) and its cost from ``engine_op_cost``, plus the sampler
    update kernel (its cost from the kernel module: reads the state and the model output, writes the state);
    measured by :mod:`fastdiff.bench.ops`."""
    fused = _fused_model(system)
    rows = []
    for r in [*step_op_rows(fused), sampler_step_row(fused, system.engine.current)]:
        name = r["name"] if r["kind"] == "sampler_step" else f"{r['name']} ({r['kind']}, {r['impl']})"
        rows.append(kernel_row(name, r["class"], 1.0, r["us"], Cost(r["flops"], r["bytes"])))
    return rows


# --------------------------------------------------------------------------------------------- load to step
def measure_loads(make_model, batch: int, dtype: torch.dtype, device: torch.device, loads: int, x_in) -> dict:
    """Weight load to first step, ``loads`` fresh loads per mode, each from the same fp32 model in host memory to
    the end of one U-Net forward on the device (host preparation of the weights counted in every mode)."""
    source = make_model()
    t = torch.zeros(batch, dtype=torch.long, device=device)
    weight_bytes = sum(p.numel() for p in source.parameters()) * _elem_bytes(dtype)

    def sync_load(model: nn.Module) -> None:
        model.to(device=device, dtype=dtype)
        model(x_in.to(dtype), t)

    def async_load(model: nn.Module) -> None:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                host = tensor.data.to(dtype if tensor.is_floating_point() else tensor.dtype).pin_memory()
                tensor.data = host.to(device, non_blocking=True)
        model(x_in.to(dtype), t)

    def early_start(model: nn.Module) -> None:
        from fastdiff.engine import FusedModel
        from fastdiff.engine.graph import channels_last_empty
        from fastdiff.engine.weights import WeightStreamer

        fused = FusedModel(model, batch, dtype, device, streamer=WeightStreamer(device))
        x = channels_last_empty(tuple(x_in.shape), dtype, device)
        x.copy_(x_in)
        fused.forward(x, t[:1])
        fused.streamer.wait_all()

    modes = {"sync": sync_load, "async": async_load, "early-start": early_start}
    notes = {
        "sync": "model.to(device, dtype) (pageable, blocking), then the forward",
        "async": "each tensor cast, pinned and copied with non_blocking=True, the forward queued behind the copies",
        "early-start": "engine: trace + memory plan, weights staged, copied and packed per module on a side stream, "
        "each module's kernels waiting only on its own weights",
    }
    if device.type != "cuda":
        notes["sync"] = "on the CPU the weights stay where they are (to() copies nothing): the first forward alone"
    result: dict[str, Any] = {"loads": loads, "weight_bytes": weight_bytes, "modes": {}}
    for mode, load in modes.items():
        if device.type != "cuda" and mode != "sync":
            result["modes"][mode] = {"skipped": "needs CUDA"}
            continue
        times = []
        for _ in tqdm(range(loads), desc=f"load to first step ({mode})", leave=False):
            model = copy.deepcopy(source).eval()
            synchronize(device)
            start = time.perf_counter()
            with torch.no_grad():
                load(model)
            synchronize(device)
            times.append(time.perf_counter() - start)
            del model
            _free(device)
        result["modes"][mode] = {
            "best_ms": min(times) * 1e3, "worst_ms": max(times) * 1e3, "avg_ms": statistics.fmean(times) * 1e3,
            "median_ms": statistics.median(times) * 1e3, "note": notes[mode],
        }  # fmt: skip
    return result


# ------------------------------------------------------------------------------------------------- the run
def run_profile(cfg: ProfileConfig) -> dict:
    """Every measurement of the report, as a JSON-ready dict (see the module docstring; a text-to-image model's:
    ``profile.text_to_image.run_text_profile``). The configuration is resolved and checked before any loading."""
    cfg = resolve_config(cfg)
    device = validate(cfg)
    if is_text_model(cfg.model):
        return text_to_image.run_text_profile(cfg, device)
    dtype = DTYPES[cfg.dtype]
    probe = load_unet(cfg.model, device="cpu")
    schedule = ScheduleConfig.from_diffusers(getattr(probe, "scheduler_config", None))
    random_weights = cfg.model in PRESETS and getattr(probe, "scheduler_config", None) is None
    model_class, mc = type(probe).__name__, probe.config
    size = mc.sample_size
    shape = (mc.in_channels, *((size, size) if isinstance(size, int) else size))
    params = sum(p.numel() for p in probe.parameters())
    del probe

    make_model = seeded_model_factory(cfg.model, cfg.seed)  # the same random weights in every backend

    sampler = make_sampler(cfg.sampler, schedule, cfg.steps, device=device)
    timed = min(cfg.timed_steps, cfg.steps)
    seeds = seed_tensor(range(cfg.seed, cfg.seed + cfg.batch), device)
    x_t = initial_noise(seeds, shape, device)
    n_warm = min(2, timed - 1)
    n_prof = min(3, timed - n_warm)
    elem = _elem_bytes(dtype)
    meter = EnergyMeter(device.index or 0) if device.type == "cuda" else None
    idle_w = meter.idle_watts(2.0) if meter is not None and meter.available else None  # before any GPU work
    log.info("measuring the ceilings of %s", device)
    ceilings = measure_ceilings(device)

    backends: dict[str, dict] = {}
    for name in cfg.backends:
        log.info("profiling backend %s", name)
        backends[name] = _profile_backend(name, cfg, make_model, dtype, device, sampler, x_t, seeds, timed, n_warm,
                                          n_prof, elem, ceilings, meter, idle_w)  # fmt: skip
        _free(device)
    log.info("weight load to first step, %d fresh loads per mode", cfg.loads)
    loads = measure_loads(make_model, cfg.batch, dtype, device, cfg.loads, x_t)
    return {
        "schema": SCHEMA,
        "env": environment(),
        "config": {
            **asdict(cfg),
            "backends": list(cfg.backends),
            "model_class": model_class,
            "parameters": params,
            "random_weights": random_weights,
            "timed_steps": timed,
            "sample_shape": list(shape),
        },  # fmt: skip
        "ceilings": ceilings,
        "idle_watts": idle_w,
        "backends": backends,
        "load_to_first_step": loads,
    }


def _profile_backend(name, cfg, make_model, dtype, device, sampler, x_t, seeds, timed, n_warm, n_prof, elem,
                     ceilings, meter, idle_w) -> dict:  # fmt: skip
    out: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    system = build_system(f"{name}-{cfg.dtype}", make_model, device, x_t)
    start = time.perf_counter()
    system.prepare()
    synchronize(device)
    out["time_to_ready_s"] = time.perf_counter() - start
    out["notes"] = system.notes
    system.run(x_t, seeds, sampler, min(3, timed))  # warm-up: kernels compiled, graphs captured
    synchronize(device)
    times = [time_ms(lambda: system.run(x_t, seeds, sampler, timed), device) for _ in range(cfg.repeats)]
    ms_step = statistics.median(times) / timed
    timer = "CUDA events" if device.type == "cuda" else "time.perf_counter"
    out["latency"] = {
        "ms_per_step": ms_step, "s_per_image": ms_step * cfg.steps / 1e3 / cfg.batch,
        "images_per_s": cfg.batch * 1e3 / (ms_step * cfg.steps), "ms_per_sample_batch": ms_step * cfg.steps,
        "method": f"median of {cfg.repeats} runs of {timed} steps ({timer}), scaled to {cfg.steps} steps",
    }  # fmt: skip

    if name == "engine":
        run_step = _engine_step(system, x_t, seeds)
    else:
        run_step = _eager_step(system.model, dtype, sampler, x_t, seeds)
    breakdown = profile_breakdown(run_step, device, steps=n_prof, warmup=n_warm)
    if device.type == "cuda":  # idle = the timed (unprofiled) step minus the kernel sum
        breakdown["idle_ms"] = max(ms_step - breakdown["total_ms"], 0.0)
        breakdown["end_to_end_ms"] = ms_step
    else:  # CPU ops slow down under the profiler: shares are of the profiled step, idle as the profiler saw it
        breakdown["end_to_end_ms"] = breakdown["wall_ms"]
    breakdown["kernels_per_step"] = breakdown["kernels_seen"] / n_prof if device.type == "cuda" else None
    breakdown["profiled_run"] = {
        "engine": "the engine's step without graph capture (the same kernels its graph replays, launched from the "
        "host); idle = graph replay's step time minus the kernel sum",
        "compile": "the compiled model as it runs (CUDA-graph replays: kernels classed by their Inductor names)",
        "eager": "the eager model as it runs",
    }[name]
    out["breakdown"] = breakdown

    if name == "engine":
        rows = engine_kernel_rows(system)
    elif name == "eager":
        rows = aten_kernel_rows(_eager_step(system.model, dtype, sampler, x_t, seeds), device, elem)
    else:
        rows = None  # Inductor's fused kernels have no aten shapes to count from
    out["roofline"] = roofline_section(rows, ceilings, cfg.top) if rows is not None else {
        "skipped": "torch.compile's fused kernels carry no op shapes to count FLOPs and bytes from"}  # fmt: skip

    if meter is not None and meter.available:
        steps_done = measure_energy(system, meter, x_t, seeds, sampler, timed, ms_step, cfg.energy_seconds, device)
        per_image = cfg.steps / cfg.batch / steps_done
        out["energy"] = {
            "avg_power_w": meter.joules / meter.seconds, "idle_w": idle_w,
            "above_idle_w": meter.joules / meter.seconds - idle_w,
            "j_per_image": meter.joules * per_image,
            "j_per_image_above_idle": (meter.joules - idle_w * meter.seconds) * per_image,
            "window_s": meter.seconds,
            "method": "NVML total-energy counter over the window; idle = the same counter over 2 s before any work",
        }  # fmt: skip
    else:
        out["energy"] = {"skipped": "no NVML energy counter (CPU or NVML unavailable)"}
    out["memory"] = _memory(system, name, device, dtype)
    return out


def _memory(system: System, name: str, device: torch.device, dtype: torch.dtype) -> dict:
    model = system.model
    weights = sum(p.numel() for p in model.parameters()) * _elem_bytes(dtype)
    if device.type != "cuda":
        return {"weight_bytes": weights, "skipped": "peak memory is measured on CUDA only"}
    allocated = torch.cuda.max_memory_allocated(device)
    result = {
        "peak_allocated_bytes": allocated,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "weight_bytes": weights,
        "activation_bytes": max(allocated - weights, 0),
        "method": "torch.cuda peak statistics over prepare + all runs of this backend; activations = peak allocated "
        "minus weights (workspaces and graph pools included)",
    }
    if name == "engine":
        fused = _fused_model(system)
        result["plan_peak_bytes"] = fused.plan.peak_bytes
        result["method"] += "; plan = the engine's planned activation arena"
    return result


# ------------------------------------------------------------------------------------------------- writing
def markdown_report(result: dict) -> str:
    """The report as Markdown (tables of every section; charts linked by file name)."""
    if result.get("schema") == text_to_image.SCHEMA:
        return text_to_image.markdown_report(result)
    cfg, env, ceil = result["config"], result["env"], result["ceilings"]
    b = result["backends"]
    names = list(b)
    lines = [
        f"# fastdiff profile: {cfg['model']}, batch {cfg['batch']}, {cfg['sampler']} {cfg['steps']} steps, "
        f"{cfg['dtype']}, {env['gpu']}",
        "",
        f"{cfg['model_class']}, {cfg['parameters'] / 1e6:.1f} M parameters"
        + (" (random weights: fine for speed, not for images)" if cfg["random_weights"] else "")
        + f"; sample {'x'.join(map(str, cfg['sample_shape']))}. torch {env['torch']}, triton {env['triton']}, "
        f"driver {env['driver']}, CUDA {env['cuda']}, git {env['git_sha']}, {env['date']}.",
        "",
        ceilings_line(ceil),
        "",
        "## 1. Time per step by op class",
        "",
        "ms per step and % of the end-to-end step (whose remainder is idle: GPU launch gaps, or host time on the CPU).",
        "",
        *breakdown_lines(b),
    ]

    loads = result["load_to_first_step"]
    lines += [
        f"## 2. Weight load to first step ({loads['loads']} fresh loads per mode, "
        f"{loads['weight_bytes'] / 2**20:.1f} MiB of weights)",
        "",
        "| mode | best ms | worst ms | average ms | median ms | what runs |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for mode, row in loads["modes"].items():
        if "skipped" in row:
            lines.append(f"| {mode} | – | – | – | – | skipped: {row['skipped']} |")
        else:
            lines.append(f"| {mode} | {row['best_ms']:.1f} | {row['worst_ms']:.1f} | {row['avg_ms']:.1f} | "
                         f"{row['median_ms']:.1f} | {row['note']} |")  # fmt: skip
    lines += ["", "From the same fp32 model in host memory to the end of one U-Net forward on the device.", ""]

    lines += [
        "## 3. Latency, memory, power and energy",
        "",
        "| backend | ms/step | s/image | images/s | ready s | peak alloc MiB | peak reserved MiB | plan MiB "
        "| weights MiB | activations MiB | avg W | J/image | J/image above idle |",
        "|---|" + "---:|" * 12,
    ]
    for n in names:
        lat, mem, en = b[n]["latency"], b[n]["memory"], b[n]["energy"]
        lines.append(
            f"| {n} | {lat['ms_per_step']:.3f} | {lat['s_per_image']:.4g} | {lat['images_per_s']:.3g} | "
            f"{b[n]['time_to_ready_s']:.1f} | {mib(mem.get('peak_allocated_bytes'))} | "
            f"{mib(mem.get('peak_reserved_bytes'))} | {mib(mem.get('plan_peak_bytes'))} | "
            f"{mib(mem['weight_bytes'])} | "
            f"{mib(mem.get('activation_bytes'))} | {fmt(en.get('avg_power_w'), '.0f')} | "
            f"{fmt(en.get('j_per_image'))} | {fmt(en.get('j_per_image_above_idle'))} |"
        )
    idle = result["idle_watts"]
    lines += [
        "",
        (f"Idle power {idle:.0f} W (measured before any work) is subtracted in the last column. " if idle else "")
        + f"Latency: {b[names[0]]['latency']['method']}.",
        "",
        "## 4. Roofline",
        "",
    ]
    lines += roofline_lines(b)
    return "\n".join(lines)


def write_report(result: dict, out_dir: Path) -> list[Path]:
    """``report.json``, ``report.md``, ``breakdown.png`` and ``roofline-<backend>.png`` as the folder ``out_dir``,
    all or nothing (``fastdiff.atomic.write_folder_atomic``): a failure leaves nothing half-written."""

    def fill(tmp: Path) -> None:
        (tmp / "report.json").write_text(json.dumps(result, indent=1) + "\n")
        (tmp / "report.md").write_text(markdown_report(result))
        b = result["backends"]
        rows = {n: {**v["breakdown"]["per_class_ms"]} for n, v in b.items()}
        cfg = result["config"]
        title = f"{cfg['model']} b{cfg['batch']} {cfg['dtype']} on {result['env']['gpu']}: kernel time per step"
        plot_breakdown(rows, tmp / "breakdown.png", title)
        for n, v in b.items():
            if "skipped" not in v["roofline"] and v["roofline"]["points"]:
                title = f"{n}: {cfg['model']} b{cfg['batch']} {cfg['dtype']}, {result['env']['gpu']}"
                plot_roofline(v["roofline"]["points"], result["ceilings"], tmp / f"roofline-{n}.png", title)

    out_dir = write_folder_atomic(out_dir, fill)
    return sorted(out_dir.iterdir())
