"""A small Fashion-MNIST CNN whose penultimate features give FD-FMNIST (an FID-like distance for 32×32 gray).

The bundled weights live in ``fastdiff/weights/fmnist-classifier/`` (config.json + model.safetensors).
Retrain them with ``python -m fastdiff.quality.classifier --out DIR``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fastdiff.errors import FastdiffError
from fastdiff.quality.frechet import feature_stats, frechet_distance

log = logging.getLogger(__name__)

BUNDLED_CLASSIFIER_DIR = Path(__file__).resolve().parent.parent / "weights" / "fmnist-classifier"
TRAINING_KEYS = ("test_accuracy", "epochs", "seed", "batch_size", "lr", "train_seconds")
"""Keys config.json may hold besides the ClassifierConfig fields: how the weights were trained."""


@dataclass(frozen=True)
class ClassifierConfig:
    """Conv stages (3×3 conv, BatchNorm, ReLU; ``convs_per_stage`` of them, then 2×2 max-pool), a linear
    ``feature_dim`` layer with ReLU (the FD features), and a linear classifier."""

    channels: tuple[int, ...] = (16, 32, 64)
    convs_per_stage: int = 1
    feature_dim: int = 128
    num_classes: int = 10
    image_size: int = 32
    dropout: float = 0.2

    @classmethod
    def from_dict(cls, data: dict) -> ClassifierConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields - set(TRAINING_KEYS))
        if unknown:
            raise FastdiffError(f"unknown classifier config key {unknown[0]!r}")
        values = {k: v for k, v in data.items() if k in fields}
        if "channels" in values:
            values["channels"] = tuple(values["channels"])
        return cls(**values)


class FashionClassifier(nn.Module):
    """Input [N, 1, S, S] in [-1, 1]; ``features`` gives [N, feature_dim], ``forward`` the class logits."""

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        self.config = config
        stages: list[nn.Module] = []
        in_ch = 1
        for out_ch in config.channels:
            for _ in range(config.convs_per_stage):
                stages += [
                    nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False),
                    nn.BatchNorm2d(out_ch),
                    nn.ReLU(),
                ]
                in_ch = out_ch
            stages.append(nn.MaxPool2d(2))
        self.stages = nn.Sequential(*stages)
        side = config.image_size // 2 ** len(config.channels)
        if side < 1:
            raise FastdiffError(f"image_size {config.image_size} is too small for {len(config.channels)} stages")
        self.to_features = nn.Linear(in_ch * side * side, config.feature_dim)
        self.dropout = nn.Dropout(config.dropout)
        self.head = nn.Linear(config.feature_dim, config.num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.to_features(self.stages(x).flatten(1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.features(x)))


def check_images(images: torch.Tensor, image_size: int) -> None:
    """FastdiffError unless images are [N, 1, image_size, image_size] with finite values in [-1, 1]."""
    if images.dim() != 4 or images.shape[1] != 1 or images.shape[2:] != (image_size, image_size):
        raise FastdiffError(
            f"classifier needs gray images [N, 1, {image_size}, {image_size}], got {tuple(images.shape)}"
        )
    if images.numel() == 0:
        raise FastdiffError("no images given")
    if not torch.isfinite(images).all():
        raise FastdiffError("images contain NaN or infinity")
    low, high = float(images.min()), float(images.max())
    if low < -1.001 or high > 1.001:
        raise FastdiffError(f"images must be in [-1, 1], got values in [{low:.3g}, {high:.3g}]")


@torch.no_grad()
def classifier_features(model: FashionClassifier, images: torch.Tensor, batch_size: int = 500) -> torch.Tensor:
    """Penultimate features float32 [N, feature_dim] on the CPU, computed in batches on the model's device."""
    check_images(images, model.config.image_size)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out = [
        model.features(images[i : i + batch_size].to(device, torch.float32)).float().cpu()
        for i in range(0, images.shape[0], batch_size)
    ]
    model.train(was_training)
    return torch.cat(out)


