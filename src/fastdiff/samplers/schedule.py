"""The training noise schedule (betas -> alpha-bar) and inference timesteps, as diffusers defines them.

``ScheduleConfig`` uses the field names and defaults of diffusers' ``DDPMScheduler`` config, so a model's
``scheduler_config.json`` loads with :meth:`ScheduleConfig.from_diffusers`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

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

SAMPLER_SCHEDULERS = {
    "ddpm": "DDPMScheduler",
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "dpmsolver++": "DPMSolverMultistepScheduler",
    "dpmsolver++_sde": "DPMSolverMultistepScheduler",
    "unipc": "UniPCMultistepScheduler",
}
"""fastdiff sampler -> the diffusers scheduler class whose default ``step`` loop it equals."""

SAMPLER_DEFAULTS: dict[str, dict[str, Any]] = {
    "ddpm": {"timestep_spacing": "leading"},
    "ddim": {"timestep_spacing": "leading"},
    "euler": {"timestep_spacing": "linspace"},
    "euler_a": {"timestep_spacing": "linspace"},
    "dpmsolver++": {"timestep_spacing": "linspace"},
    "dpmsolver++_sde": {"timestep_spacing": "linspace"},
    "unipc": {"timestep_spacing": "linspace"},
}
"""Where a sampler's diffusers scheduler defaults differ from ``ScheduleConfig``'s (DDPMScheduler's) defaults.

diffusers' ``from_config`` gives every key a saved config lacks the *target* scheduler's default
(``ConfigMixin.extract_init_dict``): google/ddpm-cifar10-32's config has no ``timestep_spacing``, so
DDIMScheduler reads it as "leading" and DPMSolverMultistepScheduler as "linspace". ``ScheduleConfig.for_sampler``
applies the same rule."""

_DPM = ("dpmsolver++", "dpmsolver++_sde")
_SIGMA_SAMPLERS = ("euler", *_DPM, "unipc")
_FIXED_KEYS: tuple[tuple[str, Any, tuple[str, ...]], ...] = (
    ("final_sigmas_type", "zero", _SIGMA_SAMPLERS),
    ("use_exponential_sigmas", False, _SIGMA_SAMPLERS),
    ("use_beta_sigmas", False, _SIGMA_SAMPLERS),
    ("solver_order", 2, (*_DPM, "unipc")),
    ("lower_order_final", True, (*_DPM, "unipc")),
    ("use_flow_sigmas", False, (*_DPM, "unipc")),
    ("use_dynamic_shifting", False, (*_DPM, "unipc")),
    ("solver_type", "midpoint", _DPM),
    ("euler_at_final", False, _DPM),
    ("use_lu_lambdas", False, _DPM),
    ("lambda_min_clipped", -math.inf, _DPM),
    ("interpolation_type", "linear", ("euler",)),
    ("timestep_type", "discrete", ("euler",)),
    ("sigma_min", None, ("euler", "unipc")),
    ("sigma_max", None, ("euler", "unipc")),
    ("solver_type", "bh2", ("unipc",)),
    ("predict_x0", True, ("unipc",)),
    ("disable_corrector", [], ("unipc",)),
    ("solver_p", None, ("unipc",)),
)
"""Scheduler options fastdiff follows only at diffusers' default: (key, default, samplers whose scheduler reads
it). A saved config holding another value for the chosen sampler is an error, not a silent difference. (The
algorithm itself, e.g. ``algorithm_type``, is the sampler's name: the user's choice, as choosing a scheduler
class is in diffusers.)"""


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
    use_karras_sigmas: bool = False
    given: frozenset[str] | None = field(default=None, compare=False, repr=False)
    """The keys a loaded scheduler config held (None: every field counts as given, as when built in Python)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The loaded config's other keys (scheduler-specific options), checked by ``for_sampler``."""

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
        for name in ("clip_sample", "set_alpha_to_one", "use_karras_sigmas"):
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
        known = {f.name for f in fields(cls)} - {"given", "extra"}
        kwargs = {k: v for k, v in d.items() if k in known and not (k == "variance_type" and v is None)}
        extra = {k: v for k, v in d.items() if k not in known and not k.startswith("_")}
        return cls(**kwargs, given=frozenset(kwargs), extra=extra)

    def to_diffusers(self) -> dict[str, Any]:
        """The config as a diffusers scheduler config dict: the keys it was loaded with (all fields when built in
        Python) and its other keys, so diffusers' ``from_config`` reads it as it read the original."""
        names = [f.name for f in fields(self) if f.name not in ("given", "extra")]
        given = names if self.given is None else [n for n in names if n in self.given]
        return {**self.extra, **{n: getattr(self, n) for n in given}}

    def for_sampler(self, sampler: str) -> ScheduleConfig:
        """This config as ``sampler``'s diffusers scheduler reads it: keys the loaded config lacked take that
        scheduler's defaults (``SAMPLER_DEFAULTS``), and options fastdiff cannot follow must hold their default."""
        for key, default, samplers in _FIXED_KEYS:
            if sampler in samplers and key in self.extra and self.extra[key] != default:
                raise FastdiffError(
                    f"scheduler config {key}={self.extra[key]!r} is not supported by fastdiff's {sampler} "
                    f"(only {default!r}, {SAMPLER_SCHEDULERS[sampler]}'s default)"
                )
        if self.given is None:
            return self
        defaults = {k: v for k, v in SAMPLER_DEFAULTS.get(sampler, {}).items() if k not in self.given}
        return replace(self, **defaults, given=None) if defaults else replace(self, given=None)


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
