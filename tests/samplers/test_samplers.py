"""Every sampler against its diffusers scheduler's *default* loop, on the scheduler configs real checkpoints ship.

The diffusers side runs exactly what its pipelines run: ``Scheduler.from_config(saved_config)`` (keys the config
lacks take that scheduler's defaults), ``set_timesteps(N)``, ``x = x_T · init_noise_sigma``, then per step
``model(scale_model_input(x, t), t)`` and ``step(out, t, x)`` with default arguments. fastdiff's side loads the same
saved config through ``ScheduleConfig.from_diffusers`` and runs ``make_sampler(name, config, N)`` from the same
unit-variance x_T. Stochastic steps get the same injected noise on both sides (diffusers' ``randn_tensor`` patched).

The model is the exact eps (or v) of a Gaussian data distribution N(0, 0.6^2) plus ``1.5·sigma_t`` times a random
tanh network added to its x0: the exact part keeps trajectories O(1) (a bare random network drives them to |x| ~
500, where fp32 rounding alone exceeds 1e-4), the network part makes x0 leave [-1, 1] at high noise, so clipping is
active wherever a config clips (checked).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.samplers import (
    KARRAS_SAMPLERS,
    SAMPLER_SCHEDULERS,
    SAMPLERS,
    Sampler,
    ScheduleConfig,
    alphas_cumprod,
    make_sampler,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

SHIPPED_CONFIGS = json.loads(
    """{
  "google/ddpm-cifar10-32": {"_class_name": "DDPMScheduler", "_diffusers_version": "0.1.1", "beta_end": 0.02,
    "beta_schedule": "linear", "beta_start": 0.0001, "clip_sample": true, "num_train_timesteps": 1000,
    "trained_betas": null, "variance_type": "fixed_small"},
  "google/ddpm-celebahq-256": {"_class_name": "DDPMScheduler", "_diffusers_version": "0.1.1", "beta_end": 0.02,
    "beta_schedule": "linear", "beta_start": 0.0001, "clip_sample": true, "num_train_timesteps": 1000,
    "trained_betas": null, "variance_type": "fixed_small"},
  "runwayml/stable-diffusion-v1-5": {"_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0",
    "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "num_train_timesteps": 1000,
    "set_alpha_to_one": false, "skip_prk_steps": true, "steps_offset": 1, "trained_betas": null,
    "clip_sample": false},
  "stabilityai/stable-diffusion-2-1": {"_class_name": "DDIMScheduler", "_diffusers_version": "0.8.0",
    "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": false,
    "num_train_timesteps": 1000, "prediction_type": "v_prediction", "set_alpha_to_one": false,
    "skip_prk_steps": true, "steps_offset": 1, "trained_betas": null},
  "fastdiff/fashion-mnist": {"_class_name": "DDIMScheduler", "beta_end": 0.02, "beta_schedule": "squaredcos_cap_v2",
    "beta_start": 0.0001, "clip_sample": true, "clip_sample_range": 1.0, "num_train_timesteps": 1000,
    "prediction_type": "v_prediction", "rescale_betas_zero_snr": false, "set_alpha_to_one": true,
    "steps_offset": 0, "thresholding": false, "timestep_spacing": "trailing", "trained_betas": null,
    "variance_type": "fixed_small"}
}"""
)
"""The scheduler_config.json files of well-known checkpoints, verbatim (and fastdiff's bundled model's)."""

SAMPLE_SHAPE = (3, 6, 10)
SEEDS = (11, 1234)
DATA_STD = 0.6
TOLERANCE = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class CheapNet(torch.nn.Module):
    """A random 3x3 conv with a timestep-dependent bias and tanh: nonlinear, spatially mixing, cheap."""

    def __init__(self, channels: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(channels, channels, 3, 3, generator=gen) * 0.4)
        self.bias = torch.nn.Parameter(torch.randn(channels, generator=gen))

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        phase = torch.sin(t.to(x.dtype) * 0.01)
        y = torch.nn.functional.conv2d(x, self.weight, padding=1) + (self.bias * phase).reshape(-1, 1, 1)
        return torch.tanh(2 * y)


class GaussianDenoiserPlus(torch.nn.Module):
    """The exact denoiser for data ~ N(0, DATA_STD^2) plus ``scale·sigma_t·net`` on its x0, returned as eps or v.
    Fractional timesteps (Euler) read alpha-bar linearly interpolated."""

    def __init__(self, config: ScheduleConfig, scale: float = 1.5, seed: int = 0) -> None:
        super().__init__()
        self.net = CheapNet(SAMPLE_SHAPE[0], seed)
        self.scale = scale
        self.prediction_type = config.prediction_type
        self.register_buffer("abar", alphas_cumprod(config).float())

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = t.reshape(-1)[:1].float()
        low = t.floor().long().clamp(max=len(self.abar) - 2)
        w = t - low
        abar = (1 - w) * self.abar[low] + w * self.abar[low + 1]
        alpha, sigma = abar.sqrt(), (1 - abar).sqrt()
        x0 = alpha * DATA_STD**2 * x / (alpha**2 * DATA_STD**2 + sigma**2) + self.scale * sigma * self.net(x, t)
        eps = (x - alpha * x0) / sigma
        return eps if self.prediction_type == "epsilon" else alpha * eps - sigma * x0


def diffusers_scheduler(name: str, saved: dict, **options):
    diffusers = pytest.importorskip("diffusers")
    if name == "dpmsolver++_sde":
        options["algorithm_type"] = "sde-dpmsolver++"
    return getattr(diffusers, SAMPLER_SCHEDULERS[name]).from_config(saved, **options)


@torch.no_grad()
def run_diffusers(name, saved, steps, model, x_t, noise, monkeypatch, step_kwargs=None, **options):
    """diffusers' pipeline loop with default arguments; returns the final sample and how many steps clipped."""
    sched = diffusers_scheduler(name, saved, **options)
    sched.set_timesteps(steps)
    draws = iter(noise)
    module = __import__(type(sched).__module__, fromlist=["randn_tensor"])
    if hasattr(module, "randn_tensor"):
        monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: next(draws).clone())
    clip = sched.config.get("clip_sample") and name in ("ddpm", "ddim")
    x, clipped = x_t * sched.init_noise_sigma, 0
    for t in sched.timesteps:
        out = model(sched.scale_model_input(x, t), t)
        result = sched.step(out, t, x, **(step_kwargs or {}))
        if clip:
            clipped += int((result.pred_original_sample.abs() >= sched.config.clip_sample_range).any())
        x = result.prev_sample
    return x, clipped


