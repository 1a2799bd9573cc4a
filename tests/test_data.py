"""Fashion-MNIST idx loading: header parsing, padding/scaling, and one-line errors for bad files."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from fastdiff.data import DEFAULT_DATA_DIR, load_fashion_mnist
from fastdiff.errors import FastdiffError


def write_idx_gz(path: Path, array: np.ndarray, dtype_code: int = 0x08) -> None:
    header = bytes([0, 0, dtype_code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def write_split(root: Path, prefix: str, images: np.ndarray, labels: np.ndarray) -> None:
    write_idx_gz(root / f"{prefix}-images-idx3-ubyte.gz", images)
    write_idx_gz(root / f"{prefix}-labels-idx1-ubyte.gz", labels)


@pytest.fixture
def tiny_images() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return rng.integers(0, 256, size=(5, 28, 28), dtype=np.uint8), np.array([0, 9, 3, 3, 1], dtype=np.uint8)


def test_synthetic_split_is_padded_and_scaled(tmp_path, tiny_images):
    images, labels = tiny_images
    write_split(tmp_path, "t10k", images, labels)
    x, y = load_fashion_mnist("test", tmp_path)
    assert x.shape == (5, 1, 32, 32) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and y.tolist() == labels.tolist()
    ref = torch.full((5, 1, 32, 32), -1.0)
    ref[:, 0, 2:30, 2:30] = torch.from_numpy(images.astype(np.float32)) / 127.5 - 1
    torch.testing.assert_close(x, ref, rtol=0, atol=1e-6)
    # a 0 byte is exactly -1, a 255 byte exactly +1
    assert x.min() == -1.0 and x.max() <= 1.0


def test_pad_to_28_keeps_size_and_odd_pad_centres(tmp_path, tiny_images):
    images, labels = tiny_images
    write_split(tmp_path, "train", images, labels)
    x, _ = load_fashion_mnist("train", tmp_path, pad_to=28)
    assert x.shape == (5, 1, 28, 28)
    x33, _ = load_fashion_mnist("train", tmp_path, pad_to=33)
    torch.testing.assert_close(x33[:, :, 2:30, 2:30], x, rtol=0, atol=0)
    with pytest.raises(FastdiffError, match="smaller"):
        load_fashion_mnist("train", tmp_path, pad_to=20)


def test_missing_file_names_file_and_install_hint(tmp_path):
    with pytest.raises(FastdiffError, match=r"t10k-images-idx3-ubyte\.gz.*apt-get install dataset-fashion-mnist"):
        load_fashion_mnist("test", tmp_path)


def test_unknown_split(tmp_path):
    with pytest.raises(FastdiffError, match="split"):
        load_fashion_mnist("valid", tmp_path)


def test_truncated_payload_is_rejected(tmp_path, tiny_images):
    images, labels = tiny_images
    write_split(tmp_path, "t10k", images, labels)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(raw[:-100]))
    with pytest.raises(FastdiffError, match="data bytes"):
        load_fashion_mnist("test", tmp_path)


def test_truncated_gzip_stream_is_rejected(tmp_path, tiny_images):
    images, labels = tiny_images
    write_split(tmp_path, "t10k", images, labels)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(FastdiffError, match="corrupt or truncated"):
        load_fashion_mnist("test", tmp_path)


def test_bad_magic_and_dtype_and_count_mismatch(tmp_path, tiny_images):
    images, labels = tiny_images
    write_split(tmp_path, "t10k", images, labels)
    labels_path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    with gzip.open(labels_path, "wb") as f:
        f.write(b"\x01\x02\x08\x01" + struct.pack(">I", 5) + bytes(5))
    with pytest.raises(FastdiffError, match="not an idx file"):
        load_fashion_mnist("test", tmp_path)
    write_idx_gz(labels_path, labels, dtype_code=0x0D)
    with pytest.raises(FastdiffError, match="data type"):
        load_fashion_mnist("test", tmp_path)
    write_idx_gz(labels_path, labels[:4])
    with pytest.raises(FastdiffError, match="5 images but 4 labels"):
        load_fashion_mnist("test", tmp_path)
    write_idx_gz(labels_path, images[:, 0, :5])
    with pytest.raises(FastdiffError, match="dimensions"):
        load_fashion_mnist("test", tmp_path)


@pytest.mark.skipif(not (DEFAULT_DATA_DIR / "t10k-images-idx3-ubyte.gz").is_file(), reason="no Fashion-MNIST")
def test_real_test_split():
    x, y = load_fashion_mnist("test")
    assert x.shape == (10000, 1, 32, 32) and y.shape == (10000,)
    assert x.min() == -1.0 and x.max() == 1.0
    assert torch.all(x[:, :, :2] == -1) and torch.all(x[:, :, :, -2:] == -1)
    assert torch.bincount(y).tolist() == [1000] * 10


@pytest.mark.skipif(not (DEFAULT_DATA_DIR / "train-images-idx3-ubyte.gz").is_file(), reason="no Fashion-MNIST")
def test_real_train_split():
    x, y = load_fashion_mnist("train")
    assert x.shape == (60000, 1, 32, 32) and y.shape == (60000,)
    assert -1.0 <= x.min() and x.max() <= 1.0
    assert torch.bincount(y).tolist() == [6000] * 10
