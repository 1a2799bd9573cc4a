"""Turning sample tensors into PIL images and PNG grids, written atomically (no half-written files).

Imports no torch (a tensor argument brings it along), so the command modules that write images load fast."""

from __future__ import annotations

import io
import json
import math
import os
import struct
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
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


PNG_LEVEL = 1
"""zlib level of every PNG fastdiff writes, with zlib's run-length strategy (``Z_RLE``): lossless, within 1 % of
Pillow's default level 6 in size. A 512x512 RGB image on the lent H200 machine's CPU: 2.9-3.0 ms with
:func:`png_bytes` on 8 threads, 6.4-10.7 ms on one, against 25.9-26.1 ms for Pillow at these settings and 46.8-74.4 ms
at its default (``benchmarks/results/png-encode-h200-host-2026-11-28.json``)."""

PNG_PART_ROWS = 64
"""An image of more rows than this is compressed in parts of at least this many rows, on :data:`PNG_THREADS`."""

PNG_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
"""Threads that compress a large PNG's parts: the CPUs this process may use, at most 8."""

PNG_MODES = {"L": 0, "RGB": 2, "RGBA": 6}
"""PIL modes :func:`png_bytes` encodes itself, with their PNG colour types (8 bits a sample); others go to Pillow."""

PNG_PARAMETERS_KEY = "parameters"
"""The PNG text chunk (iTXt, UTF-8) that holds an image's generation parameters as a JSON object."""

_png_pool: ThreadPoolExecutor | None = None
_png_pool_lock = threading.Lock()


def png_pool() -> ThreadPoolExecutor:
    """The threads that compress large PNGs' parts (made on first use; a forked child makes its own)."""
    global _png_pool
    with _png_pool_lock:
        if _png_pool is None:
            _png_pool = ThreadPoolExecutor(PNG_THREADS, thread_name_prefix="fastdiff-png")
        return _png_pool


def _forget_png_pool() -> None:
    global _png_pool, _png_pool_lock
    _png_pool, _png_pool_lock = None, threading.Lock()  # the parent's threads do not exist in a forked child


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_png_pool)


def png_info(parameters: Mapping[str, Any] | None) -> PngInfo | None:
    """The PNG text chunk of an image's generation ``parameters`` (JSON-serializable: model, prompt, seed,
    sampler, ...), with the fastdiff version added: the one place every PNG writer (``sample``, ``generate``,
    ``serve``) takes it from. None: no chunk."""
    if parameters is None:
        return None
    info = PngInfo()
    info.add_itxt(PNG_PARAMETERS_KEY, json.dumps({**dict(parameters), "fastdiff": __version__}, ensure_ascii=False))
    return info


def png_chunk(kind: bytes, data: bytes) -> bytes:
    """One PNG chunk: length, type, data, CRC-32 of type and data (PNG spec, section 5.3)."""
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def up_filtered(pixels: np.ndarray) -> np.ndarray:
    """PNG scanlines of ``pixels`` (uint8 [H, W] or [H, W, C]) for the zlib stream: each row's filter byte, then the
    row minus the row above ("Up", filter type 2, PNG spec section 9.2; the first row unfiltered, type 0).

    Pillow picks a filter for every row by trying all five (libpng's heuristic), which is most of its encoding time;
    one vectorised filter gives a size within 1 % on photograph-like images and on noise."""
    import numpy as np

    rows = pixels.reshape(pixels.shape[0], -1)
    lines = np.empty((rows.shape[0], rows.shape[1] + 1), np.uint8)
    lines[0, 0], lines[1:, 0] = 0, 2
    lines[0, 1:] = rows[0]
    np.subtract(rows[1:], rows[:-1], out=lines[1:, 1:])  # uint8: modulo 256, as the filter is defined
    return lines


def png_bytes(image: Image.Image, parameters: Mapping[str, Any] | None = None) -> bytes:
    """``image`` as PNG bytes, ``parameters`` in its text chunk (:func:`png_info`).

    8-bit gray, RGB and RGBA images are encoded here: "Up"-filtered rows (:func:`up_filtered`) compressed at
    :data:`PNG_LEVEL` in parts of rows on a thread pool (zlib works outside the GIL), each part a raw deflate
    stream ended with a sync flush so that the parts join into one zlib stream, as pigz does. Other modes go through
    Pillow. Either way Pillow reads the result back to the same pixels and text (``tests/test_png_encoder.py``)."""
    info = png_info(parameters)
    if image.mode not in PNG_MODES or 0 in image.size:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", pnginfo=info, compress_level=PNG_LEVEL, compress_type=zlib.Z_RLE)
        return buffer.getvalue()
    import numpy as np

    lines = up_filtered(np.asarray(image))
    parts = max(1, min(PNG_THREADS, lines.shape[0] // PNG_PART_ROWS))
    bounds = [lines.shape[0] * k // parts for k in range(parts + 1)]

    def deflate(k: int) -> bytes:
        stream = zlib.compressobj(PNG_LEVEL, zlib.DEFLATED, -15, 8, zlib.Z_RLE)  # raw deflate: no header
        last = k == parts - 1
        return stream.compress(lines[bounds[k] : bounds[k + 1]]) + stream.flush(
            zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH
        )

    blocks = [deflate(0)] if parts == 1 else list(png_pool().map(deflate, range(parts)))
    # zlib stream: header (deflate, 32 KiB window, no dictionary; 0x7801 % 31 == 0), the parts, Adler-32 of the data
    idat = b"\x78\x01" + b"".join(blocks) + struct.pack(">I", zlib.adler32(lines))
    header = struct.pack(">IIBBBBB", image.width, image.height, 8, PNG_MODES[image.mode], 0, 0, 0)
    chunks = [b"\x89PNG\r\n\x1a\n", png_chunk(b"IHDR", header)]
    chunks += [png_chunk(kind, data) for kind, data, *_ in (info.chunks if info is not None else [])]
    chunks += [png_chunk(b"IDAT", idat), png_chunk(b"IEND", b"")]
    return b"".join(chunks)


def png_writer(image: Image.Image, parameters: Mapping[str, Any] | None = None) -> Callable[[Path], None]:
    """``write(path)``: save ``image`` as a PNG at ``path`` (:func:`png_bytes`), ``parameters`` in its
    ``PNG_PARAMETERS_KEY`` text chunk; for ``fastdiff.atomic``'s writers."""

    def write(path: Path) -> None:
        path.write_bytes(png_bytes(image, parameters))

    return write


def save_png_atomic(image: Image.Image, path: Path, parameters: Mapping[str, Any] | None = None) -> None:
    """Write ``image`` as a PNG to ``path`` all or nothing (``fastdiff.atomic.write_atomic``).

    ``parameters`` (JSON-serializable: prompt, seed, sampler, ...) go into the ``PNG_PARAMETERS_KEY`` text chunk;
    read them back with ``json.loads(Image.open(path).text["parameters"])``.
    """
    write_atomic(path, png_writer(image, parameters))


def save_figure_atomic(fig: Any, path: Path, dpi: int | None = None) -> None:
    """Save a matplotlib ``Figure`` as a PNG the same way."""
    write_atomic(path, lambda tmp: fig.savefig(tmp, format="png", dpi=dpi))
