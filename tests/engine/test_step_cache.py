"""Step caching on the engine (``cache_interval``): the fused and eager step models in the sampling loop against
the plain-PyTorch reference loop (``fastdiff.models.step_cache`` in ``run_sampler``), guided or not; the shallow
forward runs only the ops its output needs; the loop's full/shallow schedule; on CUDA, graphs that follow it."""

from __future__ import annotations

import pytest
import torch
from sd_fixtures import randomize_norms

from fastdiff.engine import Engine, FusedModel
from fastdiff.engine.graph import SamplingLoop, channels_last_empty
from fastdiff.errors import FastdiffError
from fastdiff.models.convnext_unet import ConvNeXtUNet, ConvNeXtUNetConfig
from fastdiff.models.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel
from fastdiff.pipelines.text_to_image import denoise
from fastdiff.pipelines.unconditional import sample_loop
from fastdiff.samplers import ScheduleConfig, initial_noise, make_sampler, seed_tensor

from .conftest import DEVICE, TOL, rel_err

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
IMPLS = dict(conv_impl="cudnn", attention_impl="sdpa")  # the vendor paths: fast in the CPU test mode
COND = dict(
    # cross-attention in the first down block and the last up block: the shallow path reads the text K/V
    in_channels=3, out_channels=3, block_out_channels=[8, 12], norm_num_groups=4,
    down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"], up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
    layers_per_block=1, attention_head_dim=2, cross_attention_dim=6, sample_size=(4, 6),
)  # fmt: skip


def ddim(steps: int = 4):
    """4 steps: interval 2 runs full, shallow, full, shallow; interval 3 full, shallow, shallow, full."""
    return make_sampler("ddim", ScheduleConfig(timestep_spacing="trailing"), steps, eta=0.5, device=DEVICE)


@pytest.mark.slow
def test_ddpm_unet_matches_the_reference(tiny_model):
    """Cache intervals 2 and 3 over 4 DDIM steps (eta 0.5: noise in the step) share one fused step model."""
    model = tiny_model("attn_pad0", 11).to(DEVICE)
    sampler = ddim()
    seeds = seed_tensor([9], DEVICE)
    x_t = initial_noise(seeds, (3, 6, 10), DEVICE)
    engine = Engine(DEVICE, use_graphs=False, **IMPLS)
    with torch.no_grad():
        plain = sample_loop(model, sampler, x_t, seeds, torch.float32)
    for cache_interval in (2, 3):
        engine.prepare(model, sampler, 1, torch.float32, cache_interval=cache_interval)
        out = engine.run(x_t, seeds).clamp(-1, 1)
        with torch.no_grad():
            ref = sample_loop(model, sampler, x_t, seeds, torch.float32, cache_interval=cache_interval)
        assert rel_err(out, ref) < TOL, cache_interval
        assert rel_err(ref, plain) > 1e-2  # the shallow steps really reuse a stale feature
    assert len(engine.step_models) == 1 and len(engine.loops) == 2


