"""Pipeline(backend=...): the engine backend gives the eager backend's images, with step caching too; bad names
raise."""

from __future__ import annotations

import pytest
import torch

import fastdiff.pipelines.unconditional
from fastdiff.errors import FastdiffError
from fastdiff.models.step_cache import cached_forward
from fastdiff.pipelines import Pipeline
from fastdiff.samplers import ScheduleConfig, initial_noise, seed_tensor

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU runs the engine's interpreter mode
TOL = 1e-4 if DEVICE.type == "cpu" else 1e-2  # fp32; tf32 dots on the GPU


def test_engine_backend_matches_eager(tiny_model):
    model = tiny_model("center_scaled", 21).to(DEVICE)
    schedule = ScheduleConfig(timestep_spacing="trailing")
    default = Pipeline(model, schedule, sampler="ddpm", steps=2, device=DEVICE)
    assert default.backend == ("engine" if DEVICE.type == "cuda" else "eager")
    eager = Pipeline(model, schedule, sampler="ddpm", steps=2, device=DEVICE, backend="eager")
    engine = Pipeline(model, schedule, sampler="ddpm", steps=2, device=DEVICE, backend="engine")
    ref = eager(batch_size=2, seeds=[3, 8], output_type="tensor", progress=False)
    out = engine(batch_size=2, seeds=[3, 8], output_type="tensor", progress=False)
    assert out.shape == ref.shape == (2, 2, 10, 6)
    assert float((out - ref).norm() / ref.norm()) < TOL
    assert engine.engine.current is not None


@pytest.mark.slow
def test_step_cache_in_both_backends(tiny_model, monkeypatch):
    """cache_interval=2: the eager backend equals the cached loop written out here (full, shallow, full), the
    engine backend equals the eager one, and both differ from every step in full; a bad interval fails first."""
    model = tiny_model("center_scaled", 21).to(DEVICE)
    schedule = ScheduleConfig(timestep_spacing="trailing")
    eager = Pipeline(model, schedule, sampler="ddim", steps=3, device=DEVICE, backend="eager")
    engine = Pipeline(model, schedule, sampler="ddim", steps=3, device=DEVICE, backend="engine")
    kwargs = dict(batch_size=1, seeds=[8], output_type="tensor", progress=False)
    ours = eager(cache_interval=2, **kwargs)
    sampler = eager.sampler_for(0.0)
    x = initial_noise(seed_tensor([8], DEVICE), eager.sample_shape, DEVICE) * sampler.init_scale
    state, deep = sampler.new_state(x), None
    with torch.no_grad():
        for i in range(3):
            out, deep = cached_forward(model, x, sampler.timesteps[i].expand(1), None if i % 2 == 0 else deep)
            x = sampler.step(i, x, out, state, None)
    assert torch.equal(ours, x.clamp(-1, 1))
    assert float((engine(cache_interval=2, **kwargs) - ours).norm() / ours.norm()) < TOL
    assert float((eager(**kwargs) - ours).norm() / ours.norm()) > 1e-2

    def no_work(*args, **kw):
        raise AssertionError("sampling started before cache_interval was checked")

    monkeypatch.setattr(fastdiff.pipelines.unconditional, "sample_loop", no_work)
    with pytest.raises(FastdiffError, match=r"^cache_interval must be an integer >= 1 \(1: no step caching\), got 0$"):
        eager(cache_interval=0, **kwargs)


def test_unknown_backend_raises(tiny_model):
    with pytest.raises(FastdiffError, match="backend"):
        Pipeline(tiny_model("center_scaled", 0), ScheduleConfig(), backend="tensorrt")


def test_engine_off_cuda_without_the_interpreter_fails_before_loading(monkeypatch):
    from fastdiff.pipelines import resolve_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(FastdiffError, match="the engine backend needs a CUDA GPU"):
        resolve_backend("engine", torch.device("cpu"))
    assert resolve_backend(None, torch.device("cpu")) == "eager"
    assert resolve_backend(None, torch.device("cuda")) == "engine"
