"""Samplers against diffusers' DDPMScheduler / DDIMScheduler / DPMSolverMultistepScheduler loops (fp32).

Both loops get the same model, x_T and per-step noise. The model is the exact eps (or v) of a Gaussian data
distribution N(0, 0.6^2) plus a perturbation from a network: a tiny random diffusers ``UNet2DModel`` for a
representative subset, a cheap random conv for the option sweeps. The exact-denoiser part keeps trajectories
O(1) (a bare random network drives unclipped samples to |x| ~ 500, where float32 rounding alone exceeds 1e-4),
while the network part makes the model nonlinear and large enough that clipping is active.
"""

from __future__ import annotations

import math

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.samplers import (
    SAMPLERS,
    Sampler,
    ScheduleConfig,
    alphas_cumprod,
    draw_noise,
    inference_timesteps,
    make_sampler,
)
from fastdiff.samplers.tables import ddpm_table

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:diffusers")
scheduling_ddpm = pytest.importorskip("diffusers.schedulers.scheduling_ddpm")

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
        y = torch.nn.functional.conv2d(x, self.weight, padding=1) + (self.bias * phase)[:, None, None]
        return torch.tanh(2 * y)


class UNetNet(torch.nn.Module):
    def __init__(self, unet: torch.nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.unet(x, t).sample


class GaussianDenoiserPlus(torch.nn.Module):
    """The exact denoiser for data ~ N(0, DATA_STD^2) with ``scale·sigma_t`` times a network's output added
    to its x0, returned as eps or v. Perturbing x0 (not eps) keeps x0 O(1) at every noise level, and fading
    the perturbation out at low noise keeps the model contractive there, as a trained model is."""

    def __init__(self, net: torch.nn.Module, config: ScheduleConfig, scale: float) -> None:
        super().__init__()
        self.net = net
        self.scale = scale
        self.prediction_type = config.prediction_type
        self.register_buffer("abar", alphas_cumprod(config).float())

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        abar = self.abar[t.reshape(1)]  # advanced indexing: no host read of t, also on CUDA
        alpha, sigma = abar.sqrt(), (1 - abar).sqrt()
        x0 = alpha * DATA_STD**2 * x / (alpha**2 * DATA_STD**2 + sigma**2) + self.scale * sigma * self.net(x, t)
        eps = (x - alpha * x0) / sigma
        return eps if self.prediction_type == "epsilon" else alpha * eps - sigma * x0


@pytest.fixture(scope="module")
def tiny_unet() -> torch.nn.Module:
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )
    return UNetNet(unet.eval())


def diffusers_scheduler(name: str, config: ScheduleConfig):
    common = {
        "num_train_timesteps": config.num_train_timesteps,
        "beta_schedule": config.beta_schedule,
        "beta_start": config.beta_start,
        "beta_end": config.beta_end,
        "prediction_type": config.prediction_type,
        "timestep_spacing": config.timestep_spacing,
        "steps_offset": config.steps_offset,
    }
    clip = {"clip_sample": config.clip_sample, "clip_sample_range": config.clip_sample_range}
    if name == "ddpm":
        return diffusers.DDPMScheduler(**common, **clip, variance_type=config.variance_type)
    if name == "ddim":
        return diffusers.DDIMScheduler(**common, **clip, set_alpha_to_one=config.set_alpha_to_one)
    return diffusers.DPMSolverMultistepScheduler(**common)


