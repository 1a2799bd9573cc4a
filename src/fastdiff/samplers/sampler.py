"""``Sampler``: one generic device-side step over a per-step coefficient table; ``make_sampler`` builds it."""

from __future__ import annotations

import copy
import logging
import operator
from dataclasses import dataclass

import torch

from fastdiff.cli_args import FULL_GUIDANCE, check_guidance_interval
from fastdiff.devices import host_to_device
from fastdiff.errors import FastdiffError
from fastdiff.kernels.sampler_step import COL, sampler_step_ref
from fastdiff.samplers.schedule import SAMPLER_SCHEDULERS, ScheduleConfig, alphas_cumprod
from fastdiff.samplers.tables import (
    Table,
    ddim_table,
    ddpm_table,
    discrete_timesteps,
    dpmsolver_pp_table,
    euler_table,
    sigma_grid,
    unipc_table,
)

log = logging.getLogger(__name__)

SAMPLERS = tuple(SAMPLER_SCHEDULERS)
"""Sampler names; each equals the diffusers scheduler ``SAMPLER_SCHEDULERS[name]`` with its default options."""
KARRAS_SAMPLERS = ("euler", "dpmsolver++", "dpmsolver++_sde", "unipc")
"""Samplers whose diffusers scheduler offers ``use_karras_sigmas``."""


@dataclass
class SamplerState:
    """The tensors a sampler carries between steps (None where it needs none): the x0 of the previous two
    steps and UniPC's previous corrected sample."""

    h1: torch.Tensor
    h2: torch.Tensor | None
    aux: torch.Tensor | None


