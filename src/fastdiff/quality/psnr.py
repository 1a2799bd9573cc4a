"""Per-image PSNR and max-abs-difference between paired images (e.g. fastdiff vs a reference sampler)."""

from __future__ import annotations

import torch

from fastdiff.errors import FastdiffError


def check_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise FastdiffError(f"paired images must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dim() < 2:
        raise FastdiffError(f"images must be batched [N, ...], got shape {tuple(a.shape)}")


def psnr(a: torch.Tensor, b: torch.Tensor, data_range: float = 2.0) -> torch.Tensor:
    """PSNR in dB of each image pair, float64 [N]: 10·log10(data_range² / MSE); identical images give +inf.

    ``data_range`` is max − min of the pixel scale: 2.0 for images in [-1, 1], 1.0 for [0, 1], 255 for uint8.
    """
    check_pair(a, b)
    if data_range <= 0:
        raise FastdiffError(f"data_range must be positive, got {data_range}")
    diff = a.to(torch.float64) - b.to(torch.float64)
    mse = diff.flatten(1).pow(2).mean(dim=1)
    return 10.0 * torch.log10(data_range**2 / mse)


def psnr_uint8(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PSNR in dB of uint8 image pairs (data range 255)."""
    if a.dtype != torch.uint8 or b.dtype != torch.uint8:
        raise FastdiffError(f"psnr_uint8 needs uint8 images, got {a.dtype} and {b.dtype}")
    return psnr(a, b, data_range=255.0)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute pixel difference over all pairs (computed in float64)."""
    check_pair(a, b)
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())
