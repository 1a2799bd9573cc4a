"""Per-step coefficient tables for every sampler, computed in float64 from diffusers' own grids.

Every step is one ``fastdiff.kernels.sampler_step`` update with the row's 12 coefficients (and its
guidance switch W, 1 here: ``make_sampler`` clears it outside a guidance interval)::

    x0     = A·x + B·out                                (then clamped to [-r, r] where the scheduler clips)
    xc     = Kx·x + Ka·aux + K0·x0 + K1·h1 + K2·h2      (UniPC's corrector; xc = x otherwise)
    x_next = C·xc + D·x0 + E·h1 + G·out + F·z

with ``h1``/``h2`` the x0 of the previous two steps and ``aux`` the previous step's xc. ``x`` is always what the
model is fed at that step: for the Euler samplers, whose diffusers state x_sigma = x0 + sigma·eps is divided by
sqrt(sigma^2 + 1) in ``scale_model_input``, the table carries that division (``x = x_sigma / s``) so the engine
never scales the model input. Each table equals its diffusers scheduler's default ``step`` loop, including its
timestep grid, its choice of the "previous" timestep, its order warm-up and its lowered final order.

Notation: abar_t = alphas_cumprod[t]; the forward process is x_t = alpha_t·x0 + sigma_t·eps (Ho et al. 2020,
eq. 4) with alpha_t = sqrt(abar_t), sigma_t = sqrt(1 - abar_t); the variance-exploding noise level is
sigma = sigma_t / alpha_t (Karras et al. 2022) and lambda = log(alpha_t / sigma_t) = -log(sigma).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.sampler_step import COL, COLUMNS
from fastdiff.samplers.schedule import ScheduleConfig

DDPM_MIN_VARIANCE = 1e-20
"""diffusers clamps DDPM's posterior variance here (it is 0 when the previous step is the clean image)."""
DDIM_NEGATIVE_SLACK = 1e-12
"""1 - abar_prev - sigma^2 down to this much below 0 is float rounding and is read as 0."""
KARRAS_RHO = 7.0
"""Karras et al. 2022, eq. 5 (the value diffusers uses)."""


@dataclass
class Table:
    """A sampler's per-step inputs and coefficients (float64 numpy; the sampler casts to float32 tensors)."""

    timesteps: np.ndarray
    """[N] the model's time input at each step (integers for the discrete samplers, fractions for Euler)."""
    coefs: np.ndarray
    """[N, 13] in ``COLUMNS`` order."""
    levels: np.ndarray
    """[N, 2] (alpha, sigma) of the state x at step i: x = alpha·x0 + sigma·eps (the scheduler's ``add_noise``
    in the table's state, i.e. divided by sqrt(sigma^2 + 1) for Euler's variance-exploding sigma)."""
    init_scale: float = 1.0
    """x at step 0 = init_scale · x_T for unit-variance x_T (diffusers' init_noise_sigma / the input scale)."""

    @classmethod
    def empty(cls, timesteps: np.ndarray) -> Table:
        coefs = np.zeros((len(timesteps), len(COLUMNS)))
        coefs[:, COL["Kx"]] = 1.0  # no corrector: xc = x
        coefs[:, COL["W"]] = 1.0  # guidance at every step
        return cls(np.asarray(timesteps, dtype=np.float64), coefs, np.zeros((len(timesteps), 2)))

    def set(self, i: int, **values: float) -> None:
        for name, value in values.items():
            self.coefs[i, COL[name]] = value

    def tail(self, start: int) -> Table:
        """Steps ``start``.. of this table (img2img: the loop begins part-way down the grid)."""
        return Table(self.timesteps[start:], self.coefs[start:], self.levels[start:], self.init_scale)


def x0_coefficients(alpha: float, sigma: float, prediction_type: str) -> tuple[float, float]:
    """(A, B) with x0 = A·x_t + B·model_output.

    epsilon: invert x_t = alpha·x0 + sigma·eps (Ho et al. 2020, eq. 4): x0 = (x_t - sigma·eps) / alpha.
    v_prediction: v = alpha·eps - sigma·x0 (Salimans & Ho 2022, Sec. 4) gives x0 = alpha·x_t - sigma·v.
    """
    if prediction_type == "epsilon":
        return 1.0 / alpha, -sigma / alpha
    return alpha, -sigma


