"""ScheduleConfig, alphas_cumprod and inference timesteps against diffusers' schedulers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.samplers import SAMPLER_SCHEDULERS, ScheduleConfig, alphas_cumprod, discrete_timesteps, make_sampler

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:diffusers")

SCHEDULES = {
    "linear": {},
    "scaled_linear": {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012},
    "squaredcos_cap_v2": {"beta_schedule": "squaredcos_cap_v2"},
}
SCHEDULER_CLASSES = {name: SAMPLER_SCHEDULERS[name] for name in ("ddpm", "ddim", "euler", "dpmsolver++", "unipc")}


@pytest.mark.parametrize("train_steps", [1000, 37])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_alphas_cumprod_equals_diffusers(schedule, train_steps):
    kwargs = {"num_train_timesteps": train_steps, **SCHEDULES[schedule]}
    ours = alphas_cumprod(ScheduleConfig(**kwargs))
    ref = diffusers.DDPMScheduler(**kwargs).alphas_cumprod
    assert ours.dtype == torch.float64 and ours.shape == (train_steps,)
    assert torch.equal(ours, ref.double())


def _diffusers_timesteps(name: str, config: ScheduleConfig, steps: int) -> np.ndarray:
    sched = getattr(diffusers, SCHEDULER_CLASSES[name])(
        num_train_timesteps=config.num_train_timesteps,
        timestep_spacing=config.timestep_spacing,
        steps_offset=config.steps_offset,
    )
    sched.set_timesteps(steps)
    return sched.timesteps.numpy()


@pytest.mark.parametrize("train_steps", [1000, 37])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("spacing", ["leading", "trailing", "linspace"])
@pytest.mark.parametrize("name", list(SCHEDULER_CLASSES))
def test_timesteps_equal_diffusers(name, spacing, offset, train_steps):
    config = ScheduleConfig(num_train_timesteps=train_steps, timestep_spacing=spacing, steps_offset=offset)
    counts = sorted({1, 2, 3, 7, 10, 36, 50, 61, 99, 100, 103, 250, 999, 1000} & set(range(1, train_steps + 1)))
    for steps in counts:
        ref = _diffusers_timesteps(name, config, steps)
        out_of_range = ref.max() >= train_steps or (len(ref) == steps and ref.min() < 0)
        repeats = name in ("dpmsolver++", "unipc") and (np.diff(ref) >= 0).any()
        if out_of_range or repeats:
            with pytest.raises(FastdiffError):
                make_sampler(name, config, steps)
            continue
        sampler = make_sampler(name, config, steps)
        ours = sampler.timesteps.numpy()
        if len(ref) == steps + 1:  # diffusers' trailing float arange adds a final timestep -1
            assert spacing == "trailing" and ref[-1] == -1
            ref = ref[:-1]
        np.testing.assert_array_equal(ours, ref, err_msg=f"{name} {spacing} offset={offset} steps={steps}")
        assert sampler.num_steps == steps


def test_trailing_extra_point_is_dropped():
    config = ScheduleConfig(timestep_spacing="trailing")
    assert len(_diffusers_timesteps("ddpm", config, 61)) == 62
    ours = discrete_timesteps(config, 61)
    assert len(ours) == 61 and ours[-1] == 15


def test_config_defaults_match_ddpm_scheduler():
    ref = diffusers.DDPMScheduler().config
    for key, value in ScheduleConfig().to_diffusers().items():
        if key == "set_alpha_to_one":  # a DDIMScheduler key
            assert diffusers.DDIMScheduler().config[key] is value
        elif key == "use_karras_sigmas":  # a key of the sigma schedulers
            assert diffusers.EulerDiscreteScheduler().config[key] is value
        else:
            assert ref[key] == value, key


def test_cosine_alias():
    assert ScheduleConfig(beta_schedule="cosine").beta_schedule == "squaredcos_cap_v2"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"beta_schedule": "sigmoid"},
        {"prediction_type": "sample"},
        {"timestep_spacing": "karras"},
        {"variance_type": "learned_range"},
        {"num_train_timesteps": 0},
        {"num_train_timesteps": 1000.0},
        {"steps_offset": -1},
        {"clip_sample": "yes"},
        {"clip_sample_range": 0.0},
        {"beta_end": 1.5},
        {"beta_start": float("nan")},
    ],
)
def test_bad_config_values_are_rejected(kwargs):
    with pytest.raises(FastdiffError):
        ScheduleConfig(**kwargs)
    with pytest.raises(FastdiffError):
        ScheduleConfig.from_diffusers(kwargs)


@pytest.mark.parametrize("name", list(SCHEDULER_CLASSES.values()))
def test_from_diffusers_reads_real_configs(name):
    sched = getattr(diffusers, name)(beta_schedule="squaredcos_cap_v2", prediction_type="v_prediction")
    config = ScheduleConfig.from_diffusers({"_class_name": name, "_diffusers_version": "0.42.1", **sched.config})
    assert config.beta_schedule == "squaredcos_cap_v2" and config.prediction_type == "v_prediction"
    assert config.timestep_spacing == sched.config.timestep_spacing
    assert config.variance_type == "fixed_small"  # DPMSolverMultistepScheduler stores variance_type None


def test_from_diffusers_none_and_non_mapping():
    assert ScheduleConfig.from_diffusers(None) == ScheduleConfig()
    assert ScheduleConfig.from_diffusers({"clip_sample": False}) == ScheduleConfig(clip_sample=False)
    with pytest.raises(FastdiffError):
        ScheduleConfig.from_diffusers(["linear"])


@pytest.mark.parametrize(
    "extra", [{"thresholding": True}, {"trained_betas": [0.1, 0.2]}, {"rescale_betas_zero_snr": True}]
)
def test_from_diffusers_rejects_schedule_changes_it_cannot_follow(extra):
    with pytest.raises(FastdiffError, match="not supported"):
        ScheduleConfig.from_diffusers({"beta_schedule": "linear", **extra})
    no_op = {key: (None if key == "trained_betas" else False) for key in extra}
    assert ScheduleConfig.from_diffusers(no_op) == ScheduleConfig()
