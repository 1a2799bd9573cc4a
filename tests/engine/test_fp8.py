"""The engine's fp8 (``fp8=True``): which GroupNorm -> conv pairs go e4m3, and the fp8 forward of a DDPMUNet against the
float64 eager model next to the fp16 engine's (fp16 engine; Triton interpreter on the CPU, the TMA kernel on a
Hopper GPU)."""

from __future__ import annotations

import re

import pytest
import torch

from fastdiff.engine import Engine
from fastdiff.engine.candidates import candidates
from fastdiff.engine.executor import FusedModel
from fastdiff.engine.fp8 import fp8_unsupported, mark_fp8_ops
from fastdiff.engine.graph import channels_last_empty
from fastdiff.engine.impl import Impl
from fastdiff.engine.ir import GraphBuilder
from fastdiff.errors import FastdiffError
from fastdiff.kernels.fp8 import E4M3_MAX, FP8_DTYPE, NORM_BOUND
from fastdiff.models.ddpm_unet import DDPMUNet, DDPMUNetConfig

from .conftest import DEVICE, rel_err

needs_fp8 = pytest.mark.skipif(
    DEVICE.type == "cuda" and torch.cuda.get_device_capability()[0] < 9, reason="fp8 needs a Hopper-class GPU"
)


def _conv(g: GraphBuilder, name: str, x, cout: int, residual=None, upsample: int = 1):
    out = g.value(name, cout, x.shape[2] * upsample, x.shape[3] * upsample)
    params = dict(stride=1, padding=1, act=None, scale=None, upsample=upsample, temb=None, ksize=3)
    return g.op(name, "conv", [x, residual], out, params, {"weight": torch.randn(cout, x.shape[1], 3, 3)})


def _norm(g: GraphBuilder, name: str, x, gamma: float = 1.0, beta: float = 0.0):
    out = g.value(name, x.shape[1], x.shape[2], x.shape[3])
    weights = {"weight": torch.full((x.shape[1],), gamma), "bias": torch.full((x.shape[1],), beta)}
    return g.op(name, "group_norm", [x], out, dict(groups=2, eps=1e-5, act="silu"), weights)


def _layer_norm(g: GraphBuilder, name: str, x, gamma: float = 1.0, beta: float = 0.0):
    out = g.value(name, *x.shape[1:])
    weights = {"weight": torch.full((x.shape[1],), gamma), "bias": torch.full((x.shape[1],), beta)}
    return g.op(name, "layer_norm", [x], out, dict(eps=1e-5), weights)


def test_which_convs_and_gemms_go_fp8():
    g = GraphBuilder(1, 4, 4)
    x = g.input("x_in", 32, 4, 4)
    n_two = _norm(g, "norm_two_readers", x, gamma=-2.0, beta=0.5)
    a, b = _conv(g, "a", n_two, 32), _conv(g, "b", n_two, 16)  # both fp8: the norm goes e4m3
    n_res = _norm(g, "norm_as_residual", a)
    _conv(g, "c", b, 32, residual=n_res)  # read as a residual: stays
    n_mixed = _norm(g, "norm_mixed", a)
    _conv(g, "d", n_mixed, 32)
    g.linear("e", torch.randn(8, 32), None, n_mixed)  # a conv and a GEMM (proj_in after a GroupNorm): both fp8
    n_up = _norm(g, "norm_up", a)
    _conv(g, "f", n_up, 32, upsample=2)  # Upsample2D: stays
    narrow = _conv(g, "narrow", x, 24)
    _conv(g, "g", _norm(g, "norm_narrow", narrow), 32)  # 24 channels: not a multiple of 16, stays
    ln = _layer_norm(g, "ln", a, gamma=0.5, beta=-1.0)
    g.linear("q", torch.randn(32, 32), None, ln)
    g.linear("geglu", torch.randn(64, 32), torch.randn(64), ln, geglu=True)  # LayerNorm -> GEMMs: fp8
    g.linear("res", torch.randn(32, 32), None, a, residual=_layer_norm(g, "ln_as_residual", a))  # stays
    g.linear("thin", torch.randn(32, 24), None, _layer_norm(g, "ln_narrow", narrow))  # 24 channels: stays
    assert mark_fp8_ops(g.ops) == 6
    ops = {op.name: op for op in g.ops}
    scale = (NORM_BOUND * 2.0 + 0.5) / E4M3_MAX
    assert ops["norm_two_readers"].params["fp8_scale"] == pytest.approx(scale) and n_two.fp8
    assert ops["a"].params["fp8_scale"] == ops["b"].params["fp8_scale"] == ops["norm_two_readers"].params["fp8_scale"]
    assert ops["q"].params["fp8_scale"] == pytest.approx((NORM_BOUND * 0.5 + 1.0) / E4M3_MAX) and ln.fp8
    fp8 = sorted(op.name for op in g.ops if "fp8_scale" in op.params)
    assert fp8 == ["a", "b", "d", "e", "geglu", "ln", "norm_mixed", "norm_two_readers", "q"]
    assert sorted(v.name for v in g.values if v.fp8) == ["ln", "norm_mixed", "norm_two_readers"]


