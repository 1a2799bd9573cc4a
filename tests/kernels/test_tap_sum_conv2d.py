"""tap_sum_conv2d (tap partials by a 1x1 conv, then a shifted tap sum) against the float64 direct conv."""

from __future__ import annotations

import zlib

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.conv2d import conv2d_ref
from fastdiff.kernels.tap_sum_conv2d import pack_tap_weight, tap_sum_conv2d, tap_sum_unsupported

from .conftest import DEVICE, DTYPES, needs_cuda, rel_err

# fp32: an ieee GEMM and fp32 partials (a tf32 GEMM on the GPU: its 1e-3). 16-bit: the operands' rounding only
# (the partials are fp32), METHOD.md's 16-bit bound.
TOLERANCE = {torch.float32: 2e-3 if DEVICE == "cuda" else 2e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}

CASES = [
    pytest.param(dict(n=2, cin=24, cout=3, h=7, w=9, k=3, pad=1), id="conv_out_odd_7x9"),
    pytest.param(dict(n=1, cin=5, cout=1, h=1, w=1, k=3, pad=1), id="1x1_image_every_tap_outside_but_one"),
    pytest.param(dict(n=3, cin=16, cout=4, h=5, w=3, k=3, pad=0), id="valid_conv_shrinks_5x3_to_3x1"),
    pytest.param(dict(n=2, cin=8, cout=8, h=6, w=6, k=5, pad=2), id="5x5_cout8_columns_200"),
    pytest.param(dict(n=2, cin=12, cout=3, h=4, w=11, k=1, pad=0, bias=False), id="1x1_no_bias"),
    pytest.param(dict(n=257, cin=16, cout=3, h=3, w=3, k=3, pad=1), id="pixels_not_a_multiple_of_the_block"),
    pytest.param(dict(n=4, cin=128, cout=3, h=32, w=32, k=3, pad=1), id="ddpm_conv_out_b4", marks=needs_cuda),
]


def make_inputs(case: dict, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    n, cin, cout, h, w, k = (case[key] for key in ("n", "cin", "cout", "h", "w", "k"))
    x = torch.randn((n, cin, h, w), generator=gen).to(device=DEVICE, dtype=dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    weight = (torch.randn((cout, cin, k, k), generator=gen) / (k * k * cin) ** 0.5).to(device=DEVICE, dtype=dtype)
    bias = torch.randn(cout, generator=gen).to(device=DEVICE, dtype=dtype) if case.get("bias", True) else None
    ref = conv2d_ref(x.double(), weight.double(), None if bias is None else bias.double(), padding=case["pad"])
    return x, weight, bias, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_matches_the_direct_conv(case: dict, dtype: torch.dtype) -> None:
    x, weight, bias, ref = make_inputs(case, dtype, zlib.crc32(str(case).encode()))
    out = torch.full(ref.shape, float("nan"), device=DEVICE, dtype=dtype)  # every element must be written
    got = tap_sum_conv2d(x, weight, bias, padding=case["pad"], out=out)
    assert got is out
    assert rel_err(out, ref) < TOLERANCE[dtype]


def test_packed_weight_and_partials_are_reused() -> None:
    """The caller's packed weight and partials buffer give the same bits as a call that makes its own."""
    case = dict(n=2, cin=24, cout=3, h=7, w=9, k=3, pad=1)
    x, weight, bias, ref = make_inputs(case, torch.float32, 7)
    packed = pack_tap_weight(weight)
    partials = torch.empty((2, packed.shape[1], 7, 9), device=DEVICE).contiguous(memory_format=torch.channels_last)
    first = tap_sum_conv2d(x, weight, bias, padding=1, packed=packed, partials=partials)
    again = tap_sum_conv2d(x, weight, bias, padding=1)
    assert torch.equal(first, again)
    assert rel_err(first, ref) < TOLERANCE[torch.float32]


def test_pack_tap_weight_layout() -> None:
    """Column (kh*K + kw)*Cout + c holds weight[c, :, kh, kw]; 27 columns pad to 32 with zeros."""
    weight = torch.randn(3, 5, 3, 3)
    packed = pack_tap_weight(weight)
    assert packed.shape == (5, 32)
    assert torch.equal(packed[:, (1 * 3 + 2) * 3 + 1], weight[1, :, 1, 2])
    assert not packed[:, 27:].any()


@pytest.mark.parametrize(
    "shape, stride, padding, reason",
    [
        pytest.param((9, 3), 1, 1, "at most 8", id="too_many_channels"),
        pytest.param((3, 3), 2, 1, "stride 1", id="strided"),
        pytest.param((3, 3), 1, (0, 1), "symmetric", id="asymmetric_padding"),
    ],
)
def test_unsupported_convs_say_why(shape: tuple, stride: int, padding, reason: str) -> None:
    x = torch.zeros(1, 4, 5, 5)
    assert reason in tap_sum_unsupported(x, *shape, stride, padding)


def test_bad_operands_raise_one_line_errors() -> None:
    x = torch.randn(1, 4, 5, 5).contiguous(memory_format=torch.channels_last)
    with pytest.raises(FastdiffError, match="at most 8"):
        tap_sum_conv2d(x, torch.randn(9, 4, 3, 3), padding=1)
    with pytest.raises(FastdiffError, match="bias must have shape"):
        tap_sum_conv2d(x, torch.randn(3, 4, 3, 3), torch.zeros(4), padding=1)
    with pytest.raises(FastdiffError, match="partials must be"):
        tap_sum_conv2d(x, torch.randn(3, 4, 3, 3), padding=1, partials=torch.zeros(1, 32, 5, 5, dtype=torch.float16))
