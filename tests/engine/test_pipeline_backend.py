"""Pipeline(backend=...): the engine backend gives the eager backend's images; bad names raise."""

from __future__ import annotations

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.pipeline import Pipeline
from fastdiff.samplers import ScheduleConfig

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


def test_unknown_backend_raises(tiny_model):
    with pytest.raises(FastdiffError, match="backend"):
        Pipeline(tiny_model("center_scaled", 0), ScheduleConfig(), backend="tensorrt")


def test_engine_off_cuda_without_the_interpreter_fails_before_loading(monkeypatch):
    from fastdiff.pipeline import resolve_backend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(FastdiffError, match="the engine backend needs a CUDA GPU"):
        resolve_backend("engine", torch.device("cpu"))
    assert resolve_backend(None, torch.device("cpu")) == "eager"
    assert resolve_backend(None, torch.device("cuda")) == "engine"