FP8_UNET = dict(
    sample_size=(8, 12), in_channels=3, out_channels=3, block_out_channels=(16, 32), norm_num_groups=4,
    down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    layers_per_block=1, attention_head_dim=8,
)  # fmt: skip
"""Channels that are multiples of 16 (what the fp8 conv's TMA rows need), attention whose norm feeds a GEMM."""


@pytest.mark.slow
@needs_fp8
def test_fp8_forward_against_float64_and_fp16():
    torch.manual_seed(0)
    model = DDPMUNet(DDPMUNetConfig(**FP8_UNET)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:  # unit-variance outputs per layer, as in a trained U-Net
                p.normal_(0.0, 1.0 / p[0].numel() ** 0.5)
            else:
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.2)
    model = model.to(DEVICE)
    fp16 = FusedModel(model, 2, torch.float16, DEVICE, "triton", "triton")
    fp8 = FusedModel(model, 2, torch.float16, DEVICE, "triton", "triton", fp8=True)
    convs = sorted(op.name for op in fp8.ops if op.kind == "conv" and "fp8_scale" in op.params)
    resnet_convs = [f"{name}.conv{i}" for name, m in model.named_modules() if name.endswith(("resnets.0", "resnets.1"))
                    for i in (1, 2)]  # fmt: skip
    attentions = [
        f"{name}.to_qkv" for name, _ in model.named_modules() if name.endswith(("attentions.0", "attentions.1"))
    ]
    assert convs == sorted([*resnet_convs, *attentions]) and fp8.fp8_ops == len(convs)
    offered = {op.name: candidates(fp8, op) for op in fp8.ops if op.name in convs}
    assert all(impls[0].name == "triton-tma-fp8" for impls in offered.values())
    assert all(impl.name.startswith("triton-tma-fp8-k") for impls in offered.values() for impl in impls[1:])
    assert DEVICE.type != "cuda" or any(len(impls) > 1 for impls in offered.values())
    shape = fp8.x_in_value.shape
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    x_in = channels_last_empty(shape, torch.float16, DEVICE).copy_(x.to(DEVICE))
    t = torch.tensor([500], device=DEVICE)
    got = fp8.forward(x_in, t).clone()
    half = fp16.forward(x_in, t).clone()
    norms = [op for op in fp8.ops if op.kind == "group_norm" and "fp8_scale" in op.params]
    assert norms and all(fp8.tensor(op.output).dtype == FP8_DTYPE for op in norms)
    with torch.no_grad():
        ref = model.double().cpu()(x.half().double(), torch.tensor([500]))
    err8, err16 = rel_err(got, ref), rel_err(half, ref)
    assert torch.isfinite(got).all()
    assert err16 < 0.01 and err16 * 3 < err8 < 0.1  # fp8: e4m3 steps of 1/16 .. 1/8 in every conv, about 6% here
    # Each fp8 conv split-K (the autotune's choice where the grid leaves SMs idle) on the input the forward gave it:
    # the same products summed in another order, so within fp16 roundings of the unsplit conv. (Not compared at the
    # model's output: one changed fp16 rounding can move an e4m3 rounding downstream, and the network's output by
    # several %: 3.8% here on the H100, with every op within 4e-4 of its unsplit form.)
    fp8.temb_row.copy_(fp8.time_table(t))
    for op, call in zip(fp8.step_ops, fp8._calls, strict=True):
        call()
        if op.name in convs:
            out = fp8.tensor(op.output)
            whole = out.clone()
            fp8.call(op, Impl.parse("triton-tma-fp8-k2"))()
            assert rel_err(out, whole) < 1e-3, op.name
            out.copy_(whole)
    assert not fp8.split_workspace.counters.any()


