"""fastdiff.engine: fused U-Net forward over a planned arena, whole sampling loop as replayed CUDA graphs.

``Engine.prepare(model, sampler, batch, dtype)`` builds (once per (batch, dtype)) the step model and (once per
sampler) the sampling loop; ``Engine.run(x_T, seeds)`` returns x_0 (fp32, unclamped). DDPMUNet and ConvNeXtUNet
run on :class:`~fastdiff.engine.fused_unet.FusedUNet`; ``unet_impl="eager"`` (and any other model class) runs
the model's own forward in the engine dtype with channels-last memory, still inside the captured loop.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from fastdiff.devices import normalize_device
from fastdiff.engine.fused_unet import FusedUNet, tuning_cache_path
from fastdiff.engine.graph import SamplingLoop, StepModel, channels_last_empty
from fastdiff.engine.weights import WeightStreamer
from fastdiff.errors import FastdiffError
from fastdiff.models.convnext_unet import ConvNeXtUNet
from fastdiff.models.ddpm_unet import DDPMUNet
from fastdiff.samplers import Sampler

log = logging.getLogger(__name__)

DEFAULT_STEPS_PER_GRAPH = 50
"""Steps per captured graph (see graph.py); the GPU check script measures capture time and ms/step per K."""

__all__ = ["DEFAULT_STEPS_PER_GRAPH", "EagerStepModel", "Engine", "FusedUNet", "SamplingLoop"]


class EagerStepModel:
    """A model's own forward in the engine dtype, channels-last, with t selected on the device per step."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.model = copy.deepcopy(model).to(device=device, dtype=dtype, memory_format=torch.channels_last).eval()

    def bind_timesteps(self, timesteps: torch.Tensor) -> StepModel:
        def step(x_in: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            return self.model(x_in, timesteps.index_select(0, index))

        return step


def sample_shape_of(model: nn.Module, batch: int) -> tuple[int, int, int, int]:
    """[B, C, H, W] of the model's samples."""
    cfg = model.config
    size = cfg.sample_size
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    return (batch, cfg.in_channels, h, w)


class Engine:
    """Prepared step models and sampling loops, cached per (batch, dtype) and per sampler."""

    def __init__(
        self,
        device: torch.device | str = "cuda",
        unet_impl: str = "fused",
        conv_impl: str = "auto",
        attention_impl: str = "auto",
        steps_per_graph: int | None = DEFAULT_STEPS_PER_GRAPH,
        use_graphs: bool = True,
    ) -> None:
        self.device = normalize_device(device)
        if self.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise FastdiffError("the engine needs a CUDA GPU (or TRITON_INTERPRET=1 for its CPU test mode)")
        if unet_impl not in ("fused", "eager"):
            raise FastdiffError(f"unet_impl must be 'fused' or 'eager', got {unet_impl!r}")
        self.unet_impl, self.conv_impl, self.attention_impl = unet_impl, conv_impl, attention_impl
        self.steps_per_graph, self.use_graphs = steps_per_graph, use_graphs
        self.step_models: dict[tuple, FusedUNet | EagerStepModel] = {}
        self.loops: dict[tuple, tuple[Sampler, SamplingLoop]] = {}
        self.current: SamplingLoop | None = None
        self.timings: dict[str, float] = {}

    def step_model(self, model: nn.Module, batch: int, dtype: torch.dtype) -> FusedUNet | EagerStepModel:
        """The (cached) step model for ``model`` at (batch, dtype); the first build streams the weights."""
        key = (id(model), batch, dtype)
        if key not in self.step_models:
            t0 = time.perf_counter()
            if isinstance(model, DDPMUNet | ConvNeXtUNet) and self.unet_impl == "fused":
                fused = FusedUNet(
                    model, batch, dtype, self.device, self.conv_impl, self.attention_impl,
                    WeightStreamer(self.device),
                )  # fmt: skip
                x_in = channels_last_empty(sample_shape_of(model, batch), dtype, self.device).normal_()
                fused.forward(x_in, torch.zeros(1, dtype=torch.int64, device=self.device))  # early-start forward
                fused.streamer.wait_all()
                self._sync()
                self.timings["first_forward_s"] = time.perf_counter() - t0
                fused.autotune(x_in)
                step: FusedUNet | EagerStepModel = fused
            else:
                step = EagerStepModel(model, dtype, self.device)
            self._sync()
            self.timings["build_s"] = time.perf_counter() - t0
            self.step_models[key] = step
        return self.step_models[key]

    @torch.no_grad()
    def prepare(self, model: nn.Module, sampler: Sampler, batch: int, dtype: torch.dtype) -> SamplingLoop:
        """Build (or fetch) everything to sample ``batch`` images with ``sampler``; captures the first graph."""
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise FastdiffError(f"engine dtype must be fp16, bf16 or fp32, got {dtype}")
        cfg = model.config
        if getattr(cfg, "out_channels", cfg.in_channels) != cfg.in_channels:
            raise FastdiffError(
                f"the model predicts {cfg.out_channels} channels for {cfg.in_channels}-channel samples: "
                "learned-variance outputs are not supported"
            )
        key = (id(model), batch, dtype, id(sampler))  # the caller's sampler: a moved copy is made once, below
        if key not in self.loops:
            caller_sampler = sampler
            sampler = sampler if sampler.coefs.device == self.device else sampler.to(self.device)
            step = self.step_model(model, batch, dtype)
            t0 = time.perf_counter()
            loop = SamplingLoop(
                step.bind_timesteps(sampler.timesteps), sampler, sample_shape_of(model, batch), dtype,
                self.device, self.steps_per_graph, self.use_graphs,
            )  # fmt: skip
            if loop.use_graphs:
                loop.load(torch.randn(loop.shape, device=self.device), torch.arange(batch, device=self.device))
                loop.capture(loop.steps_per_graph)
            self.timings["loop_s"] = time.perf_counter() - t0
            self.loops[key] = (caller_sampler, loop)  # the caller's sampler is kept so its id stays unique
        self.current = self.loops[key][1]
        return self.current

    def run(self, x_t: torch.Tensor, seeds: torch.Tensor, num_steps: int | None = None) -> torch.Tensor:
        """x after the prepared sampler's steps (default all) from unit-variance x_T, with step noise from
        ``seeds`` (int64 [B]); fp32 [B, C, H, W], unclamped."""
        if self.current is None:
            raise FastdiffError("Engine.run before Engine.prepare")
        return self.current.run(x_t.to(self.device), seeds.to(self.device), num_steps)

    def sample(
        self, model: nn.Module, sampler: Sampler, x_t: torch.Tensor, seeds: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """prepare + run in one call."""
        self.prepare(model, sampler, x_t.shape[0], dtype)
        return self.run(x_t, seeds)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def kernel_cache_state() -> str:
    """Whether the engine's time to ready starts "warm" (Triton's on-disk kernel cache and the engine's tuning
    cache both hold entries: no kernel compiles, no per-layer timing) or "cold"."""
    triton_dir = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    triton_warm = triton_dir.is_dir() and any(triton_dir.iterdir())
    return "warm" if triton_warm and tuning_cache_path().is_file() else "cold"
