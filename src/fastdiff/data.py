"""Fashion-MNIST from the idx ``.gz`` files of Debian's ``dataset-fashion-mnist`` package (or any folder)."""

from __future__ import annotations

import gzip
import logging
import zlib
from pathlib import Path

import numpy as np
import torch

from fastdiff.errors import FastdiffError

log = logging.getLogger(__name__)

DEFAULT_DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
"""Where ``apt-get install dataset-fashion-mnist`` puts the files."""

SPLIT_PREFIX = {"train": "train", "test": "t10k"}
IDX_UBYTE = 0x08
INSTALL_HINT = "install it with: apt-get install dataset-fashion-mnist (or pass --data DIR)"

FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)


def read_idx_gz(path: Path, ndim: int) -> np.ndarray:
    """The uint8 array of a gzipped idx file with ``ndim`` dims; a bad header or size is a FastdiffError."""
    if not path.is_file():
        raise FastdiffError(f"Fashion-MNIST file not found: {path}; {INSTALL_HINT}")
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise FastdiffError(f"cannot read {path}: corrupt or truncated gzip ({exc})") from exc
    if len(raw) < 4 + 4 * ndim:
        raise FastdiffError(f"{path}: truncated idx header ({len(raw)} bytes)")
    zero0, zero1, dtype_code, file_ndim = raw[0], raw[1], raw[2], raw[3]
    if zero0 != 0 or zero1 != 0:
        raise FastdiffError(f"{path}: not an idx file (magic {raw[:4].hex()})")
    if dtype_code != IDX_UBYTE:
        raise FastdiffError(f"{path}: idx data type 0x{dtype_code:02x}, expected unsigned byte (0x08)")
    if file_ndim != ndim:
        raise FastdiffError(f"{path}: idx file has {file_ndim} dimensions, expected {ndim}")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims, dtype=np.int64))
    payload = len(raw) - 4 - 4 * ndim
    if payload != expected:
        raise FastdiffError(f"{path}: idx dims {dims} need {expected} data bytes, file has {payload}")
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load_fashion_mnist(split: str, data_dir: Path | None = None, pad_to: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Images float32 [N, 1, pad_to, pad_to] in [-1, 1] (zero padding becomes -1) and labels int64 [N].

    ``split`` is "train" (60000 images) or "test" (10000). ``data_dir`` defaults to DEFAULT_DATA_DIR.
    """
    if split not in SPLIT_PREFIX:
        raise FastdiffError(f"unknown Fashion-MNIST split {split!r}; expected 'train' or 'test'")
    root = Path(data_dir) if data_dir is not None else DEFAULT_DATA_DIR
    prefix = SPLIT_PREFIX[split]
    images = read_idx_gz(root / f"{prefix}-images-idx3-ubyte.gz", ndim=3)
    labels = read_idx_gz(root / f"{prefix}-labels-idx1-ubyte.gz", ndim=1)
    if images.shape[0] != labels.shape[0]:
        raise FastdiffError(f"{root}: {split} split has {images.shape[0]} images but {labels.shape[0]} labels")
    n, h, w = images.shape
    if pad_to < h or pad_to < w:
        raise FastdiffError(f"pad_to={pad_to} is smaller than the {h}x{w} images")
    if labels.size and int(labels.max()) >= len(FASHION_MNIST_CLASSES):
        raise FastdiffError(f"{root}: {split} labels hold class {int(labels.max())}, expected 0..9")
    top, left = (pad_to - h) // 2, (pad_to - w) // 2
    out = torch.full((n, 1, pad_to, pad_to), -1.0, dtype=torch.float32)
    pixels = torch.from_numpy(images.copy()).to(torch.float32).div_(127.5).sub_(1.0)
    out[:, 0, top : top + h, left : left + w] = pixels
    log.debug("loaded Fashion-MNIST %s from %s: %d images", split, root, n)
    return out, torch.from_numpy(labels.astype(np.int64))
