"""conv2d_tma (TMA-loaded implicit GEMM) against conv2d_ref in float64: odd shapes, every epilogue, and on the GPU
the default tile configs at the U-Nets' own shapes."""

from __future__ import annotations

import zlib

import pytest
import torch

import fastdiff.kernels.conv2d_tma as conv2d_tma_module
from fastdiff.errors import FastdiffError
from fastdiff.kernels.common import SplitWorkspace
from fastdiff.kernels.conv2d import unpack_conv_weight
from fastdiff.kernels.conv2d_tma import (
    OP,
    TmaConfig,
    box_tile,
    conv2d_tma,
    default_config,
    pack_conv_weight_fp8,
    pack_upsample2_weight,
    tma_conv_unsupported,
)

from .conftest import CUDA, DEVICE, DTYPES, needs_cuda, rel_err
from .test_conv2d import TOLERANCE, make_inputs, reference

SMALL = TmaConfig(block_m=32, block_n=16, block_k=16, num_warps=4, num_stages=2)
"""Interpreter-sized tiles (several tiles per image, several channel chunks per tap, chunks that cross taps)."""

CASES = [
    pytest.param(
        dict(n=2, cin=24, cout=24, h=7, w=9, k=3, padding=1, bias=True, temb=True, act="silu"), id="c24_7x9_temb_silu"
    ),  # fmt: skip
    pytest.param(dict(n=3, cin=8, cout=16, h=4, w=4, k=3, padding=1, res=True, scale=0.5), id="b3_4x4_res_scale"),
    pytest.param(dict(n=1, cin=24, cout=8, h=5, w=6, k=1, bias=True, res=True), id="k1_5x6_shortcut"),
    pytest.param(dict(n=2, cin=16, cout=8, h=6, w=5, k=3, act="gelu"), id="k3p0_valid_gelu"),
    pytest.param(
        dict(n=2, cin=256, cout=128, h=16, w=16, k=3, padding=1, bias=True, temb=True),
        id="c256_16x16",
        marks=needs_cuda,
    ),  # fmt: skip
    pytest.param(
        dict(n=4, cin=128, cout=256, h=8, w=8, k=3, padding=1, bias=True, res=True), id="c128_8x8_b4", marks=needs_cuda
    ),  # fmt: skip
]


CONFIG = None if CUDA else SMALL
"""Small tiles in the interpreter; on the GPU the wrapper's own default config (the one the engine runs)."""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_conv2d_tma_matches_ref(case: dict, dtype: torch.dtype) -> None:
    args, kwargs = make_inputs(case, dtype, seed=zlib.crc32(str(case).encode()))
    ref = reference(args, kwargs)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert conv2d_tma(*args, **kwargs, out=out, config=CONFIG) is out
    assert rel_err(out, ref) < TOLERANCE[dtype]


MODEL_SHAPES = [
    pytest.param(dict(n=256, cin=128, cout=128, h=32, w=32, k=3, padding=1, bias=True, res=True), id="b256_c128_32"),
    pytest.param(dict(n=256, cin=256, cout=768, h=16, w=16, k=1, bias=True), id="b256_qkv_1x1_16"),
    pytest.param(dict(n=256, cin=512, cout=256, h=16, w=16, k=1, bias=True), id="b256_shortcut_1x1_16"),
    pytest.param(dict(n=256, cin=256, cout=256, h=8, w=8, k=3, padding=1, bias=True, temb=True), id="b256_c256_8"),
    pytest.param(dict(n=256, cin=512, cout=256, h=4, w=4, k=3, padding=1, bias=True, temb=True), id="b256_c512_4"),
    pytest.param(dict(n=2, cin=320, cout=320, h=64, w=64, k=3, padding=1, bias=True, temb=True), id="sd15_b2_64"),
]


@needs_cuda
@pytest.mark.parametrize("case", MODEL_SHAPES)
def test_default_configs_at_model_shapes(case: dict) -> None:
    """Each default tile config (128x128, 64x128, 64x64) on a shape that picks it, with the 1x1 convs whose short
    loops gave wrong results with 8 warps (``default_config``), and the small levels of batch 256; twice, bit for
    bit (CONTRIBUTING: Triton 3.6's TMA races)."""
    args, kwargs = make_inputs(case, torch.float16, seed=zlib.crc32(str(case).encode()))
    out = conv2d_tma(*args, **kwargs)
    assert rel_err(out, reference(args, kwargs)) < TOLERANCE[torch.float16]
    assert torch.equal(conv2d_tma(*args, **kwargs), out)  # a race moves the result between calls


