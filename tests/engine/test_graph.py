"""Sampling loop: engine (fused or eager step model, device step counter) vs the reference loop; on CUDA, graph
replay vs the engine's own eager run."""

from __future__ import annotations

import pytest
import torch

from fastdiff.engine import EagerStepModel, Engine, FusedModel
from fastdiff.engine.graph import SamplingLoop
from fastdiff.errors import FastdiffError
from fastdiff.pipelines.unconditional import sample_loop
from fastdiff.samplers import ScheduleConfig, initial_noise, make_sampler, seed_tensor, step_noise

from .conftest import DEVICE, TOL, rel_err

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    ("sampler_name", "unet_impl"),
    [
        pytest.param("ddpm", "fused", marks=pytest.mark.slow),
        ("dpmsolver++", "eager"),
        ("ddim", "eager"),
        pytest.param("unipc", "fused", marks=pytest.mark.slow),
        ("euler_a", "eager"),
    ],
)
def test_engine_loop_matches_reference(tiny_model, sampler_name, unet_impl):
    """In-kernel noise (ddpm, euler_a), history (dpmsolver++, unipc's two x0 and its corrector), clipping
    (ddpm/ddim) and the input scale (euler_a) all go through the device counter."""
    model = tiny_model("attn_pad0", 11).to(DEVICE)
    steps = 3
    sampler = make_sampler(sampler_name, ScheduleConfig(timestep_spacing="trailing"), steps, device=DEVICE)
    b = 2
    shape = (model.config.in_channels, *model.config.sample_size)
    seeds = seed_tensor([4, 9], DEVICE)
    x_t = initial_noise(seeds, shape, DEVICE)
    engine = Engine(DEVICE, unet_impl=unet_impl, conv_impl="triton", attention_impl="triton", use_graphs=False)
    engine.prepare(model, sampler, b, torch.float32)
    out = engine.run(x_t, seeds)
    with torch.no_grad():
        ref = sample_loop(model, sampler, x_t.clone(), seeds, torch.float32)
    assert torch.isfinite(out).all()
    assert rel_err(out.clamp(-1, 1), ref) < TOL
    partial = engine.run(x_t, seeds, num_steps=1)  # a prefix of the loop restarts from x_T
    with torch.no_grad():
        x = x_t * sampler.init_scale
        noise = step_noise(seeds, 0, shape) if sampler.noise_steps[0] else None
        first = sampler.step(0, x, model(x, sampler.timesteps[0].expand(b)), sampler.new_state(x), noise)
    assert rel_err(partial, first) < TOL
    with pytest.raises(FastdiffError, match="num_steps"):
        engine.run(x_t, seeds, num_steps=steps + 1)
    with pytest.raises(FastdiffError, match="seeds"):
        engine.run(x_t, seeds[:1])


def test_engine_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(FastdiffError, match="CUDA"):
        Engine("cpu")


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_graph_replay_equals_eager(tiny_model, dtype):
    """The captured chunks (K = 4 over 10 steps: replays of 4, 4 and a 2-step graph) == the same kernels eagerly."""
    model = tiny_model("attn_pad0", 5).to(DEVICE)
    sampler = make_sampler("ddpm", ScheduleConfig(), 10, device=DEVICE)
    shape = (model.config.in_channels, *model.config.sample_size)
    seeds = seed_tensor(range(3), DEVICE)
    x_t = initial_noise(seeds, shape, DEVICE)
    graphs = Engine(DEVICE, steps_per_graph=4)
    graphs.prepare(model, sampler, 3, dtype)
    fused = graphs.current_step_model
    eager = SamplingLoop(fused.bind_timesteps(sampler.timesteps), sampler, (3, *shape), dtype, DEVICE, use_graphs=False)
    out_g = graphs.run(x_t, seeds)
    out_e = eager.run(x_t, seeds)
    assert set(graphs.current.graphs) == {(4, 0), (2, 0)}  # (length, phase): one phase without step caching
    assert torch.isfinite(out_g).all()
    tol = 1e-3 if dtype == torch.float16 else 1e-2
    assert rel_err(out_g, out_e) < tol
    assert torch.equal(graphs.run(x_t, seeds), out_g)  # replays are deterministic, noise included


