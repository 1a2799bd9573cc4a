"""``fastdiff fid``: Fréchet distance of generated images against Fashion-MNIST (or any reference set).

SAMPLES (and a --ref PATH) is a folder of PNG files (gray or RGB, one size) or an ``.npz`` file whose array
``images`` (or its only array) is either uint8 in [0, 255] or float in [-1, 1], laid out [N, H, W] (gray),
[N, H, W, C] or [N, C, H, W] with C = 1 or 3. A --ref ``.npz`` may instead hold precomputed ``mu``/``sigma``.
FD-FMNIST needs 28×28 (padded with black to 32×32, like the training data) or 32×32 images; RGB is turned
gray with the ITU-R 601 luma weights. The reference statistics are cached in memory, never written to disk.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from fastdiff.atomic import check_output_location, write_text_atomic
from fastdiff.cli_args import add_command, positive_int
from fastdiff.devices import resolve_device
from fastdiff.errors import FastdiffError
from fastdiff.quality.classifier import (
    cached_classifier,
    classifier_features,
    fmnist_reference_stats,
)
from fastdiff.quality.frechet import feature_stats, frechet_distance
from fastdiff.quality.inception import inception_features, load_inception

log = logging.getLogger(__name__)

FMNIST_REFS = {"fmnist-test": "test", "fmnist-train": "train"}
IMAGE_SUFFIXES = (".png",)
LUMA = (0.299, 0.587, 0.114)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``fid`` subcommand (sets ``func=run_fid``)."""
    add_command(subparsers, "fid", add_arguments)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``fastdiff fid`` (sets ``func=run_fid``)."""
    p.description = (
        "Print the Fréchet distance between SAMPLES and a reference set (lower is better). "
        "SAMPLES: a folder of PNGs, or an .npz whose 'images' array is uint8 [0, 255] or float [-1, 1] in "
        "layout [N,H,W], [N,H,W,C] or [N,C,H,W]. fd-fmnist uses the bundled Fashion-MNIST classifier's "
        "128-d features and needs 28x28 or 32x32 images; inception uses the standard FID InceptionV3."
    )
    p.add_argument("samples", type=Path, metavar="SAMPLES", help="folder of PNGs (or of .npz shards) or .npz of images")
    p.add_argument(
        "--ref",
        default="fmnist-test",
        help="fmnist-test, fmnist-train, or a PNG folder / .npz of images / .npz with mu and sigma",
    )
    p.add_argument(
        "--metric",
        default="fd-fmnist",
        choices=("fd-fmnist", "inception"),
        help="feature network",
    )
    p.add_argument("--inception", type=Path, default=None, metavar="PATH", help="pt_inception-2015-12-05-6726825d.pth")
    p.add_argument(
        "--classifier", type=Path, default=None, metavar="DIR", help="FD-FMNIST classifier (default: the bundled one)"
    )
    p.add_argument("--data", type=Path, default=None, metavar="DIR", help="Fashion-MNIST idx .gz folder")
    p.add_argument(
        "--batch", type=positive_int, default=None, metavar="N", help="images per batch (default: 500, inception 50)"
    )
    p.add_argument("--device", default="auto", help="auto (GPU if present, else CPU), cpu, cuda or cuda:N")
    p.add_argument(
        "--limit", type=positive_int, default=None, metavar="N", help="use the first N samples and references"
    )
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="also write the result as JSON here")
    p.set_defaults(func=run_fid)


def images_from_array(array: np.ndarray, source: str) -> torch.Tensor:
    """uint8 [0, 255] or float [-1, 1] array, [N,H,W], [N,H,W,C] or [N,C,H,W] → float32 [N,C,H,W], [-1, 1]."""
    if array.ndim == 3:
        array = array[:, None]
    elif array.ndim == 4 and array.shape[-1] in (1, 3):
        array = array.transpose(0, 3, 1, 2)
    elif not (array.ndim == 4 and array.shape[1] in (1, 3)):
        raise FastdiffError(f"{source}: images must be [N,H,W], [N,H,W,C] or [N,C,H,W], got {array.shape}")
    if array.shape[0] == 0:
        raise FastdiffError(f"{source}: no images")
    if array.dtype == np.uint8:
        return torch.from_numpy(np.ascontiguousarray(array)).float().div_(127.5).sub_(1.0)
    if not np.issubdtype(array.dtype, np.floating):
        raise FastdiffError(f"{source}: images must be uint8 or float, got {array.dtype}")
    images = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    if not torch.isfinite(images).all():
        raise FastdiffError(f"{source}: images contain NaN or infinity")
    low, high = float(images.min()), float(images.max())
    if low < -1.001 or high > 1.001:
        raise FastdiffError(f"{source}: float images must be in [-1, 1], got [{low:.3g}, {high:.3g}]")
    return images.clamp_(-1, 1)


def read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError) as exc:
        raise FastdiffError(f"cannot read {path}: {exc}") from exc


def npz_images(arrays: dict[str, np.ndarray], path: Path) -> np.ndarray:
    if "images" in arrays:
        return arrays["images"]
    if len(arrays) == 1:
        return next(iter(arrays.values()))
    raise FastdiffError(f"{path}: expected an 'images' array or a single array, found {sorted(arrays)}")


def png_folder_images(folder: Path) -> torch.Tensor:
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and not p.name.startswith("."))
    if not files:
        shards = sorted(p for p in folder.glob("*.npz") if not p.name.startswith("."))
        if shards:  # ``fastdiff generate --format npz``: shards of images, read in name (seed) order
            return torch.cat([images_from_array(npz_images(read_npz(s), s), str(s)) for s in shards])
        raise FastdiffError(f"no .png or .npz files in {folder}")
    arrays = []
    for file in files:
        try:
            with Image.open(file) as img:
                gray = img.mode in ("1", "L", "LA", "I", "I;16")
                arrays.append(np.asarray(img.convert("L" if gray else "RGB")))
        except OSError as exc:
            raise FastdiffError(f"cannot read image {file}: {exc}") from exc
        if arrays[-1].shape != arrays[0].shape:
            raise FastdiffError(f"{file} is {arrays[-1].shape}, but {files[0].name} is {arrays[0].shape}")
    return images_from_array(np.stack(arrays), str(folder))


def load_images(path: Path, limit: int | None = None) -> torch.Tensor:
    """Images float32 [N, C, H, W] in [-1, 1] from a PNG folder or an .npz (first ``limit`` only)."""
    if path.is_dir():
        images = png_folder_images(path)
    elif path.suffix == ".npz" and path.is_file():
        images = images_from_array(npz_images(read_npz(path), path), str(path))
    elif not path.exists():
        raise FastdiffError(f"images not found: {path}")
    else:
        raise FastdiffError(f"{path}: expected a folder of PNGs or an .npz file")
    return images[:limit] if limit is not None else images


def to_fmnist_input(images: torch.Tensor, source: str) -> torch.Tensor:
    """[N, 1 or 3, 28 or 32, same] in [-1, 1] → gray [N, 1, 32, 32] (28×28 padded with -1, i.e. black)."""
    if images.shape[1] == 3:
        weights = torch.tensor(LUMA, dtype=images.dtype).view(1, 3, 1, 1)
        images = (images * weights).sum(1, keepdim=True)
    size = tuple(images.shape[2:])
    if size == (28, 28):
        return F.pad(images, (2, 2, 2, 2), value=-1.0)
    if size != (32, 32):
        raise FastdiffError(f"{source}: fd-fmnist needs 28x28 or 32x32 images, got {size[0]}x{size[1]}")
    return images


@functools.lru_cache(maxsize=4)
def inception_fmnist_stats(
    split: str, data_dir: Path | None, limit: int | None, pad_to: int, weights: Path, device: str, batch: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """(mu, sigma, count) of Inception features of Fashion-MNIST ``split``; kept in memory only."""
    from fastdiff.data import load_fashion_mnist

    images, _ = load_fashion_mnist(split, data_dir, pad_to=pad_to)
    images = images[:limit] if limit is not None else images
    mu, sigma = feature_stats(inception_features(load_inception(weights, device), images, batch))
    return mu, sigma, images.shape[0]


def compute_fid(args: argparse.Namespace) -> dict:
    """The FD of args.samples against args.ref as a JSON-ready record."""
    device = str(resolve_device(args.device))
    inception = args.metric == "inception"
    batch = args.batch or (50 if inception else 500)
    samples = load_images(args.samples, args.limit)
    if samples.shape[0] < 2:
        raise FastdiffError(f"{args.samples}: need at least 2 images, got {samples.shape[0]}")
    if inception:
        model = load_inception(args.inception, device)

        def features(images: torch.Tensor) -> torch.Tensor:
            return inception_features(model, images, batch)
    else:
        classifier = cached_classifier(args.classifier, device)
        samples = to_fmnist_input(samples, str(args.samples))

        def features(images: torch.Tensor) -> torch.Tensor:
            return classifier_features(classifier, to_fmnist_input(images, str(args.ref)), batch)

    mu, sigma = feature_stats(features(samples))
    if args.ref in FMNIST_REFS:
        split = FMNIST_REFS[args.ref]
        if inception:
            pad_to = 28 if samples.shape[-1] == 28 else 32
            mu_ref, sigma_ref, num_ref = inception_fmnist_stats(
                split, args.data, args.limit, pad_to, args.inception, device, batch
            )
        else:
            mu_ref, sigma_ref, num_ref = fmnist_reference_stats(split, args.data, args.limit, args.classifier, device)
    else:
        ref_path = Path(args.ref)
        arrays = read_npz(ref_path) if ref_path.suffix == ".npz" and ref_path.is_file() else {}
        if "mu" in arrays and "sigma" in arrays:
            mu_ref, sigma_ref, num_ref = arrays["mu"], arrays["sigma"], None
        else:
            ref_images = load_images(ref_path, args.limit)
            mu_ref, sigma_ref = feature_stats(features(ref_images))
            num_ref = ref_images.shape[0]
    if samples.shape[0] < mu.shape[0]:
        log.warning(
            "%d samples < %d feature dims: the covariance is singular and the distance biased high",
            samples.shape[0],
            mu.shape[0],
        )
    return {
        "metric": args.metric,
        "value": frechet_distance(mu, sigma, mu_ref, sigma_ref),
        "samples": str(args.samples),
        "num_samples": samples.shape[0],
        "reference": str(args.ref),
        "num_reference": num_ref,
    }


def run_fid(args: argparse.Namespace) -> int:
    """Print the Fréchet distance (a bare number on stdout); with --json also write the record there."""
    if args.json is not None:
        check_output_location(args.json, "--json")
    start = time.perf_counter()
    record = compute_fid(args)
    record["seconds"] = round(time.perf_counter() - start, 2)
    log.info(
        "%s of %d samples vs %s (%s images): %.4f in %.1f s",
        record["metric"],
        record["num_samples"],
        record["reference"],
        record["num_reference"] if record["num_reference"] is not None else "precomputed",
        record["value"],
        record["seconds"],
    )
    print(f"{record['value']:.4f}")
    if args.json is not None:
        write_text_atomic(args.json, json.dumps(record, indent=2) + "\n")
    return 0