@pytest.mark.parametrize(
    ("n", "hw", "cout", "tile"),
    [
        (256, 32, 128, (128, 128)),  # 2048 programs
        (256, 8, 256, (128, 128)),  # 256 programs of 128x128: 1.9 per SM
        (1024, 4, 256, (128, 128)),  # the 4x4 level's Upsample2D (four phases of 256 images): the same grid
        (256, 4, 256, (64, 64)),  # 64 programs of 128x128: too few
        (2, 64, 320, (64, 128)),  # SD-1.5 at 64x64, two rows of guidance: 192 programs of 128x128
    ],
)
def test_default_config_tiles_by_grid(monkeypatch, n: int, hw: int, cout: int, tile: tuple[int, int]) -> None:
    """128-row tiles while they give 1.5 programs per SM (on the H100's 132 SMs), then 64-row ones."""
    import fastdiff.kernels.conv2d as conv2d_module  # the 128-row threshold: conv2d.fills_with_128_rows

    monkeypatch.setattr(conv2d_tma_module, "num_sms", lambda device: 132)
    monkeypatch.setattr(conv2d_module, "num_sms", lambda device: 132)
    cfg = default_config(n, hw, hw, cout, cout, torch.float16, torch.device("cpu"))
    assert (cfg.block_m, cfg.block_n) == tile


def test_channel_slice_of_a_concat_buffer() -> None:
    """The engine's zero-copy concat: the input is channels [8, 24) of a 40-channel NHWC buffer."""
    case = dict(n=2, cin=16, cout=16, h=5, w=7, k=3, padding=1, bias=True)
    args, kwargs = make_inputs(case, torch.float32, seed=3)
    x, packed, bias = args
    parent = torch.randn((2, 5, 7, 40), device=DEVICE).permute(0, 3, 1, 2)
    parent[:, 8:24] = x
    sliced = parent[:, 8:24]
    out = conv2d_tma(sliced, packed, bias, **kwargs, config=CONFIG)
    assert rel_err(out, reference(args, kwargs)) < TOLERANCE[torch.float32]


