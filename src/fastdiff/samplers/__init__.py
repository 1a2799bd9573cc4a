"""Samplers as per-step coefficient tables on the device: DDPM, DDIM and DPM-Solver++(2M).

Every step is ``x0 = A·x + B·out`` (optionally clipped), ``x' = C·x + D·x0 + E·x0_prev + F·noise``; see
``sampler.Sampler.step`` and, for how each sampler's table is derived, ``tables``.
"""

from fastdiff.samplers.noise import draw_noise
from fastdiff.samplers.sampler import SAMPLERS, Sampler, make_sampler
from fastdiff.samplers.schedule import ScheduleConfig, alphas_cumprod, inference_timesteps

__all__ = [
    "SAMPLERS",
    "Sampler",
    "ScheduleConfig",
    "alphas_cumprod",
    "draw_noise",
    "inference_timesteps",
    "make_sampler",
]