@torch.no_grad()
def run_ours(sampler: Sampler, model, x_t: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Our loop; returns the final sample and how many steps clipped some x0 value."""
    x, x0 = x_t.clone(), None
    clipped_steps = 0
    for i in range(sampler.num_steps):
        x, x0 = sampler.step(i, x, model(x, sampler.timesteps[i]), x0, noise[i])
        if sampler.clip_range is not None:
            clipped_steps += int((x0.abs() == sampler.clip_range).any())
    return x, clipped_steps


@torch.no_grad()
def run_diffusers(name, config, steps, eta, model, x_t, noise, monkeypatch) -> tuple[torch.Tensor, int]:
    """diffusers' loop; returns the final sample and how many steps drew noise."""
    sched = diffusers_scheduler(name, config)
    sched.set_timesteps(steps)
    step_index = 0
    noise_draws = []

    def predrawn_noise(shape, generator=None, device=None, dtype=None):
        assert tuple(shape) == tuple(noise.shape[1:])
        noise_draws.append(step_index)
        return noise[step_index].clone()

    monkeypatch.setattr(scheduling_ddpm, "randn_tensor", predrawn_noise)
    x = x_t.clone()
    for step_index, t in enumerate(sched.timesteps):
        out = model(x, t)
        if name == "ddim":
            variance_noise = noise[step_index] if eta > 0 else None
            x = sched.step(out, t, x, eta=eta, use_clipped_model_output=True, variance_noise=variance_noise)
        else:
            x = sched.step(out, t, x)
        x = x.prev_sample
    return x, len(noise_draws)


def check_against_diffusers(name, config, steps, eta, model, monkeypatch) -> float:
    sampler = make_sampler(name, config, steps, eta=eta)
    x_t, noise = draw_noise(list(SEEDS), SAMPLE_SHAPE, sampler.num_steps, "cpu")
    ours, clipped_steps = run_ours(sampler, model, x_t, noise)
    if sampler.clip_range is not None:  # the runs with clipping on really clip
        assert clipped_steps > 0
    ref, ref_noise_draws = run_diffusers(name, config, steps, eta, model, x_t, noise, monkeypatch)
    if name == "ddpm":
        assert ref_noise_draws == int((sampler.coefs[:, 5] != 0).sum())
    assert torch.isfinite(ref).all()
    diff = (ours - ref).abs().max().item()
    print(
        f"{name} eta={eta} steps={steps} {config}: max|ours - diffusers| = {diff:.2e}, max|ref| = {ref.abs().max():.2f}"
    )
    assert diff <= TOLERANCE, diff
    return diff


SAMPLER_CASES = [("ddpm", 0.0), ("ddim", 0.0), ("ddim", 0.7), ("dpmsolver++", 0.0)]


# ---------------------------------------------------------------- tiny UNet: a representative subset


@pytest.mark.parametrize("steps", [10, 50])
@pytest.mark.parametrize(("name", "eta"), SAMPLER_CASES)
def test_unet_default_config_matches_diffusers(tiny_unet, name, eta, steps, monkeypatch):
    config = ScheduleConfig()
    check_against_diffusers(name, config, steps, eta, GaussianDenoiserPlus(tiny_unet, config, 0.5), monkeypatch)


@pytest.mark.parametrize(("name", "eta"), [("ddpm", 0.0), ("dpmsolver++", 0.0)])
def test_unet_v_prediction_cosine_matches_diffusers(tiny_unet, name, eta, monkeypatch):
    config = ScheduleConfig(beta_schedule="cosine", prediction_type="v_prediction", timestep_spacing="trailing")
    check_against_diffusers(name, config, 20, eta, GaussianDenoiserPlus(tiny_unet, config, 0.5), monkeypatch)


def test_unet_ddpm_1000_steps_matches_diffusers(tiny_unet, monkeypatch):
    config = ScheduleConfig()
    check_against_diffusers("ddpm", config, 1000, 0.0, GaussianDenoiserPlus(tiny_unet, config, 0.5), monkeypatch)


# ---------------------------------------------------------------- cheap model: option sweeps

# eps-prediction with the cosine schedule is run only where it does not visit t = 999 (leading spacing, < 1000
# steps): there abar = 2.4e-9, and eps -> x0 in float32 loses ~5e-4 in any implementation (diffusers' float32
# run is as far from a float64 run as ours is), so cosine runs that start at t = 999 use v-prediction.
SWEEP_CONFIGS = {
    "default": {},
    "scaled-trailing-v-noclip": {
        "beta_schedule": "scaled_linear",
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "timestep_spacing": "trailing",
        "prediction_type": "v_prediction",
        "clip_sample": False,
    },
    "cosine-linspace-v-large-noclip": {
        "beta_schedule": "squaredcos_cap_v2",
        "timestep_spacing": "linspace",
        "prediction_type": "v_prediction",
        "variance_type": "fixed_large",
        "clip_sample": False,
    },
    "linear-trailing-large-clip0.8": {
        "timestep_spacing": "trailing",
        "variance_type": "fixed_large",
        "clip_sample_range": 0.8,
    },
    "cosine-leading-offset-eps-clip-alpha0": {
        "beta_schedule": "cosine",
        "steps_offset": 1,
        "set_alpha_to_one": False,
    },
    "scaled-linspace-v-clip": {
        "beta_schedule": "scaled_linear",
        "timestep_spacing": "linspace",
        "prediction_type": "v_prediction",
    },
    "linear-leading-noclip-alpha0-T500": {
        "num_train_timesteps": 500,
        "beta_end": 0.03,
        "clip_sample": False,
        "set_alpha_to_one": False,
    },
}


@pytest.mark.parametrize("steps", [7, 50])
@pytest.mark.parametrize("config_name", list(SWEEP_CONFIGS))
@pytest.mark.parametrize(("name", "eta"), SAMPLER_CASES)
def test_sweep_matches_diffusers(name, eta, config_name, steps, monkeypatch):
    config = ScheduleConfig(**SWEEP_CONFIGS[config_name])
    model = GaussianDenoiserPlus(CheapNet(3, seed=steps), config, 0.5)
    check_against_diffusers(name, config, steps, eta, model, monkeypatch)


@pytest.mark.parametrize(
    ("name", "eta", "config_name"),
    [
        ("ddpm", 0.0, "default"),
        ("ddpm", 0.0, "scaled-trailing-v-noclip"),
        ("ddim", 0.0, "scaled-trailing-v-noclip"),
        ("ddim", 0.7, "default"),
        ("ddim", 0.0, "cosine-linspace-v-large-noclip"),
        ("dpmsolver++", 0.0, "scaled-trailing-v-noclip"),
        ("dpmsolver++", 0.0, "linear-trailing-large-clip0.8"),
    ],
)
def test_sweep_1000_steps_matches_diffusers(name, eta, config_name, monkeypatch):
    config = ScheduleConfig(**SWEEP_CONFIGS[config_name])
    model = GaussianDenoiserPlus(CheapNet(3, seed=5), config, 0.5)
    check_against_diffusers(name, config, 1000, eta, model, monkeypatch)


def test_ddpm_cosine_1000_steps_tracks_float64(monkeypatch):
    """Cosine DDPM over all 1000 steps: diffusers' float32 scheduler arithmetic drifts ~6e-4 from a float64
    run (its 1 - abar_t/abar_prev loses digits where cosine betas are ~1e-5); our float32 tables stay within
    2e-5 of it."""
    config = ScheduleConfig(**SWEEP_CONFIGS["cosine-linspace-v-large-noclip"])
    model = GaussianDenoiserPlus(CheapNet(3, seed=5), config, 0.5)
    sampler = make_sampler("ddpm", config, 1000)
    table64 = ddpm_table(alphas_cumprod(config), inference_timesteps(config, 1000), "v_prediction", "fixed_large")
    sampler64 = Sampler("ddpm", sampler.timesteps, table64, sampler.clip_range)
    model64 = GaussianDenoiserPlus(CheapNet(3, seed=5), config, 0.5).double()
    model64.abar = alphas_cumprod(config)
    x_t, noise = draw_noise(list(SEEDS), SAMPLE_SHAPE, 1000, "cpu")
    ours, _ = run_ours(sampler, model, x_t, noise)
    exact, _ = run_ours(sampler64, model64, x_t.double(), noise.double())
    ref, _ = run_diffusers("ddpm", config, 1000, 0.0, model, x_t, noise, monkeypatch)
    ours_err, ref_err = (ours - exact).abs().max().item(), (ref - exact).abs().max().item()
    print(f"ddpm cosine 1000 steps: max|ours - float64| = {ours_err:.2e}, max|diffusers - float64| = {ref_err:.2e}")
    assert ours_err <= 2e-5
    assert (ours - ref).abs().max() <= 2e-3


# ---------------------------------------------------------------- tables and API


@pytest.mark.parametrize("name", SAMPLERS)
def test_tables_shapes_and_flags(name):
    sampler = make_sampler(name, ScheduleConfig(), 13)
    assert sampler.name == name and sampler.num_steps == 13
    assert sampler.coefs.shape == (13, 6) and sampler.coefs.dtype == torch.float32
    assert sampler.timesteps.shape == (13,) and sampler.timesteps.dtype == torch.int64
    assert torch.isfinite(sampler.coefs).all()
    assert sampler.needs_noise == (name == "ddpm")
    assert sampler.clip_range == (None if name == "dpmsolver++" else 1.0)
    e_column = sampler.coefs[:, 4]
    if name == "dpmsolver++":  # first and last steps are first order, the rest use x0_prev
        assert e_column[0] == 0 and e_column[-1] == 0 and (e_column[1:-1] != 0).all()
        assert sampler.coefs[-1, 2] == 0 and sampler.coefs[-1, 3] == 1  # sigma_N = 0: x_N = x0
    else:
        assert (e_column == 0).all()
    if name == "ddpm":  # leading spacing ends at t = 0, which adds no noise
        assert sampler.timesteps[-1] == 0 and sampler.coefs[-1, 5] == 0 and (sampler.coefs[:-1, 5] > 0).all()


def test_ddim_eta_needs_noise_and_clip_off():
    assert make_sampler("ddim", ScheduleConfig(), 10, eta=0.3).needs_noise
    assert make_sampler("ddim", ScheduleConfig(clip_sample=False), 10).clip_range is None


def test_to_moves_tables():
    sampler = make_sampler("dpmsolver++", ScheduleConfig(), 10).to("cpu")
    assert sampler.coefs.device.type == "cpu" and sampler.num_steps == 10
    assert "dpmsolver++" in repr(sampler)


def test_ddim_one_step_is_x0():
    """With set_alpha_to_one the step after the last timestep is the clean image: x_next = x0."""
    sampler = make_sampler("ddim", ScheduleConfig(clip_sample=False), 1)
    x, out = torch.randn(2, *SAMPLE_SHAPE), torch.randn(2, *SAMPLE_SHAPE)
    x_next, x0 = sampler.step(0, x, out)
    torch.testing.assert_close(x_next, x0, rtol=0, atol=1e-6)
    abar = alphas_cumprod(ScheduleConfig())[int(sampler.timesteps[0])].item()
    ref_x0 = (x - math.sqrt(1 - abar) * out) / math.sqrt(abar)
    torch.testing.assert_close(x0, ref_x0, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "euler"}, "unknown sampler"),
        ({"steps": 0}, "steps"),
        ({"steps": -3}, "steps"),
        ({"steps": 1001}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"eta": -0.1}, "eta"),
        ({"eta": float("nan")}, "eta"),
        ({"name": "ddpm", "eta": 0.5}, "ddim only"),
        ({"eta": 3.0}, "too large"),
    ],
)
def test_make_sampler_rejects_bad_arguments(kwargs, message):
    args = {"name": "ddim", "config": ScheduleConfig(), "steps": 10, "eta": 0.0} | kwargs
    with pytest.raises(FastdiffError, match=message):
        make_sampler(**args)


