"""``fastdiff fid``: image loading (PNG folder, npz layouts), FD against a direct computation, errors."""

import argparse
import json

import numpy as np
import pytest
import torch
from PIL import Image

from fastdiff.data import DEFAULT_DATA_DIR, load_fashion_mnist
from fastdiff.errors import FastdiffError
from fastdiff.quality.classifier import (
    BUNDLED_CLASSIFIER_DIR,
    ClassifierConfig,
    FashionClassifier,
    save_classifier,
)
from fastdiff.quality.cli import load_images, register
from fastdiff.quality.frechet import frechet_distance_features

HAVE_FMNIST = (DEFAULT_DATA_DIR / "t10k-images-idx3-ubyte.gz").is_file()
HAVE_BUNDLED = (BUNDLED_CLASSIFIER_DIR / "model.safetensors").is_file()


def parse(argv):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def run(argv, capsys):
    args = parse(argv)
    assert args.func(args) == 0
    return float(capsys.readouterr().out.strip())


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    """A small random classifier, so the tests do not depend on the bundled weights."""
    torch.manual_seed(5)
    model = FashionClassifier(ClassifierConfig(channels=(8, 12), feature_dim=16))
    model.train()
    model(torch.rand(16, 1, 32, 32) * 2 - 1)
    path = tmp_path_factory.mktemp("clf")
    save_classifier(model, path, {})
    return path


def gray_set(seed, n=40, size=28):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, size, size), dtype=np.uint8)


def direct_fd(classifier_dir, a_uint8, b_uint8):
    from fastdiff.quality.classifier import classifier_features, load_classifier

    model = load_classifier(classifier_dir)

    def prep(a):
        x = torch.from_numpy(a).float()[:, None] / 127.5 - 1
        return torch.nn.functional.pad(x, (2, 2, 2, 2), value=-1.0) if a.shape[-1] == 28 else x

    return frechet_distance_features(
        classifier_features(model, prep(a_uint8)), classifier_features(model, prep(b_uint8))
    )


def test_npz_vs_npz_matches_direct_computation(tmp_path, classifier_dir, capsys):
    a, b = gray_set(1), gray_set(2, n=33)
    np.savez(tmp_path / "a.npz", images=a)
    np.savez(tmp_path / "b.npz", b)
    before = sorted(tmp_path.iterdir())
    got = run(
        [
            "fid",
            str(tmp_path / "a.npz"),
            "--ref",
            str(tmp_path / "b.npz"),
            "--classifier",
            str(classifier_dir),
            "--device",
            "cpu",
        ],
        capsys,
    )
    expected = direct_fd(classifier_dir, a, b)
    assert got == pytest.approx(expected, rel=1e-3, abs=1e-4) and expected > 0
    assert sorted(tmp_path.iterdir()) == before  # writes nothing without --json


def test_layouts_and_png_folder_load_the_same_images(tmp_path):
    a = gray_set(3, n=5, size=32)
    expected = torch.from_numpy(a).float()[:, None] / 127.5 - 1
    np.savez(tmp_path / "hw.npz", images=a)
    np.savez(tmp_path / "hwc.npz", images=a[..., None])
    np.savez(tmp_path / "float_nchw.npz", images=expected.numpy())
    folder = tmp_path / "pngs"
    folder.mkdir()
    for k, img in enumerate(a):
        Image.fromarray(img, mode="L").save(folder / f"{k:03d}.png")
    for source in ("hw.npz", "hwc.npz", "float_nchw.npz", "pngs"):
        torch.testing.assert_close(load_images(tmp_path / source), expected, rtol=0, atol=1e-6, msg=source)
    assert load_images(folder, limit=2).shape == (2, 1, 32, 32)
    rgb = np.repeat(a[..., None], 3, axis=-1)
    np.savez(tmp_path / "rgb.npz", images=rgb)
    assert load_images(tmp_path / "rgb.npz").shape == (5, 3, 32, 32)


