"""Step caching's plain-PyTorch reference (``fastdiff.models.step_cache``): the full forward is the model's forward
and keeps the input of the last up block (checked inside diffusers' own UNet2DModel / UNet2DConditionModel); the
shallow forward equals the same cut written over diffusers' modules, never runs the deep blocks, and with the
same step's feature gives the full output bit for bit; one-line errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from sd_fixtures import make_diffusers_unet
from torch import nn

from fastdiff.errors import FastdiffError
from fastdiff.models.convnext_unet import ConvNeXtUNet, ConvNeXtUNetConfig
from fastdiff.models.ddpm_unet import DDPMUNet, DDPMUNetConfig
from fastdiff.models.step_cache import cached_forward, check
from fastdiff.models.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel

TOL = 1e-4  # fp32 max abs diff vs diffusers, relative to the tensor's scale (deep features reach ~40)


def close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """fp32 agreement up to summation order: max abs diff <= TOL x max(1, max |ref|)."""
    return bool((out - ref).abs().max() <= TOL * max(1.0, float(ref.abs().max())))


DDPM = dict(
    # three levels, two resnets per block, attention in the first down and the last up block, DDPM flags
    sample_size=8, in_channels=3, out_channels=3, block_out_channels=(6, 9, 12), norm_num_groups=3,
    down_block_types=("AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "UpBlock2D", "AttnUpBlock2D"), layers_per_block=2, attention_head_dim=3,
    norm_eps=1e-6, flip_sin_to_cos=False, freq_shift=1, downsample_padding=0,
)  # fmt: skip
COND = dict(
    # cross-attention in the first down and the last up block (the shallow path reads the text states)
    sample_size=8, in_channels=4, out_channels=4, block_out_channels=[8, 16], norm_num_groups=4,
    down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"], up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"],
    layers_per_block=1, attention_head_dim=2, cross_attention_dim=6,
)  # fmt: skip
CONVNEXT = ConvNeXtUNetConfig(
    sample_size=8, in_channels=2, out_channels=2, base_dim=6, dim_mults=(1, 2, 2), attention_heads=2,
    attention_head_dim=3,
)  # fmt: skip


def diffusers_pair(name: str) -> tuple[nn.Module, nn.Module]:
    """(diffusers model, fastdiff model with its weights) with random weights."""
    diffusers = pytest.importorskip("diffusers")
    if name == "ddpm":
        torch.manual_seed(0)
        ref = diffusers.UNet2DModel(**DDPM).eval()
        with torch.no_grad():
            for p in ref.parameters():
                p.normal_(0.0, 0.3)
        ours = DDPMUNet(DDPMUNetConfig(**DDPM))
    else:
        ref = make_diffusers_unet(COND, seed=1)
        ours = UNet2DConditionModel(UNet2DConditionConfig.from_dict(COND))
    ours.load_state_dict(ref.state_dict())
    return ref, ours.eval()


def diffusers_shallow(unet: nn.Module, x, t, deep, context=None):
    """The shallow forward written over diffusers' modules: time embedding, conv_in, the first down block's resnets
    (and attentions) without its downsampler, the last up block on ``deep`` and those skips, the output head."""
    emb = unet.time_embedding(unet.time_proj(t).to(x.dtype))
    h = unet.conv_in(x)
    skips = (h,)
    first = unet.down_blocks[0]
    for i, resnet in enumerate(first.resnets):
        h = resnet(h, emb)
        if getattr(first, "attentions", None):
            attn = first.attentions[i]
            h = attn(h) if context is None else attn(h, encoder_hidden_states=context, return_dict=False)[0]
        skips += (h,)
    last = unet.up_blocks[-1]
    extra = {} if context is None or not hasattr(last, "attentions") else {"encoder_hidden_states": context}
    h = last(hidden_states=deep, res_hidden_states_tuple=skips, temb=emb, **extra)
    return unet.conv_out(unet.conv_act(unet.conv_norm_out(h)))


def last_up_input(unet: nn.Module, *args):
    """(output, the input of diffusers' last up block) of one diffusers forward."""
    seen = []

    def hook(module, args, kwargs):
        seen.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    handle = unet.up_blocks[-1].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = unet(*args).sample
    finally:
        handle.remove()
    return out, seen[0]


@pytest.mark.parametrize("name", ["ddpm", "cond"])
def test_cut_matches_diffusers(name):
    """Full: diffusers' output and its last up block's input. Shallow at step B on step A's feature: the same cut
    over diffusers' modules (the U-Net's deep blocks never run), and step A's own feature gives the full output."""
    ref, ours = diffusers_pair(name)
    gen = torch.Generator().manual_seed(3)
    b, c = 2, ref.config.in_channels
    xa, xb = (torch.randn(b, c, 8, 8, generator=gen) for _ in range(2))
    ta, tb = torch.tensor([700, 700]), torch.tensor([650, 650])
    ctx = torch.randn(b, 5, COND["cross_attention_dim"], generator=gen) if name == "cond" else None
    extra = () if ctx is None else (ctx,)
    with torch.no_grad():
        out_ref, deep_ref = last_up_input(ref, xa, ta, *extra)
        out, deep = cached_forward(ours, xa, ta, context=ctx)
        assert close(out, out_ref) and close(deep, deep_ref)
        assert deep_ref.shape[1] == ref.config.block_out_channels[1]  # the second level's width, full resolution
        assert torch.equal(out, ours(xa, ta, *extra))  # the model's own forward, bit for bit
        calls = []
        hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in (ours.mid_block, ours.down_blocks[1])]
        shallow, kept = cached_forward(ours, xb, tb, deep, ctx)
        for handle in hooks:
            handle.remove()
        assert not calls and kept is deep
        expected = diffusers_shallow(ref, xb, tb, deep_ref, ctx)
        assert (shallow - expected).abs().max() <= TOL
        assert (shallow - ours(xb, tb, *extra)).abs().max() > 1e-2  # a stale feature changes the output
        again, _ = cached_forward(ours, xa, ta, deep, ctx)
    assert torch.equal(again, out)


