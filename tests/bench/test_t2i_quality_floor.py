"""benchmarks/t2i_quality.py --floor: what no sampler of the bundled text-to-image model can beat."""

from __future__ import annotations

import json

import pytest

from fastdiff.errors import FastdiffError

pytestmark = pytest.mark.slow


def test_quality_script_measures_the_floors(tmp_path):
    """--floor: FD-FMNIST of real training images and of their VAE reconstructions, and the classifier's accuracy
    on the real test set (the bundled classifier's own record of it)."""
    import importlib.util
    from pathlib import Path

    from fastdiff.data import DEFAULT_DATA_DIR

    pytest.importorskip("transformers")
    if not (DEFAULT_DATA_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip("needs Fashion-MNIST (make data)")
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("t2i_quality", root / "benchmarks" / "t2i_quality.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "floor.json"
    assert module.main(["--out", str(out), "--floor", "600", "--systems", "", "--device", "cpu"]) == 0
    result = json.loads(out.read_text())
    floor = result["floor"]
    assert result["results"] == [] and floor["images"] == 600
    recorded = json.loads((root / "src/fastdiff/weights/fmnist-classifier/config.json").read_text())["test_accuracy"]
    assert floor["classifier_accuracy_real_test"] == pytest.approx(recorded, abs=1e-4)
    # 600 images give both distances the same small-sample bias (about 4 here); the bundled VAE's reconstructions
    # sit within 1 of the real images they reconstruct (its floor over 10,000 images: 0.45 against 0.31)
    assert floor["fd_fmnist_real_train"] > 0 and floor["fd_fmnist_vae_reconstructions"] > 0
    assert abs(floor["fd_fmnist_vae_reconstructions"] - floor["fd_fmnist_real_train"]) < 1.0
    with pytest.raises(FastdiffError, match="--floor"):
        module.main(["--out", str(tmp_path / "x.json"), "--floor", "-1"])
