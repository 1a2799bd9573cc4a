"""conv2d (implicit GEMM + fused epilogue) against its plain-torch ref in float64, on odd shapes."""

from __future__ import annotations

import zlib

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.conv2d import OP, conv2d, conv2d_ref, pack_conv_weight, unpack_conv_weight

from .conftest import CUDA, DEVICE, DTYPES, float64, needs_cuda, rel_err

# fp32 on the GPU is a tf32 dot (~3e-4); the interpreter computes fp32 exactly.
TOLERANCE = {torch.float32: 1e-3 if CUDA else 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def reference(args: tuple, kwargs: dict) -> torch.Tensor:
    """conv2d_ref on float64 copies of the (already rounded) inputs."""
    return conv2d_ref(*[float64(a) for a in args], **{k: float64(v) for k, v in kwargs.items()})


def make_inputs(case: dict, dtype: torch.dtype, seed: int) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(seed)
    n, cin, cout, h, w, k = case["n"], case["cin"], case["cout"], case["h"], case["w"], case["k"]
    stride, padding = case.get("stride", 1), case.get("padding", 0)
    ho, wo = (h + 2 * padding - k) // stride + 1, (w + 2 * padding - k) // stride + 1

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)

    x = randn(n, cin, h, w).contiguous(memory_format=torch.channels_last)
    weight = (torch.randn((cout, cin, k, k), generator=gen) / (cin * k * k) ** 0.5).to(device=DEVICE, dtype=dtype)
    kwargs = {"stride": stride, "padding": padding}
    if case.get("temb"):
        kwargs["time_emb"] = randn(n, cout)
    if case.get("res"):
        kwargs["residual"] = randn(n, cout, ho, wo).contiguous(memory_format=torch.channels_last)
    if case.get("act"):
        kwargs["activation"] = case["act"]
    if case.get("scale"):
        kwargs["out_scale"] = case["scale"]
    bias = randn(cout) if case.get("bias") else None
    return (x, pack_conv_weight(weight), bias), kwargs


CASES = [
    pytest.param(dict(n=1, cin=3, cout=16, h=7, w=9, k=3, stride=1, padding=1, bias=True), id="cin3_k3s1p1_bias"),
    pytest.param(
        dict(n=5, cin=33, cout=33, h=7, w=9, k=3, stride=2, padding=1, bias=True, temb=True, act="silu"),
        id="c33_k3s2p1_temb_silu_b5",
    ),
    pytest.param(dict(n=2, cin=16, cout=33, h=7, w=9, k=1, bias=True, res=True, scale=0.7071), id="k1s1p0_res_scale"),
    pytest.param(dict(n=5, cin=8, cout=16, h=7, w=9, k=1, stride=2, act="relu"), id="k1s2p0_relu_b5"),
    pytest.param(dict(n=1, cin=8, cout=8, h=7, w=9, k=3, bias=True, act="gelu"), id="k3s1p0_gelu"),
    pytest.param(
        dict(
            n=2,
            cin=5,
            cout=24,
            h=7,
            w=9,
            k=3,
            stride=2,
            bias=True,
            temb=True,
            res=True,
            act="silu",
            scale=0.5,
        ),
        id="k3s2p0_full_epilogue",
    ),
    pytest.param(dict(n=1, cin=4, cout=8, h=32, w=32, k=3, padding=1, bias=True, temb=True), id="resnet_conv1_32x32"),
    pytest.param(
        dict(n=1, cin=4, cout=8, h=32, w=32, k=3, padding=1, bias=True, res=True, scale=0.5),
        id="resnet_conv2_32x32",
    ),
    pytest.param(
        dict(n=2, cin=320, cout=320, h=16, w=16, k=3, padding=1, bias=True, temb=True),
        id="c320_k3_16x16",
        marks=needs_cuda,
    ),
    pytest.param(
        dict(n=2, cin=320, cout=640, h=8, w=8, k=1, bias=True, res=True),
        id="c320_k1_shortcut",
        marks=needs_cuda,
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_conv2d_matches_ref(case: dict, dtype: torch.dtype) -> None:
    args, kwargs = make_inputs(case, dtype, seed=zlib.crc32(str(case).encode()))
    ref = reference(args, kwargs)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert conv2d(*args, **kwargs, out=out) is out
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_weight_and_nchw_input(dtype: torch.dtype) -> None:
    case = dict(n=2, cin=6, cout=10, h=7, w=9, k=3, padding=1, bias=True, temb=True, act="gelu")
    args, kwargs = make_inputs(case, dtype, seed=11)
    x, packed, bias = args
    raw = unpack_conv_weight(packed, x.shape[1])
    assert torch.equal(pack_conv_weight(raw), packed)
    kwargs["time_emb"] = kwargs["time_emb"].t().contiguous().t()  # column-major: strides (1, n)
    out = conv2d(x.contiguous(), raw, bias, **kwargs)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert rel_err(out, reference(args, kwargs)) < TOLERANCE[dtype]


def test_example_inputs_small_and_cost() -> None:
    args, kwargs = OP.example_inputs("small", torch.float32, DEVICE, 3)
    assert rel_err(OP.triton(*args, **kwargs), reference(args, kwargs)) < TOLERANCE[torch.float32]
    flops, moved = OP.cost(args, kwargs)
    n, cin, h, w = args[0].shape  # 3x3 'same' conv + bias + time embedding
    cout = args[1].shape[1]
    out = n * cout * h * w
    assert flops == 2 * out * cin * 9 + 2 * out  # multiply-adds, then the bias and time-embedding adds
    assert moved == 4 * (n * cin * h * w + 9 * cin * cout + cout + n * cout + out)
    assert (flops, moved) == (549360, 25008)  # (2, 12, 7, 9) -> 20 channels, by hand


@needs_cuda
@pytest.mark.parametrize("size", ["cifar10-b1", "sd15-b2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_example_inputs_model_shapes(size: str, dtype: torch.dtype) -> None:
    args, kwargs = OP.example_inputs(size, dtype, DEVICE, 5)
    assert rel_err(OP.triton(*args, **kwargs), reference(args, kwargs)) < TOLERANCE[dtype]


def test_bad_arguments_raise() -> None:
    args, kwargs = make_inputs(dict(n=1, cin=4, cout=8, h=5, w=5, k=3, bias=True), torch.float32, seed=0)
    x, packed, bias = args
    with pytest.raises(FastdiffError, match="packed conv weight"):
        conv2d(x, packed[:-1], bias)
    with pytest.raises(FastdiffError, match="activation"):
        conv2d(x, packed, bias, activation="tanh")
    with pytest.raises(FastdiffError, match="residual"):
        conv2d(x, packed, bias, residual=torch.zeros(1, 8, 5, 5, device=DEVICE))
    with pytest.raises(FastdiffError, match="time_emb"):
        conv2d(x, packed, bias, time_emb=torch.zeros(2, 8, device=DEVICE))
    with pytest.raises(FastdiffError, match="4-D"):
        conv2d(x[0], packed, bias)
