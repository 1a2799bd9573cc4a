"""The sampling loop as CUDA graphs: U-Net + one fused sampler step (noise drawn inside it), replayed.

Every step reads its step index from a device counter (``[1]`` int64): the model's time input, the sampler's
coefficient row and the step's noise draw (Philox counter ``i + 1`` of each image's seed) are all selected on the
device, and the counter is incremented at the end of the step. So one captured graph of K steps is valid at any
position of the loop, and an N-step run is ``N // K`` replays of the K-step graph plus one replay of an
``N % K``-step graph (both captured once, cached by length, sharing one memory pool). ``steps_per_graph = N``
captures the whole loop unrolled in one graph.

The eager fallback (``use_graphs=False``, and always on the CPU) runs the very same step function without
capture, so graph replay and eager execution launch identical kernels.

Step caching (``cache_interval`` N > 1, ``fastdiff.models.step_cache``): step k is a full U-Net forward when
``k % N == 0``, else a shallow one. Which of the two a step runs is fixed when it is captured, so the loop keeps the
step index on the host too (``position``) and keys its graphs by (length, phase = first step's index mod N): a
graph is valid at every position of its phase. ``steps_per_graph`` is rounded up to a multiple of N, so a run from
step 0 only ever replays phase-0 graphs (the K-step graph and the remainder's, as without caching).

Per step: the U-Net on the model-dtype input buffer, the fused ``sampler_step`` kernel (updates x, the x0
history and UniPC's corrected sample in place, draws the noise, and writes the next model input in the model
dtype), ``counter += 1``. No memory grows with the number of steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from fastdiff.devices import normalize_device
from fastdiff.errors import FastdiffError
from fastdiff.kernels.sampler_step import sampler_step
from fastdiff.samplers import Sampler, check_cache_interval, is_full_step

log = logging.getLogger(__name__)

StepModel = Callable[..., torch.Tensor]
"""(x_in [B, C, H, W] in the model dtype, channels-last; step index [1] int64 on the device[, shallow]) -> model
output. ``shallow`` is passed only with step caching: False for a full forward that keeps the deep feature, True for
a shallow forward on the kept one."""


def channels_last_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised logical [N, C, H, W] tensor in channels-last memory."""
    n, c, h, w = shape
    return torch.empty((n, h, w, c), dtype=dtype, device=device).permute(0, 3, 1, 2)


