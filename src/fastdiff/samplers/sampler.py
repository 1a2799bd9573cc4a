"""``Sampler``: one generic device-side step over a per-step coefficient table; ``make_sampler`` builds it."""

from __future__ import annotations

import logging
import operator

import torch

from fastdiff.errors import FastdiffError
from fastdiff.samplers.schedule import ScheduleConfig, alphas_cumprod, inference_timesteps
from fastdiff.samplers.tables import ddim_table, ddpm_table, dpmsolver_pp_2m_table

log = logging.getLogger(__name__)

SAMPLERS = ("ddpm", "ddim", "dpmsolver++")


class Sampler:
    """A sampler as tables: ``timesteps`` [N] int64 (the t fed to the model at step i) and ``coefs`` [N, 6]
    float32 holding (A, B, C, D, E, F) per step, both on the sampler's device.

    ``step`` is pure tensor maths on the device: the step index only selects a table row and nothing reads a
    tensor back to the host, so a whole sampling loop can be captured in one CUDA graph.
    """

    def __init__(self, name: str, timesteps: torch.Tensor, coefs: torch.Tensor, clip_range: float | None) -> None:
        self.name = name
        self.timesteps = timesteps
        self.coefs = coefs
        self.clip_range = clip_range
        self.num_steps = int(timesteps.shape[0])
        # Which steps have a nonzero E / F: fixed when the table is built, read on the host (no sync in step).
        self._uses_x0_prev = tuple(bool(v) for v in (coefs[:, 4] != 0).tolist())
        self._uses_noise = tuple(bool(v) for v in (coefs[:, 5] != 0).tolist())
        # Whether any step adds noise (False for ddim with eta=0 and for dpmsolver++).
        self.needs_noise = any(self._uses_noise)

    def __repr__(self) -> str:
        return (
            f"Sampler(name={self.name!r}, num_steps={self.num_steps}, clip_range={self.clip_range}, "
            f"needs_noise={self.needs_noise}, device={self.coefs.device})"
        )

    def to(self, device: torch.device | str) -> Sampler:
        """The same sampler with its tables on ``device``."""
        return Sampler(self.name, self.timesteps.to(device), self.coefs.to(device), self.clip_range)

    def step(
        self,
        i: int,
        x: torch.Tensor,
        model_output: torch.Tensor,
        x0_prev: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step i: returns (x_next, x0). Pass this step's x0 as ``x0_prev`` to step i + 1, and ``noise[i]``.

        x0 = A·x + B·model_output, clamped to [-clip_range, clip_range] when clipping is on;
        x_next = C·x + D·x0 + E·x0_prev + F·noise. The E and F terms are left out at steps whose coefficient
        is 0, so ``x0_prev`` may be None at step 0 and ``noise`` may be None when ``needs_noise`` is False.
        """
        a, b, c, d, e, f = self.coefs[i].unbind()
        x0 = a * x + b * model_output
        if self.clip_range is not None:
            x0 = x0.clamp(-self.clip_range, self.clip_range)
        x_next = c * x + d * x0
        if self._uses_x0_prev[i]:
            if x0_prev is None:
                raise FastdiffError(f"{self.name} step {i} needs x0_prev (the x0 returned by step {i - 1})")
            x_next = x_next + e * x0_prev
        if self._uses_noise[i]:
            if noise is None:
                raise FastdiffError(f"{self.name} step {i} needs noise")
            x_next = x_next + f * noise
        return x_next, x0


def make_sampler(
    name: str,
    config: ScheduleConfig,
    steps: int,
    eta: float = 0.0,
    device: torch.device | str = "cpu",
) -> Sampler:
    """Build sampler ``name`` ("ddpm", "ddim" or "dpmsolver++") for ``steps`` steps of ``config``'s schedule.

    All samplers read the same ``config`` (timestep spacing included; note that diffusers'
    DPMSolverMultistepScheduler defaults to "linspace" spacing where DDPM/DDIM default to "leading").
    Per-sampler knobs:

    - ddpm: ``variance_type``, ``clip_sample``/``clip_sample_range``. Ignores ``set_alpha_to_one`` (the step
      after the last timestep is always the clean image, abar = 1), as DDPMScheduler does.
    - ddim: ``eta`` (0 = deterministic DDIM, 1 = DDPM-like variance), ``set_alpha_to_one``, clipping; when
      clipping, eps is re-derived from the clipped x0 (DDIMScheduler.step with
      ``use_clipped_model_output=True``).
    - dpmsolver++: never clips (DPMSolverMultistepScheduler has no ``clip_sample``; its ``thresholding`` is
      off by default), so ``clip_sample`` is ignored. Needs strictly decreasing timesteps: with "leading" or
      "linspace" spacing, steps = num_train_timesteps repeats timesteps (use "trailing").
    """
    if name not in SAMPLERS:
        raise FastdiffError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
    try:
        steps = operator.index(steps)
    except TypeError:
        raise FastdiffError(f"steps must be an int, got {steps!r}") from None
    if isinstance(steps, bool) or not 1 <= steps <= config.num_train_timesteps:
        raise FastdiffError(f"steps must be in 1..{config.num_train_timesteps}, got {steps}")
    if isinstance(eta, bool) or not isinstance(eta, int | float) or not eta >= 0:
        raise FastdiffError(f"eta must be a number >= 0, got {eta!r}")
    if eta != 0 and name != "ddim":
        raise FastdiffError(f"eta applies to ddim only, got eta={eta} for {name}")

    abar = alphas_cumprod(config)
    timesteps = inference_timesteps(config, steps, solver_grid=name == "dpmsolver++")
    if name == "ddpm":
        table = ddpm_table(abar, timesteps, config.prediction_type, config.variance_type)
    elif name == "ddim":
        table = ddim_table(
            abar,
            timesteps,
            config.num_train_timesteps,
            config.prediction_type,
            float(eta),
            config.set_alpha_to_one,
        )
    else:
        table = dpmsolver_pp_2m_table(abar, timesteps, config.prediction_type)
    if not torch.isfinite(table).all():
        raise FastdiffError(f"{name} coefficients are not finite for {steps} steps of this schedule")
    clip_range = config.clip_sample_range if config.clip_sample and name != "dpmsolver++" else None
    log.debug(
        "%s: %d steps, timesteps %d..%d, clip %s",
        name,
        len(timesteps),
        timesteps[0],
        timesteps[-1],
        clip_range,
    )
    return Sampler(
        name,
        torch.from_numpy(timesteps).to(device),
        table.to(device=device, dtype=torch.float32),
        clip_range,
    )