@pytest.mark.parametrize("unet_impl", ["eager", pytest.param("fused", marks=pytest.mark.slow)])
def test_convnext_in_the_loop(unet_impl):
    """ConvNeXtUNet: fused, or its own forward (unet_impl="eager") inside the engine's loop."""
    from fastdiff.models.convnext_unet import ConvNeXtUNet, ConvNeXtUNetConfig

    torch.manual_seed(2)
    config = ConvNeXtUNetConfig(
        sample_size=12, in_channels=2, out_channels=2, base_dim=6, dim_mults=(1, 2), attention_heads=2,
        attention_head_dim=3,
    )  # fmt: skip
    model = ConvNeXtUNet(config).eval()
    model.to(DEVICE)
    sampler = make_sampler("ddim", ScheduleConfig(), 3, eta=0.5, device=DEVICE)
    seeds = seed_tensor([1, 2, 3], DEVICE)
    x_t = initial_noise(seeds, (2, 12, 12), DEVICE)
    engine = Engine(DEVICE, unet_impl=unet_impl, steps_per_graph=2, conv_impl="triton", attention_impl="triton")
    engine.prepare(model, sampler, 3, torch.float32)
    step_model = engine.current_step_model
    assert isinstance(step_model, EagerStepModel if unet_impl == "eager" else FusedModel)
    out = engine.run(x_t, seeds)
    with torch.no_grad():
        ref = sample_loop(model, sampler, x_t.clone(), seeds, torch.float32)
    assert rel_err(out.clamp(-1, 1), ref) < TOL


def test_engine_keeps_cached_models_alive_and_clears(tiny_model):
    """Caches are keyed by id(model): the engine holds the model so its id cannot be reused; clear() drops all."""
    model = tiny_model("center_scaled", 3).to(DEVICE)
    sampler = make_sampler("ddim", ScheduleConfig(), 2, device=DEVICE)
    engine = Engine(DEVICE, unet_impl="eager", use_graphs=False)
    engine.prepare(model, sampler, 1, torch.float32)
    assert engine._models[id(model)] is model
    engine.clear()
    assert not engine.step_models and not engine.loops and engine.current is None
    with pytest.raises(FastdiffError, match="Engine.run before Engine.prepare"):
        engine.run(torch.zeros(1, 2, 10, 6), torch.zeros(1, dtype=torch.int64))


def test_guided_loop_checks_the_guidance_length(tiny_model):
    sampler = make_sampler("ddim", ScheduleConfig(), 2, device=DEVICE)
    loop = SamplingLoop(lambda x, i: x, sampler, (2, 2, 4, 4), torch.float32, DEVICE, use_graphs=False, guided=True)
    with pytest.raises(FastdiffError, match=r"got \(3,\) guidance scales for a batch of 2"):
        loop.load(torch.zeros(2, 2, 4, 4), torch.zeros(2, dtype=torch.int64), torch.ones(3))


@cuda_only
def test_programmatic_launch_same_bits(tiny_model, monkeypatch):
    """The captured loop with programmatic dependent launch (each kernel may start while the one before it runs)
    gives the same bits as with every kernel serialised (FASTDIFF_PDL=0): no kernel reads early. The second
    engine takes the first one's timed choices (tuning cache, same shapes), so both run the same kernels."""
    from fastdiff.kernels.common import PDL_ENV, programmatic_launch

    model = tiny_model("attn_pad0", 7).to(DEVICE)
    sampler = make_sampler("ddpm", ScheduleConfig(), 12, device=DEVICE)
    shape = (model.config.in_channels, *model.config.sample_size)
    seeds = seed_tensor([3], DEVICE)
    x_t = initial_noise(seeds, shape, DEVICE)
    outs = []
    for pdl in ("1", "0"):
        monkeypatch.setenv(PDL_ENV, pdl)
        engine = Engine(DEVICE, steps_per_graph=6)
        engine.prepare(model, sampler, 1, torch.float16)
        outs.append(engine.run(x_t, seeds))
    assert torch.isfinite(outs[0]).all()
    assert torch.equal(outs[0], outs[1])
    monkeypatch.setenv(PDL_ENV, "1")
    if torch.cuda.get_device_capability()[0] >= 9:
        assert programmatic_launch(DEVICE)
