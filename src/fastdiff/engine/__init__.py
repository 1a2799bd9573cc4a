"""fastdiff.engine: fused model forwards over a planned arena, the whole sampling loop as replayed CUDA graphs.

``Engine.prepare(model, sampler, batch, dtype)`` builds (once per (batch, size, dtype)) the step model and (once
per sampler) the sampling loop; ``Engine.run(x_T, seeds)`` returns x_0 (fp32, unclamped). Text-conditioned
U-Nets take ``guided=True`` (the U-Net runs on [x; x] against [uncond; cond] text states, the fused sampler step
combines the halves) and ``Engine.run(..., context=, guidance=)``; ``Engine.decode(vae, latents)`` runs the VAE
decode as a second captured graph. Every family of :mod:`fastdiff.engine.lower` runs on
:class:`~fastdiff.engine.executor.FusedModel`; ``unet_impl="eager"`` (and any other model class) runs the model's
own forward in the engine dtype with channels-last memory, still inside the captured loop. ``cache_interval``
N > 1 (``Engine.prepare``) turns on step caching (``fastdiff.models.step_cache``): every N-th step a full U-Net
forward, the others its shallow path on the kept deep feature (see ``graph.py`` for how the graphs follow it).

The fused forward's parts: ``executor`` (``FusedModel``: memory plan, weights, binding, forward), ``impl`` (an
implementation as a value and its name), ``candidates`` (what each op may run and which kernels fit it), ``calls``
(the launch of an op on an implementation), ``tuning`` (the autotune and its cache), ``fusion`` (a conv and a
partner op in one launch: ``shortcut``, ``epilogue_norm``), ``weights`` (packing and streaming), ``plan`` (the arena),
``fp8``, ``ir`` and ``lower`` (the op list). Adding a fusion: see ``fastdiff.engine.executor``'s docstring.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from fastdiff.devices import normalize_device
from fastdiff.engine.compile_pool import precompile
from fastdiff.engine.executor import FusedModel
from fastdiff.engine.fp8 import fp8_unsupported
from fastdiff.engine.graph import CapturedForward, SamplingLoop, StepModel, channels_last_empty
from fastdiff.engine.kernel_plan import KernelPlan, cache_plan_path, find_entries, save_to_cache
from fastdiff.engine.lower import lowering_for, supports
from fastdiff.engine.tuning import tuning_cache_path
from fastdiff.engine.weights import WeightStreamer
from fastdiff.errors import FastdiffError
from fastdiff.models import step_cache
from fastdiff.samplers import Sampler
from fastdiff.samplers.noise import X_T_COUNTER, draw
from fastdiff.version import __version__

log = logging.getLogger(__name__)
T = TypeVar("T")

TUNE_MODES = ("auto", "off", "always")
"""``Engine(tune=)``: "auto" times the candidates of a forward no kernel plan holds (then caches its plan); "off"
runs each op's default implementation there instead (no timing, ready fastest, slower steps); "always" ignores
every plan and times (``fastdiff tune``)."""

DEFAULT_STEPS_PER_GRAPH = 1
"""Steps per captured graph (see graph.py): one, replayed once per step. On the H100 the whole 20-step loop in one
graph sampled no faster (SD 1.5 512^2: 130.7 ms a call either way; ddpm-cifar10 batch 1: 11.5 against 11.2 ms) and
took 0.7 s longer to capture, which every fresh process pays (``benchmarks/steps_per_graph.py``;
``benchmarks/results/steps-per-graph-*-h100-2026-11-28.json``). ``Engine(steps_per_graph=None)`` captures the
whole loop."""

__all__ = ["DEFAULT_STEPS_PER_GRAPH", "EagerStepModel", "Engine", "FusedModel", "SamplingLoop"]


class EagerStepModel:
    """A model's own forward in the engine dtype, channels-last, with t selected on the device per step (and the
    text states of ``set_context`` for text-conditioned models, ``context_shape`` [B, L, D]). With step caching, a
    full step copies the deep feature of ``fastdiff.models.step_cache.cached_forward`` into ``deep`` (a static
    buffer, so captured graphs can share it) and a shallow step reads it."""

    def __init__(
        self, model: nn.Module, dtype: torch.dtype, device: torch.device, context_shape: tuple | None = None
    ) -> None:
        self.model = copy.deepcopy(model).to(device=device, dtype=dtype, memory_format=torch.channels_last).eval()
        self.context = None if context_shape is None else torch.zeros(context_shape, dtype=dtype, device=device)
        self.deep: torch.Tensor | None = None  # allocated by the first full step (outside graph capture)

    def set_context(self, context: torch.Tensor) -> None:
        if self.context is None or tuple(context.shape) != tuple(self.context.shape):
            raise FastdiffError(f"text states {tuple(context.shape)} do not fit this step model")
        self.context.copy_(context)

    def bind_timesteps(self, timesteps: torch.Tensor) -> StepModel:
        def step(x_in: torch.Tensor, index: torch.Tensor, shallow: bool | None = None) -> torch.Tensor:
            """The model output; ``shallow`` None: no step caching (the model's own forward)."""
            t = timesteps.index_select(0, index)
            if shallow is None:
                return self.model(x_in, t) if self.context is None else self.model(x_in, t, self.context)
            if shallow and self.deep is None:
                raise FastdiffError("internal: a shallow step before any full one")
            out, deep = step_cache.cached_forward(self.model, x_in, t, self.deep if shallow else None, self.context)
            if not shallow:
                if self.deep is None:
                    self.deep = torch.empty_like(deep)
                self.deep.copy_(deep)
            return out

        return step


class GuidanceHalf:
    """The step model of a guided loop whose two halves run on two processes (guidance-parallel on the engine):
    ``inner`` is the U-Net at B rows; this rank runs half ``rank`` of the [x; x] input (0: the unconditional rows, 1:
    the conditional) against its half of the text states, and ``all_gather_into_tensor`` puts both halves' outputs
    into one [2B] buffer on both ranks, so the fused sampler step that follows (and the captured graph around it,
    where NCCL allows the capture) is the one-process loop's."""

    def __init__(self, inner: FusedModel | EagerStepModel, group: Any, rank: int) -> None:
        self.inner, self.group, self.rank = inner, group, rank
        self.out: torch.Tensor | None = None

    def set_context(self, context: torch.Tensor) -> None:
        half = context.shape[0] // 2
        self.inner.set_context(context[self.rank * half : (self.rank + 1) * half])

    def bind_timesteps(self, timesteps: torch.Tensor) -> StepModel:
        import torch.distributed as dist

        inner = self.inner.bind_timesteps(timesteps)

        def step(x_in: torch.Tensor, index: torch.Tensor, shallow: bool | None = None) -> torch.Tensor:
            half = x_in.shape[0] // 2
            mine = inner(x_in[self.rank * half : (self.rank + 1) * half], index)
            if self.out is None or self.out.shape[0] != 2 * half:  # allocated once, outside graph capture
                self.out = channels_last_empty((2 * half, *mine.shape[1:]), mine.dtype, mine.device)
            rows = mine.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1)  # N-major: ranks' blocks
            dist.all_gather_into_tensor(self.out.permute(0, 2, 3, 1), rows, group=self.group)
            return self.out

        return step


