"""Image-quality metrics: Fréchet distances (FD-FMNIST with the bundled classifier, Inception FID), PSNR."""

from fastdiff.quality.classifier import classifier_features, fd_fmnist, load_classifier, train_classifier
from fastdiff.quality.frechet import feature_stats, frechet_distance, frechet_distance_features
from fastdiff.quality.psnr import max_abs_diff, psnr, psnr_uint8

__all__ = [
    "classifier_features",
    "fd_fmnist",
    "feature_stats",
    "frechet_distance",
    "frechet_distance_features",
    "load_classifier",
    "max_abs_diff",
    "psnr",
    "psnr_uint8",
    "train_classifier",
]
