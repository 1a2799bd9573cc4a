"""The eager sampling loop: every fastdiff loop outside the engine (pipelines, bench, trainer) is this one."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from fastdiff.samplers.noise import step_noise
from fastdiff.samplers.sampler import Sampler

Model = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(model input [B or 2B, ...] in the model dtype, timesteps [B or 2B]) -> model output."""


@torch.no_grad()
def run_sampler(
    model: Model,
    sampler: Sampler,
    x: torch.Tensor,
    seeds: torch.Tensor,
    model_dtype: torch.dtype,
    guidance: torch.Tensor | None = None,
    num_steps: int | None = None,
    progress: bool = False,
) -> torch.Tensor:
    """Run ``num_steps`` (default all) steps of ``sampler`` from the state ``x`` (fp32 [B, ...], already scaled:
    ``init_scale · x_T``); returns the final state. Step noise is drawn per step from ``seeds`` (int64 [B]). With
    ``guidance`` [B] the model sees [x; x] (its conditioning holds [uncond; cond]) and the step combines the halves
    (classifier-free guidance)."""
    x = x.to(torch.float32)
    state = sampler.new_state(x)
    steps = sampler.num_steps if num_steps is None else num_steps
    for i in tqdm(range(steps), desc="sampling", unit="step", disable=not progress, leave=False):
        model_input = x.to(model_dtype)
        if guidance is not None:
            model_input = torch.cat([model_input, model_input])
        out = model(model_input, sampler.timesteps[i].expand(model_input.shape[0])).float()
        noise = step_noise(seeds, i, tuple(x.shape[1:])) if sampler.noise_steps[i] else None
        x = sampler.step(i, x, out, state, noise, guidance=guidance)
    return x
