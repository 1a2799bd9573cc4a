"""conv2d_gluon (the TMA conv in Gluon, wgmma from shared memory) against conv2d_ref in float64, and bit for bit
against conv2d_tma at the same tiles. Gluon kernels do not run in Triton's CPU interpreter: GPU only."""

from __future__ import annotations

import zlib

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.conv2d_gluon import GluonConfig, conv2d_gluon, gluon_conv_unsupported
from fastdiff.kernels.conv2d_tma import TmaConfig, conv2d_tma

from .conftest import DEVICE, needs_cuda, rel_err
from .test_conv2d import TOLERANCE, make_inputs, reference

pytestmark = needs_cuda

HALF = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]

CASES = [
    pytest.param(dict(n=5, cin=48, cout=40, h=9, w=9, k=3, padding=1, bias=True, temb=True, res=True), id="odd_9x9"),
    pytest.param(dict(n=2, cin=64, cout=128, h=7, w=12, k=3, bias=True), id="valid_conv_7x12"),
    pytest.param(dict(n=3, cin=256, cout=768, h=16, w=16, k=1, bias=True), id="k1_qkv_16x16"),
    pytest.param(dict(n=4, cin=200, cout=64, h=8, w=8, k=3, padding=1, res=True, scale=0.7), id="cin200_res_scale"),
    pytest.param(dict(n=3, cin=128, cout=256, h=4, w=4, k=3, padding=1, temb=True), id="4x4_images_share_a_tile"),
    pytest.param(dict(n=2, cin=8, cout=8, h=6, w=5, k=3, padding=1, bias=True, res=True), id="c8_narrower_than_a_tile"),
]

CONFIGS = [
    pytest.param(None, id="default"),
    pytest.param(GluonConfig(programs_per_sm=2), id="persistent_2_per_sm"),
    pytest.param(GluonConfig(64, 64, 64, 4), id="64x64_4_stages"),
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", CASES)
def test_conv2d_gluon_matches_ref(case: dict, dtype: torch.dtype, config: GluonConfig | None) -> None:
    args, kwargs = make_inputs(case, dtype, seed=zlib.crc32(str(case).encode()))
    kwargs.pop("stride")
    ref = reference(args, kwargs)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert conv2d_gluon(*args, **kwargs, out=out, config=config) is out
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param((256, 128, 128, 32), id="b256_32x32_128ch"),
        pytest.param((256, 256, 256, 8), id="b256_8x8_256ch"),
    ],
)
def test_equals_the_tma_conv_bit_for_bit_at_model_shapes(shape: tuple) -> None:
    """Same tiles, same accumulation order: the same bits as conv2d_tma, call after call (a race would move them)."""
    n, cin, cout, hw = shape
    case = dict(n=n, cin=cin, cout=cout, h=hw, w=hw, k=3, padding=1, bias=True, res=True)
    args, kwargs = make_inputs(case, torch.float16, seed=3)
    kwargs.pop("stride")
    tma = conv2d_tma(*args, **kwargs, config=TmaConfig(128, 128, 64, 4, 4))
    for config in (GluonConfig(), GluonConfig(programs_per_sm=2)):
        first = conv2d_gluon(*args, **kwargs, config=config)
        assert torch.equal(first, tma)
        assert torch.equal(conv2d_gluon(*args, **kwargs, config=config), first)


def test_outside_its_domain_it_says_why() -> None:
    x = torch.zeros(1, 16, 4, 4, device=DEVICE, dtype=torch.float16).contiguous(memory_format=torch.channels_last)
    assert "activation" in gluon_conv_unsupported(x, 16, 3, padding=1, activation="silu")
    assert "fp16/bf16" in gluon_conv_unsupported(x.float(), 16, 3, padding=1)
    assert "stride" in gluon_conv_unsupported(x, 16, 3, stride=2, padding=1)
    with pytest.raises(FastdiffError, match="conv2d_gluon: dtype"):
        conv2d_gluon(x.float(), torch.zeros(16, 16, 3, 3, device=DEVICE), padding=1)
    weight = torch.zeros(16, 16, 3, 3, device=DEVICE, dtype=torch.float16)
    for config in (GluonConfig(block_n=32), GluonConfig(block_k=32)):  # the 128-byte swizzle's minimum
        with pytest.raises(FastdiffError, match="128-byte swizzle"):
            conv2d_gluon(x, weight, padding=1, config=config)


