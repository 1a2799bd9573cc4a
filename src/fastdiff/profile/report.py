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
"""

from __future__ import annotations

import copy
import gc
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from tqdm.auto import tqdm

from fastdiff.atomic import write_folder_atomic
from fastdiff.bench.breakdown import OP_CLASSES, classify, plot_breakdown, profile_breakdown, sampler_range
from fastdiff.bench.counts import Cost, aten_op_cost
from fastdiff.bench.energy import EnergyMeter
from fastdiff.bench.env import environment
from fastdiff.bench.ops import sampler_step_row, step_op_rows
from fastdiff.bench.roofline import measure_ceilings, plot_roofline, roofline_point
from fastdiff.bench.runner import build_system, measure_energy, seeded_model_factory
from fastdiff.bench.systems import System
from fastdiff.devices import DTYPES, synchronize, time_ms
from fastdiff.errors import FastdiffError
from fastdiff.models import PRESETS, load_unet
from fastdiff.samplers import Sampler, ScheduleConfig, initial_noise, make_sampler, seed_tensor, step_noise

log = logging.getLogger(__name__)

SCHEMA = "fastdiff.profile/1"
BACKENDS = ("engine", "eager", "compile")
LOAD_MODES = ("sync", "async", "early-start")
POINT_KEYS = ("name", "class", "intensity", "tflops", "gbps", "bound", "seconds")
"""What report.json keeps of each roofline point (the top kernels keep everything)."""


@dataclass
class ProfileConfig:
    model: str = "ddpm-cifar10"
    batch: int = 1
    sampler: str = "ddpm"
    steps: int = 1000
    dtype: str = "fp16"
    device: str = "cuda"
    backends: tuple[str, ...] = BACKENDS
    loads: int = 20
    timed_steps: int = 20
    """Steps per timed run (every step of a loop costs the same); per-sample numbers scale it to ``steps``."""
    repeats: int = 3
    energy_seconds: float = 5.0
    seed: int = 0
    top: int = 10


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def validate(cfg: ProfileConfig) -> torch.device:
    """The device to profile on, after checking ``cfg`` (one-line :class:`FastdiffError` for bad input)."""
    if cfg.batch <= 0 or cfg.steps <= 0 or cfg.timed_steps <= 0 or cfg.repeats <= 0 or cfg.loads <= 0:
        raise FastdiffError("batch, steps, timed steps, repeats and loads must be positive")
    if cfg.dtype not in DTYPES:
        raise FastdiffError(f"unknown dtype {cfg.dtype!r}: choose from {', '.join(DTYPES)}")
    unknown = [b for b in cfg.backends if b not in BACKENDS]
    if unknown or not cfg.backends:
        raise FastdiffError(f"unknown backend {unknown[0] if unknown else ''!r}: choose from {', '.join(BACKENDS)}")
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FastdiffError("profile on cuda asked for but no CUDA GPU is available (use --device cpu)")
    if device.type == "cpu":
        if cfg.dtype != "fp32":
            raise FastdiffError(f"the CPU profile runs fp32 (got --dtype {cfg.dtype})")
        if any(b != "eager" for b in cfg.backends):
            raise FastdiffError("on the CPU only the eager backend is profiled (engine and compile need CUDA)")
    elif device.type != "cuda":
        raise FastdiffError(f"unsupported device {cfg.device!r}: use cpu or cuda")
    return device


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


# ------------------------------------------------------------------------------------------------- roofline
def _conv_out_hw(shapes: list, concrete: list) -> tuple[int, int] | None:
    """Output H, W of an ``aten::conv2d``/``aten::convolution`` event from its stride/padding/dilation arguments."""
    x, w = shapes[0], shapes[1]
    stride, padding, dilation = (concrete[i] if i < len(concrete) else None for i in (3, 4, 5))
    if not (isinstance(stride, list) and isinstance(padding, list) and isinstance(dilation, list)):
        return None
    return tuple((x[2 + d] + 2 * padding[d] - dilation[d] * (w[2 + d] - 1) - 1) // stride[d] + 1 for d in range(2))  # type: ignore[return-value]


def aten_kernel_rows(run_step: Callable[[], None], device: torch.device, elem_bytes: int, steps: int = 2) -> list:
    """Per-op (kernel) rows of one eager step: every outermost ``aten::`` op of a profiled step, grouped by name and
    input shapes, with its time (CUDA: device time of the kernels it launched; CPU: its CPU time incl. children)
    and its cost from :func:`aten_op_cost`; ops with no known cost are kept with ``cost`` None."""
    run_step()
    synchronize(device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            run_step()
        synchronize(device)
    groups: dict[tuple, dict] = {}
    for e in prof.events():
        if e.device_type != DeviceType.CPU or not e.name.startswith("aten::"):
            continue
        if e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"):
            continue  # counted by its outermost aten op
        us = e.device_time_total if cuda else e.cpu_time_total
        concrete = list(getattr(e, "concrete_inputs", None) or [])
        key = (e.name, repr(e.input_shapes), repr(concrete[3:6]) if "conv" in e.name else "")
        row = groups.setdefault(key, {"name": e.name, "shapes": e.input_shapes, "concrete": concrete, "us": 0.0})
        row["us"] += us
        row["n"] = row.get("n", 0) + 1
    rows = []
    for row in groups.values():
        out_shape = None
        if "conv" in row["name"] and len(row["shapes"]) >= 2 and len(row["shapes"][0]) == 4:
            hw = _conv_out_hw(row["shapes"], row["concrete"])
            out_shape = None if hw is None else [0, 0, *hw]
        cost = aten_op_cost(row["name"], row["shapes"], elem_bytes, out_shape)
        label = f"{row['name'].removeprefix('aten::')} {'x'.join(map(str, row['shapes'][0])) if row['shapes'] else ''}"
        rows.append(_kernel_row(label.strip(), classify(row["name"]), row["n"] / steps, row["us"] / row["n"], cost))
    return rows


def engine_kernel_rows(system: System) -> list:
    """Per-op rows of one engine step: every fused op's time with its chosen implementation (CUDA graph of
    repeated launches, see ``FusedModel.time_ops``) and its cost from ``engine_op_cost``, plus the sampler
    update kernel (its cost from the kernel module: reads the state and the model output, writes the state);
    measured by :mod:`fastdiff.bench.ops`."""
    fused = _fused_model(system)
    rows = []
    for r in [*step_op_rows(fused), sampler_step_row(fused, system.engine.current)]:
        name = r["name"] if r["kind"] == "sampler_step" else f"{r['name']} ({r['kind']}, {r['impl']})"
        rows.append(_kernel_row(name, r["class"], 1.0, r["us"], Cost(r["flops"], r["bytes"])))
    return rows


def _kernel_row(name: str, cls: str, calls: float, us_per_call: float, cost: Cost | None) -> dict:
    return {"name": name, "class": cls, "calls_per_step": calls, "us_per_call": us_per_call,
            "flops": None if cost is None else cost.flops, "bytes": None if cost is None else cost.bytes}  # fmt: skip


def roofline_section(rows: list[dict], ceilings: dict, top: int) -> dict:
    """Roofline points of every row with a counted cost and a positive time; the ``top`` costliest (by time per
    step) with their bound and % of it; and how much of the kernel time the counted rows cover."""
    points = []
    for row in rows:
        if row["flops"] is None or not row["us_per_call"] > 0 or not row["bytes"]:
            continue
        point = roofline_point(Cost(row["flops"], row["bytes"]), row["us_per_call"] / 1e6, ceilings)
        points.append({**row, **point, "ms_per_step": row["us_per_call"] * row["calls_per_step"] / 1e3})
    total_ms = sum(r["us_per_call"] * r["calls_per_step"] for r in rows) / 1e3
    counted_ms = sum(p["ms_per_step"] for p in points)
    points.sort(key=lambda p: -p["ms_per_step"])
    return {
        "kernels": len(rows),
        "kernels_counted": len(points),
        "kernel_ms_per_step": total_ms,
        "counted_ms_per_step": counted_ms,
        "top": points[:top],
        "points": [{k: p[k] for k in POINT_KEYS} for p in points],
    }


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
        "early-start": "engine: trace + memory plan, weights packed, pinned and copied per module on a side stream, "
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
    """Every measurement of the report, as a JSON-ready dict (see the module docstring)."""
    device = validate(cfg)
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
def _mib(n: float | None) -> str:
    return "–" if n is None else f"{n / 2**20:.1f}"


def _fmt(v: float | None, spec: str = ".3g") -> str:
    return "–" if v is None else format(v, spec)


def markdown_report(result: dict) -> str:
    """The report as Markdown (tables of every section; charts linked by file name)."""
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
        f"Measured ceilings (by this command): **{ceil['tflops']:.1f} TFLOP/s** ({ceil['matmul']} matmul), "
        f"**{ceil['gbps']:.0f} GB/s** (device copy of {ceil['copy_bytes'] / 2**20:.0f} MiB, read + write); "
        f"{ceil['method']}.",
        "",
        "## 1. Time per step by op class",
        "",
        "ms per step and % of the end-to-end step (whose remainder is idle: GPU launch gaps, or host time on the CPU).",
        "",
        "| class | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
    ]
    for cls in (*OP_CLASSES, "idle"):
        cells = []
        for n in names:
            bd = b[n]["breakdown"]
            ms = bd["idle_ms"] if cls == "idle" else bd["per_class_ms"][cls]
            cells.append(f"{ms:.3f} ({100 * ms / bd['end_to_end_ms']:.0f}%)")
        lines.append(f"| {cls} | " + " | ".join(cells) + " |")
    e2e = [f"**{b[n]['breakdown']['end_to_end_ms']:.3f}**" for n in names]
    lines.append("| **end-to-end step** | " + " | ".join(e2e) + " |")
    lines.append("| kernels per step | " + " | ".join(_fmt(b[n]["breakdown"]["kernels_per_step"], ".0f") for n in names)
                 + " |")  # fmt: skip
    lines += ["", "![breakdown](breakdown.png)", ""]
    for n in names:
        lines.append(f"- {n}: {b[n]['breakdown']['profiled_run']}.")
    lines += ["", f"Method: {b[names[0]]['breakdown']['method']}.", ""]

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
            f"{b[n]['time_to_ready_s']:.1f} | {_mib(mem.get('peak_allocated_bytes'))} | "
            f"{_mib(mem.get('peak_reserved_bytes'))} | {_mib(mem.get('plan_peak_bytes'))} | "
            f"{_mib(mem['weight_bytes'])} | "
            f"{_mib(mem.get('activation_bytes'))} | {_fmt(en.get('avg_power_w'), '.0f')} | "
            f"{_fmt(en.get('j_per_image'))} | {_fmt(en.get('j_per_image_above_idle'))} |"
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
    for n in names:
        roof = b[n]["roofline"]
        if "skipped" in roof:
            lines += [f"**{n}**: skipped: {roof['skipped']}.", ""]
            continue
        lines += [
            f"**{n}**: {roof['kernels_counted']} of {roof['kernels']} kernels counted, "
            f"{roof['counted_ms_per_step']:.3f} of {roof['kernel_ms_per_step']:.3f} ms per step. "
            f"![roofline {n}](roofline-{n}.png)",
            "",
            "| kernel | class | calls/step | ms/step | GFLOP | MB | FLOP/B | TFLOP/s | GB/s | bound | % of bound |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
        for p in roof["top"]:
            lines.append(
                f"| {p['name']} | {p['class']} | {p['calls_per_step']:.0f} | {p['ms_per_step']:.4f} | "
                f"{p['flops'] / 1e9:.3g} | {p['bytes'] / 1e6:.3g} | {p['intensity']:.3g} | {p['tflops']:.3g} | "
                f"{p['gbps']:.0f} | {p['bound']} | {p['pct_of_bound']:.0f}% |"
            )
        if any(p["pct_of_bound"] > 100 for p in roof["top"]):
            lines += ["Above 100%: the kernel beat the measured ceiling, so that matmul or copy is not this device's "
                      "true peak (common on CPUs, where the convolution library outruns torch.mm).", ""]  # fmt: skip
        lines.append("")
    lines += [
        "Counted FLOPs and bytes are ideal (each tensor read or written once; see fastdiff.bench.counts); time per "
        "kernel: the engine's ops each timed in a CUDA graph of repeated launches, eager ops from the profiler trace "
        "(device time of the kernels each launched, or CPU time on the CPU).",
        "",
    ]
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
