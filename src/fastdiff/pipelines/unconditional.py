"""``Pipeline``: load a U-Net and a sampler, draw seeded noise, run the sampling loop, return images."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from fastdiff.devices import resolve_device, resolve_dtype, warn_slow_dtype
from fastdiff.engine.kernel_plan import KernelPlan
from fastdiff.errors import FastdiffError
from fastdiff.images import to_pil
from fastdiff.models import load_unet, step_cache
from fastdiff.pipelines.base import (
    DTYPE_NAMES,
    FP8,
    EnginePipeline,
    check_fp8,
    check_output_type,
    expand_seeds,
    load_plan,
    warn_if_nonfinite,
)
from fastdiff.samplers import Sampler, ScheduleConfig, initial_noise, make_sampler, run_sampler, seed_tensor

if TYPE_CHECKING:
    from fastdiff.pipelines.text_to_image import TextToImagePipeline

log = logging.getLogger(__name__)

OUTPUT_TYPES = ("pil", "np", "tensor")


class Pipeline(EnginePipeline):
    """A U-Net plus a sampler. ``pipe(batch_size=4, seeds=[...])`` returns images; see ``__call__``.

    The sampler state stays in fp32 whatever the model dtype; the model sees its own dtype.
    ``backend``: "engine" (fused kernels + CUDA graphs, ``fastdiff.engine``; the default on CUDA) or "eager"
    (the plain PyTorch loop; the default elsewhere). ``fp8``: the engine's fp8 mode, ``dtype`` (fp16 or bf16)
    activations with e4m3 convs after each GroupNorm (``fastdiff.engine.Engine(fp8=True)``); it needs a Hopper GPU
    (or Triton's CPU interpreter), the engine backend (the default with fp8) and a model the fused engine lowers,
    all checked here.
    """

    def __init__(
        self,
        unet: nn.Module,
        schedule: ScheduleConfig,
        sampler: str = "ddim",
        steps: int = 100,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        backend: str | None = None,
        karras: bool | None = None,
        fp8: bool = False,
        plan: KernelPlan | str | os.PathLike[str] | None = None,
        tune: str = "auto",
    ) -> None:
        if fp8:
            backend = check_fp8(torch.device(device), dtype, backend)
        super().__init__(device, backend, fp8, plan, tune)
        if fp8:
            from fastdiff.engine.lower import lowering_for

            lowering_for(unet)  # a one-line error for a model the fused engine cannot run (fp8 would do nothing)
        self.unet = unet
        self.schedule = schedule
        self.sampler_name = sampler
        self.karras = karras
        self.steps = steps
        self.dtype = dtype
        self._samplers: dict[float, Sampler] = {}
        self.sampler_for(0.0)  # validates sampler name and step count now, not at the first call

    @classmethod
    def from_pretrained(
        cls,
        path_or_preset: str | Path,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "fp32",
        sampler: str = "ddim",
        steps: int | None = None,
        backend: str | None = None,
        karras: bool | None = None,
        plan: KernelPlan | str | os.PathLike[str] | None = None,
        tune: str = "auto",
    ) -> Pipeline | TextToImagePipeline:
        """Load a preset name or a local diffusers/fastdiff model directory (default 100 steps).

        ``dtype``: "fp32", "fp16", "bf16" (or a torch dtype among those) or "fp8", the engine's fp8 mode (the
        U-Net loaded in fp16, ``fp8=True``; see ``Pipeline``), whose device and backend are checked before any
        loading. A diffusers pipeline directory (model_index.json: Stable Diffusion) gives a
        ``fastdiff.TextToImagePipeline`` instead (default 50 steps, as diffusers; fp8 there is its U-Net's).
        """
        from fastdiff.pipelines.text_to_image import TextToImagePipeline, is_text_to_image_dir

        if isinstance(dtype, str) and dtype not in DTYPE_NAMES:
            raise FastdiffError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_NAMES)}")
        fp8 = dtype == FP8
        if is_text_to_image_dir(path_or_preset):
            steps = 50 if steps is None else steps
            return TextToImagePipeline.from_pretrained(
                path_or_preset,
                device,
                dtype,
                sampler=sampler,
                steps=steps,
                karras=karras,
                backend=backend,
                plan=plan,
                tune=tune,
            )
        steps = 100 if steps is None else steps
        plan = load_plan(plan)  # a bad plan file fails before the weights load
        dev = resolve_device(device)
        torch_dtype = torch.float16 if fp8 else resolve_dtype(dtype)
        if fp8:
            backend = check_fp8(dev, torch_dtype, backend)  # before the weights load
        warn_slow_dtype(dev, torch_dtype)
        unet = load_unet(path_or_preset, device=dev, dtype=torch_dtype)
        schedule = ScheduleConfig.from_diffusers(getattr(unet, "scheduler_config", None))
        return cls(
            unet, schedule, sampler=sampler, steps=steps, device=dev, dtype=torch_dtype, backend=backend,
            karras=karras, fp8=fp8, plan=plan, tune=tune,
        )  # fmt: skip

    @property
    def sample_shape(self) -> tuple[int, int, int]:
        cfg = self.unet.config
        size = cfg.sample_size if isinstance(cfg.sample_size, int) else tuple(cfg.sample_size)
        h, w = (size, size) if isinstance(size, int) else size
        return (cfg.in_channels, h, w)

    def sampler_for(self, eta: float) -> Sampler:
        """The sampler for this pipeline's name/steps and ``eta`` (tables built once, then cached)."""
        if eta not in self._samplers:
            self._samplers[eta] = make_sampler(
                self.sampler_name, self.schedule, self.steps, eta=eta, device=self.device, karras=self.karras
            )
        return self._samplers[eta]

    @torch.no_grad()
    def __call__(
        self,
        batch_size: int = 1,
        seeds: int | Sequence[int] | None = None,
        latents: torch.Tensor | None = None,
        eta: float = 0.0,
        output_type: str = "pil",
        progress: bool = True,
        cache_interval: int = 1,
    ):
        """Sample ``batch_size`` images.

        seeds: one int per image, or one int ``s`` meaning ``s, s+1, ...``; default ``0..B-1``. Image b depends on
        ``seeds[b]`` only (not on the batch size). latents: an optional unit-variance x_T [B, C, H, W], scaled
        inside by the sampler's initial noise scale as diffusers pipelines do (step noise still comes from the
        seeds). output_type: "pil" (list of PIL images), "np" (float32 [B, H, W, C] in [0, 1]) or
        "tensor" ([B, C, H, W] in [-1, 1], on the pipeline's device). cache_interval: step caching
        (``fastdiff.models.step_cache``, DeepCache): a full U-Net forward every N-th step, the shallow path on its
        deep feature in between (1: off).
        """
        step_cache.check(self.unet, cache_interval)
        check_output_type(output_type, OUTPUT_TYPES)
        if batch_size <= 0:
            raise FastdiffError(f"batch size must be positive, got {batch_size}")
        seeds = expand_seeds(seeds, batch_size)
        sampler = self.sampler_for(eta)
        shape = self.sample_shape
        if latents is not None:
            if tuple(latents.shape) != (batch_size, *shape):
                raise FastdiffError(f"latents have shape {tuple(latents.shape)}, expected {(batch_size, *shape)}")
            x_t = latents.to(device=self.device, dtype=torch.float32)
        seed_ids = seed_tensor(seeds, self.device)
        if latents is None:
            x_t = initial_noise(seed_ids, shape, self.device)
        if self.backend == "engine":
            images = self.engine.sample(self.unet, sampler, x_t, seed_ids, self.dtype, cache_interval).clamp(-1, 1)
        else:
            images = sample_loop(self.unet, sampler, x_t, seed_ids, self.dtype, progress, cache_interval)
        if output_type == "tensor":  # (stays on the device, unsynchronised: the caller checks it if it wants)
            return images
        warn_if_nonfinite(images, self.backend, self.dtype)  # read on the host now anyway
        if output_type == "np":
            return ((images.float().cpu() + 1) / 2).permute(0, 2, 3, 1).numpy()
        return to_pil(images)


@torch.no_grad()
def sample_loop(
    unet: nn.Module,
    sampler: Sampler,
    x_t: torch.Tensor,
    seeds: torch.Tensor,
    model_dtype: torch.dtype,
    progress: bool = False,
    cache_interval: int = 1,
) -> torch.Tensor:
    """The eager reference loop from unit-variance x_T (``fastdiff.samplers.run_sampler``): fp32 sampler state,
    the model in ``model_dtype``, step noise drawn per step from ``seeds`` (int64 [B]); returns x_0 clamped to
    [-1, 1]. ``cache_interval`` N > 1: step caching (``fastdiff.models.step_cache.cached_forward``)."""
    cached = step_cache.check(unet, cache_interval) > 1
    model = partial(step_cache.cached_forward, unet) if cached else unet
    x = x_t.to(torch.float32) * sampler.init_scale
    x = run_sampler(model, sampler, x, seeds, model_dtype, progress=progress, cache_interval=cache_interval)
    return x.clamp(-1, 1)