@pytest.mark.parametrize("spacing", ["leading", "linspace"])
def test_dpmsolver_rejects_repeated_timesteps(spacing):
    with pytest.raises(FastdiffError):
        make_sampler("dpmsolver++", ScheduleConfig(timestep_spacing=spacing), 1000)


def test_offset_beyond_last_timestep_is_rejected():
    with pytest.raises(FastdiffError, match="outside"):
        make_sampler("ddpm", ScheduleConfig(steps_offset=1), 1000)


def test_missing_x0_prev_or_noise_is_an_error():
    x = torch.randn(1, *SAMPLE_SHAPE)
    dpm = make_sampler("dpmsolver++", ScheduleConfig(), 5)
    _, x0 = dpm.step(0, x, x)
    with pytest.raises(FastdiffError, match="x0_prev"):
        dpm.step(1, x, x)
    dpm.step(1, x, x, x0_prev=x0)
    with pytest.raises(FastdiffError, match="noise"):
        make_sampler("ddpm", ScheduleConfig(), 5).step(0, x, x)


def test_step_keeps_dtype():
    sampler = make_sampler("dpmsolver++", ScheduleConfig(), 5)
    x = torch.randn(1, *SAMPLE_SHAPE, dtype=torch.bfloat16)
    x_next, x0 = sampler.step(0, x, x)
    assert x_next.dtype == torch.bfloat16 and x0.dtype == torch.bfloat16


