"""fp8 (e4m3): the rounding helper bit for bit against torch, GroupNorm's e4m3 output, the fp8 TMA conv against its
dequantised reference (odd shapes in the interpreter, the U-Net's shapes with default tiles on the GPU), and how far
an fp8 norm -> conv pair lands from fp32."""

from __future__ import annotations

import zlib

import pytest
import torch
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels.conv2d import conv2d_ref
from fastdiff.kernels.conv2d_tma import (
    TmaConfig,
    conv2d_fp8_ref,
    conv2d_tma,
    pack_conv_weight_fp8,
    unpack_conv_weight_fp8,
)
from fastdiff.kernels.fp8 import E4M3_MAX, FP8_DTYPE, norm_output_scale, quantize_e4m3_ref, to_e4m3
from fastdiff.kernels.group_norm_act import group_norm_act, group_norm_act_ref

from .conftest import CUDA, DEVICE, needs_cuda, rel_err

needs_fp8 = pytest.mark.skipif(
    CUDA and torch.cuda.get_device_capability()[0] < 9, reason="fp8 convs need a Hopper-class GPU"
)
pytestmark = needs_fp8
OUT_DTYPE = torch.float16 if CUDA else torch.float32
SMALL = TmaConfig(block_m=32, block_n=16, block_k=32, num_warps=4, num_stages=2)
"""Interpreter-sized tiles; on the GPU each call's default config (the engine's)."""
CONFIG = None if CUDA else SMALL


@triton.jit
def _to_e4m3_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, to_e4m3(tl.load(x_ptr + offs)))


def test_to_e4m3_is_torchs_rounding_bit_for_bit() -> None:
    """Round to nearest even at every magnitude: ties, carries across a power of two, subnormals (< 2^-6), the
    saturation at 448, signed zeros."""
    gen = torch.Generator().manual_seed(0)
    special = [0.0, -0.0, 447.9, 448.0, 460.0, 1e4, -1e4, 2**-10, 3 * 2**-10, 5 * 2**-10, 2**-6, -(2**-7), 1.0625,
               1.1875, 15.5, 31.0, 248.0, -240.0 - 8.0]  # fmt: skip
    x = torch.cat([torch.tensor(special), 100 * torch.randn(1000, generator=gen),
                   0.01 * torch.randn(1000, generator=gen), 1e-4 * torch.randn(30, generator=gen)])  # fmt: skip
    x = torch.nn.functional.pad(x, (0, triton.next_power_of_2(x.numel()) - x.numel())).to(DEVICE)
    y = torch.empty(x.shape, dtype=FP8_DTYPE, device=DEVICE)
    _to_e4m3_kernel[(1,)](x, y, x.numel())
    assert torch.equal(y.view(torch.uint8), quantize_e4m3_ref(x, 1.0).view(torch.uint8))


