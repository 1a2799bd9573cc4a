"""The training noise schedule (betas -> alpha-bar) and inference timesteps, as diffusers defines them.

``ScheduleConfig`` uses the field names and defaults of diffusers' ``DDPMScheduler`` config, so a model's
``scheduler_config.json`` loads with :meth:`ScheduleConfig.from_diffusers`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from fastdiff.errors import FastdiffError

log = logging.getLogger(__name__)

BETA_SCHEDULES = ("linear", "scaled_linear", "squaredcos_cap_v2")
BETA_SCHEDULE_ALIASES = {"cosine": "squaredcos_cap_v2"}
PREDICTION_TYPES = ("epsilon", "v_prediction")
TIMESTEP_SPACINGS = ("leading", "trailing", "linspace")
VARIANCE_TYPES = ("fixed_small", "fixed_large")

COSINE_MAX_BETA = 0.999
"""diffusers' ``betas_for_alpha_bar`` caps each cosine-schedule beta here (Nichol & Dhariwal 2021, eq. 17)."""

_UNSUPPORTED_DIFFUSERS_KEYS = ("trained_betas", "thresholding", "rescale_betas_zero_snr")
"""diffusers config keys that change the schedule in ways not implemented here: only no-op values pass."""


@dataclass
class ScheduleConfig:
    """The noise schedule and sampler knobs, with diffusers' ``DDPMScheduler`` names and defaults.

    ``set_alpha_to_one`` is used by DDIM only; ``clip_sample``/``clip_sample_range`` by DDPM and DDIM only;
    ``variance_type`` by DDPM only (see ``fastdiff.samplers.sampler.make_sampler``).
    """

    num_train_timesteps: int = 1000
    beta_schedule: str = "linear"
    beta_start: float = 1e-4
    beta_end: float = 0.02
    prediction_type: str = "epsilon"
    timestep_spacing: str = "leading"
    steps_offset: int = 0
    clip_sample: bool = True
    clip_sample_range: float = 1.0
    variance_type: str = "fixed_small"
    set_alpha_to_one: bool = True

    def __post_init__(self) -> None:
        self.beta_schedule = BETA_SCHEDULE_ALIASES.get(self.beta_schedule, self.beta_schedule)
        _check_choice("beta_schedule", self.beta_schedule, BETA_SCHEDULES + tuple(BETA_SCHEDULE_ALIASES))
        _check_choice("prediction_type", self.prediction_type, PREDICTION_TYPES)
        _check_choice("timestep_spacing", self.timestep_spacing, TIMESTEP_SPACINGS)
        _check_choice("variance_type", self.variance_type, VARIANCE_TYPES)
        if not _is_int(self.num_train_timesteps) or self.num_train_timesteps < 1:
            raise FastdiffError(f"num_train_timesteps must be a positive int, got {self.num_train_timesteps!r}")
        if not _is_int(self.steps_offset) or self.steps_offset < 0:
            raise FastdiffError(f"steps_offset must be a non-negative int, got {self.steps_offset!r}")
        for name in ("clip_sample", "set_alpha_to_one"):
            if not isinstance(getattr(self, name), bool):
                raise FastdiffError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if not _is_number(self.clip_sample_range) or not self.clip_sample_range > 0:
            raise FastdiffError(f"clip_sample_range must be a positive number, got {self.clip_sample_range!r}")
        if self.beta_schedule != "squaredcos_cap_v2":
            for name in ("beta_start", "beta_end"):
                value = getattr(self, name)
                if not _is_number(value) or not 0 < value < 1:
                    raise FastdiffError(f"{name} must be a number in (0, 1), got {value!r}")

    @classmethod
    def from_diffusers(cls, d: Mapping[str, Any] | None) -> ScheduleConfig:
        """Config from a diffusers scheduler config dict (DDPM, DDIM or DPMSolverMultistep); None -> defaults.

        Keys this class does not have (``_class_name``, ``solver_order``, ...) are ignored, except those
        that would change the schedule (``trained_betas``, ``thresholding``, ``rescale_betas_zero_snr``),
        which must hold their no-op values. ``variance_type: null`` (DPMSolverMultistepScheduler's default)
        means the default.
        """
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise FastdiffError(f"scheduler config must be a mapping, got {type(d).__name__}")
        for key in _UNSUPPORTED_DIFFUSERS_KEYS:
            if d.get(key) not in (None, False):
                raise FastdiffError(f"scheduler config {key}={d[key]!r} is not supported")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known and not (k == "variance_type" and v is None)}
        ignored = sorted(k for k in d if k not in known)
        if ignored:
            log.debug("scheduler config: ignoring keys %s", ignored)
        return cls(**kwargs)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise FastdiffError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def alphas_cumprod(config: ScheduleConfig) -> torch.Tensor:
    """alpha-bar_t = prod_{s<=t} (1 - beta_s) for t = 0..T-1, float64 [T].

    The betas and their cumulative product are computed in float32 exactly as diffusers does (so a model
    trained with diffusers' schedule sees the same noise levels, bit for bit), then widened to float64 for the
    sampler tables.
    """
    steps = config.num_train_timesteps
    if config.beta_schedule == "linear":  # Ho et al. 2020, Sec. 4
        betas = torch.linspace(config.beta_start, config.beta_end, steps, dtype=torch.float32)
    elif config.beta_schedule == "scaled_linear":  # latent diffusion: linear in sqrt(beta)
        betas = torch.linspace(config.beta_start**0.5, config.beta_end**0.5, steps, dtype=torch.float32) ** 2
    else:  # squaredcos_cap_v2: Nichol & Dhariwal 2021, eq. 17, beta_t = 1 - abar(t+1)/abar(t) capped at 0.999

        def alpha_bar(u: float) -> float:
            return math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2

        betas = torch.tensor(
            [min(1 - alpha_bar((i + 1) / steps) / alpha_bar(i / steps), COSINE_MAX_BETA) for i in range(steps)],
            dtype=torch.float32,
        )
    return torch.cumprod(1.0 - betas, dim=0).to(torch.float64)