# ------------------------------------------------------------------------------------------------ grids
def discrete_timesteps(config: ScheduleConfig, steps: int, solver_grid: bool = False) -> np.ndarray:
    """The ``steps`` integer timesteps, descending (DDPM/DDIM ``set_timesteps``; ``solver_grid=True`` for
    DPMSolverMultistep/UniPC, whose "leading"/"linspace" place ``steps + 1`` points and drop the last).

    For ``trailing`` with some step counts (61, 103, ...) diffusers' float ``np.arange`` yields one extra point
    that becomes timestep -1; it is dropped here, so those counts give ``steps`` timesteps, not ``steps + 1``.
    """
    train = config.num_train_timesteps
    points = steps + 1 if solver_grid else steps
    if config.timestep_spacing == "linspace":
        timesteps = np.linspace(0, train - 1, points).round()[::-1][:steps]
    elif config.timestep_spacing == "leading":
        timesteps = (np.arange(0, points) * (train // points)).round()[::-1][:steps] + config.steps_offset
    else:  # trailing
        timesteps = np.round(np.arange(train, 0, -train / steps))[:steps] - 1
    return _checked(timesteps.astype(np.int64), config, steps)


def euler_timesteps(config: ScheduleConfig, steps: int) -> np.ndarray:
    """EulerDiscrete/EulerAncestral ``set_timesteps``: float32 points ("linspace" is not rounded)."""
    train = config.num_train_timesteps
    if config.timestep_spacing == "linspace":
        timesteps = np.linspace(0, train - 1, steps, dtype=np.float32)[::-1]
    elif config.timestep_spacing == "leading":
        timesteps = (np.arange(0, steps) * (train // steps)).round()[::-1].astype(np.float32) + config.steps_offset
    else:
        timesteps = (np.arange(train, 0, -train / steps)).round()[:steps].astype(np.float32) - 1
    return _checked(timesteps.astype(np.float64), config, steps)


def _checked(timesteps: np.ndarray, config: ScheduleConfig, steps: int) -> np.ndarray:
    if timesteps.min() < 0 or timesteps.max() >= config.num_train_timesteps:
        raise FastdiffError(
            f"{steps} steps with timestep_spacing={config.timestep_spacing} and steps_offset={config.steps_offset} "
            f"give timesteps outside 0..{config.num_train_timesteps - 1}"
        )
    return timesteps


def train_sigmas(abar: torch.Tensor) -> np.ndarray:
    """sqrt((1 - abar) / abar) in float32, as every diffusers sigma scheduler computes it, [T] ascending in t."""
    abar32 = abar.to(torch.float32)
    return (((1 - abar32) / abar32) ** 0.5).numpy()


def karras_sigmas(sigma_min: float, sigma_max: float, steps: int) -> np.ndarray:
    """Karras et al. 2022, eq. 5: sigma_i = (max^(1/rho) + i/(N-1)·(min^(1/rho) - max^(1/rho)))^rho."""
    ramp = np.linspace(0, 1, steps)
    lo, hi = sigma_min ** (1 / KARRAS_RHO), sigma_max ** (1 / KARRAS_RHO)
    return (hi + ramp * (lo - hi)) ** KARRAS_RHO


def sigma_to_t(sigmas: np.ndarray, log_train_sigmas: np.ndarray) -> np.ndarray:
    """The fractional timestep of each sigma: linear interpolation in log-sigma (diffusers ``_sigma_to_t``)."""
    log_sigma = np.log(np.maximum(sigmas, 1e-10))
    dists = log_sigma - log_train_sigmas[:, np.newaxis]
    low = np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_train_sigmas.shape[0] - 2)
    lo, hi = log_train_sigmas[low], log_train_sigmas[low + 1]
    w = np.clip((lo - log_sigma) / (lo - hi), 0, 1)
    return (1 - w) * low + w * (low + 1)


def sigma_grid(name: str, config: ScheduleConfig, abar: torch.Tensor, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(timesteps [N], sigmas [N + 1] ending in 0) of the Euler, DPM-Solver++ and UniPC schedulers.

    Euler interpolates the training sigmas at its float timesteps; with Karras sigmas it spaces them between its
    own first and last sigma and maps them back to fractional timesteps. DPM-Solver++ and UniPC use integer
    timesteps; with Karras sigmas they span the whole training range and round the timesteps (DPM-Solver++ on the
    cosine schedule skips the rounding and diffusers' int64 cast truncates: so does this).
    """
    sigmas_t = train_sigmas(abar)
    karras = config.use_karras_sigmas
    if name in ("euler", "euler_a"):
        timesteps = euler_timesteps(config, steps)
        sigmas = np.interp(timesteps, np.arange(len(sigmas_t)), sigmas_t)
        if karras:
            sigmas = karras_sigmas(sigmas[-1].item(), sigmas[0].item(), steps)
            timesteps = sigma_to_t(sigmas, np.log(sigmas_t))
    else:
        timesteps = discrete_timesteps(config, steps, solver_grid=True)
        if karras:
            sigmas = karras_sigmas(sigmas_t[0].item(), sigmas_t[-1].item(), steps)
            timesteps = sigma_to_t(sigmas, np.log(sigmas_t))
            # diffusers rounds, except DPM-Solver++ on the cosine schedule, whose int64 cast truncates instead
            cosine_dpm = name != "unipc" and config.beta_schedule == "squaredcos_cap_v2"
            timesteps = np.trunc(timesteps) if cosine_dpm else timesteps.round()
        else:
            sigmas = np.interp(timesteps, np.arange(len(sigmas_t)), sigmas_t)
    sigmas = np.concatenate([sigmas, [0.0]]).astype(np.float32).astype(np.float64)
    return timesteps.astype(np.float64), sigmas


def _alpha_sigma(sigma: float) -> tuple[float, float]:
    """(alpha_t, sigma_t) of a VE sigma: alpha_t = 1/sqrt(sigma^2 + 1), sigma_t = sigma·alpha_t."""
    alpha = 1.0 / math.sqrt(sigma * sigma + 1.0)
    return alpha, sigma * alpha


# ----------------------------------------------------------------------------------------------- tables
def ddpm_table(abar: torch.Tensor, timesteps: np.ndarray, prediction_type: str, variance_type: str) -> Table:
    """Ancestral sampling from the DDPM posterior q(x_prev | x_t, x0) (Ho et al. 2020), DDPMScheduler.step.

    1. The step's previous timestep is the next one in ``timesteps``; after the last it is -1, where
       abar_prev = 1 (the clean image). The step's own alpha is abar_t / abar_prev, so skipped timesteps fold
       into one step (DDPMScheduler.previous_timestep).
    2. x0 from the model output (eq. 4 inverted; ``x0_coefficients``), clipped where the config clips.
    3. Posterior mean, eq. 7: mu = sqrt(abar_prev)·beta/(1-abar_t)·x0 + sqrt(alpha)·(1-abar_prev)/(1-abar_t)·x_t.
    4. Noise scale F = sqrt(variance): "fixed_small" is the posterior variance beta-tilde of eq. 7 (clamped at
       1e-20 as diffusers does), "fixed_large" is beta (Sec. 3.2). diffusers adds noise wherever t > 0.
    """
    table = Table.empty(timesteps)
    for i, t in enumerate(timesteps.astype(np.int64).tolist()):
        prev = int(timesteps[i + 1]) if i + 1 < len(timesteps) else -1  # 1.
        abar_t = float(abar[t])
        abar_prev = float(abar[prev]) if prev >= 0 else 1.0
        alpha = abar_t / abar_prev
        beta = 1.0 - alpha
        a, b = x0_coefficients(math.sqrt(abar_t), math.sqrt(1.0 - abar_t), prediction_type)  # 2.
        table.levels[i] = math.sqrt(abar_t), math.sqrt(1.0 - abar_t)
        d = math.sqrt(abar_prev) * beta / (1.0 - abar_t)  # 3.
        c = math.sqrt(alpha) * (1.0 - abar_prev) / (1.0 - abar_t)
        if variance_type == "fixed_small":  # 4.
            variance = max((1.0 - abar_prev) / (1.0 - abar_t) * beta, DDPM_MIN_VARIANCE)
        else:
            variance = beta
        table.set(i, A=a, B=b, C=c, D=d, F=math.sqrt(variance) if t > 0 else 0.0)
    return table


def ddim_table(
    abar: torch.Tensor,
    timesteps: np.ndarray,
    config: ScheduleConfig,
    eta: float,
    clipped_model_output: bool,
) -> Table:
    """The generalized DDIM step (Song et al. 2021, eq. 12), DDIMScheduler.step.

    1. The step's previous timestep is t - train_steps // N, whatever the spacing; below 0, abar_prev = 1 if
       ``set_alpha_to_one`` else abar_0.
    2. x0 from the model output (clipped where the config clips).
    3. sigma_t = eta·sqrt((1 - abar_prev)/(1 - abar_t))·sqrt(1 - abar_t/abar_prev) (eq. 16).
    4. x_prev = sqrt(abar_prev)·x0 + dir·eps + sigma_t·z with dir = sqrt(1 - abar_prev - sigma_t^2). eps is the
       model's own (diffusers' default, ``use_clipped_model_output=False``): the model output for epsilon
       prediction, sqrt(abar_t)·v + sqrt(1 - abar_t)·x_t for v-prediction. With ``clipped_model_output`` eps is
       re-derived from the clipped x0, (x_t - sqrt(abar_t)·x0)/sqrt(1 - abar_t). Without clipping both agree.
    """
    table = Table.empty(timesteps)
    step_ratio = config.num_train_timesteps // len(timesteps)
    final_abar = 1.0 if config.set_alpha_to_one else float(abar[0])
    for i, t in enumerate(timesteps.astype(np.int64).tolist()):
        prev = t - step_ratio  # 1.
        abar_t = float(abar[t])
        abar_prev = float(abar[prev]) if prev >= 0 else final_abar
        alpha_t, sigma_t = math.sqrt(abar_t), math.sqrt(1.0 - abar_t)
        a, b = x0_coefficients(alpha_t, sigma_t, config.prediction_type)  # 2.
        table.levels[i] = alpha_t, sigma_t
        sigma = eta * math.sqrt((1.0 - abar_prev) / (1.0 - abar_t) * (1.0 - abar_t / abar_prev))  # 3.
        dir_squared = 1.0 - abar_prev - sigma**2  # 4.
        if dir_squared < -DDIM_NEGATIVE_SLACK:
            raise FastdiffError(f"ddim eta={eta} is too large: 1 - abar_prev - sigma^2 < 0 at timestep {t}")
        direction = math.sqrt(max(dir_squared, 0.0))
        if clipped_model_output:
            table.set(i, C=direction / sigma_t, D=math.sqrt(abar_prev) - direction * alpha_t / sigma_t)
        elif config.prediction_type == "epsilon":
            table.set(i, D=math.sqrt(abar_prev), G=direction)
        else:
            table.set(i, C=direction * sigma_t, D=math.sqrt(abar_prev), G=direction * alpha_t)
        table.set(i, A=a, B=b, F=sigma)
    return table


def euler_table(sigmas: np.ndarray, timesteps: np.ndarray, config: ScheduleConfig, ancestral: bool) -> Table:
    """Euler's method on the probability-flow ODE in sigma (Karras et al. 2022, Alg. 1 without churn;
    EulerDiscreteScheduler.step with its defaults), or its ancestral variant (EulerAncestralDiscreteScheduler).

    With s_i = sqrt(sigma_i^2 + 1) and the fastdiff state x = x_sigma / s_i (the scaled model input):
    1. x0 = x_sigma - sigma·eps (epsilon) or -sigma/s·v + x_sigma/s^2 (v-prediction).
    2. The ODE derivative d = (x_sigma - x0)/sigma. Plain Euler steps to sigma_next:
       x_sigma' = x_sigma + (sigma_next - sigma)·d = (sigma_next/sigma)·x_sigma + (1 - sigma_next/sigma)·x0.
    3. Ancestral: step to sigma_down and add sigma_up·z, with sigma_up = sqrt(sigma_next^2·(sigma^2 -
       sigma_next^2)/sigma^2) and sigma_down = sqrt(sigma_next^2 - sigma_up^2).
    4. Divide by s_next for the next model input. x_T is scaled by init_noise_sigma / s_0, where
       init_noise_sigma = max sigma for "linspace"/"trailing" spacing and sqrt(max^2 + 1) for "leading".
    """
    table = Table.empty(timesteps)
    for i in range(len(timesteps)):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        s, s_next = math.sqrt(sigma * sigma + 1.0), math.sqrt(sigma_next * sigma_next + 1.0)
        if config.prediction_type == "epsilon":  # 1. x0 from the state x = x_sigma / s
            a, b = s, -sigma
        else:
            a, b = 1.0 / s, -sigma / s
        table.levels[i] = 1.0 / s, sigma / s
        sigma_up = 0.0
        if ancestral:  # 3.
            sigma_up = math.sqrt(sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2)
            sigma_next = math.sqrt(sigma_next**2 - sigma_up**2)
        ratio = sigma_next / sigma  # 2.
        table.set(i, A=a, B=b, C=ratio * s / s_next, D=(1.0 - ratio) / s_next, F=sigma_up / s_next)  # 4.
    max_sigma = float(np.max(sigmas))
    spread = config.timestep_spacing in ("linspace", "trailing")
    init_noise_sigma = max_sigma if spread else math.sqrt(max_sigma**2 + 1.0)
    table.init_scale = init_noise_sigma / math.sqrt(sigmas[0] ** 2 + 1.0)
    return table


def dpmsolver_pp_table(sigmas: np.ndarray, timesteps: np.ndarray, prediction_type: str, sde: bool) -> Table:
    """Multistep DPM-Solver++(2M) (Lu et al. 2022, Alg. 2, midpoint form) or its SDE variant
    (``algorithm_type="sde-dpmsolver++"``), DPMSolverMultistepScheduler.step with its defaults.

    1. alpha_i, sigma_i from the VE sigmas; lambda_i = log(alpha_i / sigma_i); h_i = lambda_{i+1} - lambda_i.
       The last point has sigma = 0 (final_sigmas_type "zero").
    2. x0_i from the model output.
    3. First order (step 0, no history, and the last step, where diffusers always lowers the order):
       ODE: x' = (sigma_{i+1}/sigma_i)·x - alpha_{i+1}·(e^{-h} - 1)·x0 (DPM-Solver++(1) = DDIM);
       SDE: x' = (sigma_{i+1}/sigma_i)·e^{-h}·x + alpha_{i+1}·(1 - e^{-2h})·x0 + sigma_{i+1}·sqrt(1 - e^{-2h})·z.
    4. Second order: r = h_{i-1}/h_i, D0 = x0_i, D1 = (x0_i - x0_{i-1})/r; the x0 term becomes D0 + D1/2, i.e.
       the x0 weight grows by 1 + 1/(2r) and x0_{i-1} gets the weight -1/(2r) of the first-order x0 weight.
    """
    steps = len(timesteps)
    table = Table.empty(timesteps)
    alphas, sigma_ts = zip(*(_alpha_sigma(s) for s in sigmas), strict=True)  # 1.
    lambdas = [math.log(a) - math.log(s) if s > 0 else math.inf for a, s in zip(alphas, sigma_ts, strict=True)]
    if any(later <= earlier for earlier, later in zip(lambdas, lambdas[1:], strict=False)):
        raise FastdiffError(f"dpmsolver++ needs strictly decreasing timesteps; got repeats among {steps} steps")
    for i in range(steps):
        a, b = x0_coefficients(alphas[i], sigma_ts[i], prediction_type)  # 2.
        table.levels[i] = alphas[i], sigma_ts[i]
        h = lambdas[i + 1] - lambdas[i]
        ratio = sigma_ts[i + 1] / sigma_ts[i]
        if sde:  # 3.
            c, d, f = ratio * math.exp(-h), alphas[i + 1] * -math.expm1(-2.0 * h), 0.0
            if sigma_ts[i + 1] > 0:
                f = sigma_ts[i + 1] * math.sqrt(-math.expm1(-2.0 * h))
        else:
            c, d, f = ratio, alphas[i + 1] * -math.expm1(-h), 0.0
        e = 0.0
        if 0 < i < steps - 1:  # 4.
            half_inv_r = 0.5 * h / (lambdas[i] - lambdas[i - 1])
            d, e = d * (1.0 + half_inv_r), -d * half_inv_r
        table.set(i, A=a, B=b, C=c, D=d, E=e, F=f)
    return table


def unipc_table(sigmas: np.ndarray, timesteps: np.ndarray, prediction_type: str) -> Table:
    """UniPC with the B(h) = e^h - 1 ("bh2") variant, order 2, data prediction (Zhao et al. 2023, Alg. 2/3);
    UniPCMultistepScheduler.step with its defaults.

    Step i: x0_i = m_i from the model output at the *uncorrected* x_i. Then
    1. UniC corrector (i > 0), order p = the previous predictor's order: with h = lambda_i - lambda_{i-1},
       x_c = (sigma_i/sigma_{i-1})·x_c,prev - alpha_i·(e^{-h} - 1)·m_{i-1}
             - alpha_i·B(h)·(rho_1·D1 + rho_p·(m_i - m_{i-1})),
       D1 = (m_{i-2} - m_{i-1})/r, r = (lambda_{i-2} - lambda_{i-1})/h, with (rho) solving R·rho = b
       (Vandermonde R of (r, 1); b_k from the phi functions); order 1 uses rho = 0.5 and no D1.
    2. UniP predictor from x_c, order min(2, i + 1, N - i): x' = (sigma_{i+1}/sigma_i)·x_c
       - alpha_{i+1}·(e^{-h} - 1)·m_i - alpha_{i+1}·B(h)·rho·D1, rho = 0.5, D1 = (m_{i-1} - m_i)/r,
       r = (lambda_{i-1} - lambda_i)/h, h = lambda_{i+1} - lambda_i.
    The table writes both stages as linear maps of (x, aux = x_c,prev, x0 = m_i, h1 = m_{i-1}, h2 = m_{i-2}).
    """
    steps = len(timesteps)
    table = Table.empty(timesteps)
    alphas, sigma_ts = zip(*(_alpha_sigma(s) for s in sigmas), strict=True)
    lambdas = [math.log(a) - math.log(s) if s > 0 else math.inf for a, s in zip(alphas, sigma_ts, strict=True)]
    if any(later <= earlier for earlier, later in zip(lambdas, lambdas[1:], strict=False)):
        raise FastdiffError(f"unipc needs strictly decreasing timesteps; got repeats among {steps} steps")

    def order_at(i: int) -> int:
        return min(2, steps - i, i + 1)

    for i in range(steps):
        a, b = x0_coefficients(alphas[i], sigma_ts[i], prediction_type)
        table.set(i, A=a, B=b)
        table.levels[i] = alphas[i], sigma_ts[i]
        if i > 0:  # 1. corrector of x_i
            h = lambdas[i] - lambdas[i - 1]
            h_phi_1 = b_h = math.expm1(-h)
            scale = alphas[i] * b_h
            k = {"Kx": 0.0, "Ka": sigma_ts[i] / sigma_ts[i - 1], "K1": -alphas[i] * h_phi_1, "K2": 0.0}
            if order_at(i - 1) == 1:
                rho_c = [0.5]
            else:
                r = (lambdas[i - 2] - lambdas[i - 1]) / h
                rho_c = _unipc_rhos(-h, b_h, [r, 1.0])
                k["K2"] = -scale * rho_c[0] / r
                k["K1"] += scale * rho_c[0] / r
            k["K0"] = -scale * rho_c[-1]
            k["K1"] += scale * rho_c[-1]
            table.set(i, **k)
        h = lambdas[i + 1] - lambdas[i]  # 2. predictor from x_c
        h_phi_1 = b_h = -1.0 if math.isinf(h) else math.expm1(-h)
        c = sigma_ts[i + 1] / sigma_ts[i]
        d, e = -alphas[i + 1] * h_phi_1, 0.0
        if order_at(i) == 2:
            r = (lambdas[i - 1] - lambdas[i]) / h
            d += 0.5 * alphas[i + 1] * b_h / r
            e = -0.5 * alphas[i + 1] * b_h / r
        table.set(i, C=c, D=d, E=e)
    return table


def _unipc_rhos(hh: float, b_h: float, rks: list[float]) -> list[float]:
    """Solve R·rho = b of UniC: R[k] = rks^k, b[k] = k!·phi_{k+1}(hh)/B(h) (diffusers' recursion for phi)."""
    order = len(rks)
    h_phi_k = math.expm1(hh) / hh - 1.0
    factorial = 1
    rhs = []
    for k in range(1, order + 1):
        rhs.append(h_phi_k * factorial / b_h)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1.0 / factorial
    vandermonde = np.array([[r ** (k - 1) for r in rks] for k in range(1, order + 1)])
    return np.linalg.solve(vandermonde, np.array(rhs)).tolist()