def _gn_inputs(n: int, c: int, h: int, w: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (3.0 * torch.randn((n, c, h, w), generator=gen) + 1.0).to(DEVICE).contiguous(memory_format=torch.channels_last)
    weight = (1.0 + 0.5 * torch.randn(c, generator=gen)).to(DEVICE)
    bias = torch.randn(c, generator=gen).to(DEVICE)
    return x, weight, bias


@pytest.mark.parametrize(
    ("shape", "groups", "design"),
    [
        pytest.param((2, 48, 5, 7), 3, "single_pass", id="c48_g3_5x7_single"),
        pytest.param((3, 32, 6, 5), 8, "two_phase", id="c32_g8_6x5_two_phase"),
        pytest.param((2, 64, 9, 9), 32, "auto", id="c64_g32_9x9_auto"),
    ],
)
def test_group_norm_e4m3_output(shape: tuple[int, ...], groups: int, design: str) -> None:
    """e4m3(y / scale) with the scale of the norm's affine: each value within one e4m3 step of the reference's
    (the fp32 y of kernel and torch differ in the last bits, so a value on a rounding boundary may go either way),
    and nearly all identical."""
    x, weight, bias = _gn_inputs(*shape, seed=zlib.crc32(repr(shape).encode()))
    scale = norm_output_scale(weight, bias)
    out = torch.empty(shape, dtype=FP8_DTYPE, device=DEVICE).contiguous(memory_format=torch.channels_last)
    got = group_norm_act(x, groups, weight, bias, 1e-6, activation="silu", out=out, design=design, fp8_scale=scale)
    assert got is out
    ref = group_norm_act_ref(x.double(), groups, weight.double(), bias.double(), 1e-6, activation="silu",
                             fp8_scale=scale)  # fmt: skip
    g, r = got.float(), ref.float()
    assert (g - r).abs().le(r.abs() / 8 + 2**-9).all()
    assert (got.view(torch.uint8) == ref.view(torch.uint8)).float().mean() > 0.99
    assert g.abs().max() < E4M3_MAX / 4  # a 16-sigma bound leaves normalised data far from saturation


CONV_CASES = [
    pytest.param(dict(n=2, cin=32, cout=16, h=7, w=9, k=3, padding=1, temb=True, act="silu"), id="c32_7x9_temb_silu"),
    pytest.param(dict(n=3, cin=48, cout=32, h=4, w=5, k=3, padding=1, res=True, scale=0.5), id="c48_4x5_res_scale"),
    pytest.param(dict(n=1, cin=64, cout=16, h=5, w=6, k=1, res=True), id="k1_5x6_shortcut"),
    pytest.param(
        dict(n=2, cin=256, cout=128, h=16, w=16, k=3, padding=1, temb=True), id="c256_16x16", marks=needs_cuda
    ),  # fmt: skip
    pytest.param(
        dict(n=256, cin=128, cout=128, h=32, w=32, k=3, padding=1, res=True), id="b256_c128_32", marks=needs_cuda
    ),  # fmt: skip
    pytest.param(
        dict(n=256, cin=256, cout=256, h=8, w=8, k=3, padding=1, temb=True), id="b256_c256_8", marks=needs_cuda
    ),  # fmt: skip
    pytest.param(
        dict(n=256, cin=512, cout=256, h=4, w=4, k=3, padding=1, temb=True), id="b256_c512_4", marks=needs_cuda
    ),  # fmt: skip
    pytest.param(
        dict(n=1, cin=128, cout=128, h=32, w=32, k=3, padding=1, temb=True), id="b1_c128_32", marks=needs_cuda
    ),  # fmt: skip
]


def _conv_inputs(case: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """fp32 activations (a SiLU'd normal, like a GroupNorm's output), a conv weight of unit-variance outputs, and
    the epilogue's tensors."""
    gen = torch.Generator().manual_seed(seed)
    n, cin, cout, h, w, k = (case[key] for key in ("n", "cin", "cout", "h", "w", "k"))
    ho, wo = h + 2 * case.get("padding", 0) - k + 1, w + 2 * case.get("padding", 0) - k + 1
    x = torch.nn.functional.silu(torch.randn((n, cin, h, w), generator=gen))
    weight = torch.randn((cout, cin, k, k), generator=gen) / (cin * k * k) ** 0.5
    kwargs: dict = {"padding": case.get("padding", 0), "activation": case.get("act"), "out_scale": case.get("scale")}
    kwargs["bias"] = torch.randn(cout, generator=gen)
    if case.get("temb"):
        kwargs["time_emb"] = torch.randn((n, cout), generator=gen)
    if case.get("res"):
        kwargs["residual"] = torch.randn((n, cout, ho, wo), generator=gen).contiguous(memory_format=torch.channels_last)
    return x, weight, kwargs


def _on_device(kwargs: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(DEVICE, dtype) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


@pytest.mark.parametrize("case", CONV_CASES)
def test_fp8_conv_matches_its_dequantised_reference(case: dict) -> None:
    """The kernel against conv2d_ref of exactly the e4m3 values it multiplies: only the fp32 summation order and
    the output rounding may differ."""
    x, weight, kwargs = _conv_inputs(case, seed=zlib.crc32(str(case).encode()))
    a_scale = 4.0 / E4M3_MAX
    x8 = quantize_e4m3_ref(x, a_scale).to(DEVICE).contiguous(memory_format=torch.channels_last)
    w8, w_scale = pack_conv_weight_fp8(weight)
    w8, w_scale = w8.to(DEVICE), (w_scale * a_scale).to(DEVICE)
    kwargs = _on_device(kwargs, OUT_DTYPE)
    bias = kwargs.pop("bias")
    out = torch.full((x.shape[0], weight.shape[0], *_out_hw(case)), float("nan"), dtype=OUT_DTYPE, device=DEVICE)
    out = out.contiguous(memory_format=torch.channels_last)
    got = conv2d_tma(x8, w8, bias, weight_scale=w_scale, out=out, config=CONFIG, **kwargs)
    assert got is out
    ref = conv2d_fp8_ref(x8, w8, bias, weight_scale=w_scale, **kwargs)
    assert rel_err(got, ref.double()) < (2e-3 if CUDA else 1e-5)


def _out_hw(case: dict) -> tuple[int, int]:
    p, k = case.get("padding", 0), case["k"]
    return case["h"] + 2 * p - k + 1, case["w"] + 2 * p - k + 1


def test_fp8_norm_then_conv_against_fp32() -> None:
    """What the engine's fp8 does to one ResNet conv: GroupNorm + SiLU to e4m3 at the affine's scale, the conv with
    per-channel e4m3 weights, against the same two ops in fp32. e4m3 keeps 3 mantissa bits (a relative step of
    1/8 .. 1/16): the output's relative error is a few percent, and zero-mean rounding keeps it there."""
    case = dict(n=2, cin=64, cout=32, h=8, w=8, k=3, padding=1)
    x, weight, kwargs = _conv_inputs(case, seed=5)
    h, gamma, beta = _gn_inputs(2, 64, 8, 8, seed=6)
    h, gamma, beta = h.cpu(), gamma.cpu(), beta.cpu()
    scale = norm_output_scale(gamma, beta)
    a8 = group_norm_act(h.to(DEVICE), 32, gamma.to(DEVICE), beta.to(DEVICE), activation="silu", fp8_scale=scale)
    w8, w_scale = pack_conv_weight_fp8(weight)
    bias = kwargs["bias"].to(DEVICE, OUT_DTYPE)
    got = conv2d_tma(a8, w8.to(DEVICE), bias, padding=1, weight_scale=(w_scale * scale).to(DEVICE), config=CONFIG)
    exact = conv2d_ref(group_norm_act_ref(h.double(), 32, gamma.double(), beta.double(), activation="silu"),
                       weight.double(), kwargs["bias"].double(), padding=1)  # fmt: skip
    err = rel_err(got.cpu(), exact)
    assert 1e-3 < err < 0.05  # really quantised, and by no more than e4m3's step


def test_weight_packing_round_trip() -> None:
    """Per-output-channel scales: every channel's largest weight is exactly +-448 steps, the rest within 1/16."""
    weight = torch.randn(24, 16, 3, 3, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 1, 24)[
        :, None, None, None
    ]  # fmt: skip
    weight[3] = 0.0
    w8, scale = pack_conv_weight_fp8(weight)
    assert w8.dtype == FP8_DTYPE and tuple(w8.shape) == (24, 144) and scale[3] == 1.0
    assert torch.equal(w8.float().abs().amax(1)[torch.arange(24) != 3], torch.full((23,), E4M3_MAX))
    back = unpack_conv_weight_fp8(w8, scale, 16)
    assert (back - weight).abs().le(weight.abs() / 16 + scale[:, None, None, None] * 2**-9).all()


def test_fp8_conv_rejects_what_it_cannot_run() -> None:
    case = dict(n=1, cin=32, cout=16, h=4, w=4, k=3, padding=1)
    x, weight, _ = _conv_inputs(case, seed=2)
    x8 = quantize_e4m3_ref(x, 0.01).to(DEVICE).contiguous(memory_format=torch.channels_last)
    w8, w_scale = pack_conv_weight_fp8(weight)
    w8, w_scale = w8.to(DEVICE), w_scale.to(DEVICE)
    with pytest.raises(FastdiffError, match="pack_conv_weight_fp8"):
        conv2d_tma(x8, weight.to(DEVICE), padding=1, weight_scale=w_scale)  # a raw weight
    with pytest.raises(FastdiffError, match="weight_scale"):
        conv2d_tma(x8, w8, padding=1)
    with pytest.raises(FastdiffError, match="fp8 Upsample2D"):
        conv2d_tma(x8, w8, padding=1, upsample=2, weight_scale=w_scale)
    with pytest.raises(FastdiffError, match="not fp8"):
        conv2d_tma(x8, w8, padding=1, weight_scale=w_scale, out=torch.empty_like(x8[:, :16]))
    with pytest.raises(FastdiffError, match="fp8 inputs only"):
        conv2d_tma(x.to(DEVICE).contiguous(memory_format=torch.channels_last), weight.to(DEVICE), padding=1,
                   weight_scale=w_scale)  # fmt: skip
    with pytest.raises(FastdiffError, match="fp8_scale"):
        group_norm_act(x.to(DEVICE), 4, None, None, fp8_scale=0.0)


@pytest.mark.parametrize("rows, channels", [(37, 48), (70, 320)])
def test_layer_norm_e4m3_output(rows: int, channels: int) -> None:
    """LayerNorm writing e4m3 at the scale of its affine (what an fp8 token GEMM reads): within one e4m3 step of
    the float64 reference quantised the same way, nearly all values identical."""
    from fastdiff.kernels.layer_norm import layer_norm, layer_norm_ref

    gen = torch.Generator().manual_seed(rows)
    x = (3 * torch.randn((rows, channels), generator=gen) + 1).to(DEVICE, torch.float16)
    weight = (1 + 0.3 * torch.randn(channels, generator=gen)).to(DEVICE, torch.float16)
    bias = (0.3 * torch.randn(channels, generator=gen)).to(DEVICE, torch.float16)
    scale = norm_output_scale(weight, bias)
    got = layer_norm(x, weight, bias, 1e-5, fp8_scale=scale)
    assert got.dtype == FP8_DTYPE
    ref = quantize_e4m3_ref(layer_norm_ref(x.double(), weight.double(), bias.double(), 1e-5), scale)
    g, r = got.float(), ref.float()
    assert (g - r).abs().le(r.abs() / 8 + 2**-9).all()
    assert (got.view(torch.uint8) == ref.view(torch.uint8)).float().mean() > 0.99
    with pytest.raises(FastdiffError, match="out must be a torch.float8_e4m3fn tensor"):
        layer_norm(x, weight, bias, 1e-5, fp8_scale=scale, out=torch.empty_like(x))


LINEAR_FP8_CASES = [
    pytest.param(dict(m=45, k=48, n=24, geglu=True, bias=True, res=True), id="m45_k48_n24_geglu_res"),
    pytest.param(dict(m=33, k=32, n=40, act="gelu", scale=0.5), id="m33_k32_n40_gelu_scale"),
    pytest.param(dict(m=8192, k=320, n=1280, geglu=True, bias=True), id="sd15_ff_geglu", marks=needs_cuda),
    pytest.param(dict(m=2048, k=640, n=1920), id="sd15_qkv_32x32", marks=needs_cuda),
]


@pytest.mark.parametrize("case", LINEAR_FP8_CASES)
def test_fp8_linear_matches_its_dequantised_reference(case: dict) -> None:
    """The TMA token GEMM on e4m3 operands (an activation at a per-tensor scale, weights per row) against the fp32
    GEMM of the same dequantised values, with the whole epilogue, on every tile (GPU) or the interpreter's."""
    from fastdiff.kernels.linear import linear, linear_ref, linear_tiles, pack_linear_weight_fp8

    gen = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    m, k, n, geglu = case["m"], case["k"], case["n"], case.get("geglu", False)
    n_w = 2 * n if geglu else n
    a_scale = 4.0 / E4M3_MAX
    x8 = quantize_e4m3_ref(torch.randn((m, k), generator=gen), a_scale).to(DEVICE)
    w8, w_scale = pack_linear_weight_fp8((torch.randn((n_w, k), generator=gen) / k**0.5).to(DEVICE))
    bias = torch.randn(n_w, generator=gen).to(DEVICE, torch.float16) if case.get("bias") else None
    kwargs = dict(geglu=geglu, activation=case.get("act"), out_scale=case.get("scale"))
    residual = torch.randn((m, n), generator=gen).to(DEVICE, torch.float16) if case.get("res") else None
    ref = linear_ref(x8.double() * a_scale, w8.double() * w_scale.double()[:, None],
                     None if bias is None else bias.double(), residual=None if residual is None else residual.double(),
                     **kwargs)  # fmt: skip
    folded = (w_scale * a_scale).to(DEVICE)
    for tile in linear_tiles(m, tma=True) if CUDA else [None]:
        got = linear(x8, w8.to(DEVICE), bias, residual=residual, **kwargs, packed=True, tma=True,
                     weight_scale=folded, tile=tile)  # fmt: skip
        assert got.dtype == torch.float16 and rel_err(got, ref) < 2e-3, tile
    with pytest.raises(FastdiffError, match="an e4m3 input runs on the TMA kernel"):
        linear(x8, w8.to(DEVICE), bias, residual=residual, **kwargs, packed=True, weight_scale=folded)
    with pytest.raises(FastdiffError, match="weight_scale must be a contiguous float32"):
        linear(x8, w8.to(DEVICE), bias, residual=residual, **kwargs, packed=True, tma=True, weight_scale=folded[1:])