def on_own_device(method: Callable[..., T]) -> Callable[..., T]:
    """Run an Engine method with the engine's GPU as the current CUDA device: Triton launches, graph capture and
    replays go to the current device, so an engine on cuda:1 works whichever device is current."""

    @functools.wraps(method)
    def wrapper(self: Engine, *args: Any, **kwargs: Any) -> T:
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)

    return wrapper


def sample_size_of(model: nn.Module, size: tuple[int, int] | None = None) -> tuple[int, int]:
    """(H, W) of the model's samples: ``size`` if given, else the config's ``sample_size``."""
    if size is not None:
        return tuple(size)
    sample = model.config.sample_size
    return (sample, sample) if isinstance(sample, int) else tuple(sample)


def is_text_conditioned(model: nn.Module) -> bool:
    """Whether the model's forward takes text states (``cross_attention_dim`` in its config)."""
    return hasattr(model.config, "cross_attention_dim")


class Engine:
    """Prepared step models, sampling loops and decoders, cached per (model, batch, size, dtype) and sampler."""

    def __init__(
        self,
        device: torch.device | str = "cuda",
        unet_impl: str = "fused",
        conv_impl: str = "auto",
        attention_impl: str = "auto",
        steps_per_graph: int | None = DEFAULT_STEPS_PER_GRAPH,
        use_graphs: bool = True,
        fp8: bool = False,
        plan: KernelPlan | str | os.PathLike[str] | None = None,
        tune: str = "auto",
    ) -> None:
        self.device = normalize_device(device)
        if tune not in TUNE_MODES:
            raise FastdiffError(f"tune must be one of {', '.join(TUNE_MODES)}, got {tune!r}")
        self.plan = plan if isinstance(plan, KernelPlan) or plan is None else KernelPlan.load(plan)
        self.tune = tune
        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise FastdiffError("the engine needs a CUDA GPU (or TRITON_INTERPRET=1 for its CPU test mode)")
        if unet_impl not in ("fused", "eager"):
            raise FastdiffError(f"unet_impl must be 'fused' or 'eager', got {unet_impl!r}")
        if fp8 and (reason := fp8_unsupported(self.device, None, conv_impl)) is not None:
            raise FastdiffError(reason)
        self.unet_impl, self.conv_impl, self.attention_impl = unet_impl, conv_impl, attention_impl
        self.fp8 = fp8
        self.steps_per_graph, self.use_graphs = steps_per_graph, use_graphs
        self.step_models: dict[tuple, FusedModel | EagerStepModel] = {}
        self.loops: dict[tuple, tuple[Sampler, SamplingLoop, FusedModel | EagerStepModel]] = {}
        self.decoders: dict[tuple, tuple[FusedModel, CapturedForward]] = {}
        self.current: SamplingLoop | None = None
        self.current_step_model: FusedModel | EagerStepModel | None = None
        self.timings: dict[str, float] = {}
        self._models: dict[int, nn.Module] = {}  # caches are keyed by id(model): keep those models alive
        self.gpu = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        self.used_plan = KernelPlan(self.gpu)  # the entry of every fused forward built, as it ran
        self.plan_sources: dict[str, str] = {}  # by structure: "given", "shipped", "cache", "tuned" or "default"
        self._digests: dict[int, str] = {}  # id(FusedModel) -> its plan entry's digest
        self._last_decoder: FusedModel | None = None
        self.guidance_group: Any = None  # split_guidance's group (None: the default group)
        self.guidance_rank: int | None = None  # set by split_guidance: guided loops run one half per process

    def clear(self) -> None:
        """Drop every prepared step model, loop and decoder (their weights and arenas); the next calls rebuild."""
        self.step_models.clear()
        self.loops.clear()
        self.decoders.clear()
        self._models.clear()
        self.current = self.current_step_model = None

    def _fused(
        self, model: nn.Module, batch: int, dtype: torch.dtype, size: tuple[int, int] | None,
        context_tokens: int | None, role: str,
    ) -> FusedModel:  # fmt: skip
        """A FusedModel with its weights streamed in by a first forward, then autotuned (``timings`` gets
        ``<role>_first_forward_s`` and ``<role>_autotune_s``)."""
        t0 = time.perf_counter()
        fused = FusedModel(
            model, batch, dtype, self.device, self.conv_impl, self.attention_impl, WeightStreamer(self.device),
            size=size, context_tokens=context_tokens, fp8=self.fp8 and role == "step",
        )  # fmt: skip
        structure = fused.structure()
        label = f"{type(model).__name__} {role} batch {batch} {fused.height}x{fused.width} {dtype}".replace(
            "torch.", ""
        )
        x_in = channels_last_empty(fused.x_in_value.shape, dtype, self.device).normal_()
        source = self._apply_plan(fused, structure, label, x_in)
        if fused.context is not None:
            fused.context.normal_()
        fused.forward(x_in, torch.zeros(1, dtype=torch.int64, device=self.device))  # early-start forward
        fused.streamer.wait_all()
        self._sync()
        self.timings[f"{role}_first_forward_s"] = time.perf_counter() - t0
        self.timings.update({f"{role}_kernels_{k}": v for k, v in fused.compile_stats.items()})
        t1 = time.perf_counter()
        if source is None and self.tune != "off":
            fused.autotune(x_in)
            source = "tuned" if self.device.type == "cuda" else "default"
        else:
            fused.bind(x_in)
            fused.drop_unused_weights()
            source = source or "default"
        self._sync()
        self.timings[f"{role}_autotune_s"] = time.perf_counter() - t1
        self.timings[f"{role}_ops_timed"] = fused.ops_timed
        made_by = {"how": source, "fastdiff": __version__, "torch": torch.__version__}
        entry = fused.plan_entry(label, made_by)
        if source == "tuned":
            save_to_cache(self.gpu, structure, entry)
            log.info("tuned %s: its kernel plan is in %s", label, cache_plan_path(self.gpu))
        self.used_plan.add(structure, entry)
        self.plan_sources[structure] = source
        self._digests[id(fused)] = entry.digest()
        return fused

    def _apply_plan(self, fused: FusedModel, structure: str, label: str, x_in: torch.Tensor) -> str | None:
        """Take ``fused``'s implementations from a kernel plan (the given one, a shipped one, or the cache's) and
        say which; None where no plan holds this forward or the one that does cannot be used here (said in one
        log line): then the engine tunes (``tune="auto"``) or runs each op's default (``tune="off"``)."""
        if self.tune == "always":
            return None
        found = find_entries(self.gpu, structure, self.plan)
        if not found and self.plan is not None:
            log.warning("the kernel plan has no entry for %s on %s: %s", label, self.gpu,
                        "tuning it" if self.tune == "auto" else "default kernels")  # fmt: skip
        elif not found and self.tune == "auto" and self.device.type == "cuda":
            log.info("no kernel plan holds %s on %s: timing its kernels (minutes for a large model, once per "
                     "machine; fastdiff tune writes a plan to reuse)", label, self.gpu)  # fmt: skip
        for entry, source in found:
            why = fused.apply_plan(entry, x_in)
            if why is None:
                return source
            log.warning("the %s kernel plan for %s cannot be used (%s): %s", source, label, why,
                        "trying the next" if (entry, source) != found[-1] else
                        "tuning instead" if self.tune == "auto" else "default kernels")  # fmt: skip
        return None

    @property
    def plan_digest(self) -> str | None:
        """The kernel plan digest of what the last sampling run and decode ran (step model, then the decoder
        joined by "+"): equal digests, equal kernels. None before any fused forward."""
        models = (getattr(self.current_step_model, "inner", self.current_step_model), self._last_decoder)
        parts = [self._digests.get(id(m)) for m in models if m is not None]
        parts = [p for p in parts if p]
        return "+".join(parts) or None

    def split_guidance(self, group: Any = None) -> None:
        """Run the guided loops prepared from now on as one of the two processes of ``group`` (an initialised
        ``torch.distributed`` group; None: the default): this process's U-Net runs B rows, its guidance half, and
        the halves' outputs are gathered into the [2B] model output every step (:class:`GuidanceHalf`)."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) != 2:
            raise FastdiffError("the engine's guidance split needs an initialised torch.distributed group of 2")
        self.guidance_group, self.guidance_rank = group, dist.get_rank(group)
        self.loops.clear()  # loops prepared before hold whole guided batches

    def save_plan(self, path: str | os.PathLike[str]) -> Path:
        """Write the kernel plan this engine used (every fused forward built so far) to ``path``."""
        return self.used_plan.save(path)

    def step_model(
        self, model: nn.Module, batch: int, dtype: torch.dtype, size: tuple[int, int] | None = None,
        context_tokens: int | None = None,
    ) -> FusedModel | EagerStepModel:  # fmt: skip
        """The (cached) step model for ``model`` at (batch, size, dtype) (``batch`` counts the U-Net's rows:
        2x the images with guidance); the first build streams the weights."""
        size = sample_size_of(model, size)
        key = (id(model), batch, size, dtype, context_tokens)
        self._models[id(model)] = model
        if key not in self.step_models:
            t0 = time.perf_counter()
            if self.unet_impl == "fused" and supports(model):
                step: FusedModel | EagerStepModel = self._fused(model, batch, dtype, size, context_tokens, "step")
            else:
                context_shape = None
                if is_text_conditioned(model):
                    context_shape = (batch, context_tokens or 77, model.config.cross_attention_dim)
                step = EagerStepModel(model, dtype, self.device, context_shape)
            self._sync()
            self.timings["build_s"] = time.perf_counter() - t0
            self.step_models[key] = step
        return self.step_models[key]

    @torch.no_grad()
    @on_own_device
    def prepare(
        self, model: nn.Module, sampler: Sampler, batch: int, dtype: torch.dtype, *,
        size: tuple[int, int] | None = None, guided: bool = False, context_tokens: int | None = None,
        cache_interval: int = 1,
    ) -> SamplingLoop:  # fmt: skip
        """Build (or fetch) everything to sample ``batch`` images of ``size`` (default the model's) with
        ``sampler``; captures the first graph. ``guided``: classifier-free guidance (the U-Net runs on 2x batch);
        ``context_tokens``: the text length of a text-conditioned model (default 77); ``cache_interval``: step
        caching, a full U-Net forward every N steps (1: off). Loops with different intervals share the step
        model."""
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise FastdiffError(f"engine dtype must be fp16, bf16 or fp32, got {dtype}")
        cache_interval = step_cache.check(model, cache_interval)
        cfg = model.config
        if getattr(cfg, "out_channels", cfg.in_channels) != cfg.in_channels:
            raise FastdiffError(
                f"the model predicts {cfg.out_channels} channels for {cfg.in_channels}-channel samples: "
                "learned-variance outputs are not supported"
            )
        if guided and not is_text_conditioned(model):
            raise FastdiffError("classifier-free guidance needs a text-conditioned model")
        size = sample_size_of(model, size)
        key = (id(model), batch, size, dtype, guided, context_tokens, cache_interval, id(sampler))  # caller's sampler
        if key not in self.loops:
            caller_sampler = sampler
            sampler = sampler if sampler.coefs.device == self.device else sampler.to(self.device)
            split = guided and self.guidance_rank is not None
            step = self.step_model(model, batch * (2 if guided and not split else 1), dtype, size, context_tokens)
            if split:
                if cache_interval > 1:
                    raise FastdiffError("guidance-parallel runs every step in full: use cache_interval=1")
                step = GuidanceHalf(step, self.guidance_group, self.guidance_rank)
            t0 = time.perf_counter()
            loop = SamplingLoop(
                step.bind_timesteps(sampler.timesteps), sampler, (batch, cfg.in_channels, *size), dtype,
                self.device, self.steps_per_graph, self.use_graphs, guided=guided, cache_interval=cache_interval,
            )  # fmt: skip
            if loop.use_graphs:
                guidance = torch.ones(batch, device=self.device) if guided else None
                x_t = torch.randn(loop.shape, device=self.device)
                seeds = torch.arange(batch, device=self.device)
                loop.load(x_t, seeds, guidance)
                # The kernels the first call compiles outside the model (x_T's noise, the fused sampler step),
                # compiled in workers; the recorded step moved the loop, so it is loaded again.
                noise = functools.partial(draw, seeds, X_T_COUNTER, loop.shape[1:])
                self.timings["loop_kernels"] = precompile([noise, loop.step], self.device.type).get("to_compile", 0)
                loop.load(x_t, seeds, guidance)
                loop.capture(loop.steps_per_graph)
                if rest := sampler.num_steps % loop.steps_per_graph:  # a whole run's last graph (step caching)
                    loop.capture(rest)
            self.timings["loop_s"] = time.perf_counter() - t0
            self.loops[key] = (caller_sampler, loop, step)  # the caller's sampler is kept so its id stays unique
        _, self.current, self.current_step_model = self.loops[key]
        return self.current

    @on_own_device
    def run(
        self, x_t: torch.Tensor, seeds: torch.Tensor, num_steps: int | None = None, *,
        context: torch.Tensor | None = None, guidance: torch.Tensor | None = None, scale: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """x after the prepared sampler's steps (default all) from unit-variance x_T, with step noise from
        ``seeds`` (int64 [B]); fp32 [B, C, H, W], unclamped. Text-conditioned models: ``context`` holds the
        text states [B or 2B, L, D] ([uncond; cond] with guidance) and ``guidance`` the scales [B];
        ``scale=False`` starts from an already scaled state (img2img)."""
        if self.current is None:
            raise FastdiffError("Engine.run before Engine.prepare")
        if context is not None:
            self.current_step_model.set_context(context.to(self.device, self.current.x_in.dtype))
        elif getattr(self.current_step_model, "context", None) is not None:
            raise FastdiffError("this model needs text states: pass context=")
        if guidance is not None:
            guidance = guidance.to(self.device, torch.float32)
        return self.current.run(x_t.to(self.device), seeds.to(self.device), num_steps, guidance, scale)

    def sample(
        self, model: nn.Module, sampler: Sampler, x_t: torch.Tensor, seeds: torch.Tensor, dtype: torch.dtype,
        cache_interval: int = 1,
    ) -> torch.Tensor:  # fmt: skip
        """prepare + run in one call."""
        self.prepare(model, sampler, x_t.shape[0], dtype, cache_interval=cache_interval)
        return self.run(x_t, seeds)

    @torch.no_grad()
    @on_own_device
    def decode(self, vae: nn.Module, latents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``vae.decode(latents / scaling_factor)`` on the fused engine, replayed as a CUDA graph (built and
        autotuned once per (batch, size, dtype)); fp32 images [B, 3, 8h, 8w], unclamped."""
        lowering_for(vae)  # a one-line error for a model without a fused decode
        b, _, h, w = latents.shape
        key = (id(vae), b, h, w, dtype)
        self._models[id(vae)] = vae
        if key not in self.decoders:
            t0 = time.perf_counter()
            fused = self._fused(vae, b, dtype, (h, w), None, "decoder")
            x_in = channels_last_empty(fused.x_in_value.shape, dtype, self.device)
            self.decoders[key] = (fused, CapturedForward(fused.forward_from_row, x_in, self.use_graphs))
            self.timings["decoder_build_s"] = time.perf_counter() - t0
        self._last_decoder = self.decoders[key][0]
        out = self.decoders[key][1].run(latents.to(self.device, dtype))
        return out.to(torch.float32, copy=True)  # the graph's output buffer is overwritten by the next decode

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def kernel_cache_state() -> str:
    """Whether the engine's time to ready starts "warm" (Triton's on-disk kernel cache and the engine's tuning
    cache both hold entries: no kernel compiles, no per-layer timing) or "cold"."""
    triton_dir = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    triton_warm = triton_dir.is_dir() and any(triton_dir.iterdir())
    return "warm" if triton_warm and tuning_cache_path().is_file() else "cold"
