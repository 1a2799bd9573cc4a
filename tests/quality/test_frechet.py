"""Fréchet distance against the pytorch-fid formula (scipy.linalg.sqrtm); exact mean-shift behaviour."""

import numpy as np
import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.quality.frechet import feature_stats, frechet_distance, frechet_distance_features


def pytorch_fid_ref(mu1, sigma1, mu2, sigma2, eps=1e-6) -> float:
    """calculate_frechet_distance of pytorch-fid (sqrtm of Σ1·Σ2, eps offset if singular, real part)."""
    scipy_linalg = pytest.importorskip("scipy.linalg")  # only the reference needs scipy
    diff = mu1 - mu2
    covmean = scipy_linalg.sqrtm(sigma1.dot(sigma2))
    if not np.isfinite(covmean).all():
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = scipy_linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    covmean = covmean.real
    return float(diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean))


def correlated_features(rng, n, d, shift=0.0):
    mixing = rng.standard_normal((d, d)) / np.sqrt(d)
    return rng.standard_normal((n, d)) @ mixing + rng.standard_normal(d) * 0.3 + shift


@pytest.mark.parametrize(("n1", "n2", "d"), [(400, 300, 7), (2000, 1500, 64), (200, 250, 131)])
def test_matches_pytorch_fid_formula(n1, n2, d):
    rng = np.random.default_rng(1000 + d)
    a = correlated_features(rng, n1, d)
    b = correlated_features(rng, n2, d, shift=0.1)
    stats_a, stats_b = feature_stats(a), feature_stats(b)
    ref = pytorch_fid_ref(*stats_a, *stats_b)
    got = frechet_distance(*stats_a, *stats_b)
    assert abs(got - ref) <= 1e-6 * abs(ref), (got, ref)


def test_singular_covariance_fewer_samples_than_dims():
    """n < d: both covariances are rank-deficient; still matches the reference to 1e-6 relative."""
    rng = np.random.default_rng(3)
    a = correlated_features(rng, 40, 96)
    b = correlated_features(rng, 55, 96, shift=0.05)
    stats_a, stats_b = feature_stats(a), feature_stats(b)
    assert np.linalg.matrix_rank(stats_a[1]) == 39
    ref = pytorch_fid_ref(*stats_a, *stats_b)
    got = frechet_distance(*stats_a, *stats_b)
    assert abs(got - ref) <= 1e-6 * abs(ref), (got, ref)


def test_feature_stats_match_numpy():
    rng = np.random.default_rng(11)
    f = rng.standard_normal((37, 5)) * 3 + 1
    mu, sigma = feature_stats(torch.from_numpy(f).float())
    np.testing.assert_allclose(mu, f.astype(np.float32).astype(np.float64).mean(0), rtol=1e-12)
    np.testing.assert_allclose(sigma, np.cov(f.astype(np.float32).astype(np.float64), rowvar=False), rtol=1e-10)


def test_same_features_give_zero():
    rng = np.random.default_rng(5)
    for n, d in ((500, 10), (30, 64)):
        a = correlated_features(rng, n, d)
        mu, sigma = feature_stats(a)
        assert frechet_distance_features(a, a) < 1e-9 * np.trace(sigma)


def test_mean_shift_adds_squared_norm():
    rng = np.random.default_rng(9)
    a = correlated_features(rng, 800, 33)
    b = correlated_features(rng, 700, 33)
    shift = rng.standard_normal(33)
    base = frechet_distance_features(a, b)
    shifted = frechet_distance_features(a, b + shift)
    # covariances are unchanged by the shift, so FD grows by exactly the change of ‖Δμ‖²
    mu_a, _ = feature_stats(a)
    mu_b, _ = feature_stats(b)
    expected = float((mu_a - mu_b - shift) @ (mu_a - mu_b - shift) - (mu_a - mu_b) @ (mu_a - mu_b))
    assert shifted - base == pytest.approx(expected, rel=1e-9, abs=1e-9)
    # and against itself a pure shift gives exactly ‖shift‖²
    assert frechet_distance_features(a, a + shift) == pytest.approx(float(shift @ shift), rel=1e-9)


def test_torch_and_numpy_inputs_agree():
    rng = np.random.default_rng(2)
    a = correlated_features(rng, 100, 12)
    b = correlated_features(rng, 90, 12, shift=0.2)
    assert frechet_distance_features(torch.from_numpy(a), torch.from_numpy(b)) == frechet_distance_features(a, b)


def test_bad_inputs():
    with pytest.raises(FastdiffError, match=r"\[N, D\]"):
        feature_stats(np.zeros(5))
    with pytest.raises(FastdiffError, match="at least 2"):
        feature_stats(np.zeros((1, 5)))
    with pytest.raises(FastdiffError, match="NaN"):
        feature_stats(np.full((4, 3), np.nan))
    mu, sigma = np.zeros(3), np.eye(3)
    with pytest.raises(FastdiffError, match="do not match"):
        frechet_distance(mu, sigma, np.zeros(4), np.eye(4))
    with pytest.raises(FastdiffError, match="sigma2"):
        frechet_distance(mu, sigma, mu, np.full((3, 3), np.nan))
