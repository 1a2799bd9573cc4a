"""GroupNorm folded into the convs (``fold_norms=True``): which norms fold, and the folded forward of each U-Net
family and the VAE decoder against the eager model in float64 (fp32 engine; Triton interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch
from sd_fixtures import randomize_norms, tiny_unet_config, tiny_vae_config

from fastdiff.engine.executor import FusedModel
from fastdiff.engine.fold import fold_group_norms
from fastdiff.engine.graph import channels_last_empty
from fastdiff.engine.ir import GraphBuilder
from fastdiff.models.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig
from fastdiff.models.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel

from .conftest import DEVICE, TOL, rel_err


def _conv(g: GraphBuilder, name: str, x, cout: int, residual=None):
    out = g.value(name, cout, x.shape[2], x.shape[3])
    params = dict(stride=1, padding=1, act=None, scale=None, upsample=1, temb=None)
    return g.op(name, "conv", [x, residual], out, params, {"weight": torch.randn(cout, x.shape[1], 3, 3)})


def _norm(g: GraphBuilder, name: str, x, act="silu"):
    out = g.value(name, x.shape[1], x.shape[2], x.shape[3])
    weights = {"weight": torch.ones(x.shape[1]), "bias": torch.zeros(x.shape[1])}
    return g.op(name, "group_norm", [x], out, dict(groups=2, eps=1e-5, act=act), weights)


def test_which_norms_fold():
    g = GraphBuilder(1, 4, 4)
    x = g.input("x_in", 4, 4, 4)
    n_input = _norm(g, "norm_of_input", x)  # the graph input: no producing conv
    a = _conv(g, "a", n_input, 4)
    n_a = _norm(g, "norm_a", a)  # conv -> norm -> conv: folds
    b = _conv(g, "b", n_a, 4, residual=a)  # a is also b's residual: still folds (a stays stored)
    n_b = _norm(g, "norm_b", b, act=None)
    c = _conv(g, "c", x, 4, residual=n_b)  # norm_b is read as a residual: stays
    left, right = _conv(g, "left", c, 2), _conv(g, "right", c, 2)
    cat = g.concat("cat", [left, right])
    n_cat = _norm(g, "norm_cat", cat)  # a concat: two producers, stays
    _conv(g, "d", n_cat, 4)
    n_left = _norm(g, "norm_left", left)  # one concat part (a skip): its producer writes the slice, folds
    _conv(g, "e", n_left, 4)
    ops = fold_group_norms(g.ops)
    assert [op.name for op in ops if op.kind == "group_norm"] == ["norm_of_input", "norm_b", "norm_cat"]
    assert [op.name for op in ops if "stats" in op.params] == ["a", "left"]
    by_name = {op.name: op for op in ops}
    assert by_name["a"].params["stats"] == ("norm_a", 2, 1e-5, "silu")
    assert by_name["b"].params["norm"] == ("norm_a", 2, 1e-5, "silu") and by_name["b"].inputs[0] is a
    assert by_name["b"].inputs[1] is a and "norm_weight" in by_name["b"].weights
    assert "stats" not in by_name["b"].params and "norm" not in by_name["c"].params


def _check_folded(model, batch: int, size, call, reference) -> FusedModel:
    """The folded engine against the unfolded one (which norms went, and the outputs) and, on the CPU, against
    ``reference(x, t)`` (float64 eager) for two inputs; ``call(fused, x_in, t)`` runs the engine."""
    plain = FusedModel(model, batch, torch.float32, DEVICE, "triton", "triton", size=size, context_tokens=5)
    folded = FusedModel(model, batch, torch.float32, DEVICE, "triton", "triton", size=size, context_tokens=5,
                        fold_norms=True)  # fmt: skip
    folded.arena.view(torch.float32).fill_(float("nan"))
    norms = sum(op.kind == "group_norm" for op in plain.ops)
    stats = [op for op in folded.ops if "stats" in op.params]
    assert stats and sum(op.kind == "group_norm" for op in folded.ops) == norms - len(stats)
    assert len(folded.ops) == len(plain.ops) - len(stats)
    gen = torch.Generator().manual_seed(batch)
    shape = folded.x_in_value.shape
    for t in (981, 20):  # a second call: no weight waits, the statistics of a new input
        x = torch.randn(shape, generator=gen)
        x_in = channels_last_empty(shape, torch.float32, DEVICE).copy_(x.to(DEVICE))
        out = call(folded, x_in, t).clone()
        assert torch.isfinite(out).all()
        # the fold's own error: against the unfolded engine (on the GPU both round their dots to TF32 alike)
        assert rel_err(out, call(plain, x_in, t)) < TOL
        if DEVICE.type == "cpu":  # exact fp32 dots in the interpreter: also against the float64 eager model
            with torch.no_grad():
                ref = reference(model.double().cpu(), x.double(), t)
                model.to(DEVICE, torch.float32)
            assert rel_err(out, ref) < TOL
    return folded


def test_folded_ddpm_unet_matches_eager(tiny_name, tiny_model):
    model = tiny_model(tiny_name, seed=5).to(DEVICE)
    folded = _check_folded(
        model, 3, None,
        lambda fused, x_in, t: fused.forward(x_in, torch.tensor([t], device=DEVICE)),
        lambda ref, x, t: ref(x, torch.tensor([t])),
    )  # fmt: skip
    resnets = sum(len(b.resnets) for b in [*model.down_blocks, *model.up_blocks])
    assert sum("stats" in op.params for op in folded.ops) >= resnets  # at least every ResNet block's norm2


def test_folded_unet_2d_condition_matches_eager():
    torch.manual_seed(2)
    config = {k: v for k, v in tiny_unet_config("sd15").items() if not k.startswith("_")}
    model = randomize_norms(UNet2DConditionModel(UNet2DConditionConfig.from_dict(config)), 2).eval().to(DEVICE)
    context = torch.randn((1, 5, model.config.cross_attention_dim), generator=torch.Generator().manual_seed(4))
    _check_folded(
        model, 1, (8, 8),
        lambda fused, x_in, t: fused.forward(x_in, torch.tensor([t], device=DEVICE), context.to(DEVICE)),
        lambda ref, x, t: ref(x, torch.tensor([t]), context.double()),
    )  # fmt: skip


@pytest.mark.parametrize("post_quant_conv", [True, False])
def test_folded_vae_decoder_matches_eager(post_quant_conv):
    config = tiny_vae_config("sd15")
    config.update(use_post_quant_conv=post_quant_conv, scaling_factor=0.3)
    torch.manual_seed(3)
    vae = randomize_norms(AutoencoderKL(AutoencoderKLConfig.from_dict(config)), 3).eval().to(DEVICE)
    _check_folded(
        vae, 2, (3, 5),
        lambda fused, x_in, t: fused.forward(x_in),
        lambda ref, x, t: ref.decode(x / 0.3),
    )  # fmt: skip


def test_engine_and_bench_options():
    from fastdiff.bench.runner import build_system
    from fastdiff.engine import Engine
    from fastdiff.errors import FastdiffError

    system = build_system("engine+fold-fp16", lambda: None, DEVICE, torch.zeros(1))
    assert system.fold_norms and system.name == "engine+fold" and "folded" in system.notes
    assert not build_system("engine-fp16", lambda: None, DEVICE, torch.zeros(1)).fold_norms
    with pytest.raises(FastdiffError, match="fold_norms needs the Triton conv"):
        Engine(DEVICE, conv_impl="cudnn", fold_norms=True)
