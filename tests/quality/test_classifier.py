"""The FD-FMNIST classifier: shapes, augmentation, save/load round trip, training on tiny synthetic data,
and the bundled weights' accuracy on the real test split (when Fashion-MNIST is installed)."""

import gzip
import json
import struct

import numpy as np
import pytest
import torch

from fastdiff.data import DEFAULT_DATA_DIR, load_fashion_mnist
from fastdiff.errors import FastdiffError
from fastdiff.quality.classifier import (
    BUNDLED_CLASSIFIER_DIR,
    ClassifierConfig,
    FashionClassifier,
    augment,
    classifier_accuracy,
    classifier_features,
    fd_fmnist,
    load_classifier,
    save_classifier,
    train_classifier,
)
from fastdiff.quality.frechet import frechet_distance_features

HAVE_FMNIST = (DEFAULT_DATA_DIR / "t10k-images-idx3-ubyte.gz").is_file()
HAVE_BUNDLED = (BUNDLED_CLASSIFIER_DIR / "model.safetensors").is_file()
TINY = ClassifierConfig(channels=(4, 6), feature_dim=24)


def write_idx_gz(path, array):
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def synthetic_fmnist(root, n_train=96, n_test=40):
    """Two easy classes: bright images are class 1, dark ones class 0."""
    rng = np.random.default_rng(4)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 2, size=n)
        images = rng.integers(0, 60, size=(n, 28, 28)) + labels[:, None, None] * 190
        write_idx_gz(root / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx_gz(root / f"{prefix}-labels-idx1-ubyte.gz", labels)


def test_shapes_on_odd_batch():
    torch.manual_seed(0)
    model = FashionClassifier(ClassifierConfig()).eval()
    x = torch.rand(3, 1, 32, 32) * 2 - 1
    assert model(x).shape == (3, 10)
    assert model.features(x).shape == (3, 128)


def test_features_independent_of_batch_size():
    torch.manual_seed(1)
    model = FashionClassifier(TINY)
    x = torch.rand(13, 1, 32, 32) * 2 - 1
    full = classifier_features(model, x, batch_size=500)
    pieces = classifier_features(model, x, batch_size=4)
    assert full.shape == (13, 24) and full.dtype == torch.float32
    torch.testing.assert_close(pieces, full, rtol=1e-5, atol=1e-6)
    assert model.training  # restored


def test_features_reject_bad_input():
    model = FashionClassifier(TINY)
    with pytest.raises(FastdiffError, match=r"\[N, 1, 32, 32\]"):
        classifier_features(model, torch.zeros(2, 3, 32, 32))
    with pytest.raises(FastdiffError, match=r"\[-1, 1\]"):
        classifier_features(model, torch.full((2, 1, 32, 32), 200.0))
    with pytest.raises(FastdiffError, match="NaN"):
        classifier_features(model, torch.full((2, 1, 32, 32), float("nan")))


def test_augment_is_a_flip_and_shift_of_the_input():
    g = torch.Generator().manual_seed(3)
    x = torch.rand(9, 1, 11, 13) * 2 - 1
    out = augment(x, g, max_shift=2)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (2, 2, 2, 2), value=-1.0)
    for k in range(9):
        candidates = [
            src[:, dy : dy + 11, dx : dx + 13]
            for src in (padded[k], padded[k].flip(2))
            for dy in range(5)
            for dx in range(5)
        ]
        assert any(torch.equal(out[k], c) for c in candidates), k


def test_save_load_round_trip(tmp_path):
    torch.manual_seed(2)
    model = FashionClassifier(TINY)
    model.train()
    model(torch.rand(8, 1, 32, 32))  # move BatchNorm running stats off their defaults
    save_classifier(model, tmp_path, {"test_accuracy": 0.5})
    loaded = load_classifier(tmp_path)
    assert not loaded.training and loaded.config == TINY
    x = torch.rand(5, 1, 32, 32) * 2 - 1
    torch.testing.assert_close(classifier_features(loaded, x), classifier_features(model, x), rtol=0, atol=0)
    config = json.loads((tmp_path / "config.json").read_text())
    config["colour"] = "blue"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FastdiffError, match="colour"):
        load_classifier(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FastdiffError, match="model.safetensors"):
        load_classifier(tmp_path)


def test_train_on_tiny_synthetic_data(tmp_path):
    synthetic_fmnist(tmp_path)
    accuracy = train_classifier(2, "cpu", tmp_path, tmp_path / "clf", batch_size=16, config=TINY)
    assert accuracy >= 0.9  # bright vs dark is trivially separable
    config = json.loads((tmp_path / "clf" / "config.json").read_text())
    assert config["test_accuracy"] == round(accuracy, 4) and config["epochs"] == 2
    model = load_classifier(tmp_path / "clf")
    test_x, test_y = load_fashion_mnist("test", tmp_path)
    assert classifier_accuracy(model, test_x, test_y) == accuracy


@pytest.mark.skipif(not HAVE_BUNDLED, reason="bundled classifier not trained yet")
def test_bundled_weights_are_small_and_recorded():
    config = json.loads((BUNDLED_CLASSIFIER_DIR / "config.json").read_text())
    assert config["test_accuracy"] >= 0.90
    assert (BUNDLED_CLASSIFIER_DIR / "model.safetensors").stat().st_size < 2 * 1024 * 1024


@pytest.mark.slow
@pytest.mark.skipif(not (HAVE_BUNDLED and HAVE_FMNIST), reason="needs the bundled classifier and Fashion-MNIST")
def test_bundled_classifier_accuracy_and_fd_of_test_split():
    model = load_classifier()
    x, y = load_fashion_mnist("test")
    accuracy = classifier_accuracy(model, x, y)
    assert accuracy == pytest.approx(json.loads((BUNDLED_CLASSIFIER_DIR / "config.json").read_text())["test_accuracy"])
    # the first 1000 test images against the first 1000 test images: identical sets give 0
    assert fd_fmnist(x[:1000], "test", limit=1000) < 1e-6
    # and a different half of the test split is close, but not identical
    other = fd_fmnist(x[5000:6000], "test", limit=1000)
    reference = frechet_distance_features(
        classifier_features(model, x[5000:6000]), classifier_features(model, x[:1000])
    )
    assert other == pytest.approx(reference, rel=1e-9) and other > 0