def inference_timesteps(config: ScheduleConfig, steps: int, solver_grid: bool = False) -> np.ndarray:
    """The ``steps`` timesteps the model is evaluated at, descending, int64 (diffusers' ``set_timesteps``).

    ``solver_grid=False`` is DDPMScheduler/DDIMScheduler's spacing of ``steps`` points. ``solver_grid=True``
    is DPMSolverMultistepScheduler's: ``leading`` and ``linspace`` place ``steps + 1`` points and drop the
    last (the solver ends at sigma = 0 instead); ``trailing`` is the same for both.

    For ``trailing`` with some step counts (61, 103, ...) diffusers' float ``np.arange`` yields one extra
    point that becomes timestep -1; it is dropped here, so those counts give ``steps`` timesteps, not
    ``steps + 1``.
    """
    train_steps = config.num_train_timesteps
    points = steps + 1 if solver_grid else steps
    if config.timestep_spacing == "linspace":
        timesteps = np.linspace(0, train_steps - 1, points).round()[::-1][:steps]
    elif config.timestep_spacing == "leading":
        step_ratio = train_steps // points
        timesteps = (np.arange(0, points) * step_ratio).round()[::-1][:steps] + config.steps_offset
    else:  # trailing
        timesteps = np.round(np.arange(train_steps, 0, -train_steps / steps))[:steps] - 1
    timesteps = timesteps.astype(np.int64)
    if timesteps.min() < 0 or timesteps.max() >= train_steps:
        raise FastdiffError(
            f"{steps} steps with timestep_spacing={config.timestep_spacing} and "
            f"steps_offset={config.steps_offset} give timesteps outside 0..{train_steps - 1}"
        )
    return timesteps