@torch.no_grad()
def euler_float64(name, saved, steps, model, x_t, noise, **options) -> torch.Tensor:
    """diffusers' Euler / Euler-ancestral step written out in float64 on diffusers' own sigma grid.

    diffusers runs Euler in the variance-exploding form x_sigma in fp32; with the cosine schedule sigma_max is
    ~1e4 and its fp32 rounding alone reaches ~1e-3 by the end. This is the same loop without that rounding."""
    sched = diffusers_scheduler(name, saved, **options)
    sched.set_timesteps(steps)
    sigmas = sched.sigmas.double()
    x = x_t.double() * float(sched.init_noise_sigma)
    for i, t in enumerate(sched.timesteps):
        sigma, sigma_next = sigmas[i], sigmas[i + 1]
        out = model.double()(x / (sigma**2 + 1) ** 0.5, t)
        if sched.config.prediction_type == "epsilon":
            x0 = x - sigma * out
        else:
            x0 = out * (-sigma / (sigma**2 + 1) ** 0.5) + x / (sigma**2 + 1)
        sigma_up = (
            torch.zeros(()) if name == "euler" else (sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2) ** 0.5
        )
        sigma_down = (sigma_next**2 - sigma_up**2) ** 0.5
        x = x + (x - x0) / sigma * (sigma_down - sigma) + sigma_up * noise[i].double()
    model.float()
    return x.float()