def test_fp8_arguments_are_checked_first(tiny_model):
    model = tiny_model("attn_pad0", 0)
    with pytest.raises(FastdiffError, match="engine dtype cannot be"):
        FusedModel(model, 1, torch.float32, DEVICE, fp8=True)
    with pytest.raises(FastdiffError, match="TMA kernel"):
        FusedModel(model, 1, torch.float16, DEVICE, "cudnn", fp8=True)
    with pytest.raises(FastdiffError, match="TMA kernel"):
        Engine(DEVICE, conv_impl="cudnn", fp8=True)


def test_fp8_unsupported_names_the_first_problem(monkeypatch):
    """One home for fp8's preconditions, in order: the device, the activation dtype, the conv implementation; None
    when all hold (the engine, its step model and the pipeline all ask it)."""
    from fastdiff.engine import fp8 as engine_fp8

    assert fp8_unsupported(DEVICE, torch.float16) is None
    assert fp8_unsupported(DEVICE, None, "cudnn").endswith("not with conv_impl='cudnn'")
    reason = fp8_unsupported(DEVICE, torch.float32, "cudnn", role="pipeline")
    assert "the pipeline dtype cannot be torch.float32" in reason
    monkeypatch.setattr(engine_fp8, "fp8_supported", lambda device: "fp8 needs a Hopper-class GPU")
    assert fp8_unsupported(DEVICE, torch.float32, "cudnn") == "fp8 needs a Hopper-class GPU"


@pytest.mark.slow
@needs_fp8
def test_fp8_stable_diffusion_unet_against_float64_and_fp16():
    """The SD 1.5-structured U-Net (tiny widths) at a guided batch of 2: the conv1/conv2 of every ResNet block and
    the GEMMs after a norm (q|k|v, the cross-attention query, the GEGLU projection, proj_in) go e4m3 (shortcuts,
    resampling, conv_in/conv_out and the other GEMMs stay fp16), and the fp8 forward stays within 15 % of the
    float64 eager model where the fp16 engine is within 3 %."""
    from sd_fixtures import randomize_norms, tiny_unet_config

    from fastdiff.models.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel

    torch.manual_seed(0)
    config = UNet2DConditionConfig.from_dict({k: v for k, v in tiny_unet_config("sd15").items() if k[0] != "_"})
    model = randomize_norms(UNet2DConditionModel(config), 0).eval().to(DEVICE)
    kwargs = dict(size=(8, 8), context_tokens=77)
    fp8 = FusedModel(model, 2, torch.float16, DEVICE, "triton", "triton", fp8=True, **kwargs)
    fp16 = FusedModel(model, 2, torch.float16, DEVICE, "triton", "triton", **kwargs)
    convs = sorted(op.name for op in fp8.ops if op.kind == "conv" and "fp8_scale" in op.params)
    resnets = [name for name, _ in model.named_modules() if re.fullmatch(r".*resnets\.\d+", name)]
    resnet_convs = sorted(f"{name}.conv{i}" for name in resnets for i in (1, 2))
    gemms = sorted(op.name for op in fp8.ops if op.kind == "linear" and "fp8_scale" in op.params)
    blocks = [name for name, _ in model.named_modules() if re.fullmatch(r".*attentions\.\d+", name)]
    after_norms = ["transformer_blocks.0.attn1.to_qkv", "transformer_blocks.0.attn2.to_q",
                   "transformer_blocks.0.ff.net.0.proj", "proj_in"]  # fmt: skip
    assert convs == resnet_convs and gemms == sorted(f"{name}.{op}" for name in blocks for op in after_norms)
    assert fp8.fp8_ops == len(convs) + len(gemms) == 28 + 40
    gen = torch.Generator().manual_seed(1)
    shape = fp8.x_in_value.shape
    x = torch.randn(shape, generator=gen)
    context = torch.randn((2, 77, model.config.cross_attention_dim), generator=gen).half()
    x_in = channels_last_empty(shape, torch.float16, DEVICE).copy_(x.to(DEVICE))
    t = torch.tensor([500], device=DEVICE)
    got = fp8.forward(x_in, t, context.to(DEVICE)).clone()
    half = fp16.forward(x_in, t, context.to(DEVICE)).clone()
    with torch.no_grad():
        ref = model.double().cpu()(x.half().double(), torch.tensor([500]), context.double())
    err8, err16 = rel_err(got, ref), rel_err(half, ref)
    assert torch.isfinite(got).all()
    assert err16 < 0.03 and err16 * 2 < err8 < 0.15  # 2.2 % and 11.6 % in the interpreter (convs alone: 7.8 %)
