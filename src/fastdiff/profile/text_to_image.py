"""``fastdiff profile --model sd15|sd21|fashion-mnist-t2i|DIR``: one text-to-image model on each backend.

``run_text_profile(cfg, device)`` loads the model's components once (fp32, host memory: the random-weight Stable
Diffusion presets from ``SD_PRESETS``, the bundled or a directory's real ones) and then, per backend, on copies of
them (``fastdiff.bench.text_to_image.FastdiffT2I``):

* eager: fastdiff's diffusers-equal modules in plain PyTorch (``TextToImagePipeline``, backend "eager");
* compile: the same with the U-Net under ``torch.compile`` (``bench.systems.COMPILE_CONFIGS["compile"]``, Inductor's
  CUDA-graph mode "reduce-overhead", as the unconditional profile's compile backend);
* engine: ``TextToImagePipeline`` with backend "engine" (U-Net loop in CUDA graphs, fused VAE decode);

measures:

1. load to first image: from the fp32 components in host memory to the first image's pixels on the device (copies
   in the model dtype, the engine's build and tuning, torch.compile's compilation), the first load and ``loads - 1``
   fresh ones more;
2. the end-to-end time of one image split into text encoder (each distinct text encoded alone, as the pipeline
   does: "" and the prompt with guidance), U-Net loop (every step: the U-Net on 2x the batch with guidance and the
   sampler step) and VAE decode, timed in one run (CUDA events between the phases, or perf_counter on the CPU);
   next to it, the pipeline's own call (its text states cached from the first call);
3. the U-Net step by op class (``fastdiff.bench.breakdown.profile_breakdown``) against the timed step (U-Net loop /
   steps); the counted kernels' achieved TFLOP/s and GB/s per class, GEMMs apart from convolutions, as % of the
   ceilings this command measures (``profile.kernels.class_rates``), and the roofline of the top kernels;
4. peak memory, weight bytes (text encoder, U-Net, VAE), NVML power and energy per image (CUDA).

The sampler runs at ``cfg.steps``; prompts, seeds and initial latents are the same on every backend.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from fastdiff.bench.breakdown import profile_breakdown, sampler_range
from fastdiff.bench.energy import EnergyMeter
from fastdiff.bench.env import environment
from fastdiff.bench.ops import sampler_step_row, step_op_rows
from fastdiff.bench.roofline import measure_ceilings
from fastdiff.bench.systems import COMPILE_CONFIGS, compile_model
from fastdiff.bench.text_to_image import FastdiffT2I
from fastdiff.devices import DTYPES, synchronize, time_ms
from fastdiff.engine import FusedModel
from fastdiff.engine.graph import SamplingLoop
from fastdiff.errors import FastdiffError
from fastdiff.kernels.cost_model import Cost
from fastdiff.models.stable_diffusion import (
    StableDiffusionComponents,
    encode_prompts,
    is_random_preset,
    load_stable_diffusion,
    random_components,
)
from fastdiff.pipelines.text_to_image import denoise, vae_scale_factor
from fastdiff.profile.config import ProfileConfig, elem_bytes, free
from fastdiff.profile.kernels import GEMM_KINDS, aten_kernel_rows, class_rates, kernel_row, roofline_section
from fastdiff.profile.tables import breakdown_lines, ceilings_line, fmt, mib, pct, roofline_lines
from fastdiff.samplers import Sampler, initial_noise, seed_tensor, step_noise

log = logging.getLogger(__name__)

SCHEMA = "fastdiff.profile.text_to_image/1"
PHASES = ("text_encoder", "unet_loop", "vae_decode")
COMPILE_CONFIG = "compile"
"""The ``COMPILE_CONFIGS`` entry of the compile backend (the unconditional profile's)."""
PROFILED_RUNS = {
    "engine": "the engine's loop step without graph capture (the same kernels its graph replays, launched from the "
    "host); idle = graph replay's step time minus the kernel sum",
    "compile": "the compiled U-Net as it runs (CUDA-graph replays: kernels classed by their Inductor names) and the "
    "sampler step",
    "eager": "the eager U-Net and sampler step as they run",
}


# ------------------------------------------------------------------------------------------------- a backend
class TextBackend:
    """One backend's ``TextToImagePipeline`` on copies of the host components, with the inputs of every image."""

    def __init__(self, name: str, comps: StableDiffusionComponents, cfg: ProfileConfig, device: torch.device) -> None:
        self.name, self.cfg, self.device = name, cfg, device
        self.dtype = DTYPES[cfg.dtype]
        self.system = FastdiffT2I(comps, self.dtype, device, backend="engine" if name == "engine" else "eager")
        self.notes = self.system.notes
        if name == "compile":
            self.notes += f"; U-Net {COMPILE_CONFIGS[COMPILE_CONFIG].notes}"
        self.prompts = [cfg.prompt] * cfg.batch
        self.seed_list = list(range(cfg.seed, cfg.seed + cfg.batch))
        self.guided = cfg.guidance > 1
        self.texts = ([""] * cfg.batch if self.guided else []) + self.prompts  # [uncond; cond], as the pipeline
        self.unet: nn.Module | None = None

    def _call_pipeline(self) -> torch.Tensor:
        cfg = self.cfg
        return self.pipe(
            self.prompts, guidance_scale=cfg.guidance, height=cfg.height, width=cfg.width, seeds=self.seed_list,
            steps=cfg.steps, sampler=cfg.sampler, output_type="pt", progress=False,
        )  # fmt: skip

    @torch.no_grad()
    def load(self) -> float:
        """Seconds from the host components to the first image's pixels on the device (``prepare`` + one call)."""
        synchronize(self.device)
        start = time.perf_counter()
        self.system.prepare()
        self.pipe = self.system.pipe
        if self.name == "compile":
            self.pipe.unet = compile_model(self.pipe.unet, COMPILE_CONFIGS[COMPILE_CONFIG])
        self._call_pipeline()
        synchronize(self.device)
        seconds = time.perf_counter() - start
        pipe = self.pipe
        self.unet = pipe.unet
        self.shape = pipe.latent_shape(self.cfg.height, self.cfg.width)
        self.sampler: Sampler = pipe.sampler_for(self.cfg.sampler, self.cfg.steps)  # the pipeline's (cached)
        self.seeds = seed_tensor(self.seed_list, self.device)
        self.noise = initial_noise(self.seed_list, self.shape, self.device).to(torch.float32)
        self.guidance = (
            torch.full((self.cfg.batch,), float(self.cfg.guidance), device=self.device) if self.guided else None
        )
        return seconds

    # the three phases of one image, as TextToImagePipeline.__call__ runs them
    def encode(self) -> torch.Tensor:
        """Text states [B or 2B, tokens, width]: each distinct text encoded alone (the pipeline's way)."""
        parts = self.pipe.components
        states = {
            text: encode_prompts(parts.text_encoder, parts.tokenizer, [text], self.device, check=False)
            for text in dict.fromkeys(self.texts)
        }
        return torch.cat([states[t] for t in self.texts])

    def denoise(self, context: torch.Tensor) -> torch.Tensor:
        x = self.noise * self.sampler.init_scale
        if self.name != "engine":
            return denoise(self.unet, self.sampler, x, context, self.guidance, self.seeds, self.dtype)
        engine = self.pipe.engine
        engine.prepare(self.unet, self.sampler, self.cfg.batch, self.dtype, size=self.shape[1:], guided=self.guided,
                       context_tokens=context.shape[1])  # fmt: skip
        return engine.run(x, self.seeds, context=context, guidance=self.guidance, scale=False)

    def decode(self, x0: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        if self.name == "engine":
            return self.pipe.engine.decode(vae, x0, self.dtype)
        return vae.decode((x0 / vae.config.scaling_factor).to(self.dtype)).float()

    @torch.no_grad()
    def image(self) -> dict[str, float]:
        """One batch of images, ms per phase (``PHASES``) and ``total``: CUDA events between the phases (GPU
        time, host gaps included), perf_counter on the CPU."""
        cuda = self.device.type == "cuda"

        def mark() -> Any:
            if not cuda:
                return time.perf_counter()
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event

        marks = [mark()]
        context = self.encode()
        marks.append(mark())
        x0 = self.denoise(context)
        marks.append(mark())
        self.decode(x0)
        marks.append(mark())
        if cuda:
            marks[-1].synchronize()
            ms = [a.elapsed_time(b) for a, b in zip(marks, marks[1:], strict=False)]
        else:
            ms = [(b - a) * 1e3 for a, b in zip(marks, marks[1:], strict=False)]
        return {**dict(zip(PHASES, ms, strict=True)), "total": sum(ms)}

    def pipeline_ms(self) -> float:
        """ms of one ``TextToImagePipeline`` call (its text states cached by the first call)."""
        synchronize(self.device)
        return time_ms(self._call_pipeline, self.device)

    # one U-Net step, for the profiler
    def step_fn(self, context: torch.Tensor) -> Callable[[], None]:
        """One sampling step per call (steps wrap around the sampler; the sampler step in ``sampler_range``)."""
        if self.name == "engine":
            return _engine_step(self.pipe.engine.current, self.noise, self.seeds, self.guidance)
        return _eager_step(self.unet, self.dtype, self.sampler, self.noise, self.seeds, context, self.guidance)


def _eager_step(unet, dtype, sampler: Sampler, x_t, seeds, context, guidance) -> Callable[[], None]:  # noqa: ANN001
    """One eager (or compiled) step per call: the U-Net on [x; x] with guidance, then the sampler step, as
    ``fastdiff.samplers.run_sampler`` runs them."""
    x = x_t * sampler.init_scale
    state: dict[str, Any] = {"x": x, "sampler": sampler.new_state(x), "i": 0}
    context = context.to(dtype)

    @torch.no_grad()
    def step() -> None:
        i = state["i"] % sampler.num_steps
        model_input = state["x"].to(dtype)
        if guidance is not None:
            model_input = torch.cat([model_input, model_input])
        out = unet(model_input, sampler.timesteps[i].expand(model_input.shape[0]), context).float()
        with sampler_range():
            noise = step_noise(seeds, i, tuple(x_t.shape[1:])) if sampler.noise_steps[i] else None
            state["x"] = sampler.step(i, state["x"], out, state["sampler"], noise, guidance=guidance)
        state["i"] += 1

    return step


def _engine_step(loop: SamplingLoop, x_t, seeds, guidance) -> Callable[[], None]:  # noqa: ANN001
    """One non-graph step of the engine's prepared loop per call (its text states as the last run left them),
    reloaded from x_T when it reaches the sampler's last step."""
    loop.load(x_t, seeds, guidance)

    @torch.no_grad()
    def step() -> None:
        if loop.position >= loop.sampler.num_steps:
            loop.load(x_t, seeds, guidance)
        loop.step()

    return step


def engine_rows(loop: SamplingLoop, fused: FusedModel) -> list[dict]:
    """Per-op rows of one engine step: every fused op of the U-Net (``bench.ops.step_op_rows``: its implementation
    timed in a CUDA graph of repeated launches, its cost from ``engine_op_cost``) and the fused sampler step with
    guidance (``bench.ops.sampler_step_row``). Needs CUDA."""
    rows = []
    for r in [*step_op_rows(fused), sampler_step_row(fused, loop)]:
        name = r["name"] if r["kind"] == "sampler_step" else f"{r['name']} ({r['kind']}, {r['impl']})"
        group = "gemm" if r["kind"] in GEMM_KINDS else r["class"]
        rows.append(kernel_row(name, r["class"], 1.0, r["us"], Cost(r["flops"], r["bytes"]), group))
    return rows


# ------------------------------------------------------------------------------------------------- the run
def load_components(cfg: ProfileConfig, device: torch.device) -> tuple[StableDiffusionComponents, bool]:
    """The fp32 host components (random weights, seeded, drawn on ``device``, for an SD preset) and whether the
    weights are random."""
    if is_random_preset(cfg.model):  # a local folder of that name wins, as everywhere
        return random_components(cfg.model, cfg.seed, device), True
    return load_stable_diffusion(cfg.model), False


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def run_text_profile(cfg: ProfileConfig, device: torch.device) -> dict:
    """Every measurement of a text-to-image report, as a JSON-ready dict (see the module docstring); ``cfg`` is
    resolved and checked (``profile.config.resolve_config``, ``validate``)."""
    log.info("loading %s", cfg.model)
    comps, random_weights = load_components(cfg, device)
    unet_cfg = comps.unet.config
    scale = vae_scale_factor(comps.vae.config)
    size = unet_cfg.sample_size
    default_h, default_w = (size, size) if isinstance(size, int) else tuple(size)
    height, width = cfg.height or default_h * scale, cfg.width or default_w * scale
    if height % scale or width % scale:
        raise FastdiffError(f"height and width must be multiples of the VAE's {scale}, got {height}x{width}")
    latent = (unet_cfg.in_channels, height // scale, width // scale)
    factor = 2 ** (len(unet_cfg.block_out_channels) - 1)
    if "engine" in cfg.backends and (latent[1] % factor or latent[2] % factor):
        raise FastdiffError(
            f"the engine needs image sides that are multiples of {factor * scale} for this model (got {height}x"
            f"{width}; other sizes run eagerly): choose --height/--width accordingly or leave engine out"
        )
    guided = cfg.guidance > 1
    dtype = DTYPES[cfg.dtype]
    params = {"text_encoder": _params(comps.text_encoder), "unet": _params(comps.unet), "vae": _params(comps.vae)}

    meter = EnergyMeter(device.index or 0) if device.type == "cuda" else None
    idle_w = meter.idle_watts(2.0) if meter is not None and meter.available else None  # before any GPU work
    log.info("measuring the ceilings of %s", device)
    ceilings = measure_ceilings(device)

    backends: dict[str, dict] = {}
    loads: dict[str, Any] = {"loads": cfg.loads, "modes": {}}
    for name in cfg.backends:
        log.info("profiling backend %s", name)
        backends[name], loads["modes"][name] = _profile_backend(name, comps, cfg, device, ceilings, meter, idle_w)
        free(device)
    return {
        "schema": SCHEMA,
        "env": environment(),
        "config": {
            **asdict(cfg),
            "backends": list(cfg.backends),
            "height": height,
            "width": width,
            "model_class": type(comps.unet).__name__,
            "parameters": sum(params.values()),
            "component_parameters": params,
            "random_weights": random_weights,
            "latent_shape": list(latent),
            "guided": guided,
            "unet_batch": cfg.batch * (2 if guided else 1),
            "text_tokens": comps.tokenizer.model_max_length,
            "cross_attention_dim": unet_cfg.cross_attention_dim,
            "elem_bytes": elem_bytes(dtype),
        },
        "ceilings": ceilings,
        "idle_watts": idle_w,
        "backends": backends,
        "load_to_first_image": loads,
    }


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run whose total is the median (the lower one of an even count): its phases add up to its total."""
    total = statistics.median_low(r["total"] for r in runs)
    return next(r for r in runs if r["total"] == total)


def _profile_backend(name, comps, cfg, device, ceilings, meter, idle_w) -> tuple[dict, dict]:  # noqa: ANN001
    cuda = device.type == "cuda"
    out: dict[str, Any] = {}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    backend = TextBackend(name, comps, cfg, device)
    first_s = backend.load()
    out["notes"] = backend.notes
    out["time_to_ready_s"] = first_s
    backend.image()  # warm-up: kernels compiled, graphs captured, the text encoder's first calls
    runs = [backend.image() for _ in range(cfg.repeats)]
    run = _median_run(runs)
    per_image = {f"{k}_ms": v / cfg.batch for k, v in run.items()}
    pipeline = [backend.pipeline_ms() for _ in range(cfg.repeats)]
    timer = "CUDA events" if cuda else "time.perf_counter"
    out["time_split"] = {
        **per_image,
        "batch_ms": run,
        "pipeline_call_ms_per_image": statistics.median(pipeline) / cfg.batch,
        "totals_ms": [r["total"] for r in runs],
        "method": f"the run of median total of {cfg.repeats} ({timer} between the phases), per image = per batch / "
        f"{cfg.batch}; the pipeline's call: median of {cfg.repeats}, its text states cached by its first call",
    }  # fmt: skip
    ms_step = run["unet_loop"] / cfg.steps
    out["latency"] = {
        "ms_per_step": ms_step, "s_per_image": run["total"] / cfg.batch / 1e3,
        "images_per_s": cfg.batch * 1e3 / run["total"], "ms_per_batch": run["total"],
        "method": f"{out['time_split']['method']}; ms/step = U-Net loop / {cfg.steps} steps (U-Net + sampler step)",
    }  # fmt: skip

    with torch.no_grad():
        context = backend.encode().to(backend.dtype)
    n_warm, n_prof = min(2, cfg.steps), min(3, cfg.steps)
    breakdown = profile_breakdown(backend.step_fn(context), device, steps=n_prof, warmup=n_warm)
    if cuda:  # idle = the timed (unprofiled) step minus the kernel sum
        breakdown["idle_ms"] = max(ms_step - breakdown["total_ms"], 0.0)
        breakdown["end_to_end_ms"] = ms_step
    else:  # CPU ops slow down under the profiler: shares are of the profiled step, idle as the profiler saw it
        breakdown["end_to_end_ms"] = breakdown["wall_ms"]
    breakdown["kernels_per_step"] = breakdown["kernels_seen"] / n_prof if cuda else None
    breakdown["profiled_run"] = PROFILED_RUNS[name]
    out["breakdown"] = breakdown

    rows, skipped = None, None
    if name == "eager":
        rows = aten_kernel_rows(backend.step_fn(context), device, elem_bytes(backend.dtype))
    elif name == "compile":
        skipped = "torch.compile's fused kernels carry no op shapes to count FLOPs and bytes from"
    else:
        fused = backend.pipe.engine.current_step_model
        if isinstance(fused, FusedModel) and cuda:
            rows = engine_rows(backend.pipe.engine.current, fused)
        else:
            skipped = "the engine runs this U-Net unfused" if cuda else "per-op engine timing needs CUDA"
    if rows is not None:
        out["class_rates"] = class_rates(rows, ceilings)
        out["roofline"] = roofline_section(rows, ceilings, cfg.top)
    else:
        out["class_rates"] = {"skipped": skipped}
        out["roofline"] = {"skipped": skipped}

    if meter is not None and meter.available:
        images = max(1, math.ceil(cfg.energy_seconds * 1e3 / run["total"]))
        with meter:
            for _ in range(images):
                backend.image()
            synchronize(device)
        per_image = 1 / (images * cfg.batch)
        out["energy"] = {
            "avg_power_w": meter.joules / meter.seconds, "idle_w": idle_w,
            "above_idle_w": meter.joules / meter.seconds - idle_w,
            "j_per_image": meter.joules * per_image,
            "j_per_image_above_idle": (meter.joules - idle_w * meter.seconds) * per_image,
            "window_s": meter.seconds, "batches": images,
            "method": "NVML total-energy counter over whole batches (text encoder, U-Net loop, VAE decode); idle = "
            "the same counter over 2 s before any work",
        }  # fmt: skip
    else:
        out["energy"] = {"skipped": "no NVML energy counter (CPU or NVML unavailable)"}
    out["memory"] = _memory(backend, device)
    del backend, context
    free(device)
    return out, _extra_loads(name, comps, cfg, device, first_s)


def _memory(backend: TextBackend, device: torch.device) -> dict:
    pipe, size = backend.pipe, elem_bytes(backend.dtype)
    parts = {"text_encoder": pipe.components.text_encoder, "unet": backend.unet, "vae": pipe.vae}
    component_bytes = {k: _params(m) * size for k, m in parts.items()}
    weights = int(backend.system.weights_mib * 2**20)  # what is on the device (the engine: its packed weights)
    result: dict[str, Any] = {"weight_bytes": weights, "component_weight_bytes": component_bytes}
    if device.type != "cuda":
        return {**result, "skipped": "peak memory is measured on CUDA only"}
    allocated = torch.cuda.max_memory_allocated(device)
    result.update({
        "peak_allocated_bytes": allocated,
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
        "activation_bytes": max(allocated - weights, 0),
        "method": "torch.cuda peak statistics over the load and all runs of this backend; weights = the modules and "
        "the engine's packed weights on the device; activations = peak allocated minus weights",
    })  # fmt: skip
    if backend.name == "engine":
        engine = pipe.engine
        step = engine.current_step_model
        if isinstance(step, FusedModel):
            result["plan_peak_bytes"] = step.plan.peak_bytes
        result["decoder_plan_bytes"] = sum(f.plan.peak_bytes for f, _ in engine.decoders.values())
    return result


def _extra_loads(name: str, comps, cfg: ProfileConfig, device: torch.device, first_s: float) -> dict:  # noqa: ANN001
    """Load to first image: the first load (timed above) and ``cfg.loads - 1`` fresh backends more."""
    times = [first_s]
    for _ in range(cfg.loads - 1):
        backend = TextBackend(name, comps, cfg, device)
        times.append(backend.load())
        del backend
        free(device)
    ms = [t * 1e3 for t in times]
    notes = {
        "eager": "a host copy of the fp32 components, copied to the device in the model dtype, then one pipeline call",
        "compile": "as eager, then torch.compile of the U-Net: compiled and its CUDA graphs recorded in the call",
        "engine": "a host copy of the fp32 components; text encoder and VAE copied, the U-Net streamed by the "
        "engine's early start, traced, tuned (or from a kernel plan: the first load tunes, later ones find its "
        "cache), its loop captured, the VAE decode fused, in the call",
    }
    return {"first_ms": ms[0], "best_ms": min(ms), "worst_ms": max(ms), "avg_ms": statistics.fmean(ms),
            "median_ms": statistics.median(ms), "all_ms": ms, "note": notes[name]}  # fmt: skip


# ------------------------------------------------------------------------------------------------- Markdown
def markdown_report(result: dict) -> str:
    """A text-to-image report as Markdown (charts linked by file name, as ``report.write_report`` writes them)."""
    cfg, env, ceil = result["config"], result["env"], result["ceilings"]
    b = result["backends"]
    names = list(b)
    parts = cfg["component_parameters"]
    guidance = f"guidance {cfg['guidance']:g}" + (" (U-Net on 2x the batch)" if cfg["guided"] else " (unguided)")
    lines = [
        f"# fastdiff profile: {cfg['model']} (text to image), batch {cfg['batch']}, {cfg['height']}x{cfg['width']}, "
        f"{cfg['sampler']} {cfg['steps']} steps, {cfg['dtype']}, {env['gpu']}",
        "",
        f"{cfg['model_class']} {parts['unet'] / 1e6:.1f} M, text encoder {parts['text_encoder'] / 1e6:.1f} M, "
        f"VAE {parts['vae'] / 1e6:.1f} M parameters"
        + (" (random weights: fine for speed, not for images)" if cfg["random_weights"] else "")
        + f"; latents {'x'.join(map(str, cfg['latent_shape']))}, {guidance}: U-Net batch {cfg['unet_batch']}, "
        f"{cfg['text_tokens']} text tokens; prompt {cfg['prompt']!r}. torch {env['torch']}, triton {env['triton']}, "
        f"driver {env['driver']}, CUDA {env['cuda']}, git {env['git_sha']}, {env['date']}.",
        "",
        ceilings_line(ceil),
        "",
        "## 1. End-to-end time per image",
        "",
        "ms per image (a batch's time / its images) and % of the image: the phases of one timed run.",
        "",
        "| backend | text encoder | U-Net loop | VAE decode | **total** | images/s | U-Net step ms | pipeline call |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in names:
        split, lat = b[n]["time_split"], b[n]["latency"]
        total = split["total_ms"]
        cells = [f"{split[f'{p}_ms']:.2f} ({100 * split[f'{p}_ms'] / total:.0f}%)" for p in PHASES]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | **{total:.2f}** | {lat['images_per_s']:.3g} | "
                     f"{lat['ms_per_step']:.3f} | {split['pipeline_call_ms_per_image']:.2f} |")  # fmt: skip
    lines += [
        "",
        f"Method: {b[names[0]]['time_split']['method']}. U-Net step = U-Net loop / {cfg['steps']} steps (the U-Net "
        "and the sampler step). The pipeline call skips the text encoder (cached texts).",
        "",
        "## 2. U-Net step by op class",
        "",
        "ms per step and % of the end-to-end step (whose remainder is idle: GPU launch gaps, or host time on the CPU). "
        "convolution includes the GEMMs (linear layers); section 3 splits them.",
        "",
        *breakdown_lines(b),
        "## 3. Achieved rates by op class",
        "",
        "The counted kernels of one U-Net step (section 6) per class: their FLOPs and bytes over their time, and % of "
        "the ceiling that bounds the class as a whole on the roofline (of the matmul peak if compute-bound, of the "
        "copy bandwidth if memory-bound).",
        "",
    ]
    for n in names:
        rates = b[n]["class_rates"]
        if "skipped" in rates:
            lines += [f"**{n}**: skipped: {rates['skipped']}.", ""]
            continue
        lines += [
            f"**{n}**",
            "",
            "| class | kernels (counted) | ms/step | counted ms | GFLOP | MB | TFLOP/s | GB/s | bound | % of bound |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|",
        ]
        for cls, r in rates.items():
            lines.append(
                f"| {cls} | {r['kernels']} ({r['kernels_counted']}) | {r['ms_per_step']:.4f} | "
                f"{r['counted_ms_per_step']:.4f} | {r['gflop_per_step']:.3g} | {r['mb_per_step']:.3g} | "
                f"{fmt(r['tflops'])} | {fmt(r['gbps'], '.0f')} | {r['bound'] or '–'} | {pct(r['pct_of_ceiling'])} |"
            )
        lines.append("")

    loads = result["load_to_first_image"]
    lines += [
        f"## 4. Load to first image ({loads['loads']} load{'s' if loads['loads'] != 1 else ''} per backend)",
        "",
        "| backend | first ms | best ms | worst ms | average ms | median ms | what runs |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for n, row in loads["modes"].items():
        lines.append(f"| {n} | {row['first_ms']:.0f} | {row['best_ms']:.0f} | {row['worst_ms']:.0f} | "
                     f"{row['avg_ms']:.0f} | {row['median_ms']:.0f} | {row['note']} |")  # fmt: skip
    lines += ["", "From the fp32 components in host memory to the first image's pixels on the device.", ""]

    lines += [
        "## 5. Memory, power and energy",
        "",
        "| backend | peak alloc MiB | peak reserved MiB | weights MiB | text / U-Net / VAE MiB | activations MiB "
        "| U-Net plan MiB | avg W | J/image | J/image above idle |",
        "|---|" + "---:|" * 9,
    ]
    for n in names:
        mem, en = b[n]["memory"], b[n]["energy"]
        comp = mem["component_weight_bytes"]
        lines.append(
            f"| {n} | {mib(mem.get('peak_allocated_bytes'))} | {mib(mem.get('peak_reserved_bytes'))} | "
            f"{mib(mem['weight_bytes'])} | {mib(comp['text_encoder'])} / {mib(comp['unet'])} / {mib(comp['vae'])} | "
            f"{mib(mem.get('activation_bytes'))} | {mib(mem.get('plan_peak_bytes'))} | "
            f"{fmt(en.get('avg_power_w'), '.0f')} | {fmt(en.get('j_per_image'))} | "
            f"{fmt(en.get('j_per_image_above_idle'))} |"
        )
    idle = result["idle_watts"]
    lines += [
        "",
        (f"Idle power {idle:.0f} W (measured before any work) is subtracted in the last column. " if idle else "")
        + "Weights: what the backend holds on the device (the engine: its packed U-Net and VAE weights too).",
        "",
        "## 6. Roofline of the U-Net step",
        "",
        *roofline_lines(b, class_key="group"),
    ]
    for n in names:
        lines.append(f"- {n}: {b[n]['notes']}.")
    lines.append("")
    return "\n".join(lines)


__all__ = ["SCHEMA", "TextBackend", "engine_rows", "markdown_report", "run_text_profile"]