@torch.no_grad()
def classifier_accuracy(
    model: FashionClassifier, images: torch.Tensor, labels: torch.Tensor, batch_size: int = 1000
) -> float:
    """Top-1 accuracy of ``model`` (eval mode) on labelled images."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    for i in range(0, images.shape[0], batch_size):
        logits = model(images[i : i + batch_size].to(device))
        correct += int((logits.argmax(1).cpu() == labels[i : i + batch_size]).sum())
    model.train(was_training)
    return correct / images.shape[0]


def augment(images: torch.Tensor, generator: torch.Generator, max_shift: int = 2) -> torch.Tensor:
    """Random horizontal flips and random shifts of up to ``max_shift`` pixels (border filled with -1)."""
    n, _, h, w = images.shape
    flip = torch.rand(n, generator=generator, device="cpu") < 0.5
    images = torch.where(flip.to(images.device)[:, None, None, None], images.flip(3), images)
    padded = F.pad(images, (max_shift,) * 4, value=-1.0)
    dy = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator).to(images.device)
    dx = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator).to(images.device)
    rows = (dy[:, None] + torch.arange(h, device=images.device))[:, :, None]
    cols = (dx[:, None] + torch.arange(w, device=images.device))[:, None, :]
    batch = torch.arange(n, device=images.device)[:, None, None]
    return padded[batch, 0, rows, cols].unsqueeze(1)


def save_classifier(model: FashionClassifier, out_dir: Path, training: dict) -> None:
    """Write config.json (config + training record) and model.safetensors (fp32) into ``out_dir``."""
    from safetensors.torch import save

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    # serialised in memory and written as a plain file: save_file would create it readable by its owner only
    (out_dir / "model.safetensors").write_bytes(save(state))
    config = dataclasses.asdict(model.config)
    config["channels"] = list(config["channels"])
    (out_dir / "config.json").write_text(json.dumps({**config, **training}, indent=2) + "\n")


def load_classifier(path: Path | None = None, device: str | torch.device = "cpu") -> FashionClassifier:
    """The classifier saved in ``path`` (default: the bundled one), in eval mode on ``device``."""
    from fastdiff.models.weights import load_state_dict_checked, read_state_dict

    root = Path(path) if path is not None else BUNDLED_CLASSIFIER_DIR
    config_path, weights_path = root / "config.json", root / "model.safetensors"
    for needed in (config_path, weights_path):
        if not needed.is_file():
            raise FastdiffError(f"classifier file not found: {needed}")
    try:
        config = ClassifierConfig.from_dict(json.loads(config_path.read_text()))
    except (json.JSONDecodeError, TypeError) as exc:
        raise FastdiffError(f"cannot read classifier config {config_path}: {exc}") from exc
    model = FashionClassifier(config)
    load_state_dict_checked(model, read_state_dict(weights_path), str(weights_path))
    return model.to(device).eval()


@functools.lru_cache(maxsize=4)
def cached_classifier(path: Path | None, device: str) -> FashionClassifier:
    """load_classifier, kept in memory per (path, device)."""
    return load_classifier(path, device)


@functools.lru_cache(maxsize=8)
def fmnist_reference_stats(
    split: str, data_dir: Path | None, limit: int | None, classifier_path: Path | None, device: str
) -> tuple[np.ndarray, np.ndarray, int]:
    """(mu, sigma, count) of the classifier features of the first ``limit`` (default all) Fashion-MNIST
    images of ``split``; kept in memory only, per argument set."""
    from fastdiff.data import load_fashion_mnist

    model = cached_classifier(classifier_path, device)
    images, _ = load_fashion_mnist(split, data_dir, pad_to=model.config.image_size)
    if limit is not None:
        images = images[:limit]
    mu, sigma = feature_stats(classifier_features(model, images))
    log.info("FD-FMNIST reference: %d %s images", images.shape[0], split)
    return mu, sigma, images.shape[0]


def fd_fmnist(
    images: torch.Tensor,
    ref: str = "test",
    *,
    data_dir: Path | None = None,
    classifier_path: Path | None = None,
    device: str | torch.device = "cpu",
    limit: int | None = None,
    batch_size: int = 500,
) -> float:
    """FD-FMNIST: Fréchet distance between classifier features of ``images`` [N, 1, 32, 32] in [-1, 1] and of
    the Fashion-MNIST ``ref`` split ("test" or "train"; first ``limit`` images). Lower is better."""
    device = str(device)
    model = cached_classifier(classifier_path, device)
    features = classifier_features(model, images, batch_size)
    if features.shape[0] < features.shape[1]:
        log.warning(
            "FD-FMNIST from %d images < %d feature dims: singular covariance, the distance is biased high",
            features.shape[0],
            features.shape[1],
        )
    mu_ref, sigma_ref, _ = fmnist_reference_stats(ref, data_dir, limit, classifier_path, device)
    return frechet_distance(*feature_stats(features), mu_ref, sigma_ref)


def train_classifier(
    epochs: int,
    device: str | torch.device,
    data_dir: Path | None,
    out_dir: Path,
    *,
    batch_size: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
    config: ClassifierConfig | None = None,
) -> float:
    """Train on the Fashion-MNIST train split (AdamW, warm-up + cosine LR, flips and shifts), save to
    ``out_dir`` and return the test-split accuracy (also recorded as ``test_accuracy`` in config.json)."""
    from fastdiff.data import load_fashion_mnist

    if epochs < 1:
        raise FastdiffError(f"epochs must be >= 1, got {epochs}")
    config = config or ClassifierConfig()
    train_x, train_y = load_fashion_mnist("train", data_dir, pad_to=config.image_size)
    test_x, test_y = load_fashion_mnist("test", data_dir, pad_to=config.image_size)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = FashionClassifier(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)
    steps_per_epoch = math.ceil(train_x.shape[0] / batch_size)
    total_steps, warmup = epochs * steps_per_epoch, steps_per_epoch // 2

    def lr_factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    start = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(train_x.shape[0], generator=generator)
        total_loss = 0.0
        for i in range(0, order.shape[0], batch_size):
            idx = order[i : i + batch_size]
            x = augment(train_x[idx], generator).to(device)
            loss = F.cross_entropy(model(x), train_y[idx].to(device))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            total_loss += loss.item() * idx.shape[0]
        log.info(
            "classifier epoch %d/%d: train loss %.4f, test accuracy %.4f (%.0f s)",
            epoch + 1,
            epochs,
            total_loss / train_x.shape[0],
            classifier_accuracy(model, test_x, test_y),
            time.perf_counter() - start,
        )
    accuracy = classifier_accuracy(model, test_x, test_y)
    training = {
        "test_accuracy": round(accuracy, 4),
        "epochs": epochs,
        "seed": seed,
        "batch_size": batch_size,
        "lr": lr,
        "train_seconds": round(time.perf_counter() - start, 1),
    }
    save_classifier(model, out_dir, training)
    log.info("saved classifier to %s: test accuracy %.4f", out_dir, accuracy)
    return accuracy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train the Fashion-MNIST classifier used by FD-FMNIST.")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--data", type=Path, default=None, help="Fashion-MNIST idx .gz folder")
    parser.add_argument("--out", type=Path, default=BUNDLED_CLASSIFIER_DIR)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    train_classifier(args.epochs, args.device, args.data, args.out, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
