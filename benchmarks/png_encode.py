"""PNG encoding options against each other: milliseconds per image and bytes, on this machine's CPU.

    python benchmarks/png_encode.py --out png-encode.json

Every PNG fastdiff writes (``sample``, ``generate``, ``serve``) goes through ``fastdiff.images.png_bytes``. A
served image is encoded after the GPU is done with it, so its encoding adds to the request's latency. This times
Pillow's encoder on 512x512 RGB images at zlib levels 6 (Pillow's default), 1 and 0, and at level 1 with zlib's
run-length strategy (``Z_RLE``), against fastdiff's encoder (one "Up" filter for every row, level 1 with ``Z_RLE``,
compressed in parts on ``PNG_THREADS`` threads, and in one part on one thread). The images are a smooth gradient
with mild noise (as a photograph compresses), uniform noise (as random weights give), and, with ``--image``, given
files. Median of
``--repeats`` encodes; every option decodes to the same pixels.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

OPTIONS = {
    "level 6 (Pillow's default)": {"compress_level": 6},
    "level 1": {"compress_level": 1},
    "level 1, Z_RLE": {"compress_level": 1, "compress_type": zlib.Z_RLE},
    "level 0 (stored)": {"compress_level": 0},
}


def synthetic_images(size: int = 512) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 1, size)
    gradient = np.stack(np.meshgrid(ramp, ramp), -1).sum(-1, keepdims=True).repeat(3, -1) * 120
    smooth = (gradient + rng.normal(0, 3, (size, size, 3))).clip(0, 255).astype(np.uint8)
    noise = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    return {f"smooth {size}x{size}": smooth, f"noise {size}x{size}": noise}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", type=Path, action="append", default=[], help="an image file to encode too")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from fastdiff import images as fastdiff_images
    from fastdiff.atomic import write_text_atomic
    from fastdiff.bench.env import environment

    def fastdiff_encoder(threads: int):
        def encode(image: Image.Image, buffer: io.BytesIO) -> None:
            saved = fastdiff_images.PNG_THREADS
            fastdiff_images.PNG_THREADS = threads
            try:
                buffer.write(fastdiff_images.png_bytes(image))
            finally:
                fastdiff_images.PNG_THREADS = saved

        return encode

    def pillow(kwargs: dict):
        return lambda image, buffer: image.save(buffer, format="PNG", **kwargs)

    encoders = {option: pillow(kwargs) for option, kwargs in OPTIONS.items()}
    encoders[f"fastdiff, {fastdiff_images.PNG_THREADS} threads"] = fastdiff_encoder(fastdiff_images.PNG_THREADS)
    encoders["fastdiff, 1 thread"] = fastdiff_encoder(1)
    images = synthetic_images()
    images.update({path.name: np.asarray(Image.open(path).convert("RGB")) for path in args.image})
    rows = []
    for name, pixels in images.items():
        image = Image.fromarray(pixels)
        for option, encode in encoders.items():
            times = []
            for _ in range(args.repeats):
                buffer = io.BytesIO()
                t0 = time.perf_counter()
                encode(image, buffer)
                times.append((time.perf_counter() - t0) * 1e3)
            data = buffer.getvalue()
            same = np.array_equal(np.asarray(Image.open(io.BytesIO(data))), pixels)
            default = option == f"fastdiff, {fastdiff_images.PNG_THREADS} threads"
            rows.append({"image": name, "option": option, "ms": statistics.median(times), "kib": len(data) / 1024,
                         "lossless": same, "fastdiff_default": default})  # fmt: skip
            print(f"{name:24s} {option:28s} {rows[-1]['ms']:7.1f} ms {rows[-1]['kib']:7.0f} KiB", flush=True)
    result = {
        "what": "PNG encoding of 512x512 RGB images, Pillow's per option and fastdiff's: median ms per encode and size",
        "env": {
            **environment(),
            "cpus": os.cpu_count(),
            "pillow": Image.__version__,
            "zlib": zlib.ZLIB_RUNTIME_VERSION,
        },  # fmt: skip
        "repeats": args.repeats,
        "rows": rows,
    }
    if args.out:
        write_text_atomic(args.out, json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
