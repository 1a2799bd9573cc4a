"""Samplers as per-step coefficient tables on the device, each equal to a diffusers scheduler's default loop.

Every step is one fused update over (x, model output, the previous two x0, UniPC's previous corrected sample,
counter-based noise); see ``sampler.Sampler.step``, ``tables`` for how each sampler's table is derived and
``noise`` for the seeded noise.
"""

from fastdiff.samplers.loop import check_cache_interval, is_full_step, run_sampler
from fastdiff.samplers.noise import initial_noise, seed_tensor, step_noise
from fastdiff.samplers.sampler import (
    FULL_GUIDANCE,
    KARRAS_SAMPLERS,
    SAMPLERS,
    Sampler,
    SamplerState,
    check_guidance_interval,
    make_sampler,
)
from fastdiff.samplers.schedule import SAMPLER_SCHEDULERS, ScheduleConfig, alphas_cumprod
from fastdiff.samplers.tables import discrete_timesteps

__all__ = [
    "FULL_GUIDANCE",
    "KARRAS_SAMPLERS",
    "SAMPLERS",
    "SAMPLER_SCHEDULERS",
    "Sampler",
    "SamplerState",
    "ScheduleConfig",
    "alphas_cumprod",
    "check_cache_interval",
    "check_guidance_interval",
    "discrete_timesteps",
    "initial_noise",
    "is_full_step",
    "make_sampler",
    "run_sampler",
    "seed_tensor",
    "step_noise",
]