@torch.no_grad()
def run_ours(sampler: Sampler, model, x_t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    x = x_t * sampler.init_scale
    state = sampler.new_state(x)
    draws = iter(noise)
    for i in range(sampler.num_steps):
        out = model(x, sampler.timesteps[i])
        x = sampler.step(i, x, out, state, next(draws) if sampler.noise_steps[i] else None)
    return x


def inputs(steps: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x_t = torch.randn((len(SEEDS), *SAMPLE_SHAPE), generator=gen)
    return x_t, torch.randn((steps, len(SEEDS), *SAMPLE_SHAPE), generator=gen)


def check(name, saved, steps, monkeypatch, karras=None, eta=0.0, clipped_model_output=False, chaotic=False) -> float:
    """Max abs difference of our loop to diffusers' default loop, asserted <= 1e-4. ``chaotic``: a run long
    enough that fp32 rounding alone moves diffusers' own result by more than that from its float64 value; then
    ours must be at least as close to the float64 loop as diffusers is (METHOD: compare in higher precision)."""
    config = ScheduleConfig.from_diffusers(saved)
    model = GaussianDenoiserPlus(config.for_sampler(name))
    x_t, noise = inputs(steps)
    options = {"use_karras_sigmas": True} if karras else {}
    step_kwargs = {"eta": eta, "use_clipped_model_output": clipped_model_output} if name == "ddim" else None
    ref, clipped = run_diffusers(name, saved, steps, model, x_t, noise, monkeypatch, step_kwargs, **options)
    sampler = make_sampler(name, config, steps, eta=eta, karras=karras, clipped_model_output=clipped_model_output)
    noise_steps = [n for n, used in zip(noise, sampler.noise_steps, strict=True) if used]
    ours = run_ours(sampler, model, x_t, torch.stack(noise_steps) if noise_steps else noise[:0])
    if sampler.clip_range is not None:
        assert clipped > 0, "clipping never triggered: the test would not see a clipping bug"
    assert torch.isfinite(ref).all() and ref.abs().max() > 0.1
    if name in ("euler", "euler_a") and float(diffusers_scheduler(name, saved).sigmas.max()) > 1e3:
        exact = euler_float64(name, saved, steps, model, x_t, noise, **options)
        assert (ref - exact).abs().max() < 1e-2  # diffusers itself, to its fp32 rounding
        ref = exact
    err = (ours - ref).abs().max().item()
    if chaotic:
        table64 = Sampler(name, sampler.timesteps, sampler.coefs.double(), sampler.clip_range, sampler.init_scale)
        exact = run_ours(table64, model.double(), x_t.double(), noise.double())
        model.float()
        ours_err, ref_err = ((t.double() - exact).abs().max().item() for t in (ours, ref))
        assert ours_err <= max(TOLERANCE, 1.5 * ref_err), f"ours {ours_err:.2e} vs diffusers {ref_err:.2e} off fp64"
        return ours_err
    assert err <= TOLERANCE, f"{name} {steps} steps: max abs diff {err:.2e}"
    return err


@pytest.mark.parametrize("steps", [10, 50])
@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("checkpoint", list(SHIPPED_CONFIGS))
def test_default_loop_on_shipped_config_matches_diffusers(checkpoint, name, steps, monkeypatch):
    saved = SHIPPED_CONFIGS[checkpoint]
    if name in ("dpmsolver++", "dpmsolver++_sde", "unipc") and "trailing" in json.dumps(saved) and steps > 999:
        pytest.skip("unused")
    check(name, saved, steps, monkeypatch)


def test_ddpm_1000_steps_on_google_ddpm_config(monkeypatch):
    check("ddpm", SHIPPED_CONFIGS["google/ddpm-cifar10-32"], 1000, monkeypatch)


def test_ddim_1000_steps_on_google_ddpm_config(monkeypatch):
    """Both fp32 loops land ~2e-4 from the float64 loop after 1000 clipped steps: compare in float64."""
    check("ddim", SHIPPED_CONFIGS["google/ddpm-cifar10-32"], 1000, monkeypatch, chaotic=True)


@pytest.mark.parametrize("name", KARRAS_SAMPLERS)
@pytest.mark.parametrize("checkpoint", ["runwayml/stable-diffusion-v1-5", "google/ddpm-cifar10-32"])
def test_karras_sigmas_match_diffusers(checkpoint, name, monkeypatch):
    """(With the cosine schedule diffusers' own multistep schedulers fail on Karras sigmas: repeated rounded
    timesteps break their step-index lookup, so there is nothing to compare against.)"""
    check(name, SHIPPED_CONFIGS[checkpoint], 20, monkeypatch, karras=True)


def test_karras_follows_the_saved_config_and_rejects_euler_ancestral():
    saved = {**SHIPPED_CONFIGS["runwayml/stable-diffusion-v1-5"], "use_karras_sigmas": True}
    config = ScheduleConfig.from_diffusers(saved)
    default = make_sampler("euler", config, 12)
    assert not torch.equal(default.timesteps, make_sampler("euler", config, 12, karras=False).timesteps)
    with pytest.raises(FastdiffError, match="karras"):
        make_sampler("euler_a", config, 12, karras=True)


@pytest.mark.parametrize("eta", [0.0, 0.7])
def test_ddim_clipped_model_output_option(eta, monkeypatch):
    """The non-default ``use_clipped_model_output=True`` is an explicit option, and it differs from the default
    where clipping is active (the defect this suite exists for)."""
    saved = SHIPPED_CONFIGS["google/ddpm-cifar10-32"]
    check("ddim", saved, 25, monkeypatch, eta=eta, clipped_model_output=True)
    check("ddim", saved, 25, monkeypatch, eta=eta)
    config = ScheduleConfig.from_diffusers(saved)
    model = GaussianDenoiserPlus(config)
    x_t, noise = inputs(25)
    a = run_ours(make_sampler("ddim", config, 25, eta=eta), model, x_t, noise)
    b = run_ours(make_sampler("ddim", config, 25, eta=eta, clipped_model_output=True), model, x_t, noise)
    assert (a - b).abs().max() > 1e-2


def test_absent_keys_take_the_target_schedulers_defaults():
    """google's config has no timestep_spacing: DDIM reads "leading", DPM-Solver++ and the others "linspace"."""
    config = ScheduleConfig.from_diffusers(SHIPPED_CONFIGS["google/ddpm-cifar10-32"])
    ddim = make_sampler("ddim", config, 20).timesteps.numpy()
    dpm = make_sampler("dpmsolver++", config, 20).timesteps.numpy()
    np.testing.assert_array_equal(ddim[:3], [950, 900, 850])
    np.testing.assert_array_equal(dpm[[0, 1, -1]], [999, 949, 50])
    explicit = ScheduleConfig.from_diffusers(
        {**SHIPPED_CONFIGS["google/ddpm-cifar10-32"], "timestep_spacing": "leading"}
    )
    np.testing.assert_array_equal(make_sampler("dpmsolver++", explicit, 20).timesteps.numpy()[:2], [940, 893])


@pytest.mark.parametrize(
    "key, value, sampler",
    [("final_sigmas_type", "sigma_min", "euler"), ("solver_type", "heun", "dpmsolver++"),
     ("lower_order_final", False, "unipc"), ("use_exponential_sigmas", True, "dpmsolver++_sde")],
)  # fmt: skip
def test_scheduler_options_fastdiff_cannot_follow_are_errors(key, value, sampler):
    config = ScheduleConfig.from_diffusers({**SHIPPED_CONFIGS["runwayml/stable-diffusion-v1-5"], key: value})
    with pytest.raises(FastdiffError, match=key):
        make_sampler(sampler, config, 10)
    make_sampler("ddim", config, 10)  # a scheduler without that option ignores it, as diffusers' from_config does


@pytest.mark.parametrize("name", SAMPLERS)
def test_tables_shapes_and_flags(name):
    sampler = make_sampler(name, ScheduleConfig(), 13)
    assert sampler.coefs.shape == (13, 13) and sampler.coefs.dtype == torch.float32
    assert sampler.timesteps.shape == (13,) and sampler.timesteps.dtype == torch.float32
    assert torch.isfinite(sampler.coefs).all()
    assert sampler.needs_noise == (name in ("ddpm", "euler_a", "dpmsolver++_sde"))
    assert sampler.clip_range == (1.0 if name in ("ddpm", "ddim") else None)
    assert sampler.uses_aux == sampler.uses_h2 == (name == "unipc")
    assert sampler.uses_h1 == (name in ("dpmsolver++", "dpmsolver++_sde", "unipc"))


def test_one_step_samplers_return_x0():
    """With one step every sampler ends on its x0 prediction (sigma = 0 / abar_prev = 1)."""
    config = ScheduleConfig(clip_sample=False)
    for name in ("ddim", "euler", "dpmsolver++", "unipc"):
        sampler = make_sampler(name, config, 1)
        x, out = torch.randn(2, *SAMPLE_SHAPE), torch.randn(2, *SAMPLE_SHAPE)
        got = sampler.step(0, x, out, sampler.new_state(x))
        a, b = sampler.coefs[0, 0], sampler.coefs[0, 1]
        torch.testing.assert_close(got, a * x + b * out, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "pndm"}, "unknown sampler"),
        ({"steps": 0}, "steps"),
        ({"steps": 1001}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"eta": -1.0}, "eta"),
        ({"eta": 0.5, "name": "euler"}, "eta applies to ddim"),
        ({"clipped_model_output": True, "name": "unipc"}, "ddim only"),
        ({"karras": True, "name": "ddpm"}, "karras"),
    ],
)
def test_make_sampler_rejects_bad_arguments(kwargs, message):
    args = {"name": "ddim", "config": ScheduleConfig(), "steps": 10, "eta": 0.0} | kwargs
    with pytest.raises(FastdiffError, match=message):
        make_sampler(**args)