class Sampler:
    """A sampler as tables on one device: ``timesteps`` [N] float32 (the model's time input at step i) and
    ``coefs`` [N, 13] float32 (``fastdiff.kernels.sampler_step.COLUMNS``).

    ``step`` is pure tensor maths on the device: the step index only selects a table row and nothing reads a
    tensor back to the host, so a whole loop can be captured in one CUDA graph (``fastdiff.engine``). The state
    x is the model input itself; x_T (unit variance) enters as ``init_scale · x_T``. ``levels`` [N, 2] float32
    (optional) holds each step's (alpha, sigma) for ``noised_state``.
    """

    def __init__(
        self,
        name: str,
        timesteps: torch.Tensor,
        coefs: torch.Tensor,
        clip_range: float | None,
        init_scale: float,
        levels: torch.Tensor | None = None,
    ) -> None:
        self.name = name
        self.timesteps = timesteps
        self.coefs = coefs
        self.clip_range = clip_range
        self.init_scale = init_scale
        self.levels = levels
        self.num_steps = int(timesteps.shape[0])
        # read on the host: make_sampler builds from host tables, then moves them (``to`` keeps what was read); a
        # table on the GPU would make the host wait here for all the work queued before (a text encoder's, say)
        nonzero = (coefs != 0).any(dim=0).tolist()
        self.uses_h1 = nonzero[COL["E"]] or nonzero[COL["K1"]] or nonzero[COL["K2"]]
        self.uses_h2 = nonzero[COL["K2"]]
        self.uses_aux = nonzero[COL["Ka"]]
        # Which steps add noise: fixed when the table is built, read on the host (no sync in step).
        self.noise_steps = tuple(bool(v) for v in (coefs[:, COL["F"]] != 0).tolist())
        self.needs_noise = any(self.noise_steps)

    def __repr__(self) -> str:
        return (
            f"Sampler(name={self.name!r}, num_steps={self.num_steps}, clip_range={self.clip_range}, "
            f"needs_noise={self.needs_noise}, device={self.coefs.device})"
        )

    def to(self, device: torch.device | str) -> Sampler:
        """The same sampler with its tables on ``device`` (what the host reads of them stays read)."""

        def move(t: torch.Tensor) -> torch.Tensor:  # host tables through pinned memory: no wait for queued work
            return host_to_device(t, device) if t.device.type == "cpu" else t.to(device)

        moved = copy.copy(self)
        moved.timesteps, moved.coefs = move(self.timesteps), move(self.coefs)
        moved.levels = None if self.levels is None else move(self.levels)
        return moved

    def new_state(self, x: torch.Tensor) -> SamplerState:
        """Zeroed history buffers like ``x`` (fp32, or fp64 for fp64 x): read with coefficient 0 at the first
        steps, so finite."""
        dtype = torch.promote_types(x.dtype, torch.float32)

        def zeros(used: bool) -> torch.Tensor | None:
            return torch.zeros_like(x, dtype=dtype) if used else None

        return SamplerState(torch.zeros_like(x, dtype=dtype), zeros(self.uses_h2), zeros(self.uses_aux))

    def noised_state(self, x0: torch.Tensor, noise: torch.Tensor, step: int = 0) -> torch.Tensor:
        """The state x at ``step`` for clean x0 and unit-variance ``noise``: alpha·x0 + sigma·noise in fp32.

        This is the diffusers scheduler's ``add_noise`` at that step's timestep (then ``scale_model_input`` for
        the Euler samplers), i.e. where an img2img loop begins.
        """
        if self.levels is None:
            raise FastdiffError(f"{self.name} sampler was built without noise levels")
        alpha, sigma = self.levels[step].to(torch.float32)
        return alpha * x0.to(torch.float32) + sigma * noise.to(torch.float32)

    def step(
        self,
        i: int,
        x: torch.Tensor,
        model_output: torch.Tensor,
        state: SamplerState,
        noise: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Step i in plain torch (``sampler_step_ref``): returns x_next and updates ``state`` in place.

        ``noise`` is step i's z (needed where ``noise_steps[i]``); ``guidance`` [B] combines a [2B] model output
        of (unconditional, conditional) halves.
        """
        if self.noise_steps[i] and noise is None:
            raise FastdiffError(f"{self.name} step {i} needs noise")
        x_next = torch.empty_like(x, dtype=torch.promote_types(x.dtype, torch.float32))
        out = (x_next, state.h1, *(t for t in (state.h2, state.aux) if t is not None))
        sampler_step_ref(
            x, model_output, self.coefs, i, state.h1, state.h2, state.aux,
            noise=noise if self.noise_steps[i] else None, guidance=guidance, clip_range=self.clip_range, out=out,
        )  # fmt: skip
        return x_next


def guidance_steps(interval: tuple[float, float], num_steps: int) -> tuple[int, int]:
    """The guided steps ``first..stop-1`` of ``num_steps`` for a (start, stop) interval in fractions of the steps."""
    start, stop = check_guidance_interval(interval)
    return int(start * num_steps), int(stop * num_steps)


def make_sampler(
    name: str,
    config: ScheduleConfig,
    steps: int,
    eta: float = 0.0,
    device: torch.device | str = "cpu",
    karras: bool | None = None,
    clipped_model_output: bool = False,
    start: int = 0,
    guidance_interval: tuple[float, float] = FULL_GUIDANCE,
) -> Sampler:
    """Build sampler ``name`` (one of ``SAMPLERS``) for ``steps`` steps of ``config``'s schedule.

    ``start`` > 0 keeps steps ``start``..``steps - 1`` of that grid only (img2img, diffusers' ``set_begin_index``):
    the sampler then has ``steps - start`` steps, begins at ``noised_state(x0, noise)``, and the multistep solvers
    warm up from first order again, as their diffusers schedulers do with an empty history.

    The config is read as the sampler's diffusers scheduler reads it (``ScheduleConfig.for_sampler``: keys a
    saved config lacks take that scheduler's defaults). Per-sampler knobs:

    - ddpm: ``variance_type``, ``clip_sample``/``clip_sample_range``.
    - ddim: ``eta`` (0 = deterministic, 1 = DDPM-like variance), ``set_alpha_to_one``, clipping;
      ``clipped_model_output`` re-derives eps from the clipped x0 (diffusers' ``use_clipped_model_output=True``;
      the default keeps the model's eps, as DDIMPipeline and StableDiffusionPipeline do).
    - euler, euler_a, dpmsolver++, dpmsolver++_sde, unipc: never clip (their schedulers have no ``clip_sample``).
      ``karras`` (default: the config's ``use_karras_sigmas``) uses Karras et al.'s sigma spacing; euler_a
      has no Karras option in diffusers. The multistep solvers need strictly decreasing noise levels.

    ``guidance_interval`` (start, stop): classifier-free guidance applies at steps ``int(start·N) <= i <
    int(stop·N)`` of the N steps this sampler runs and the other steps take the conditional output alone (table
    column W; without guidance it changes nothing). This is diffusers' ``ClassifierFreeGuidance(start=, stop=)``
    guider. Kynkäänniemi et al. 2024 ("Applying guidance in a limited interval") state the interval in noise
    levels instead; fastdiff follows diffusers' fractions of steps.
    """
    if name not in SAMPLERS:
        raise FastdiffError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")
    try:
        steps = operator.index(steps)
    except TypeError:
        raise FastdiffError(f"steps must be an int, got {steps!r}") from None
    if isinstance(steps, bool) or not 1 <= steps <= config.num_train_timesteps:
        raise FastdiffError(f"steps must be in 1..{config.num_train_timesteps}, got {steps}")
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < steps:
        raise FastdiffError(f"start must be an int in 0..{steps - 1}, got {start!r}")
    if isinstance(eta, bool) or not isinstance(eta, int | float) or not eta >= 0:
        raise FastdiffError(f"eta must be a number >= 0, got {eta!r}")
    if eta != 0 and name != "ddim":
        raise FastdiffError(f"eta applies to ddim only, got eta={eta} for {name}")
    if clipped_model_output and name != "ddim":
        raise FastdiffError(f"clipped_model_output applies to ddim only, not {name}")
    config = config.for_sampler(name)
    if karras is None:
        karras = config.use_karras_sigmas and name in KARRAS_SAMPLERS
    if karras and name not in KARRAS_SAMPLERS:
        raise FastdiffError(f"karras sigmas apply to {', '.join(KARRAS_SAMPLERS)}, not {name}")
    if karras != config.use_karras_sigmas:
        config = ScheduleConfig(**{**vars(config), "use_karras_sigmas": karras, "given": None})

    abar = alphas_cumprod(config)
    table = _table(name, config, abar, steps, float(eta), clipped_model_output, start)
    first, stop = guidance_steps(guidance_interval, len(table.timesteps))
    table.coefs[:first, COL["W"]] = 0.0
    table.coefs[stop:, COL["W"]] = 0.0
    coefs = torch.from_numpy(table.coefs)
    if not torch.isfinite(coefs).all():
        raise FastdiffError(f"{name} coefficients are not finite for {steps} steps of this schedule")
    clip_range = config.clip_sample_range if config.clip_sample and name in ("ddpm", "ddim") else None
    log.debug("%s: %d steps, t %.2f..%.2f, clip %s", name, steps, table.timesteps[0], table.timesteps[-1], clip_range)
    return Sampler(
        name,
        torch.from_numpy(table.timesteps).to(torch.float32),
        coefs.to(torch.float32),
        clip_range,
        table.init_scale,
        torch.from_numpy(table.levels).to(torch.float32),
    ).to(device)


def _table(
    name: str,
    config: ScheduleConfig,
    abar: torch.Tensor,
    steps: int,
    eta: float,
    clipped_model_output: bool,
    start: int,
) -> Table:
    if name == "ddpm":
        timesteps = discrete_timesteps(config, steps)
        return ddpm_table(abar, timesteps, config.prediction_type, config.variance_type).tail(start)
    if name == "ddim":
        return ddim_table(abar, discrete_timesteps(config, steps), config, eta, clipped_model_output).tail(start)
    timesteps, sigmas = sigma_grid(name, config, abar, steps)
    timesteps, sigmas = timesteps[start:], sigmas[start:]  # the multistep solvers' warm-up restarts at ``start``
    if name in ("euler", "euler_a"):
        return euler_table(sigmas, timesteps, config, ancestral=name == "euler_a")
    if name == "unipc":
        return unipc_table(sigmas, timesteps, config.prediction_type)
    return dpmsolver_pp_table(sigmas, timesteps, config.prediction_type, sde=name == "dpmsolver++_sde")
