"""Per-step coefficient tables (A, B, C, D, E, F) for DDPM, DDIM and DPM-Solver++(2M), computed in float64.

Every sampler step is, for step index i (see ``Sampler.step``)::

    x0     = A[i]·x + B[i]·model_output                         (then clamped to [-r, r] if clipping is on)
    x_next = C[i]·x + D[i]·x0 + E[i]·x0_prev + F[i]·noise_i

Notation: abar_t = alphas_cumprod[t]; the forward process is x_t = alpha_t·x0 + sigma_t·eps with
alpha_t = sqrt(abar_t), sigma_t = sqrt(1 - abar_t) (Ho et al. 2020, eq. 4). Each table matches the
corresponding diffusers scheduler step for step, including its choice of the "previous" timestep.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fastdiff.errors import FastdiffError

COLUMNS = ("A", "B", "C", "D", "E", "F")
DDPM_MIN_VARIANCE = 1e-20
"""diffusers clamps DDPM's posterior variance here (it is 0 when the previous step is the clean image)."""
DDIM_NEGATIVE_SLACK = 1e-12
"""1 - abar_prev - sigma^2 down to this much below 0 is float rounding and is read as 0."""


def x0_coefficients(alpha: float, sigma: float, prediction_type: str) -> tuple[float, float]:
    """(A, B) with x0 = A·x_t + B·model_output.

    epsilon: invert x_t = alpha·x0 + sigma·eps (Ho et al. 2020, eq. 4): x0 = (x_t - sigma·eps) / alpha.
    v_prediction: v = alpha·eps - sigma·x0 (Salimans & Ho 2022, Sec. 4) gives x0 = alpha·x_t - sigma·v.
    """
    if prediction_type == "epsilon":
        return 1.0 / alpha, -sigma / alpha
    return alpha, -sigma


def ddpm_table(abar: torch.Tensor, timesteps: np.ndarray, prediction_type: str, variance_type: str) -> torch.Tensor:
    """Ancestral sampling from the DDPM posterior q(x_prev | x_t, x0) (Ho et al. 2020), float64 [N, 6].

    1. The step's previous timestep is the next one in ``timesteps``; after the last it is -1, where
       abar_prev = 1 (the clean image). The step's own alpha is abar_t / abar_prev, so skipped timesteps fold
       into one step (DDPMScheduler.previous_timestep).
    2. x0 from the model output (eq. 4 inverted; ``x0_coefficients``).
    3. Posterior mean, eq. 7: mu = sqrt(abar_prev)·beta/(1-abar_t)·x0
       + sqrt(alpha)·(1-abar_prev)/(1-abar_t)·x_t, with beta = 1 - alpha. With x0 from step 2 and no clipping
       this is eq. 11.
    4. Noise scale F = sqrt(variance): "fixed_small" is the posterior variance beta-tilde of eq. 7 (clamped
       at 1e-20 as diffusers does), "fixed_large" is beta (Sec. 3.2: sigma^2 = beta_t). Like Algorithm 2
       (z = 0 at the last step) F is 0 where t = 0; diffusers adds noise wherever t > 0, so a last step at
       t > 0 (trailing spacing, steps_offset) keeps its noise, as there.
    """
    table = torch.zeros(len(timesteps), len(COLUMNS), dtype=torch.float64)
    for i, t in enumerate(timesteps.tolist()):
        # 1. previous timestep and this step's alpha/beta
        prev = int(timesteps[i + 1]) if i + 1 < len(timesteps) else -1
        abar_t = float(abar[t])
        abar_prev = float(abar[prev]) if prev >= 0 else 1.0
        alpha = abar_t / abar_prev
        beta = 1.0 - alpha
        # 2. x0
        a, b = x0_coefficients(math.sqrt(abar_t), math.sqrt(1.0 - abar_t), prediction_type)
        # 3. posterior mean (eq. 7)
        d = math.sqrt(abar_prev) * beta / (1.0 - abar_t)
        c = math.sqrt(alpha) * (1.0 - abar_prev) / (1.0 - abar_t)
        # 4. noise
        if variance_type == "fixed_small":
            variance = max((1.0 - abar_prev) / (1.0 - abar_t) * beta, DDPM_MIN_VARIANCE)
        else:
            variance = beta
        f = math.sqrt(variance) if t > 0 else 0.0
        table[i] = torch.tensor([a, b, c, d, 0.0, f], dtype=torch.float64)
    return table