@pytest.mark.slow
@pytest.mark.parametrize(("unet_impl", "intervals"), [("fused", (2, 3)), ("eager", (2,))])
def test_guided_text_unet_matches_the_reference(unet_impl, intervals):
    """Classifier-free guidance (the U-Net on [x; x] against [uncond; cond]), fused or the model's own forward
    (unet_impl="eager") in the loop."""
    torch.manual_seed(7)
    cfg = UNet2DConditionConfig.from_dict(COND)
    model = randomize_norms(UNet2DConditionModel(cfg), 7).eval().to(DEVICE)
    with torch.no_grad():  # a random U-Net amplifies rounding through guidance: keep its output small
        model.conv_out.weight.mul_(0.1)
        model.conv_out.bias.mul_(0.1)
    sampler = ddim()
    batch, tokens = 1, 3
    seeds = seed_tensor([5], DEVICE)
    x = initial_noise(seeds, (3, 4, 6), DEVICE) * sampler.init_scale
    context = torch.randn((2 * batch, tokens, 6), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    guidance = torch.tensor([4.0], device=DEVICE)
    engine = Engine(DEVICE, unet_impl=unet_impl, use_graphs=False, **IMPLS)
    for cache_interval in intervals:
        engine.prepare(model, sampler, batch, torch.float32, guided=True, context_tokens=tokens,
                       cache_interval=cache_interval)  # fmt: skip
        out = engine.run(x, seeds, context=context, guidance=guidance, scale=False)
        ref = denoise(model, sampler, x, context, guidance, seeds, torch.float32, cache_interval=cache_interval)
        plain = denoise(model, sampler, x, context, guidance, seeds, torch.float32)
        assert rel_err(out, ref) < TOL, cache_interval
        assert rel_err(ref, plain) > 1e-3


def test_convnext_unet_matches_the_reference():
    torch.manual_seed(2)
    config = ConvNeXtUNetConfig(
        sample_size=8, in_channels=2, out_channels=2, base_dim=6, dim_mults=(1, 2), attention_heads=2,
        attention_head_dim=3,
    )  # fmt: skip
    model = ConvNeXtUNet(config).eval().to(DEVICE)
    sampler = ddim(3)
    seeds = seed_tensor([2], DEVICE)
    x_t = initial_noise(seeds, (2, 8, 8), DEVICE)
    engine = Engine(DEVICE, use_graphs=False, **IMPLS)
    engine.prepare(model, sampler, 1, torch.float32, cache_interval=2)
    out = engine.run(x_t, seeds).clamp(-1, 1)
    with torch.no_grad():
        ref = sample_loop(model, sampler, x_t, seeds, torch.float32, cache_interval=2)
    assert rel_err(out, ref) < TOL
    names = {op.name for op in engine.current_step_model.shallow_ops}
    assert "mid_block1.conv2" not in names and {"downs.0.block2.conv2", "ups.1.gate", "final_conv"} <= names


SHALLOW = ("center_input", "conv_in", "down_blocks.0.resnets.", "down_blocks.0.attentions.", "up_blocks.1.",
           "conv_norm_out", "conv_out")  # fmt: skip
"""Name prefixes of the ops of a shallow forward of the two-level tiny models (see step_cache's docstring)."""


def test_shallow_forward_runs_only_the_shallow_ops(tiny_model, tiny_name, monkeypatch):
    """The ops a shallow forward launches are the first down block's, the last up block's and the input and
    output layers' (counted as they run); the deep feature lives in its own buffer, outside the arena; on the same
    step's feature the shallow output is the full one, on another it changes."""
    ran: list[str] = []
    make_call = FusedModel.call

    def counted(self, op, impl):
        call = make_call(self, op, impl)
        return lambda: (ran.append(op.name), call())

    monkeypatch.setattr(FusedModel, "call", counted)
    model = tiny_model(tiny_name, 3).to(DEVICE)
    fused = FusedModel(model, 1, torch.float32, DEVICE, **IMPLS)
    x = channels_last_empty(fused.x_in_value.shape, torch.float32, DEVICE).normal_()
    t = torch.tensor([400], device=DEVICE)
    fused.forward(x, t)  # the first forward streams the weights
    ran.clear()
    full = fused.forward(x, t).clone()
    assert ran == [op.name for op in fused.step_ops]
    ran.clear()
    shallow = fused.forward(x, t, shallow=True).clone()
    expected = [op.name for op in fused.step_ops if op.name.startswith(SHALLOW)]
    assert ran == expected == [op.name for op in fused.shallow_ops]
    assert len(ran) < len(fused.step_ops) * 2 // 3
    assert torch.equal(shallow, full)
    cat = fused.cached_value.concat
    assert cat.name == "up_blocks.1.cat.0" and cat.name in fused.persistent and cat.name not in fused.plan.offsets
    fused.persistent[cat.name][:, : fused.cached_value.shape[1]].mul_(0.5)  # as if a different full step left it
    assert rel_err(fused.forward(x, t, shallow=True), full) > 1e-3


def test_loop_schedule():
    """Step k is full when k % N == 0, whatever the calls' split (the host keeps the position); graphs hold whole
    cache periods; cache_interval 1 calls the step model as without step caching (no flag)."""
    sampler = make_sampler("ddim", ScheduleConfig(), 7, device=DEVICE)
    seen = []

    def step_model(x_in, index, shallow="not passed"):
        seen.append((int(index), shallow))
        return torch.zeros_like(x_in)

    shape, zeros, seeds = (1, 1, 2, 2), torch.zeros(1, 1, 2, 2, device=DEVICE), torch.zeros(1, dtype=torch.int64)
    loop = SamplingLoop(step_model, sampler, shape, torch.float32, DEVICE, 4, use_graphs=False, cache_interval=3)
    assert loop.steps_per_graph == 6
    loop.load(zeros, seeds.to(DEVICE))
    loop.run_steps(2)
    loop.run_steps(5)
    assert seen == [(0, False), (1, True), (2, True), (3, False), (4, True), (5, True), (6, False)]
    seen.clear()
    plain = SamplingLoop(step_model, sampler, shape, torch.float32, DEVICE, 4, use_graphs=False)
    plain.run(zeros, seeds.to(DEVICE), 3)
    assert plain.steps_per_graph == 4 and seen == [(0, "not passed"), (1, "not passed"), (2, "not passed")]
    five = make_sampler("ddim", ScheduleConfig(), 5, device=DEVICE)
    assert SamplingLoop(step_model, five, shape, torch.float32, DEVICE, 4, cache_interval=3).steps_per_graph == 5
    with pytest.raises(FastdiffError, match="cache_interval must be an integer >= 1"):
        SamplingLoop(step_model, five, shape, torch.float32, DEVICE, cache_interval=0)


def test_prepare_checks_the_interval(tiny_model):
    engine = Engine(DEVICE, use_graphs=False, **IMPLS)
    with pytest.raises(FastdiffError, match=r"cache_interval must be an integer >= 1 .*, got 2\.5"):
        engine.prepare(tiny_model("attn_pad0", 0), ddim(), 1, torch.float32, cache_interval=2.5)
    assert not engine.step_models  # nothing was built


@cuda_only
def test_cached_graphs_follow_the_schedule(tiny_model):
    """K = 3 rounds up to 4 (two cache periods of 2): a 10-step run replays the phase-0 graphs of 4 and 2 steps and
    equals the same step model run eagerly; a run split at step 3 replays phase-1 graphs and ends the same."""
    model = tiny_model("attn_pad0", 5).to(DEVICE)
    sampler = make_sampler("ddpm", ScheduleConfig(), 10, device=DEVICE)
    shape = (model.config.in_channels, *model.config.sample_size)
    seeds = seed_tensor(range(2), DEVICE)
    x_t = initial_noise(seeds, shape, DEVICE)
    engine = Engine(DEVICE, steps_per_graph=3)
    loop = engine.prepare(model, sampler, 2, torch.float32, cache_interval=2)
    assert loop.steps_per_graph == 4
    out = engine.run(x_t, seeds)
    assert set(loop.graphs) == {(4, 0), (2, 0)}
    step = engine.current_step_model.bind_timesteps(sampler.timesteps)
    eager = SamplingLoop(step, sampler, (2, *shape), torch.float32, DEVICE, use_graphs=False, cache_interval=2)
    assert rel_err(out, eager.run(x_t, seeds)) < TOL
    loop.load(x_t, seeds)
    loop.run_steps(3)
    loop.run_steps(7)
    assert {(3, 0), (4, 1), (3, 1)} <= set(loop.graphs)
    assert rel_err(loop.x, out) < TOL
