"""conv2d_tma (TMA-loaded implicit GEMM) against conv2d_ref in float64: both layouts, odd shapes, every epilogue."""

from __future__ import annotations

import zlib

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.conv2d_tma import OP, TmaConfig, box_tile, conv2d_tma, tma_conv_unsupported

from .conftest import CUDA, DEVICE, DTYPES, needs_cuda, rel_err
from .test_conv2d import TOLERANCE, make_inputs, reference

SMALL = TmaConfig(block_m=32, block_n=16, block_k=8, num_warps=4, num_stages=2)
"""Interpreter-sized tiles (several tiles per image, several channel chunks per tap)."""

CASES = [
    pytest.param(dict(n=2, cin=12, cout=24, h=7, w=9, k=3, padding=1, bias=True, temb=True, act="silu"),
                 id="c12_7x9_temb_silu"),  # fmt: skip
    pytest.param(dict(n=3, cin=8, cout=16, h=4, w=4, k=3, padding=1, res=True, scale=0.5), id="b3_4x4_res_scale"),
    pytest.param(dict(n=1, cin=24, cout=8, h=5, w=6, k=1, bias=True, res=True), id="k1_5x6_shortcut"),
    pytest.param(dict(n=2, cin=16, cout=8, h=6, w=5, k=3, act="gelu"), id="k3p0_valid_gelu"),
    pytest.param(dict(n=2, cin=256, cout=128, h=16, w=16, k=3, padding=1, bias=True, temb=True), id="c256_16x16",
                 marks=needs_cuda),  # fmt: skip
    pytest.param(dict(n=4, cin=128, cout=256, h=8, w=8, k=3, padding=1, bias=True, res=True), id="c128_8x8_b4",
                 marks=needs_cuda),  # fmt: skip
]


def config_for(layout: str) -> TmaConfig | None:
    """Small tiles in the interpreter; on the GPU the wrapper's own default config (the one the engine runs)."""
    if CUDA:
        return None if layout == "box" else TmaConfig(layout="rows")
    return TmaConfig(**{**SMALL.__dict__, "layout": layout})


@pytest.mark.parametrize("layout", ["box", "rows"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_conv2d_tma_matches_ref(case: dict, dtype: torch.dtype, layout: str) -> None:
    if layout == "rows" and case["k"] != 2 * case.get("padding", 0) + 1:
        pytest.skip("the rows layout is for 'same' convs")
    args, kwargs = make_inputs(case, dtype, seed=zlib.crc32(str(case).encode()))
    ref = reference(args, kwargs)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert conv2d_tma(*args, **kwargs, out=out, config=config_for(layout)) is out
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("layout", ["box", "rows"])
def test_channel_slice_of_a_concat_buffer(layout: str) -> None:
    """The engine's zero-copy concat: the input is channels [8, 24) of a 40-channel NHWC buffer."""
    case = dict(n=2, cin=16, cout=16, h=5, w=7, k=3, padding=1, bias=True)
    args, kwargs = make_inputs(case, torch.float32, seed=3)
    x, packed, bias = args
    parent = torch.randn((2, 5, 7, 40), device=DEVICE).permute(0, 3, 1, 2)
    parent[:, 8:24] = x
    sliced = parent[:, 8:24]
    out = conv2d_tma(sliced, packed, bias, **kwargs, config=config_for(layout))
    assert rel_err(out, reference(args, kwargs)) < TOLERANCE[torch.float32]


def test_box_tile_shapes() -> None:
    assert box_tile(128, 256, 32, 32) == (1, 4, 32)  # whole rows of one image
    assert box_tile(128, 256, 8, 8) == (2, 8, 8)  # whole images
    assert box_tile(128, 256, 4, 4) == (8, 4, 4)
    assert box_tile(64, 1, 20, 20) == (1, 2, 32)  # a row wider than the image: the box overhangs (zero fill)


def test_unsupported_convs_say_why() -> None:
    x = torch.randn((2, 16, 8, 8), device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert tma_conv_unsupported(x, 16, 3, padding=1) is None
    assert "stride 1" in tma_conv_unsupported(x, 16, 3, stride=2, padding=1)
    assert "stride 1" in tma_conv_unsupported(x, 16, 3, padding=1, upsample=2)
    assert "channels" in tma_conv_unsupported(x.contiguous(), 16, 3, padding=1)
    assert "aligned" in tma_conv_unsupported(x[:, 1:5], 16, 3, padding=1)  # 4-byte offset: not 16-byte aligned
    assert "aligned" in tma_conv_unsupported(x, 3, 3, padding=1)  # packed weight rows of 12 bytes
    assert "same" in tma_conv_unsupported(x, 16, 3, padding=0, layout="rows")
    args, kwargs = make_inputs(dict(n=1, cin=16, cout=8, h=5, w=5, k=3), torch.float32, seed=0)
    with pytest.raises(FastdiffError, match="stride 1"):
        conv2d_tma(*args, stride=2, config=config_for("box"))


def test_example_inputs_small() -> None:
    args, kwargs = OP.example_inputs("small", torch.float32, DEVICE, 3)
    out = OP.triton(*args, **kwargs, config=config_for("box"))
    assert rel_err(out, reference(args, kwargs)) < TOLERANCE[torch.float32]
