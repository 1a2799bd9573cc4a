"""fastdiff's PNG encoder (``fastdiff.images.png_bytes``) against Pillow, the reference: Pillow decodes every image it
writes to the same pixels and text, on labelled edge-case shapes and modes, in one part and in several."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
from PIL import Image

from fastdiff import images
from fastdiff.images import png_bytes

rng = np.random.default_rng(0)


def smooth(h: int, w: int, c: int) -> np.ndarray:
    """A gradient with mild noise, as a photograph compresses."""
    ramp = np.add.outer(np.linspace(0, 120, h), np.linspace(0, 120, w))[..., None].repeat(c, -1)
    return (ramp + rng.normal(0, 3, (h, w, c))).clip(0, 255).astype(np.uint8)


def noise(h: int, w: int, c: int) -> np.ndarray:
    return rng.integers(0, 256, (h, w, c), dtype=np.uint8)


CASES = {
    "one pixel rgb": (noise(1, 1, 3), "RGB"),
    "one row rgb": (noise(1, 37, 3), "RGB"),
    "one column gray": (noise(41, 1, 1), "L"),
    "odd gray": (smooth(67, 29, 1), "L"),
    "odd rgba": (noise(33, 65, 4), "RGBA"),
    "512 rgb smooth": (smooth(512, 512, 3), "RGB"),
    "512 rgb noise": (noise(512, 512, 3), "RGB"),
    "tall odd rgb (parts of unequal rows)": (smooth(203, 17, 3), "RGB"),
    "saturated rgb (wrap-around in the filter)": (np.where(noise(70, 70, 3) > 127, 255, 0).astype(np.uint8), "RGB"),
}


def as_image(pixels: np.ndarray, mode: str) -> Image.Image:
    return Image.fromarray(pixels[..., 0] if mode == "L" else pixels, mode)


@pytest.mark.parametrize("parts", [1, 3, 8], ids=lambda n: f"{n} parts")
@pytest.mark.parametrize("case", CASES, ids=str)
def test_pillow_reads_back_the_pixels_and_text(case, parts, monkeypatch):
    monkeypatch.setattr(images, "PNG_THREADS", parts)
    monkeypatch.setattr(images, "PNG_PART_ROWS", 1)  # as many parts as rows allow
    pixels, mode = CASES[case]
    image = as_image(pixels, mode)
    data = png_bytes(image, {"prompt": "ein Kleid, rot – ü", "seed": 3})
    back = Image.open(io.BytesIO(data))
    back.load()
    assert back.mode == mode and back.size == image.size
    assert np.array_equal(np.asarray(back), np.asarray(image))
    assert '"prompt": "ein Kleid, rot – ü"' in back.text["parameters"]


def test_the_size_is_pillows_within_two_percent():
    """One "Up" filter for every row against Pillow's per-row choice, at the same zlib level and strategy."""
    for pixels in (smooth(512, 512, 3), noise(512, 512, 3)):
        image = Image.fromarray(pixels)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=images.PNG_LEVEL, compress_type=zlib.Z_RLE)
        assert len(png_bytes(image)) <= 1.02 * len(buffer.getvalue())


def test_the_parts_join_into_one_checked_zlib_stream(monkeypatch):
    """The IDAT is one zlib stream (header, deflate parts, Adler-32) that zlib inflates with its checksum checked."""
    monkeypatch.setattr(images, "PNG_THREADS", 4)
    monkeypatch.setattr(images, "PNG_PART_ROWS", 8)
    pixels = smooth(64, 40, 3)
    data = png_bytes(Image.fromarray(pixels))
    start = data.index(b"IDAT") + 4
    length = int.from_bytes(data[start - 8 : start - 4], "big")
    lines = zlib.decompress(data[start : start + length])
    assert lines == images.up_filtered(pixels).tobytes()
    assert lines[0] == 0 and lines[1 + 40 * 3] == 2  # row filters: none, then Up


def test_other_modes_go_through_pillow():
    image = Image.fromarray(noise(9, 7, 3)).quantize(16)  # a palette image
    back = Image.open(io.BytesIO(png_bytes(image, {"seed": 1})))
    assert back.mode == "P" and np.array_equal(np.asarray(back), np.asarray(image)) and "parameters" in back.text