# ---------------------------------------------------------------- no host sync


def _loop(sampler: Sampler, model, x: torch.Tensor, noise: torch.Tensor | None) -> torch.Tensor:
    x0 = None
    for i in range(sampler.num_steps):
        x, x0 = sampler.step(i, x, model(x, sampler.timesteps[i]), x0, None if noise is None else noise[i])
    return x


def test_step_never_reads_tensors_back_to_host(monkeypatch):
    samplers = [make_sampler(name, ScheduleConfig(), 12, eta=eta) for name, eta in SAMPLER_CASES]
    x_t, noise = draw_noise([3], SAMPLE_SHAPE, 12, "cpu")
    outputs = torch.randn(12, *x_t.shape, generator=torch.Generator().manual_seed(4))

    def host_read(*args, **kwargs):
        raise AssertionError("host read in the sampling step")

    for method in ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, method, host_read)
    results = []
    for sampler in samplers:
        x, x0 = x_t, None
        for i in range(sampler.num_steps):
            x, x0 = sampler.step(i, x, outputs[i], x0, noise[i])
        results.append(x)
    monkeypatch.undo()
    assert all(torch.isfinite(r).all() for r in results)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("name", "eta"), SAMPLER_CASES)
def test_whole_loop_captures_in_one_cuda_graph(name, eta):
    device = torch.device("cuda")
    config = ScheduleConfig()
    model = GaussianDenoiserPlus(CheapNet(3, seed=2), config, 0.5).to(device)
    sampler = make_sampler(name, config, 25, eta=eta, device=device)
    x_t, noise = draw_noise(list(SEEDS), SAMPLE_SHAPE, sampler.num_steps, device)
    with torch.no_grad():
        eager = _loop(sampler, model, x_t, noise)
        static_x = x_t.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _loop(sampler, model, static_x, noise)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = _loop(sampler, model, static_x, noise)
        static_x.copy_(x_t)
        static_out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(static_out, eager, rtol=0, atol=1e-5)
