"""``fastdiff bench --model sd15``: Stable Diffusion text-to-image, every system on the same weights, prompts
and initial latents, in one process and run.

Systems: diffusers' ``StableDiffusionPipeline`` (eager fp32 as the quality reference, eager fp16, and fp16 with
the U-Net ``torch.compile``d in "reduce-overhead" mode with channels-last memory), fastdiff's
``TextToImagePipeline`` eager fp16 and on the engine (fp16, bf16, and fp8: e4m3 after each norm). The sampler is DDIM
(diffusers' ``DDIMScheduler.from_config`` of the release's scheduler config, as users switch to it) with
classifier-free guidance, so one image is a U-Net call on a batch of 2 per step.

Per system: time to ready (weights to the GPU, compilation / engine build, first image), the end-to-end time of
one call (text encoding, all steps, VAE decode, to a [0, 1] tensor) as the median of ``repeats``, the time of one
U-Net step (diffusers and fastdiff eager: one U-Net call on the guided batch; the engine: a full captured loop
divided by its steps, so its figure includes the fused sampler step), the peak GPU memory while ready and while
sampling, the weight bytes on the GPU, and the PSNR of the images against diffusers fp32 from the same latents.
With ``cache_interval`` > 1 fastdiff's systems cache steps (``fastdiff.models.step_cache``: a full U-Net every N-th
step) while diffusers runs every step, so their PSNR also measures what the caching changes; the engine's per-step
time then averages full and shallow steps, the eager one stays one full U-Net call.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from fastdiff.bench.env import environment
from fastdiff.bench.ops import op_table, sampler_step_row, step_op_rows
from fastdiff.bench.roofline import measure_ceilings
from fastdiff.bench.runner import error_line
from fastdiff.cli_args import DEFAULT_GUIDANCE
from fastdiff.devices import DTYPES, synchronize, time_ms
from fastdiff.engine.kernel_plan import KernelPlan
from fastdiff.errors import FastdiffError
from fastdiff.kernels.fp8 import fp8_supported
from fastdiff.models.clip_text import to_transformers
from fastdiff.models.clip_tokenizer import to_transformers as tokenizer_to_transformers
from fastdiff.models.stable_diffusion import (
    SD_PRESETS,
    StableDiffusionComponents,
    load_stable_diffusion,
    random_components,
)
from fastdiff.pipelines.base import FP8, nonfinite_message
from fastdiff.pipelines.text_to_image import is_text_to_image_dir, vae_scale_factor
from fastdiff.quality.psnr import psnr
from fastdiff.samplers import check_cache_interval, initial_noise, seed_tensor

log = logging.getLogger(__name__)

SCHEMA = "fastdiff.bench.text_to_image/1"
T2I_SYSTEMS = ("engine-fp16", "eager-fp16", "diffusers-fp16", "diffusers-fp32", "diffusers+compile-fp16",
               "engine-bf16", "engine-fp8")  # fmt: skip
T2I_KINDS = ("diffusers", "diffusers+compile", "eager", "engine")
PROMPT = "a photograph of an astronaut riding a horse"


@dataclass
class TextToImageBenchConfig:
    model: str = "sd15"
    """A Stable Diffusion preset (random weights), a bundled text-to-image preset or a pipeline directory."""
    batch: int = 1
    """Images per call (prompts); the U-Net sees twice as many rows with guidance."""
    height: int | None = None
    """Image height (default: the model's, 512 for sd15)."""
    width: int | None = None
    steps: int = 20
    guidance: float = DEFAULT_GUIDANCE
    repeats: int = 5
    unet_calls: int = 20
    """U-Net calls timed per repeat for the per-step figure."""
    systems: tuple[str, ...] = T2I_SYSTEMS
    seed: int = 0
    device: str = "cuda"
    plan: KernelPlan | None = None
    """The kernel plan the engine systems take (None: the shipped or cached one, else they tune)."""
    cache_interval: int = 1
    """Step caching (``fastdiff.models.step_cache``) in fastdiff's systems: a full U-Net forward every N-th step
    (1: off); diffusers runs every step in full. Each row's ``extra`` says which."""


@dataclass
class T2IRow:
    system: str
    dtype: str
    time_to_ready_s: float | None = None
    end_to_end_ms: float | None = None
    unet_step_ms: float | None = None
    peak_ready_mib: float | None = None
    peak_sampling_mib: float | None = None
    weights_mib: float | None = None
    psnr_vs_diffusers_fp32_db: float | None = None
    notes: str = ""
    error: str | None = None
    extra: dict = field(default_factory=dict)


def diffusers_config(config: object) -> dict:
    """A fastdiff model config dataclass as the config dict diffusers' ``from_config`` takes (same field names)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()}


def module_mib(*modules: torch.nn.Module) -> float:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters()) / 2**20


class DiffusersT2I:
    """diffusers' StableDiffusionPipeline on copies of the components (U-Net optionally compiled)."""

    def __init__(self, comps: StableDiffusionComponents, dtype: torch.dtype, device: torch.device, compiled: bool):
        self.comps, self.dtype, self.device, self.compiled = comps, dtype, device, compiled
        self.notes = "DDIMScheduler.from_config(release config), default attention processor (SDPA)"
        if compiled:
            self.notes += "; U-Net torch.compile(mode='reduce-overhead', fullgraph=True), channels_last"

    def prepare(self) -> None:
        import diffusers

        comps = self.comps
        with torch.device("meta"):  # no random initialisation: the weights are the given ones, as from_pretrained
            unet = diffusers.UNet2DConditionModel.from_config(diffusers_config(comps.unet.config))
            vae = diffusers.AutoencoderKL.from_config(diffusers_config(comps.vae.config))
        unet.load_state_dict(comps.unet.state_dict(), assign=True)
        vae.load_state_dict(comps.vae.state_dict(), assign=True)
        scheduler = diffusers.DDIMScheduler.from_config(comps.scheduler_config)
        text_encoder, tokenizer = to_transformers(comps.text_encoder), tokenizer_to_transformers(comps.tokenizer)
        self.pipe = diffusers.StableDiffusionPipeline(
            vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        ).to(self.device, self.dtype)  # fmt: skip
        self.pipe.set_progress_bar_config(disable=True)
        self.weights_mib = module_mib(self.pipe.unet, self.pipe.vae, self.pipe.text_encoder)
        if self.compiled:
            self.pipe.unet.to(memory_format=torch.channels_last)
            self.pipe.unet = torch.compile(self.pipe.unet, mode="reduce-overhead", fullgraph=True)

    def generate(self, prompts: list[str], latents: torch.Tensor, cfg: TextToImageBenchConfig) -> torch.Tensor:
        return self.pipe(
            prompts, height=cfg.height, width=cfg.width, num_inference_steps=cfg.steps,
            guidance_scale=cfg.guidance, latents=latents.to(self.device, self.dtype), output_type="pt",
        ).images.float()  # fmt: skip

    def unet_call(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> None:
        self.pipe.unet(x, t, encoder_hidden_states=context)


class FastdiffT2I:
    """fastdiff's TextToImagePipeline (eager or engine) on copies of the components."""

    def __init__(
        self, comps: StableDiffusionComponents, dtype: torch.dtype, device: torch.device, backend: str,
        plan: KernelPlan | None = None, fp8: bool = False,
    ) -> None:  # fmt: skip
        self.comps, self.dtype, self.device, self.backend, self.plan = comps, dtype, device, backend, plan
        self.fp8 = fp8
        self.notes = "DDIM (equal to DDIMScheduler), one U-Net call on [x; x] per step, fused guidance"
        if backend == "engine":
            self.notes += "; engine: U-Net loop in CUDA graphs, VAE decode in a second graph"
        if fp8:
            self.notes += "; U-Net convs and token GEMMs after each norm in e4m3, fp16 elsewhere (fp8=True)"

    def prepare(self) -> None:
        from fastdiff.pipelines.text_to_image import TextToImagePipeline

        comps = copy.copy(self.comps)
        comps.text_encoder = copy.deepcopy(comps.text_encoder).to(self.device, self.dtype)
        comps.vae = copy.deepcopy(comps.vae).to(self.device, self.dtype)
        # the engine streams the U-Net's weights from the host copy (packing them on the GPU); eager needs it there
        comps.unet = copy.deepcopy(comps.unet).to(self.device if self.backend == "eager" else "cpu", self.dtype)
        self.pipe = TextToImagePipeline(
            comps, sampler="ddim", steps=20, device=self.device, dtype=self.dtype, backend=self.backend, plan=self.plan,
            fp8=self.fp8,
        )  # fmt: skip

    def generate(self, prompts: list[str], latents: torch.Tensor, cfg: TextToImageBenchConfig) -> torch.Tensor:
        return self.pipe(
            prompts, guidance_scale=cfg.guidance, height=cfg.height, width=cfg.width, latents=latents,
            steps=cfg.steps, output_type="pt", progress=False, cache_interval=cfg.cache_interval,
        ).float()  # fmt: skip

    @property
    def weights_mib(self) -> float:
        on_gpu = [self.pipe.vae, self.pipe.components.text_encoder]
        mib = module_mib(*on_gpu)
        if self.backend == "eager":
            return mib + module_mib(self.pipe.unet)
        engine = self.pipe.engine
        fused = [*engine.step_models.values(), *(f for f, _ in engine.decoders.values())]
        return mib + sum(f.weight_bytes() for f in fused) / 2**20

    def unet_call(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> None:
        self.pipe.unet(x, t, context)


def run_text_to_image_bench(cfg: TextToImageBenchConfig, on_row: Callable[[dict], None] | None = None) -> dict:
    """Measure every system of ``cfg.systems`` (see the module docstring); returns the JSON-ready result.
    ``on_row(result so far)`` is called after each system (to save partial results of a long run)."""
    random_weights = cfg.model in SD_PRESETS
    if not random_weights and not is_text_to_image_dir(cfg.model):
        raise FastdiffError(
            f"unknown Stable Diffusion preset {cfg.model!r}: choose one of {', '.join(SD_PRESETS)}, a bundled "
            "text-to-image preset or a diffusers pipeline directory"
        )
    for name in cfg.systems:
        kind, _, dtype_name = name.rpartition("-")
        if kind not in T2I_KINDS or dtype_name not in (*DTYPES, FP8):
            raise FastdiffError(f"unknown system {name!r}: <kind>-<dtype> with kind one of {', '.join(T2I_KINDS)}")
        if dtype_name == FP8 and kind != "engine":
            raise FastdiffError(f"unknown system {name!r}: fp8 runs on the engine only (engine-fp8)")
    check_cache_interval(cfg.cache_interval)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FastdiffError("bench on cuda asked for but no CUDA GPU is available")
    comps = random_components(cfg.model, cfg.seed, device) if random_weights else load_stable_diffusion(cfg.model)
    scale = vae_scale_factor(comps.vae.config)
    size = comps.unet.config.sample_size
    default_h, default_w = (size, size) if isinstance(size, int) else size
    cfg = dataclasses.replace(cfg, height=cfg.height or default_h * scale, width=cfg.width or default_w * scale)
    prompts = [PROMPT] * cfg.batch
    seeds = seed_tensor(range(cfg.seed, cfg.seed + cfg.batch), device)
    latent_shape = (comps.unet.config.in_channels, cfg.height // scale, cfg.width // scale)
    latents = initial_noise(seeds, latent_shape, device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    guided = cfg.guidance > 1
    unet_rows = (2 if guided else 1) * cfg.batch
    text_dim, tokens = comps.unet.config.cross_attention_dim, comps.tokenizer.model_max_length
    rows: list[T2IRow] = []
    images: dict[str, torch.Tensor] = {}
    engines = any(name.startswith("engine-") for name in cfg.systems)
    ceilings = measure_ceilings(device) if device.type == "cuda" and engines else None  # for the op tables
    result = {
        "schema": SCHEMA,
        "env": environment(),
        "config": {**asdict(cfg), "random_weights": random_weights, "sampler": "ddim", "prompt": PROMPT},
        "ceilings": ceilings,
        "results": [],
    }
    for name in cfg.systems:
        kind, _, dtype_name = name.rpartition("-")
        dtype = torch.float16 if dtype_name == FP8 else DTYPES[dtype_name]
        row = T2IRow(system=kind, dtype=dtype_name)
        row.extra["cache_interval"] = 1 if kind.startswith("diffusers") else cfg.cache_interval
        try:
            if kind.startswith("diffusers"):
                system: DiffusersT2I | FastdiffT2I = DiffusersT2I(comps, dtype, device, compiled="compile" in kind)
            else:
                if dtype_name == FP8 and (reason := fp8_supported(device)) is not None:
                    raise FastdiffError(reason)
                system = FastdiffT2I(comps, dtype, device, backend=kind, plan=cfg.plan, fp8=dtype_name == FP8)
            images[name] = measure_calls(row, system, cfg, prompts, latents, device).cpu()
            row.unet_step_ms = unet_step_ms(system, cfg, unet_rows, latent_shape, text_dim, tokens, gen, device)
            if kind == "engine" and ceilings is not None:
                row.extra.update(engine_facts(system, ceilings))
            row.error = nonfinite_message(images[name])  # its times are kept in the JSON, but it is no result
        except Exception as exc:  # a system that fails is reported, not fatal
            log.exception("%s failed", name)
            row.error = error_line(exc)
        rows.append(row)
        system = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        finite = {f"{r.system}-{r.dtype}" for r in rows if r.error is None}  # a broken image is no reference either
        reference = images.get("diffusers-fp32") if "diffusers-fp32" in finite else None
        for done in rows:
            key = f"{done.system}-{done.dtype}"
            if reference is not None and key in images and key in finite and key != "diffusers-fp32":
                done.psnr_vs_diffusers_fp32_db = float(psnr(images[key], reference, data_range=1.0).mean())
        result["results"] = [asdict(r) for r in rows]
        if on_row is not None:
            on_row(result)
    return result


def measure_calls(
    row: T2IRow, system: DiffusersT2I | FastdiffT2I, cfg: TextToImageBenchConfig, prompts: list[str],
    latents: torch.Tensor, device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """Fill ``row``'s ready time, end-to-end times and memory; returns the first call's images."""
    row.notes = system.notes
    cuda = device.type == "cuda"
    synchronize(device)
    if isinstance(system, FastdiffT2I) and system.backend == "engine":
        from fastdiff.engine import kernel_cache_state

        row.extra["kernel_cache"] = kernel_cache_state()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        row.extra["allocated_before_mib"] = torch.cuda.memory_allocated() / 2**20  # left by earlier systems
    t0 = time.perf_counter()
    system.prepare()
    images = system.generate(prompts, latents, cfg)
    synchronize(device)
    row.time_to_ready_s = time.perf_counter() - t0
    row.peak_ready_mib = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    row.weights_mib = system.weights_mib
    system.generate(prompts, latents, cfg)  # warm-up (compiled graphs recorded, caches hot)
    synchronize(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = [time_ms(lambda: system.generate(prompts, latents, cfg), device) for _ in range(cfg.repeats)]
    row.peak_sampling_mib = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    row.end_to_end_ms = statistics.median(times)
    row.extra["end_to_end_ms_all"] = times
    return images


def unet_step_ms(system, cfg, rows, latent_shape, text_dim, tokens, gen, device) -> float:
    """Median ms of one U-Net step: one call on the guided batch (diffusers, fastdiff eager), or a whole captured
    loop over its steps (the engine: U-Net + fused sampler step per step)."""
    if isinstance(system, FastdiffT2I) and system.backend == "engine":
        engine = system.pipe.engine
        loop = engine.current
        x_t = torch.randn(loop.shape, device=device, generator=gen)
        seeds = torch.arange(loop.shape[0], device=device)
        guidance = torch.full((loop.shape[0],), cfg.guidance, device=device) if loop.guided else None

        def run_loop() -> None:  # the prepared loop with the context already set by the last call
            loop.run(x_t, seeds, None, guidance)

        run_loop()
        times = [time_ms(run_loop, device) / loop.sampler.num_steps for _ in range(cfg.repeats)]
        return statistics.median(times)
    dtype = system.dtype
    x = torch.randn((rows, *latent_shape), device=device, generator=gen).to(dtype)
    context = torch.randn((rows, tokens, text_dim), device=device, generator=gen).to(dtype)
    t = torch.tensor([500] * rows, device=device)

    def calls() -> None:
        for _ in range(cfg.unet_calls):
            system.unet_call(x, t, context)

    with torch.no_grad():
        calls()
        synchronize(device)
        times = [time_ms(calls, device) / cfg.unet_calls for _ in range(cfg.repeats)]
    return statistics.median(times)


def engine_facts(system: FastdiffT2I, ceilings: dict) -> dict:
    """Build timings, kernel counts per step and the activation arenas of the engine system, and the op table of
    one step (``fastdiff.bench.ops.op_table`` under the run's ``ceilings``: the U-Net's ops, then the fused sampler
    step; each op's % of the ceiling that bounds it, and the step's roofline floor)."""
    engine = system.pipe.engine
    facts: dict = {f"engine_{k}": v for k, v in engine.timings.items()}
    unet = engine.current_step_model
    facts["unet_ops_per_step"] = len(unet.step_ops)
    facts["unet_context_ops"] = len(unet.context_ops)
    facts["unet_arena_mib"] = unet.plan.peak_bytes / 2**20
    facts["unet_weights_mib"] = unet.weight_bytes() / 2**20
    for fused, _ in engine.decoders.values():
        facts["vae_decoder_arena_mib"] = fused.plan.peak_bytes / 2**20
        facts["vae_decoder_weights_mib"] = fused.weight_bytes() / 2**20
    impls: dict[str, dict[str, int]] = {}
    for op in unet.ops:
        name = unet.impls[op.name].name
        impls.setdefault(op.kind, {}).setdefault(name, 0)
        impls[op.kind][name] += 1
    facts["unet_impls"] = impls
    rows = [*step_op_rows(unet), sampler_step_row(unet, engine.current)]
    facts["op_table"] = {
        "step": "one step: the U-Net's ops (on [x; x] with guidance) in model order, then the fused sampler step",
        "method": "us per call: a CUDA graph of repeated launches of the op (launch overhead excluded); FLOPs and "
        "bytes: ideal counts (fastdiff.bench.counts); pct_of_ceiling: of the run's measured ceiling (top-level "
        "'ceilings') that bounds the op on the roofline; floor_ms_per_step: every op at that ceiling",
        **op_table(rows, ceilings),
    }
    return facts