def test_convnext_cut():
    """ConvNeXtUNet: the full forward is the model's, the feature is the last decoder level's input (what its
    attention gate is driven by), the shallow path skips the deep levels and is exact on its own step's feature."""
    torch.manual_seed(4)
    model = ConvNeXtUNet(CONVNEXT).eval()
    x, t = torch.randn(2, 2, 8, 8), torch.tensor([300, 300])
    seen = []
    handle = model.ups[-1]["gate"].register_forward_pre_hook(lambda module, args: seen.append(args[1]))
    with torch.no_grad():
        expected = model(x, t)
        handle.remove()
        out, deep = cached_forward(model, x, t)
        calls = []
        hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in (model.mid_block1, model.downs[1])]
        shallow, _ = cached_forward(model, x, t, deep)
        other, _ = cached_forward(model, x, torch.tensor([900, 900]), deep)
    for h in hooks:
        h.remove()
    assert torch.equal(out, expected) and torch.equal(deep, seen[0]) and torch.equal(shallow, expected)
    assert not calls and not torch.equal(other, expected)
    assert deep.shape == (2, 6, 8, 8)


def test_convnext_cut_of_a_one_level_model():
    """One level: no downsample and a single decoder level, so the deep feature is the middle's output."""
    torch.manual_seed(5)
    model = ConvNeXtUNet(dataclasses.replace(CONVNEXT, dim_mults=(1,))).eval()
    x, t = torch.randn(2, 2, 8, 8), torch.tensor([300, 300])
    with torch.no_grad():
        out, deep = cached_forward(model, x, t)
        shallow, _ = cached_forward(model, x, t, deep)
        _, temb = model.embed(x, t)
        skip = model.shallow_in(x, temb)
        middle = model.mid_block2(model.mid_attn(model.mid_block1(skip, temb)), temb)
    assert torch.equal(out, model(x, t)) and torch.equal(shallow, out) and torch.equal(deep, middle)


def test_errors_are_one_line():
    for bad in (0, -2, 1.5, True, "2", None):
        with pytest.raises(FastdiffError, match=r"^cache_interval must be an integer >= 1 \(1: no step caching\)"):
            check(DDPMUNet(DDPMUNetConfig(**DDPM)), bad)
    assert check(nn.Conv2d(1, 1, 1), 1) == 1  # no cache asked: any model
    with pytest.raises(FastdiffError, match="step caching .* supports DDPMUNet, UNet2DConditionModel, Conv"):
        check(nn.Conv2d(1, 1, 1), 2)
    with pytest.raises(FastdiffError, match="needs text states"):
        cached_forward(UNet2DConditionModel(UNet2DConditionConfig.from_dict(COND)), torch.zeros(1, 4, 8, 8), 1)