class SamplingLoop:
    """Static buffers and captured graphs for one (step model, sampler, batch, model dtype).

    ``run(x_T, seeds, num_steps)`` runs steps ``0..num_steps-1`` from unit-variance x_T and returns x (fp32,
    before the final clamp). ``cache_interval``: step caching (see the module docstring; 1: off).
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
        guided: bool = False,
        cache_interval: int = 1,
    ) -> None:
        device = normalize_device(device)
        if sampler.coefs.device != device:
            raise FastdiffError(f"sampler tables are on {sampler.coefs.device}, the engine runs on {device}")
        self.step_model = step_model
        self.sampler = sampler
        self.device = device
        self.shape = sample_shape
        self.use_graphs = use_graphs and device.type == "cuda"
        if steps_per_graph is not None and (
            isinstance(steps_per_graph, bool) or not isinstance(steps_per_graph, int) or steps_per_graph < 1
        ):
            raise FastdiffError(f"steps_per_graph must be a positive int or None, got {steps_per_graph!r}")
        self.cache_interval = check_cache_interval(cache_interval)
        per_graph = steps_per_graph or sampler.num_steps
        per_graph = -(-per_graph // self.cache_interval) * self.cache_interval  # whole cache periods
        self.steps_per_graph = min(sampler.num_steps, per_graph)
        self.x = channels_last_empty(sample_shape, torch.float32, device)
        self.guided = guided
        model_rows = (2 * sample_shape[0], *sample_shape[1:]) if guided else sample_shape
        self.x_in = channels_last_empty(model_rows, dtype, device)  # [x; x] with classifier-free guidance
        self.guidance = torch.ones(sample_shape[0], dtype=torch.float32, device=device) if guided else None
        self.h1 = channels_last_empty(sample_shape, torch.float32, device)  # this step's x0 (the history)
        self.h2 = channels_last_empty(sample_shape, torch.float32, device) if sampler.uses_h2 else None
        self.aux = channels_last_empty(sample_shape, torch.float32, device) if sampler.uses_aux else None
        self.seeds = torch.zeros(sample_shape[0], dtype=torch.int64, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.position = 0  # the counter's value, known on the host (what a step runs depends on it)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (length, phase)
        self.capture_seconds: dict[tuple[int, int], float] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    @property
    def state(self) -> tuple[torch.Tensor, ...]:
        """The buffers the sampler step updates, in its ``out`` order: x, the x0 history, aux."""
        return (self.x, self.h1, *(t for t in (self.h2, self.aux) if t is not None))

    def step(self) -> None:
        """One sampling step at the step index held by ``counter`` (device-side only: capturable); a full or a
        shallow forward as ``position`` says (step caching)."""
        if self.cache_interval == 1:
            out = self.step_model(self.x_in, self.counter)
        else:
            out = self.step_model(self.x_in, self.counter, not is_full_step(self.position, self.cache_interval))
        sampler = self.sampler
        sampler_step(
            self.x, out, sampler.coefs, self.counter, self.h1 if sampler.uses_h1 else None, self.h2, self.aux,
            seeds=self.seeds if sampler.needs_noise else None, guidance=self.guidance,
            clip_range=sampler.clip_range, out=self.state, model_input=self.x_in,
        )  # fmt: skip
        self.counter.add_(1)
        self.position += 1

    def load(
        self, x_t: torch.Tensor, seeds: torch.Tensor, guidance: torch.Tensor | None = None, scale: bool = True
    ) -> None:
        """Put unit-variance x_T [B, C, H, W] (scaled by the sampler's ``init_scale``; with ``scale=False`` an
        already scaled state, e.g. img2img's noised image), the images' seeds (int64 [B], for the step noise) and
        their guidance scales ([B], guided loops only) in place and reset the history and the step counter."""
        if tuple(x_t.shape) != self.shape:
            raise FastdiffError(f"x_T has shape {tuple(x_t.shape)}, the engine was prepared for {self.shape}")
        if tuple(seeds.shape) != (self.shape[0],):
            raise FastdiffError(f"got {tuple(seeds.shape)} seeds for a batch of {self.shape[0]}")
        if self.guided != (guidance is not None):
            raise FastdiffError("guidance scales must be given exactly when the loop was prepared with guidance")
        self.x.copy_(x_t)
        if scale:
            self.x.mul_(self.sampler.init_scale)
        for half in self.x_in.chunk(2) if self.guided else (self.x_in,):
            half.copy_(self.x)
        if guidance is not None:
            if tuple(guidance.shape) != (self.shape[0],):
                raise FastdiffError(f"got {tuple(guidance.shape)} guidance scales for a batch of {self.shape[0]}")
            self.guidance.copy_(guidance)
        for history in self.state[1:]:
            history.zero_()  # read with coefficient 0 at the first steps: must be finite
        self.seeds.copy_(seeds)
        self.counter.zero_()
        self.position = 0

    @torch.no_grad()
    def capture(self, length: int) -> torch.cuda.CUDAGraph:
        """The graph of ``length`` consecutive steps from the current position's phase (captured on first use,
        then cached); the loop's buffers and position are left as they were."""
        start = self.position
        key = (length, start % self.cache_interval)
        if key in self.graphs:
            return self.graphs[key]
        t0 = time.perf_counter()
        buffers = (*self.state, self.x_in, self.counter)
        saved = [t.clone() for t in buffers]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside capture: kernel compilation, library handles
            self.step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.position = start
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            for _ in range(length):
                self.step()
        torch.cuda.synchronize(self.device)
        for buffer, value in zip(buffers, saved, strict=True):
            buffer.copy_(value)
        self.position = start
        self.graphs[key] = graph
        self.capture_seconds[key] = time.perf_counter() - t0
        log.info("captured a %d-step graph (phase %d) in %.2f s", length, key[1], self.capture_seconds[key])
        return graph

    def run_steps(self, num_steps: int) -> None:
        """Advance ``num_steps`` steps from the current counter (graph replays or eager)."""
        if not self.use_graphs:
            for _ in range(num_steps):
                self.step()
            return
        k = self.steps_per_graph
        full, rest = divmod(num_steps, k)
        for length in [k] * full + [rest] * (rest > 0):
            self.capture(length).replay()
            self.position += length

    @torch.no_grad()
    def run(
        self, x_t: torch.Tensor, seeds: torch.Tensor, num_steps: int | None = None,
        guidance: torch.Tensor | None = None, scale: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """x after ``num_steps`` (default: all) steps from x_T, fp32 [B, C, H, W] (a fresh tensor); ``guidance``
        and ``scale`` as in ``load``."""
        num_steps = self.sampler.num_steps if num_steps is None else num_steps
        if not 0 <= num_steps <= self.sampler.num_steps:
            raise FastdiffError(f"num_steps must be in 0..{self.sampler.num_steps}, got {num_steps}")
        self.load(x_t, seeds, guidance, scale)
        self.run_steps(num_steps)
        return self.x.clone(memory_format=torch.contiguous_format)


class CapturedForward:
    """One model forward replayed as a CUDA graph over a static input buffer (the VAE decode): ``run(x)`` copies
    x in, replays and returns the output buffer (valid until the next run). The first run is eager (it may
    stream weights and compile kernels); the graph is captured on the second. Eager always off CUDA."""

    def __init__(self, forward: Callable[[torch.Tensor], torch.Tensor], x_in: torch.Tensor, use_graphs: bool = True):
        self.forward, self.x_in = forward, x_in
        self.use_graphs = use_graphs and x_in.device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.runs = 0

    @torch.no_grad()
    def run(self, x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape) != tuple(self.x_in.shape):
            raise FastdiffError(f"input {tuple(x.shape)} does not match the prepared {tuple(self.x_in.shape)}")
        self.x_in.copy_(x)
        if self.graph is not None:
            self.graph.replay()
        elif self.use_graphs and self.runs >= 1:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.out = self.forward(self.x_in)
            graph.replay()
            self.graph = graph
        else:
            self.out = self.forward(self.x_in)
        self.runs += 1
        return self.out
