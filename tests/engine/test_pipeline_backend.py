"""Pipeline(backend=...): the engine backend gives the eager backend's images; bad names raise."""

from __future__ import annotations

import pytest

from fastdiff.errors import FastdiffError
from fastdiff.pipeline import Pipeline
from fastdiff.samplers import ScheduleConfig


def test_engine_backend_matches_eager(tiny_model):
    model = tiny_model("center_scaled", 21)
    schedule = ScheduleConfig(timestep_spacing="trailing")
    eager = Pipeline(model, schedule, sampler="ddpm", steps=2)
    assert eager.backend == "eager"  # the CPU default
    engine = Pipeline(model, schedule, sampler="ddpm", steps=2, backend="engine")
    ref = eager(batch_size=2, seeds=[3, 8], output_type="tensor", progress=False)
    out = engine(batch_size=2, seeds=[3, 8], output_type="tensor", progress=False)
    assert out.shape == ref.shape == (2, 2, 10, 6)
    assert float((out - ref).norm() / ref.norm()) < 1e-4
    assert engine.engine.current is not None


def test_unknown_backend_raises(tiny_model):
    with pytest.raises(FastdiffError, match="backend"):
        Pipeline(tiny_model("center_scaled", 0), ScheduleConfig(), backend="tensorrt")
