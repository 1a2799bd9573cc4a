"""The sampling loop as CUDA graphs: U-Net + fused sampler step + pre-generated noise, replayed.

Every step reads its step index from a device counter (``[1]`` int64): the model's time input, the noise slice
and the sampler's coefficient row are all selected on the device, and the counter is incremented at the end of
the step. So one captured graph of K steps is valid at any position of the loop, and an N-step run is
``N // K`` replays of the K-step graph plus one replay of an ``N % K``-step graph (both captured once, cached
by length, sharing one memory pool). ``steps_per_graph = N`` captures the whole loop unrolled in one graph.

The eager fallback (``use_graphs=False``, and always on the CPU) runs the very same step function without
capture, so graph replay and eager execution launch identical kernels.

Per step: cast x (fp32 state) into the model-dtype input buffer, the U-Net, select this step's noise (one
``index_select``), the fused ``sampler_step`` kernel updating x and x0 in place, ``counter += 1``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from fastdiff.engine.weights import normalize_device
from fastdiff.errors import FastdiffError
from fastdiff.kernels.sampler_step import sampler_step
from fastdiff.samplers import Sampler

log = logging.getLogger(__name__)

StepModel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(x_in [B, C, H, W] in the model dtype, channels-last; step index [1] int64 on the device) -> model output."""


def channels_last_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised logical [N, C, H, W] tensor in channels-last memory."""
    n, c, h, w = shape
    return torch.empty((n, h, w, c), dtype=dtype, device=device).permute(0, 3, 1, 2)


class SamplingLoop:
    """Static buffers and captured graphs for one (step model, sampler, batch, model dtype).

    ``run(x_T, noise, num_steps)`` runs steps ``0..num_steps-1`` and returns x (fp32, before the final clamp).
    """

    def __init__(
        self,
        step_model: StepModel,
        sampler: Sampler,
        sample_shape: tuple[int, int, int, int],
        dtype: torch.dtype,
        device: torch.device,
        steps_per_graph: int | None = None,
        use_graphs: bool = True,
    ) -> None:
        device = normalize_device(device)
        if sampler.coefs.device != device:
            raise FastdiffError(f"sampler tables are on {sampler.coefs.device}, the engine runs on {device}")
        self.step_model = step_model
        self.sampler = sampler
        self.device = device
        self.shape = sample_shape
        self.use_graphs = use_graphs and device.type == "cuda"
        n_steps = sampler.num_steps
        self.steps_per_graph = min(n_steps, steps_per_graph or n_steps)
        b, c, h, w = sample_shape
        self.x = channels_last_empty(sample_shape, torch.float32, device)
        self.x0 = channels_last_empty(sample_shape, torch.float32, device)
        self.x_in = channels_last_empty(sample_shape, dtype, device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        # Noise of step i at noise_nhwc[i]: [N, B, H, W, C] so every slice is laid out like x (channels-last).
        self.noise_nhwc = (
            torch.zeros((n_steps, b, h, w, c), dtype=torch.float32, device=device) if sampler.needs_noise else None
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds: dict[int, float] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def step(self) -> None:
        """One sampling step at the step index held by ``counter`` (device-side only: capturable)."""
        self.x_in.copy_(self.x)
        out = self.step_model(self.x_in, self.counter)
        noise = None
        if self.noise_nhwc is not None:
            b, c, h, w = self.shape
            noise = self.noise_nhwc.index_select(0, self.counter).view(b, h, w, c).permute(0, 3, 1, 2)
        sampler_step(
            self.x, out, self.x0, noise, self.sampler.coefs, self.counter, self.sampler.clip_range,
            out=(self.x, self.x0),
        )  # fmt: skip
        self.counter.add_(1)

    def load(self, x_t: torch.Tensor, noise: torch.Tensor | None, num_steps: int | None = None) -> None:
        """Copy x_T [B, C, H, W] and the noise of the first ``num_steps`` steps (default all; from ``noise``
        [>= num_steps, B, C, H, W], when the sampler uses noise) into place."""
        if tuple(x_t.shape) != self.shape:
            raise FastdiffError(f"x_T has shape {tuple(x_t.shape)}, the engine was prepared for {self.shape}")
        self.x.copy_(x_t)
        self.x0.zero_()  # read with coefficient E = 0 at step 0: must be finite
        self.counter.zero_()
        if self.noise_nhwc is not None:
            if noise is None:
                raise FastdiffError(f"sampler {self.sampler.name} adds noise: pass the step noise")
            steps = self.sampler.num_steps if num_steps is None else num_steps
            if noise.shape[0] < steps:
                raise FastdiffError(f"noise has {noise.shape[0]} steps, {steps} are run")
            self.noise_nhwc[:steps].copy_(noise[:steps].permute(0, 1, 3, 4, 2))

    def capture(self, length: int) -> torch.cuda.CUDAGraph:
        """The graph of ``length`` consecutive steps (captured on first use, then cached)."""
        if length in self.graphs:
            return self.graphs[length]
        t0 = time.perf_counter()
        saved = (self.x.clone(), self.x0.clone(), self.counter.clone())
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside capture: kernel compilation, library handles
            self.step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            for _ in range(length):
                self.step()
        torch.cuda.synchronize(self.device)
        self.x.copy_(saved[0])
        self.x0.copy_(saved[1])
        self.counter.copy_(saved[2])
        self.graphs[length] = graph
        self.capture_seconds[length] = time.perf_counter() - t0
        log.info("captured a %d-step graph in %.2f s", length, self.capture_seconds[length])
        return graph

    def run_steps(self, num_steps: int) -> None:
        """Advance ``num_steps`` steps from the current counter (graph replays or eager)."""
        if not self.use_graphs:
            for _ in range(num_steps):
                self.step()
            return
        k = self.steps_per_graph
        full, rest = divmod(num_steps, k)
        if full:
            graph = self.capture(k)
            for _ in range(full):
                graph.replay()
        if rest:
            self.capture(rest).replay()

    @torch.no_grad()
    def run(self, x_t: torch.Tensor, noise: torch.Tensor | None, num_steps: int | None = None) -> torch.Tensor:
        """x after ``num_steps`` (default: all) steps from x_T, fp32 [B, C, H, W] (a fresh tensor)."""
        num_steps = self.sampler.num_steps if num_steps is None else num_steps
        if not 0 <= num_steps <= self.sampler.num_steps:
            raise FastdiffError(f"num_steps must be in 0..{self.sampler.num_steps}, got {num_steps}")
        self.load(x_t, noise, num_steps)
        self.run_steps(num_steps)
        return self.x.contiguous().clone()
