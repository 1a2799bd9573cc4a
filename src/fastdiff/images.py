"""Turning sample tensors into PIL images and PNG grids, written atomically (no half-written files)."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[B, C, H, W] in [-1, 1] -> uint8 [B, H, W, C] (rounded, clipped)."""
    x = ((images.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return x.permute(0, 2, 3, 1).numpy()


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """[B, C, H, W] in [-1, 1] -> PIL images (grayscale for one channel, RGB for three)."""
    arr = to_uint8(images)
    if arr.shape[-1] == 1:
        return [Image.fromarray(a[..., 0], mode="L") for a in arr]
    return [Image.fromarray(a) for a in arr]


def make_grid(images: Sequence[Image.Image], nrow: int | None = None, pad: int = 2) -> Image.Image:
    """Tile PIL images into a grid with ``nrow`` images per row (default: about square)."""
    if not images:
        raise ValueError("make_grid needs at least one image")
    nrow = nrow or math.ceil(math.sqrt(len(images)))
    rows = math.ceil(len(images) / nrow)
    w, h = images[0].size
    grid = Image.new(images[0].mode, (nrow * (w + pad) + pad, rows * (h + pad) + pad))
    for k, img in enumerate(images):
        grid.paste(img, (pad + (k % nrow) * (w + pad), pad + (k // nrow) * (h + pad)))
    return grid


def _write_png_atomic(write: Callable[[str], None], path: Path) -> None:
    """``write(tmp)`` a PNG to a temporary file next to ``path``, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".png", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_png_atomic(image: Image.Image, path: Path) -> None:
    """Write ``image`` to a temporary file next to ``path`` and rename it into place."""
    _write_png_atomic(lambda tmp: image.save(tmp, format="PNG"), path)


def save_figure_atomic(fig: Any, path: Path, dpi: int | None = None) -> None:
    """Save a matplotlib ``Figure`` as PNG the same way (nothing half-written on failure)."""
    _write_png_atomic(lambda tmp: fig.savefig(tmp, format="png", dpi=dpi), path)
