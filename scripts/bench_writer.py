"""How fast ``fastdiff generate`` writes PNGs on this host (CPU only): N noise images of SIZE x SIZE RGB (what
ddpm-cifar10 with random weights makes), in chunks of BATCH, written by

- per-file: the old writer, ``fastdiff.images.save_png_atomic`` per image in a thread pool (encode, write, fsync,
  rename, fsync the folder: two journal commits per file);
- unit-writer: ``fastdiff.generate.UnitWriter`` with T encoder threads (encode and write temporary files in
  parallel, one ``syncfs``/fsync per chunk, the renames, one folder fsync);
- unit-writer with P processes: the same, the PNGs encoded in a pool of processes (``FASTDIFF_WRITER=processes``;
  the pool's start-up is inside the time).

    .venv/bin/python scripts/bench_writer.py [--images 2048] [--batch 256] [--size 32] [--repeats 3] [--dir DIR]

Prints one line per writer: images/s (best of --repeats), and the same as JSON at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fastdiff.generate import (
    HostPixels,
    Unit,
    UnitWriter,
    png_name,
)
from fastdiff.images import save_png_atomic

log = logging.getLogger("bench_writer")
PARAMETERS = {"model": "ddpm-cifar10", "sampler": "ddim", "steps": 20, "dtype": "fp16"}


def per_file(threads: int) -> Callable[[Path, np.ndarray, int], None]:
    def write(out: Path, pixels: np.ndarray, batch: int) -> None:
        with ThreadPoolExecutor(threads) as pool:
            for start in range(0, len(pixels), batch):
                chunk = range(start, min(start + batch, len(pixels)))
                jobs = [
                    pool.submit(
                        save_png_atomic, Image.fromarray(pixels[i]), out / png_name(i), {**PARAMETERS, "seed": i}
                    )
                    for i in chunk
                ]
                for job in jobs:
                    job.result()

    return write


def unit_writer(threads: int, processes: bool = False) -> Callable[[Path, np.ndarray, int], None]:
    """generate's ``UnitWriter``: encoders in ``threads`` threads, or (``processes``) that many processes."""

    def write(out: Path, pixels: np.ndarray, batch: int) -> None:
        with UnitWriter(out, threads, processes=processes) as writer:
            pending = None
            for start in range(0, len(pixels), batch):
                unit = Unit(start, min(start + batch, len(pixels)))
                host = HostPixels(torch.from_numpy(pixels[unit.start : unit.stop]))
                parameters = [{**PARAMETERS, "seed": i} for i in range(unit.start, unit.stop)]
                queued = writer.start(unit, [host], "png", parameters)
                if pending is not None:
                    pending.wait()
                pending = queued
            pending.wait()

    return write


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the folders go (default: a temporary folder)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    pixels = np.random.default_rng(0).integers(0, 256, (args.images, args.size, args.size, 3), dtype=np.uint8)
    writers = {
        **{f"per-file, {t} threads": per_file(t) for t in (1, 2, 4, 8)},
        **{f"unit-writer, {t} threads": unit_writer(t) for t in (1, 2, 4)},
        **{f"unit-writer, {p} processes": unit_writer(p, processes=True) for p in (2, 4)},
    }
    root = Path(tempfile.mkdtemp(prefix="bench-writer-", dir=args.dir))
    results = {}
    try:
        for name, write in writers.items():
            best = 0.0
            for repeat in range(args.repeats):
                out = root / f"{len(results)}-{repeat}"
                out.mkdir()
                start = time.perf_counter()
                write(out, pixels, args.batch)
                best = max(best, args.images / (time.perf_counter() - start))
                assert len(list(out.glob("*.png"))) == args.images  # folders removed at the end: no discards now
            results[name] = round(best, 1)
            log.info("%-28s %8.0f images/s", name, best)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps({"images": args.images, "batch": args.batch, "size": args.size, "images_per_s": results}))


if __name__ == "__main__":
    main()
