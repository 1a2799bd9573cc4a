"""Turning sample tensors into PIL images and PNG grids, written atomically (no half-written files).

Imports no torch (a tensor argument brings it along), so the command modules that write images load fast."""

from __future__ import annotations

import io
import json
import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from fastdiff.atomic import write_atomic
from fastdiff.version import __version__

if TYPE_CHECKING:
    import numpy as np
    import torch


def uint8_pixels(images: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] in [-1, 1] -> uint8 [B, H, W, C] (rounded, clipped), a view where ``images`` are."""
    import torch

    return ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[B, C, H, W] in [-1, 1] -> uint8 [B, H, W, C] (rounded, clipped) on the host (``uint8_pixels``)."""
    return uint8_pixels(images.cpu()).numpy()


def pil_image(pixels: np.ndarray) -> Image.Image:
    """One uint8 [H, W, C] image as a PIL image: grayscale for one channel, RGB for three."""
    return Image.fromarray(pixels[..., 0], mode="L") if pixels.shape[-1] == 1 else Image.fromarray(pixels)


def to_pil(images: torch.Tensor) -> list[Image.Image]:
    """[B, C, H, W] in [-1, 1] -> PIL images (grayscale for one channel, RGB for three)."""
    return [pil_image(a) for a in to_uint8(images)]


def make_grid(images: Sequence[Image.Image], nrow: int | None = None, pad: int = 2) -> Image.Image:
    """Tile PIL images into a grid with ``nrow`` images per row (default: about square)."""
    if not images:
        raise ValueError("make_grid needs at least one image")
    if nrow is None:
        nrow = math.ceil(math.sqrt(len(images)))
    elif nrow <= 0:
        raise ValueError(f"make_grid needs a positive nrow, got {nrow}")
    rows = math.ceil(len(images) / nrow)
    w, h = images[0].size
    grid = Image.new(images[0].mode, (nrow * (w + pad) + pad, rows * (h + pad) + pad))
    for k, img in enumerate(images):
        grid.paste(img, (pad + (k % nrow) * (w + pad), pad + (k // nrow) * (h + pad)))
    return grid


PNG_OPTIONS: dict[str, int] = {"compress_level": 1, "compress_type": zlib.Z_RLE}
"""How every PNG is encoded (Pillow's ``save`` options): zlib level 1 with its run-length strategy. On the lent
H100 machine's CPU a photograph-like 512x512 image took 37 ms against 102 ms at Pillow's default level 6, at the same
size (403 KiB), and uniform noise 36 against 60 ms (``benchmarks/png_encode.py``,
``benchmarks/results/png-encode-h100-host-2026-11-28.json``). A served image's encoding adds to its latency (63 ms of
a 222 ms SD 1.5 request at level 6). Lossless either way."""

PNG_PARAMETERS_KEY = "parameters"
"""The PNG text chunk (iTXt, UTF-8) that holds an image's generation parameters as a JSON object."""


def png_info(parameters: Mapping[str, Any] | None) -> PngInfo | None:
    """The PNG text chunk of an image's generation ``parameters`` (JSON-serializable: model, prompt, seed,
    sampler, ...), with the fastdiff version added: the one place every PNG writer (``sample``, ``generate``,
    ``serve``) takes it from. None: no chunk."""
    if parameters is None:
        return None
    info = PngInfo()
    info.add_itxt(PNG_PARAMETERS_KEY, json.dumps({**dict(parameters), "fastdiff": __version__}, ensure_ascii=False))
    return info


def png_writer(image: Image.Image, parameters: Mapping[str, Any] | None = None) -> Callable[[Path], None]:
    """``write(path)``: save ``image`` as a PNG at ``path``, ``parameters`` in its ``PNG_PARAMETERS_KEY`` text
    chunk (:func:`png_info`); for ``fastdiff.atomic``'s writers."""
    info = png_info(parameters)

    def write(path: Path) -> None:
        image.save(path, format="PNG", pnginfo=info, **PNG_OPTIONS)

    return write


def png_bytes(image: Image.Image, parameters: Mapping[str, Any] | None = None) -> bytes:
    """``image`` as PNG bytes, ``parameters`` in its text chunk (:func:`png_info`)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=png_info(parameters), **PNG_OPTIONS)
    return buffer.getvalue()


def save_png_atomic(image: Image.Image, path: Path, parameters: Mapping[str, Any] | None = None) -> None:
    """Write ``image`` as a PNG to ``path`` all or nothing (``fastdiff.atomic.write_atomic``).

    ``parameters`` (JSON-serializable: prompt, seed, sampler, ...) go into the ``PNG_PARAMETERS_KEY`` text chunk;
    read them back with ``json.loads(Image.open(path).text["parameters"])``.
    """
    write_atomic(path, png_writer(image, parameters))


def save_figure_atomic(fig: Any, path: Path, dpi: int | None = None) -> None:
    """Save a matplotlib ``Figure`` as a PNG the same way."""
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))
