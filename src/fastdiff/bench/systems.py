"""The systems ``fastdiff bench`` compares, each with ``prepare()`` (timed as time-to-ready) and ``run()``.

All systems share the model weights and the seeds' unit-variance x_T. Ours use fastdiff's device-side samplers (step
noise drawn from the seeds); the diffusers systems use diffusers' own schedulers with their default options, as a
diffusers user would (stochastic steps draw diffusers' own noise). Step caching (``cache_interval`` > 1,
``fastdiff.models.step_cache``) applies to the eager and engine systems; torch.compile and diffusers run every step
in full.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from fastdiff.engine import DEFAULT_STEPS_PER_GRAPH, Engine, SamplingLoop, kernel_cache_state
from fastdiff.engine.kernel_plan import KernelPlan
from fastdiff.models import step_cache
from fastdiff.samplers import SAMPLER_SCHEDULERS, Sampler, ScheduleConfig, run_sampler

log = logging.getLogger(__name__)


class System:
    """One way to run the sampling loop. ``run(x_T, seeds, sampler, num_steps)`` runs steps 0..num_steps-1, with a
    full U-Net forward every ``cache_interval``-th step (step caching; 1: every step)."""

    name: str = ""
    notes: str = ""

    def __init__(self, dtype: torch.dtype, cache_interval: int = 1) -> None:
        self.dtype = dtype
        self.cache_interval = cache_interval
        self.facts: dict[str, object] = {}
        """What ``prepare()`` found out that the result should carry (copied into the row's ``extra``)."""

    def prepare(self) -> None:
        raise NotImplementedError

    def run(self, x_t: torch.Tensor, seeds: torch.Tensor, sampler: Sampler, num_steps: int) -> torch.Tensor:
        raise NotImplementedError


def cache_note(cache_interval: int) -> str:
    """The notes' words for step caching (empty without it)."""
    return f"step cache: full U-Net every {cache_interval} steps" if cache_interval > 1 else ""


class EagerSystem(System):
    """fastdiff's plain PyTorch model and sampler (fp32 is the reference of every quality number)."""

    def __init__(
        self, make_model: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device, cache_interval: int = 1
    ) -> None:
        super().__init__(dtype, cache_interval)
        self.make_model, self.device = make_model, device
        self.name = "eager"
        self.notes = cache_note(cache_interval)

    def prepare(self) -> None:
        self.model = self.make_model().to(device=self.device, dtype=self.dtype).eval()

    @torch.no_grad()
    def run(self, x_t, seeds, sampler, num_steps):
        model = self.model if self.cache_interval == 1 else partial(step_cache.cached_forward, self.model)
        x = x_t * sampler.init_scale
        return run_sampler(
            model, sampler, x, seeds, self.dtype, num_steps=num_steps, cache_interval=self.cache_interval
        )


@dataclass(frozen=True)
class CompileConfig:
    """One torch.compile configuration: a ``torch.compile`` mode plus extra Inductor options, and whether the model's
    weights are made channels-last before compiling (the inputs stay as the caller gives them)."""

    mode: str
    extra_options: tuple[tuple[str, object], ...] = ()
    channels_last: bool = False

    @property
    def options(self) -> dict[str, object]:
        """The Inductor options ``torch.compile(options=...)`` gets: the mode's own, then the extras."""
        import torch._inductor

        return {**torch._inductor.list_mode_options(self.mode), **dict(self.extra_options)}

    @property
    def notes(self) -> str:
        words = [f"torch.compile mode={self.mode}"] + [f"{k}={v}" for k, v in self.extra_options]
        return ", ".join(words + (["channels_last"] if self.channels_last else []))


COMPILE_CONFIGS = {
    "compile": CompileConfig("reduce-overhead"),
    "compile+autotune": CompileConfig("max-autotune"),
    "compile+freeze": CompileConfig("reduce-overhead", (("freezing", True),)),
    "compile+autotune+freeze": CompileConfig("max-autotune", (("freezing", True),)),
    "compile+autotune+freeze+cl": CompileConfig("max-autotune", (("freezing", True),), channels_last=True),
}
"""The torch.compile configurations ``fastdiff bench`` can compare (system ``<name>-<dtype>``): Inductor's CUDA-graph
modes, with max-autotune (Triton templates timed against cuDNN/cuBLAS per conv and matmul), Inductor's freezing
(weights folded in as constants) and channels-last weights. ``benchmarks/sweep_compile.py`` times all of them on a
model's forward. On torch 2.11 the frozen weights reach the CUDA graph as non-static inputs, copied into it on every
replay (Inductor's ``cudagraph_recorded_non_static_inputs`` counter, which the sweep records), so the ``+freeze``
forms time those copies as well as freezing."""


def compile_model(model: nn.Module, config: CompileConfig) -> nn.Module:
    """``model`` (on its device, eval) under torch.compile with ``config``; compiles on the first calls."""
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
    return torch.compile(model, options=config.options)


class CompileSystem(EagerSystem):
    """torch.compile of fastdiff's eager model in one of ``COMPILE_CONFIGS``; compilation (and max-autotune's
    timing) counts in time-to-ready. Every step in full (no step cache)."""

    def __init__(self, make_model, dtype, device, warmup_batch: torch.Tensor, config_name: str = "compile") -> None:
        super().__init__(make_model, dtype, device)
        self.name = config_name
        self.config = COMPILE_CONFIGS[config_name]
        self.notes = self.config.notes
        self.warmup_batch = warmup_batch

    def prepare(self) -> None:
        super().prepare()
        self.model = compile_model(self.model, self.config)
        t = torch.zeros(self.warmup_batch.shape[0], dtype=torch.long, device=self.device)
        with torch.no_grad():
            for _ in range(3):  # compile + CUDA-graph recording happen in these calls
                self.model(self.warmup_batch.to(self.dtype), t)
        torch.cuda.synchronize()


class DiffusersSystem(System):
    """diffusers' UNet2DModel with the same weights and its own scheduler (optionally torch.compile'd)."""

    def __init__(self, make_model, dtype, device, schedule: ScheduleConfig, compile_warmup=None) -> None:
        super().__init__(dtype)
        self.make_model, self.device, self.schedule = make_model, device, schedule
        self.compile_warmup = compile_warmup
        self.name = "diffusers+compile" if compile_warmup is not None else "diffusers"
        self.notes = "diffusers UNet2DModel + its scheduler" + (
            ", torch.compile mode=reduce-overhead" if compile_warmup is not None else ""
        )
        self._schedulers: dict[tuple[str, int], object] = {}

    def prepare(self) -> None:
        import diffusers

        ours = self.make_model()
        config = {k: v for k, v in vars(ours.config).items() if not k.startswith("_")}
        unet = diffusers.UNet2DModel(**config)
        unet.load_state_dict(ours.state_dict())
        self.unet = unet.to(device=self.device, dtype=self.dtype).eval()
        if self.compile_warmup is not None:
            self.unet = torch.compile(self.unet, mode="reduce-overhead")
            t = torch.zeros(self.compile_warmup.shape[0], dtype=torch.long, device=self.device)
            with torch.no_grad():
                for _ in range(3):
                    self.unet(self.compile_warmup.to(self.dtype), t)
            torch.cuda.synchronize()

    def scheduler(self, sampler: Sampler):
        """The diffusers scheduler ``sampler`` equals, built from the model's scheduler config as diffusers'
        ``from_config`` reads it (absent keys take that scheduler's defaults)."""
        import diffusers

        key = (sampler.name, sampler.num_steps)
        if key not in self._schedulers:
            options = {"algorithm_type": "sde-dpmsolver++"} if sampler.name == "dpmsolver++_sde" else {}
            cls = getattr(diffusers, SAMPLER_SCHEDULERS[sampler.name])
            sched = cls.from_config(self.schedule.to_diffusers(), **options)
            sched.set_timesteps(sampler.num_steps, device=self.device)
            self._schedulers[key] = sched
        return self._schedulers[key]

    @torch.no_grad()
    def run(self, x_t, seeds, sampler, num_steps):
        sched = self.scheduler(sampler)
        sched.set_timesteps(sampler.num_steps, device=self.device)  # resets multistep state
        x = (x_t * sched.init_noise_sigma).to(self.dtype)
        for t in sched.timesteps[:num_steps]:
            x = sched.step(self.unet(sched.scale_model_input(x, t), t).sample, t, x).prev_sample
        return x.float()


class EngineSystem(System):
    """The engine for ``fastdiff bench``: prepare() loads the model and, given a warm-up batch, builds the
    fused forward for its batch size (plan, weights, kernels, per-layer choice); the first run with a sampler
    captures that sampler's graph."""

    def __init__(
        self,
        make_model: Callable[[], nn.Module],
        dtype: torch.dtype,
        device: torch.device,
        warmup_batch: torch.Tensor | None = None,
        cache_interval: int = 1,
        fp8: bool = False,
        plan: KernelPlan | None = None,
    ) -> None:
        super().__init__(dtype, cache_interval)
        self.make_model, self.device, self.warmup_batch = make_model, torch.device(device), warmup_batch
        self.fp8, self.plan = fp8, plan
        self.name = "engine"
        per_graph = -(-DEFAULT_STEPS_PER_GRAPH // cache_interval) * cache_interval  # as SamplingLoop rounds it
        self.notes = f"fused kernels + planned buffers + CUDA graphs of {per_graph} step(s), replayed"
        if fp8:
            self.notes += "; e4m3 convs after each GroupNorm, fp16 elsewhere (fp8=True)"
        if cache_interval > 1:
            self.notes += f"; {cache_note(cache_interval)}"

    def prepare(self) -> None:
        cache = kernel_cache_state()
        self.model = self.make_model().eval()
        self.engine = Engine(self.device, fp8=self.fp8, plan=self.plan)
        if self.warmup_batch is not None:
            step = self.engine.step_model(self.model, self.warmup_batch.shape[0], self.dtype)
            if getattr(step, "ops_timed", 0):  # the files existed but not for these shapes: it timed and compiled
                cache = "cold"
        self.facts["kernel_cache"] = cache

    def loop(self, sampler: Sampler, batch: int) -> SamplingLoop:
        """The engine's loop for ``sampler`` at ``batch`` (built and its graph captured on first use), made current."""
        return self.engine.prepare(self.model, sampler, batch, self.dtype, cache_interval=self.cache_interval)

    @torch.no_grad()
    def run(self, x, seeds, sampler, num_steps):
        self.loop(sampler, x.shape[0])
        return self.engine.run(x, seeds, num_steps)
