"""depthwise_conv2d (7x7, padding 3, + bias + time_emb) against its plain-torch ref in float64."""

from __future__ import annotations

import zlib

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.depthwise_conv2d import (
    OP,
    depthwise_conv2d,
    depthwise_conv2d_ref,
    pack_depthwise_weight,
)

from .conftest import DEVICE, DTYPES, float64, needs_cuda, rel_err

# No dot here: fp32 FMAs on every device, so only output rounding separates the 16-bit results from the ref.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def reference(args: tuple, kwargs: dict) -> torch.Tensor:
    return depthwise_conv2d_ref(*[float64(a) for a in args], **{k: float64(v) for k, v in kwargs.items()})


def make_inputs(n: int, c: int, h: int, w: int, bias: bool, temb: bool, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n, c, h, w), generator=gen).to(device=DEVICE, dtype=dtype)
    weight = (torch.randn((c, 1, 7, 7), generator=gen) / 7).to(device=DEVICE, dtype=dtype)
    b = torch.randn(c, generator=gen).to(device=DEVICE, dtype=dtype) if bias else None
    kwargs = {"time_emb": torch.randn((n, c), generator=gen).to(device=DEVICE, dtype=dtype)} if temb else {}
    return (x.contiguous(memory_format=torch.channels_last), pack_depthwise_weight(weight), b), kwargs


CASES = [
    pytest.param((1, 3, 7, 9, True, False), id="c3_7x9_bias_b1"),
    pytest.param((5, 33, 7, 9, True, True), id="c33_7x9_bias_temb_b5"),
    pytest.param((1, 4, 32, 32, False, True), id="c4_32x32_temb"),
    pytest.param((2, 70, 5, 3, False, False), id="c70_5x3_smaller_than_kernel"),
    pytest.param((2, 320, 16, 16, True, True), id="c320_16x16", marks=needs_cuda),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_depthwise_matches_ref(case: tuple, dtype: torch.dtype) -> None:
    args, kwargs = make_inputs(*case, dtype=dtype, seed=zlib.crc32(repr(case).encode()))
    ref = reference(args, kwargs)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert depthwise_conv2d(*args, **kwargs, out=out) is out
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_weight_and_nchw_input(dtype: torch.dtype) -> None:
    args, kwargs = make_inputs(2, 9, 6, 11, True, True, dtype, seed=21)
    x, packed, bias = args
    raw = packed.t().reshape(9, 1, 7, 7)
    out = depthwise_conv2d(x.contiguous(), raw, bias, time_emb=kwargs["time_emb"])
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert rel_err(out, reference(args, kwargs)) < TOLERANCE[dtype]


def test_example_inputs_small_and_cost() -> None:
    args, kwargs = OP.example_inputs("small", torch.float32, DEVICE, 4)
    assert rel_err(OP.triton(*args, **kwargs), reference(args, kwargs)) < TOLERANCE[torch.float32]
    flops, moved = OP.cost(args, kwargs)
    n, c, h, w = args[0].shape  # + bias + time embedding
    assert flops == 2 * 49 * n * c * h * w + 2 * n * c * h * w
    assert moved == 4 * (2 * n * c * h * w + 49 * c + c + n * c)


@needs_cuda
@pytest.mark.parametrize("size", ["cifar10-b1", "sd15-b2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_example_inputs_model_shapes(size: str, dtype: torch.dtype) -> None:
    args, kwargs = OP.example_inputs(size, dtype, DEVICE, 6)
    assert rel_err(OP.triton(*args, **kwargs), reference(args, kwargs)) < TOLERANCE[dtype]


def test_bad_arguments_raise() -> None:
    args, _ = make_inputs(1, 4, 5, 5, True, False, torch.float32, seed=0)
    x, packed, bias = args
    with pytest.raises(FastdiffError, match="depthwise weight"):
        depthwise_conv2d(x, torch.zeros(4, 1, 3, 3, device=DEVICE), bias)
    with pytest.raises(FastdiffError, match=r"\[49, 4\]"):
        depthwise_conv2d(x, packed[:, :3], bias)
    with pytest.raises(FastdiffError, match="time_emb"):
        depthwise_conv2d(x, packed, bias, time_emb=torch.zeros(4, device=DEVICE))
