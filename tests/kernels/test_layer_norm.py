"""layer_norm (LayerNorm over the channels of a token matrix) vs its plain-torch ref in float64."""

from __future__ import annotations

import zlib

import pytest
import torch

import fastdiff.kernels.layer_norm as ln_module
from fastdiff.errors import FastdiffError
from fastdiff.kernels.layer_norm import OP, layer_norm, layer_norm_ref

from .conftest import DEVICE, DTYPES, needs_cuda, rel_err

# No dot: fp32 statistics and FMAs, so output rounding is what separates the 16-bit results from the ref.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_inputs(m, c, dtype, seed, offset=0.0, pad=0):
    """x [m, c] (a column slice at offset 3 of a [m, c + pad] matrix when ``pad``), weight, bias."""
    gen = torch.Generator().manual_seed(seed)
    big = (offset + 2.0 * torch.randn((m, c + pad), generator=gen)).to(device=DEVICE, dtype=dtype)
    x = big[:, 3 : 3 + c] if pad else big
    weight = (1.0 + 0.5 * torch.randn(c, generator=gen)).to(device=DEVICE, dtype=dtype)
    bias = torch.randn(c, generator=gen).to(device=DEVICE, dtype=dtype)
    return x, weight, bias


def run_case(m, c, strided, dtype, offset=0.0) -> float:
    """rel err of layer_norm into a NaN-poisoned ``out`` (a column slice of a wider matrix when ``strided``);
    the columns around the slice must stay untouched."""
    x, weight, bias = make_inputs(m, c, dtype, zlib.crc32(repr((m, c, strided, str(dtype))).encode()), offset,
                                  pad=7 if strided else 0)  # fmt: skip
    wide = torch.full((m, c + 5 if strided else c), float("nan"), device=DEVICE, dtype=dtype)
    out = wide[:, 2 : 2 + c] if strided else wide
    assert layer_norm(x, weight, bias, 1e-6, out=out) is out
    if strided:
        assert x.stride(0) == c + 7 and out.stride(0) == c + 5
        assert wide[:, :2].isnan().all() and wide[:, 2 + c :].isnan().all()
    return rel_err(out, layer_norm_ref(x.double(), weight.double(), bias.double(), 1e-6))


CASES = [
    pytest.param((37, 40, False), id="m37_c40"),
    pytest.param((37, 40, True), id="m37_c40_strided"),
    pytest.param((5, 77, True), id="m5_c77_strided"),
    pytest.param((66, 3, False), id="m66_c3"),
    pytest.param((1, 320, True), id="m1_c320_strided"),
    pytest.param((3, 5000, True), id="m3_c5000_strided"),
    pytest.param((2, 8192, False), id="m2_c8192"),
    pytest.param((300, 640, True), id="m300_c640_strided", marks=needs_cuda),
    pytest.param((128, 1280, False), id="m128_c1280", marks=needs_cuda),
    pytest.param((1000, 1280, True), id="m1000_c1280_strided", marks=needs_cuda),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_layer_norm_matches_ref(case: tuple, dtype: torch.dtype) -> None:
    assert run_case(*case, dtype=dtype) < TOLERANCE[dtype]


def test_statistics_survive_a_large_mean() -> None:
    """Mean 1000, std 2: a fp32 sum-of-squares variance would lose ~all digits; two passes do not."""
    assert run_case(37, 40, False, torch.float32, offset=1000.0) < 1e-4


def test_without_affine_and_allocated_out() -> None:
    x, _, _ = make_inputs(9, 24, torch.float32, seed=4, pad=5)
    got = layer_norm(x, None, None)
    assert got.shape == (9, 24) and got.is_contiguous()
    assert rel_err(got, layer_norm_ref(x.double(), None, None)) < 1e-5
    assert rel_err(got, torch.nn.functional.layer_norm(x.double(), (24,))) < 1e-5


def test_plan_stacks_rows_for_narrow_channels() -> None:
    """~TILE-element tiles: many rows of 40 (padded to 64) per program, one row of 5000, at least 2 programs (per
    SM; 1 SM off CUDA)."""
    cpu = torch.device("cpu")
    assert ln_module._blocks(8192, 320, cpu) == (8, 512, 8)
    assert ln_module._blocks(37, 40, cpu) == (32, 64, 4)  # 64 rows would leave one program
    assert ln_module._blocks(3, 5000, cpu) == (1, 8192, 8)


def test_example_inputs_and_cost() -> None:
    args, kwargs = OP.example_inputs("small", torch.float32, DEVICE, 0)
    assert rel_err(OP.triton(*args, **kwargs), layer_norm_ref(*[a.double() for a in args[:3]], args[3])) < 1e-5
    flops, moved = OP.cost(args, kwargs)
    m, c = args[0].shape  # [37, 40], affine
    assert flops == (3 + 2 + 2) * m * c == 10360  # statistics, normalise, affine
    assert moved == 4 * (2 * m * c + 2 * c) == 12160  # x read, y written, gamma and beta, fp32


@needs_cuda
@pytest.mark.parametrize("size", ["sd15-b2", "sd15-b2-mid"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_example_inputs_model_shapes(size: str, dtype: torch.dtype) -> None:
    args, kwargs = OP.example_inputs(size, dtype, DEVICE, 5)
    ref = layer_norm_ref(*[a.double() for a in args[:3]], args[3])
    assert rel_err(OP.triton(*args, **kwargs), ref) < TOLERANCE[dtype]


def _bad_calls() -> dict:
    x, weight, bias = make_inputs(4, 6, torch.float32, seed=0)
    return {
        "not_2d": ((x[None], weight, bias), {}, "2-D token matrix"),
        "column_stride": ((x.t().contiguous().t(), weight, bias), {}, "unit column stride"),
        "too_many_channels": ((torch.zeros(1, 8193, device=DEVICE), None, None), {}, "1 to 8192 channels"),
        "no_channels": ((torch.zeros(3, 0, device=DEVICE), None, None), {}, "1 to 8192 channels"),
        "weight_shape": ((x, weight[:5], bias), {}, "weight must have shape"),
        "bias_shape": ((x, weight, torch.zeros(6, 1, device=DEVICE)), {}, "bias must have shape"),
        "out_shape": ((x, weight, bias), {"out": torch.empty(4, 7, device=DEVICE)}, "out must be"),
        "out_dtype": ((x, weight, bias), {"out": torch.empty(4, 6, device=DEVICE, dtype=torch.float64)}, "out must"),
        "out_device": ((x, weight, bias), {"out": torch.empty(4, 6, device="meta")}, "out must be"),
        "out_column_stride": ((x, weight, bias), {"out": torch.empty(6, 4, device=DEVICE).t()}, "out needs unit"),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_bad_arguments_raise_one_line(name: str) -> None:
    args, kwargs, message = _bad_calls()[name]
    with pytest.raises(FastdiffError, match=message) as info:
        layer_norm(*args, **kwargs)
    assert "\n" not in str(info.value)