def test_rgb_input_is_turned_gray(tmp_path, classifier_dir, capsys):
    a, b = gray_set(4, size=32), gray_set(5, size=32)
    np.savez(tmp_path / "rgb.npz", images=np.repeat(a[..., None], 3, axis=-1))
    np.savez(tmp_path / "gray.npz", images=a)
    np.savez(tmp_path / "ref.npz", images=b)
    common = ["--ref", str(tmp_path / "ref.npz"), "--classifier", str(classifier_dir), "--device", "cpu"]
    rgb = run(["fid", str(tmp_path / "rgb.npz"), *common], capsys)
    gray = run(["fid", str(tmp_path / "gray.npz"), *common], capsys)
    assert rgb == pytest.approx(gray, rel=1e-3, abs=1e-4)


def test_json_record_and_precomputed_stats_ref(tmp_path, classifier_dir, capsys):
    from fastdiff.quality.classifier import classifier_features, load_classifier
    from fastdiff.quality.frechet import feature_stats

    a, b = gray_set(6), gray_set(7)
    np.savez(tmp_path / "a.npz", images=a)
    ref = torch.nn.functional.pad(torch.from_numpy(b).float()[:, None] / 127.5 - 1, (2, 2, 2, 2), value=-1.0)
    mu, sigma = feature_stats(classifier_features(load_classifier(classifier_dir), ref))
    np.savez(tmp_path / "stats.npz", mu=mu, sigma=sigma)
    out = tmp_path / "res" / "fid.json"
    got = run(
        [
            "fid",
            str(tmp_path / "a.npz"),
            "--ref",
            str(tmp_path / "stats.npz"),
            "--classifier",
            str(classifier_dir),
            "--device",
            "cpu",
            "--json",
            str(out),
        ],
        capsys,
    )
    record = json.loads(out.read_text())
    assert record["value"] == pytest.approx(direct_fd(classifier_dir, a, b), rel=1e-9)
    assert got == pytest.approx(record["value"], abs=1e-4)
    assert record["metric"] == "fd-fmnist" and record["num_samples"] == 40 and record["num_reference"] is None


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing.npz", "not found"),
        (lambda p: (np.savez(p / "x.npz", images=gray_set(0, size=30)), p / "x.npz")[1], "28x28 or 32x32"),
        (lambda p: (np.savez(p / "x.npz", images=np.full((3, 32, 32), 2.0)), p / "x.npz")[1], r"\[-1, 1\]"),
        (lambda p: (np.savez(p / "x.npz", a=gray_set(0), b=gray_set(1)), p / "x.npz")[1], "'images' array"),
        (
            lambda p: (np.savez(p / "x.npz", images=np.zeros((3, 5, 32, 32))), p / "x.npz")[1],
            "layout|must be",
        ),
        (lambda p: (p / "empty").mkdir() or p / "empty", "no .png"),
    ],
)
def test_bad_samples(tmp_path, classifier_dir, make, message):
    path = make(tmp_path)
    np.savez(tmp_path / "ref.npz", images=gray_set(9))
    args = parse(["fid", str(path), "--ref", str(tmp_path / "ref.npz"), "--classifier", str(classifier_dir)])
    with pytest.raises(FastdiffError, match=message):
        args.func(args)


def test_inception_needs_weights(tmp_path):
    np.savez(tmp_path / "a.npz", images=gray_set(0))
    args = parse(["fid", str(tmp_path / "a.npz"), "--metric", "inception", "--device", "cpu"])
    with pytest.raises(FastdiffError, match="pass --inception PATH"):
        args.func(args)


@pytest.mark.skipif(not (HAVE_FMNIST and HAVE_BUNDLED), reason="needs Fashion-MNIST and the bundled classifier")
def test_real_test_split_with_limit(tmp_path, capsys):
    test_x, _ = load_fashion_mnist("test", pad_to=28)
    same = ((test_x[:300, 0] + 1) * 127.5).round().to(torch.uint8).numpy()
    np.savez(tmp_path / "same.npz", images=same)
    assert run(["fid", str(tmp_path / "same.npz"), "--limit", "300", "--device", "cpu"], capsys) < 1e-3
    noise = gray_set(8, n=300)
    np.savez(tmp_path / "noise.npz", images=noise)
    assert run(["fid", str(tmp_path / "noise.npz"), "--limit", "300", "--device", "cpu"], capsys) > 10