@pytest.mark.parametrize("name", ["dpmsolver++", "unipc"])
def test_multistep_solvers_reject_repeated_noise_levels(name):
    with pytest.raises(FastdiffError, match="strictly decreasing"):
        make_sampler(name, ScheduleConfig(timestep_spacing="linspace"), 1000)


def test_missing_noise_is_an_error():
    sampler = make_sampler("ddpm", ScheduleConfig(), 5)
    x = torch.randn(1, *SAMPLE_SHAPE)
    with pytest.raises(FastdiffError, match="needs noise"):
        sampler.step(0, x, x, sampler.new_state(x))


def test_eager_step_reads_no_tensor_back_to_host(monkeypatch):
    """Sampler.step (the eager path; the engine's graph capture is tested on CUDA below) reads no tensor value on
    the host: no .item()/.tolist()/bool()/float() on tensors."""
    sampler = make_sampler("unipc", ScheduleConfig(), 6)
    x = torch.randn(2, *SAMPLE_SHAPE)
    state = sampler.new_state(x)
    for name in ("item", "tolist", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, **k: pytest.fail("host read in step"))
    for i in range(sampler.num_steps):
        x = sampler.step(i, x, torch.tanh(x), state)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", SAMPLERS)
def test_whole_loop_captures_in_one_cuda_graph(name):
    """The engine's loop (fused step, in-kernel noise) captures and replays like its eager run."""
    from fastdiff.engine.graph import SamplingLoop

    config = ScheduleConfig.from_diffusers(SHIPPED_CONFIGS["runwayml/stable-diffusion-v1-5"])
    sampler = make_sampler(name, config, 12, device="cuda")
    model = GaussianDenoiserPlus(config.for_sampler(name)).cuda()
    shape = (2, *SAMPLE_SHAPE)
    x_t, seeds = torch.randn(shape, device="cuda"), torch.tensor([3, 4], device="cuda")

    def step_model(x_in, index):
        return model(x_in, sampler.timesteps.index_select(0, index))

    runs = []
    for graphs in (False, True):
        loop = SamplingLoop(step_model, sampler, shape, torch.float32, torch.device("cuda"), 5, use_graphs=graphs)
        runs.append(loop.run(x_t, seeds))
    torch.testing.assert_close(runs[1], runs[0], rtol=1e-5, atol=1e-5)
    assert math.isfinite(runs[1].abs().max().item())