UPSAMPLE_CASES = [
    pytest.param(dict(n=2, cin=16, cout=24, h=3, w=5, bias=True, res=True, act="silu"), id="3x5_res_silu"),
    pytest.param(dict(n=3, cin=24, cout=16, h=4, w=4, bias=True, temb=True, scale=0.5), id="b3_4x4_temb_scale"),
    pytest.param(dict(n=256, cin=256, cout=256, h=16, w=16, bias=True), id="b256_16x16", marks=needs_cuda),
    pytest.param(dict(n=256, cin=256, cout=256, h=4, w=4, bias=True), id="b256_4x4", marks=needs_cuda),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", UPSAMPLE_CASES)
def test_upsample2_conv_as_four_phase_convs(case: dict, dtype: torch.dtype) -> None:
    """Upsample2D (nearest x2 + 3x3 conv) from the low-resolution input: raw and phase-packed weights."""
    args, kwargs = make_inputs({**case, "k": 3, "padding": 1}, dtype, seed=zlib.crc32(str(case).encode()))
    x, packed, bias = args
    kwargs["upsample"] = 2
    n, cout, (h, w) = case["n"], case["cout"], x.shape[2:]
    if case.get("res"):
        kwargs["residual"] = torch.randn((n, cout, 2 * h, 2 * w), device=DEVICE, dtype=dtype)
    ref = reference(args, kwargs)
    raw = unpack_conv_weight(packed, case["cin"])
    assert rel_err(conv2d_tma(x, raw, bias, **kwargs, config=CONFIG), ref) < TOLERANCE[dtype]
    phases = pack_upsample2_weight(raw)
    assert phases.shape == (16 * case["cin"], cout)
    assert rel_err(conv2d_tma(x, phases, bias, **kwargs, config=CONFIG), ref) < TOLERANCE[dtype]
    with pytest.raises(FastdiffError, match="pack_upsample2_weight"):
        conv2d_tma(x, packed, bias, **kwargs, config=CONFIG)


def test_box_tile_shapes() -> None:
    assert box_tile(128, 256, 32, 32) == (1, 4, 32)  # whole rows of one image
    assert box_tile(128, 256, 8, 8) == (2, 8, 8)  # whole images
    assert box_tile(128, 256, 4, 4) == (8, 4, 4)
    assert box_tile(64, 1, 20, 20) == (1, 2, 32)  # a row wider than the image: the box overhangs (zero fill)


def test_unsupported_convs_say_why() -> None:
    x = torch.randn((2, 16, 8, 8), device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert tma_conv_unsupported(x, 16, 3, padding=1) is None
    assert "stride 1" in tma_conv_unsupported(x, 16, 3, stride=2, padding=1)
    assert tma_conv_unsupported(x, 16, 3, padding=1, upsample=2) is None
    assert "stride 1" in tma_conv_unsupported(x, 16, 3, padding=1, upsample=3)
    assert "Upsample2D" in tma_conv_unsupported(x, 16, 3, padding=0, upsample=2)
    assert "channels" in tma_conv_unsupported(x.contiguous(), 16, 3, padding=1)
    assert "aligned" in tma_conv_unsupported(x[:, 1:5], 16, 3, padding=1)  # 4-byte offset: not 16-byte aligned
    assert "aligned" in tma_conv_unsupported(x, 3, 3, padding=1)  # packed weight rows of 12 bytes
    args, kwargs = make_inputs(dict(n=1, cin=16, cout=8, h=5, w=5, k=3), torch.float32, seed=0)
    with pytest.raises(FastdiffError, match="stride 1"):
        conv2d_tma(*args, stride=2, config=CONFIG)


def test_example_inputs_small() -> None:
    args, kwargs = OP.example_inputs("small", torch.float32, DEVICE, 3)
    out = OP.triton(*args, **kwargs, config=CONFIG)
    assert rel_err(out, reference(args, kwargs)) < TOLERANCE[torch.float32]


SPLIT_CASES = [
    pytest.param(
        dict(n=2, cin=24, cout=24, h=7, w=9, k=3, padding=1, bias=True, temb=True, act="silu"), 3, id="7x9_k3"
    ),
    pytest.param(dict(n=3, cin=8, cout=16, h=4, w=4, k=3, padding=1, res=True, scale=0.5), 4, id="b3_4x4_res_k4"),
    pytest.param(dict(n=1, cin=24, cout=8, h=5, w=6, k=1, bias=True), 8, id="k1_more_splits_than_steps"),
    pytest.param(
        dict(n=256, cin=256, cout=256, h=4, w=4, k=3, padding=1, bias=True, temb=True),
        2,
        id="b256_4x4_k2",
        marks=needs_cuda,
    ),  # fmt: skip
    pytest.param(
        dict(n=256, cin=512, cout=256, h=4, w=4, k=3, padding=1, bias=True, res=True),
        4,
        id="b256_4x4_c512_k4",
        marks=needs_cuda,
    ),  # fmt: skip
    pytest.param(
        dict(n=1, cin=128, cout=128, h=32, w=32, k=3, padding=1, bias=True, res=True),
        8,
        id="b1_32x32_k8",
        marks=needs_cuda,
    ),  # fmt: skip
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("case", "split_k"), SPLIT_CASES)
def test_split_k_matches_ref(case: dict, split_k: int, dtype: torch.dtype) -> None:
    """The reduction split over programs, finished by the last to arrive in the same launch: equal to the reference,
    bit for bit call after call (the partials are summed in split order; the counters are back at 0), one shared
    workspace."""
    args, kwargs = make_inputs(case, dtype, seed=zlib.crc32(str(case).encode()))
    ref = reference(args, kwargs)
    workspace = SplitWorkspace()
    out = conv2d_tma(*args, **kwargs, config=CONFIG, split_k=split_k, workspace=workspace)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert torch.equal(conv2d_tma(*args, **kwargs, config=CONFIG, split_k=split_k, workspace=workspace), out)
    assert workspace.counters is None or not workspace.counters.any()  # None: the steps allowed no split


def test_split_k_upsample2_and_bad_split() -> None:
    case = dict(n=2, cin=16, cout=24, h=3, w=5, k=3, padding=1, bias=True)
    args, kwargs = make_inputs(case, torch.float32, seed=9)
    kwargs["upsample"] = 2
    ref = reference(args, kwargs)
    x, packed, bias = args
    raw = unpack_conv_weight(packed, 16)
    assert rel_err(conv2d_tma(x, raw, bias, **kwargs, config=CONFIG, split_k=2), ref) < TOLERANCE[torch.float32]
    with pytest.raises(FastdiffError, match="split_k"):
        conv2d_tma(x, raw, bias, **kwargs, config=CONFIG, split_k=0)


@needs_cuda
@pytest.mark.parametrize(("hw", "cin", "split_k"), [(32, 384, 4), (8, 512, 8), (16, 128, 2)])
def test_fp8_split_k_equals_unsplit(hw: int, cin: int, split_k: int) -> None:
    """An e4m3 conv split over programs: the same products summed in another order, so within an fp16 rounding of
    the unsplit conv; bit for bit call after call."""
    gen = torch.Generator().manual_seed(hw + cin)
    x = torch.randn((1, cin, hw, hw), generator=gen).to(DEVICE).contiguous(memory_format=torch.channels_last)
    weight = torch.randn((128, cin, 3, 3), generator=gen).to(DEVICE) / (9 * cin) ** 0.5
    packed, scale = pack_conv_weight_fp8(weight)
    x8 = x.to(torch.float8_e4m3fn)
    residual = torch.randn((1, 128, hw, hw), generator=gen).to(DEVICE, torch.float16)
    kwargs = dict(padding=1, weight_scale=scale, residual=residual.contiguous(memory_format=torch.channels_last))
    whole = conv2d_tma(x8, packed, **kwargs)
    split = conv2d_tma(x8, packed, **kwargs, split_k=split_k)
    assert rel_err(split, whole) < 1e-3
    assert torch.equal(conv2d_tma(x8, packed, **kwargs, split_k=split_k), split)