SHORTCUT_CASES = [
    pytest.param(
        dict(n=2, cin=24, cout=64, h=7, w=9, k=3, padding=1, bias=True, scale=0.5, shortcut=40),
        id="resnet_conv2_7x9_shortcut_c40_scale",
    ),
    pytest.param(
        dict(n=3, cin=64, cout=64, h=4, w=4, k=3, padding=1, temb=True, shortcut=200), id="4x4_images_per_box_c200"
    ),
    pytest.param(
        dict(n=256, cin=128, cout=128, h=32, w=32, k=3, padding=1, bias=True, shortcut=384), id="b256_32x32_c384"
    ),
    pytest.param(
        dict(n=256, cin=256, cout=256, h=16, w=16, k=3, padding=1, bias=True, shortcut=512), id="b256_16x16_c512"
    ),
    pytest.param(dict(n=256, cin=256, cout=256, h=4, w=4, k=3, padding=1, bias=True, shortcut=512), id="b256_4x4_c512"),
]


@pytest.mark.parametrize("config", CONFIGS[:2])
@pytest.mark.parametrize("case", SHORTCUT_CASES)
def test_shortcut_summed_into_the_reduction(case: dict, config: GluonConfig | None) -> None:
    """A ResnetBlock2D's conv2 + 1x1 conv_shortcut in one launch (up to the batch-256 shapes), against the float64
    reference; raw and packed shortcut weights give the same bits, call after call (a race would move them)."""
    args, kwargs = make_inputs(case, torch.float16, seed=zlib.crc32(str(case).encode()))
    kwargs.pop("stride")
    ref = reference(args, kwargs)
    out = torch.full(ref.shape, float("nan"), dtype=torch.float16, device=DEVICE)
    out = out.contiguous(memory_format=torch.channels_last)
    assert conv2d_gluon(*args, **kwargs, config=config, out=out) is out
    assert rel_err(out, ref) < TOLERANCE[torch.float16]
    kwargs["shortcut_weight"] = kwargs["shortcut_weight"].reshape(case["cout"], case["shortcut"]).t().contiguous()
    assert torch.equal(conv2d_gluon(*args, **kwargs, config=config), out)
    assert torch.equal(conv2d_gluon(*args, **kwargs, config=config), out)


def test_shortcut_from_a_concat_part_and_bad_arguments() -> None:
    """The shortcut a channel slice of a wider channels-last buffer (the up path's skip concat); what it rejects."""
    case = dict(n=2, cin=64, cout=64, h=5, w=6, k=3, padding=1, bias=True, shortcut=24)
    args, kwargs = make_inputs(case, torch.bfloat16, seed=5)
    kwargs.pop("stride")
    wide = torch.randn((2, 5, 6, 48), device=DEVICE, dtype=torch.bfloat16).permute(0, 3, 1, 2)
    wide[:, 8:32] = kwargs["shortcut"]
    kwargs["shortcut"] = wide[:, 8:32]
    assert rel_err(conv2d_gluon(*args, **kwargs), reference(args, kwargs)) < TOLERANCE[torch.bfloat16]
    with pytest.raises(FastdiffError, match="together"):
        conv2d_gluon(*args, shortcut=kwargs["shortcut"], padding=1)
    with pytest.raises(FastdiffError, match="aligned"):
        conv2d_gluon(*args, padding=1, shortcut=wide[:, 9:33], shortcut_weight=kwargs["shortcut_weight"])
