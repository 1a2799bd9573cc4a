"""Fréchet distance between two Gaussians fitted to feature sets (the formula behind FID), in float64.

FD = ‖μ1 − μ2‖² + tr(Σ1) + tr(Σ2) − 2·tr((Σ1 Σ2)^½). The trace of the matrix square root is computed as
Σ sqrt(λ_i) over the eigenvalues λ_i of the symmetric PSD matrix Σ1^½ Σ2 Σ1^½, which shares its eigenvalues
with Σ1 Σ2. Symmetric eigen-decompositions stay stable for singular covariances (fewer samples than
dimensions), where a general matrix square root (scipy.linalg.sqrtm) may lose accuracy.
"""

from __future__ import annotations

import numpy as np
import torch

from fastdiff.errors import FastdiffError

ArrayLike = np.ndarray | torch.Tensor


def as_float64(x: ArrayLike) -> np.ndarray:
    """A float64 numpy copy of a tensor (any device) or an array."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def feature_stats(features: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
    """Mean [D] and unbiased covariance [D, D] (float64) of features [N, D], as ``np.cov(rowvar=False)``."""
    f = as_float64(features)
    if f.ndim != 2:
        raise FastdiffError(f"features must be [N, D], got shape {tuple(f.shape)}")
    if f.shape[0] < 2:
        raise FastdiffError(f"need at least 2 feature vectors for a covariance, got {f.shape[0]}")
    if not np.all(np.isfinite(f)):
        raise FastdiffError("features contain NaN or infinity")
    mu = f.mean(axis=0)
    centered = f - mu
    sigma = centered.T @ centered / (f.shape[0] - 1)
    return mu, sigma


def sqrt_psd(matrix: np.ndarray) -> np.ndarray:
    """Symmetric square root of a symmetric PSD matrix (negative round-off eigenvalues count as 0)."""
    eigvals, eigvecs = np.linalg.eigh((matrix + matrix.T) / 2)
    return (eigvecs * np.sqrt(np.clip(eigvals, 0.0, None))) @ eigvecs.T


def frechet_distance(mu1: ArrayLike, sigma1: ArrayLike, mu2: ArrayLike, sigma2: ArrayLike) -> float:
    """Fréchet distance between N(mu1, sigma1) and N(mu2, sigma2), computed in float64, clamped at 0."""
    mu1, mu2 = as_float64(mu1), as_float64(mu2)
    sigma1, sigma2 = as_float64(sigma1), as_float64(sigma2)
    d = mu1.shape[0] if mu1.ndim == 1 else -1
    if mu1.shape != (d,) or mu2.shape != (d,) or sigma1.shape != (d, d) or sigma2.shape != (d, d):
        raise FastdiffError(
            f"Fréchet statistics do not match: mu {tuple(mu1.shape)} / {tuple(mu2.shape)}, "
            f"sigma {tuple(sigma1.shape)} / {tuple(sigma2.shape)}"
        )
    for name, value in (("mu1", mu1), ("sigma1", sigma1), ("mu2", mu2), ("sigma2", sigma2)):
        if not np.all(np.isfinite(value)):
            raise FastdiffError(f"Fréchet statistic {name} contains NaN or infinity")
    root1 = sqrt_psd(sigma1)
    inner = root1 @ sigma2 @ root1
    eigvals = np.linalg.eigvalsh((inner + inner.T) / 2)
    trace_sqrt = float(np.sqrt(np.clip(eigvals, 0.0, None)).sum())
    diff = mu1 - mu2
    distance = float(diff @ diff) + float(np.trace(sigma1)) + float(np.trace(sigma2)) - 2.0 * trace_sqrt
    return max(distance, 0.0)


def frechet_distance_features(a: ArrayLike, b: ArrayLike) -> float:
    """Fréchet distance between the Gaussians fitted to feature sets a [N, D] and b [M, D]."""
    return frechet_distance(*feature_stats(a), *feature_stats(b))
