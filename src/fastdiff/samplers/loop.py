"""The eager sampling loop: every fastdiff loop outside the engine (pipelines, bench, trainer) is this one."""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from fastdiff.errors import FastdiffError
from fastdiff.samplers.noise import step_noise
from fastdiff.samplers.sampler import Sampler

Model = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(model input [B or 2B, ...] in the model dtype, timesteps [B or 2B]) -> model output."""
CachedModel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
"""(model input, timesteps, deep feature or None) -> (model output, deep feature): a U-Net with a step cache
(``fastdiff.models.step_cache.cached_forward``); None asks for a full forward."""


def check_cache_interval(value: object, name: str = "cache_interval") -> int:
    """A step-cache interval: an int >= 1 (1: no caching) or a one-line error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise FastdiffError(f"{name} must be an integer >= 1 (1: no step caching), got {value!r}")
    return int(value)


def is_full_step(step: int, cache_interval: int) -> bool:
    """Whether sampling step ``step`` (0-based within the run) runs the whole U-Net (refreshing the step cache's
    deep feature) or only its shallow path (``fastdiff.models.step_cache``): every ``cache_interval``-th step."""
    return step % cache_interval == 0


@torch.no_grad()
def run_sampler(
    model: Model | CachedModel,
    sampler: Sampler,
    x: torch.Tensor,
    seeds: torch.Tensor,
    model_dtype: torch.dtype,
    guidance: torch.Tensor | None = None,
    num_steps: int | None = None,
    progress: bool = False,
    cache_interval: int = 1,
) -> torch.Tensor:
    """Run ``num_steps`` (default all) steps of ``sampler`` from the state ``x`` (fp32 [B, ...], already scaled:
    ``init_scale · x_T``); returns the final state. Step noise is drawn per step from ``seeds`` (int64 [B]). With
    ``guidance`` [B] the model sees [x; x] (its conditioning holds [uncond; cond]) and the step combines the halves
    (classifier-free guidance). With ``cache_interval`` N > 1, ``model`` is a ``CachedModel``: step i passes None
    (a full forward) when ``is_full_step(i, N)``, else the deep feature of the last full step (a shallow one)."""
    cache_interval = check_cache_interval(cache_interval)
    x = x.to(torch.float32)
    state = sampler.new_state(x)
    steps = sampler.num_steps if num_steps is None else num_steps
    deep = None
    for i in tqdm(range(steps), desc="sampling", unit="step", disable=not progress, leave=False):
        model_input = x.to(model_dtype)
        if guidance is not None:
            model_input = torch.cat([model_input, model_input])
        t = sampler.timesteps[i].expand(model_input.shape[0])
        if cache_interval == 1:
            out = model(model_input, t)
        else:
            out, deep = model(model_input, t, None if is_full_step(i, cache_interval) else deep)
        out = out.float()
        noise = step_noise(seeds, i, tuple(x.shape[1:])) if sampler.noise_steps[i] else None
        x = sampler.step(i, x, out, state, noise, guidance=guidance)
    return x