def ddim_table(
    abar: torch.Tensor,
    timesteps: np.ndarray,
    train_steps: int,
    prediction_type: str,
    eta: float,
    set_alpha_to_one: bool,
) -> torch.Tensor:
    """The generalized (non-Markovian) DDIM step (Song et al. 2021), float64 [N, 6].

    1. The step's previous timestep is t - train_steps // N, whatever the spacing (as DDIMScheduler.step
       does); below 0, abar_prev = 1 if ``set_alpha_to_one`` else abar_0.
    2. x0 from the model output (``x0_coefficients``).
    3. sigma_t = eta·sqrt((1 - abar_prev)/(1 - abar_t))·sqrt(1 - abar_t/abar_prev) (eq. 16).
    4. eq. 12: x_prev = sqrt(abar_prev)·x0 + sqrt(1 - abar_prev - sigma_t^2)·eps + sigma_t·z, where eps is
       re-derived from the (possibly clipped) x0 as eps = (x_t - sqrt(abar_t)·x0)/sqrt(1 - abar_t) (diffusers'
       ``use_clipped_model_output=True``; without clipping it equals the model's eps). Collecting terms:
       C = dir/sqrt(1 - abar_t), D = sqrt(abar_prev) - dir·sqrt(abar_t)/sqrt(1 - abar_t), F = sigma_t,
       with dir = sqrt(1 - abar_prev - sigma_t^2).
    """
    step_ratio = train_steps // len(timesteps)
    final_abar = 1.0 if set_alpha_to_one else float(abar[0])
    table = torch.zeros(len(timesteps), len(COLUMNS), dtype=torch.float64)
    for i, t in enumerate(timesteps.tolist()):
        # 1. previous timestep
        prev = t - step_ratio
        abar_t = float(abar[t])
        abar_prev = float(abar[prev]) if prev >= 0 else final_abar
        # 2. x0
        a, b = x0_coefficients(math.sqrt(abar_t), math.sqrt(1.0 - abar_t), prediction_type)
        # 3. sigma_t (eq. 16)
        sigma = eta * math.sqrt((1.0 - abar_prev) / (1.0 - abar_t) * (1.0 - abar_t / abar_prev))
        # 4. eq. 12 with eps re-derived from x0
        dir_squared = 1.0 - abar_prev - sigma**2
        if dir_squared < -DDIM_NEGATIVE_SLACK:
            raise FastdiffError(f"ddim eta={eta} is too large: 1 - abar_prev - sigma^2 < 0 at timestep {t}")
        direction = math.sqrt(max(dir_squared, 0.0))
        c = direction / math.sqrt(1.0 - abar_t)
        d = math.sqrt(abar_prev) - direction * math.sqrt(abar_t) / math.sqrt(1.0 - abar_t)
        table[i] = torch.tensor([a, b, c, d, 0.0, sigma], dtype=torch.float64)
    return table


def dpmsolver_pp_2m_table(abar: torch.Tensor, timesteps: np.ndarray, prediction_type: str) -> torch.Tensor:
    """Multistep DPM-Solver++(2M), data prediction, midpoint form (Lu et al. 2022, Alg. 2), float64 [N, 6].

    diffusers' DPMSolverMultistepScheduler defaults: solver_order 2, solver_type "midpoint",
    lower_order_final True, final_sigmas_type "zero", euler_at_final False.

    1. Grid: s_i = timesteps[i] for i < N with alpha_i = sqrt(abar), sigma_i = sqrt(1 - abar), and a final
       point s_N with sigma_N = 0, alpha_N = 1 (final_sigmas_type "zero"). lambda_i = log(alpha_i / sigma_i),
       and h_i = lambda_{i+1} - lambda_i must be > 0 (strictly decreasing timesteps).
    2. x0_i = x_theta(x_i, s_i) from the model output (``x0_coefficients``).
    3. First-order step (DPM-Solver++(1), Lu et al. Sec. 4.1; = DDIM): x_{i+1} = (sigma_{i+1}/sigma_i)·x_i
       + alpha_{i+1}·(1 - e^{-h_i})·x0_i. Used at step 0 (no history) and at the last step (diffusers always
       lowers the order there when final_sigmas_type is "zero"); with sigma_N = 0 the last step is x_N = x0.
    4. Second-order multistep step (Alg. 2): r_i = h_{i-1}/h_i, D_i = (1 + 1/(2r_i))·x0_i - 1/(2r_i)·x0_{i-1},
       x_{i+1} = (sigma_{i+1}/sigma_i)·x_i + alpha_{i+1}·(1 - e^{-h_i})·D_i, i.e. the x0 weight grows by
       (1 + 1/(2r_i)) and E = -alpha_{i+1}·(1 - e^{-h_i})/(2r_i).
    """
    steps = len(timesteps)
    # 1. grid
    alphas = [math.sqrt(float(abar[t])) for t in timesteps.tolist()] + [1.0]
    sigmas = [math.sqrt(1.0 - float(abar[t])) for t in timesteps.tolist()] + [0.0]
    lambdas = [math.log(a) - math.log(s) for a, s in zip(alphas[:-1], sigmas[:-1], strict=True)] + [math.inf]
    if any(later <= earlier for earlier, later in zip(lambdas, lambdas[1:], strict=False)):
        raise FastdiffError(f"dpmsolver++ needs strictly decreasing timesteps; got repeats among {steps} steps")
    table = torch.zeros(steps, len(COLUMNS), dtype=torch.float64)
    for i in range(steps):
        # 2. x0
        a, b = x0_coefficients(alphas[i], sigmas[i], prediction_type)
        if i == steps - 1:
            # 3. last step: sigma_N = 0, h = inf -> x_N = alpha_N·x0 = x0
            table[i] = torch.tensor([a, b, 0.0, alphas[steps], 0.0, 0.0], dtype=torch.float64)
            continue
        h = lambdas[i + 1] - lambdas[i]
        c = sigmas[i + 1] / sigmas[i]
        d = alphas[i + 1] * -math.expm1(-h)
        e = 0.0
        if i > 0:
            # 4. second-order multistep
            half_inv_r = 0.5 * h / (lambdas[i] - lambdas[i - 1])
            d, e = d * (1.0 + half_inv_r), -d * half_inv_r
        table[i] = torch.tensor([a, b, c, d, e, 0.0], dtype=torch.float64)
    return table
