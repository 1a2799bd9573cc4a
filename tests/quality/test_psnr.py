"""PSNR and max-abs-diff against hand computations."""

import math

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.quality.psnr import max_abs_diff, psnr, psnr_uint8


def test_psnr_hand_computed():
    a = torch.zeros(3, 1, 2, 3)
    b = a.clone()
    b[0, 0, 0, 0] = 0.625  # MSE = 0.390625 / 6 -> 10 log10(4 * 6 / 0.390625)
    b[1] = 0.5  # MSE = 0.25 -> 10 log10(16)
    got = psnr(a, b)
    assert got.dtype == torch.float64 and got.shape == (3,)
    assert got[0].item() == pytest.approx(10 * math.log10(4 * 6 / 0.390625), rel=1e-12)
    assert got[1].item() == pytest.approx(10 * math.log10(16), rel=1e-12)
    assert math.isinf(got[2].item())
    assert psnr(a, b, data_range=1.0)[1].item() == pytest.approx(10 * math.log10(4), rel=1e-12)


def test_psnr_uint8_hand_computed():
    a = torch.full((2, 4, 5, 3), 100, dtype=torch.uint8)
    b = a.clone()
    b[0] = 110  # MSE 100 -> 10 log10(255² / 100)
    b[1, 0, 0, 0] = 0  # MSE 10000 / 60
    got = psnr_uint8(a, b)
    assert got[0].item() == pytest.approx(10 * math.log10(255**2 / 100), rel=1e-12)
    assert got[1].item() == pytest.approx(10 * math.log10(255**2 * 60 / 10000), rel=1e-12)
    with pytest.raises(FastdiffError, match="uint8"):
        psnr_uint8(a.float(), b.float())


def test_nan_never_passes():
    a = torch.zeros(2, 1, 3, 3)
    b = a.clone()
    b[1, 0, 1, 1] = float("nan")
    assert math.isnan(psnr(a, b)[1].item())
    assert math.isnan(max_abs_diff(a, b))


def test_max_abs_diff_and_errors():
    a = torch.zeros(2, 3, 4)
    b = a.clone()
    b[1, 2, 3] = -0.75
    b[0, 0, 0] = 0.5
    assert max_abs_diff(a, b) == 0.75
    with pytest.raises(FastdiffError, match="same shape"):
        psnr(a, b[:1])
    with pytest.raises(FastdiffError, match="data_range"):
        psnr(a, b, data_range=0)
