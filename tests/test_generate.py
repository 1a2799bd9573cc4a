"""``fastdiff generate`` on a tiny saved model (CPU): one process vs ``torchrun`` with gloo, resume after a rank
fails or is killed, manifest checks, errors before sampling, npz shards and ``fastdiff fid`` reading them."""

from __future__ import annotations

import io
import json
import shutil
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchrun_helpers import kill_rank_1_script, torchrun

import fastdiff.generate as generate_module
from fastdiff.cli import main
from fastdiff.generate import npz_bytes
from fastdiff.pipelines import Pipeline
from fastdiff.quality.cli import load_images

diffusers = pytest.importorskip("diffusers")

FIRST_SEED = 3
NUM_IMAGES = 11  # seeds 3..13; batch 2 makes six chunks, the last one of a single seed
SEEDS = range(FIRST_SEED, FIRST_SEED + NUM_IMAGES)
PNG_NAMES = {f"{seed:06d}.png" for seed in SEEDS}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny 1-channel 32x32 diffusers UNet2DModel with its scheduler config, saved by diffusers."""
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=32,
        in_channels=1,
        out_channels=1,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
    )
    root = tmp_path_factory.mktemp("tiny-unet")
    unet.save_pretrained(root / "unet")
    diffusers.DDPMScheduler(num_train_timesteps=1000).save_pretrained(root / "scheduler")
    return root


def generate_argv(model: Path, out_dir: Path, *extra: str) -> list[str]:
    return [
        "generate", "--model", str(model), "--out-dir", str(out_dir), "--num-images", str(NUM_IMAGES),
        "--first-seed", str(FIRST_SEED), "--sampler", "ddpm", "--steps", "3", "--batch", "2", "--device", "cpu",
        "--no-progress", *extra,
    ]  # fmt: skip


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.suffix in (".png", ".npz")}


def mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file() and p.suffix in (".png", ".npz")}


@pytest.fixture(scope="module")
def reference(tiny_model, tmp_path_factory) -> Path:
    """The single-process run, one thread (as each torchrun rank): the files every other run must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(generate_argv(tiny_model, out)) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def test_single_process_writes_each_seed_once(reference, tiny_model):
    names = {p.name for p in reference.iterdir()}
    assert names == PNG_NAMES | {"manifest.json", "summary.json"}  # no temporary files left
    manifest = json.loads((reference / "manifest.json").read_text())
    assert manifest["model_hash"].startswith("sha256:")
    assert (manifest["sampler"], manifest["steps"], manifest["dtype"], manifest["format"]) == ("ddpm", 3, "fp32", "png")
    assert manifest["image_size"] == [32, 32] and manifest["channels"] == 1
    assert manifest["num_images"] == NUM_IMAGES and manifest["seed_ranges"] == [[SEEDS[0], SEEDS[-1]]]
    summary = json.loads((reference / "summary.json").read_text())
    assert summary["written"] == NUM_IMAGES and summary["world_size"] == 1 and summary["already_present"] == 0
    assert summary["ranks"][0]["images"] == NUM_IMAGES and summary["images_per_s"] > 0
    rank = summary["ranks"][0]  # where the sampling thread's time went: queueing units, waiting for their files
    assert rank["queue_seconds"] > 0 and rank["write_wait_seconds"] >= 0
    assert rank["queue_seconds"] + rank["write_wait_seconds"] <= rank["seconds"] + 1e-3
    # seed k's file is the pipeline's image for seed k, in the batch of two it was sampled in
    pipe = Pipeline.from_pretrained(tiny_model, device="cpu", sampler="ddpm", steps=3)
    images = pipe(batch_size=2, seeds=[5, 6], output_type="tensor", progress=False)
    expected = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)[:, 0].numpy()
    for seed, pixels in zip((5, 6), expected, strict=True):
        np.testing.assert_array_equal(np.asarray(Image.open(reference / f"{seed:06d}.png")), pixels)
    assert not np.array_equal(expected[0], expected[1])


@pytest.mark.slow
def test_torchrun_rank_failure_then_rerun_is_identical_to_one_process(reference, tiny_model, tmp_path):
    out = tmp_path / "out"
    (out / "000005.png").mkdir(parents=True)  # a folder where seed 5 goes: rank 1's first chunk cannot be written
    argv = ["-m", "fastdiff.cli", *generate_argv(tiny_model, out)]
    failed = torchrun(*argv)
    assert failed.returncode != 0
    assert "fastdiff: error: rank 1 of 2 failed on seeds 5-6" in failed.stderr, failed.stderr[-3000:]
    assert "run the same command again" in failed.stderr
    before = mtimes(out)
    assert {"000003.png", "000004.png"} <= set(before) and "000013.png" not in before  # stopped half way

    (out / "000005.png").rmdir()
    done = torchrun(*argv)
    assert done.returncode == 0, done.stderr[-3000:]
    assert folder_bytes(out) == folder_bytes(reference)  # byte-identical, nothing more, nothing less
    after = mtimes(out)
    assert all(after[name] == mtime for name, mtime in before.items())  # finished images were not redone
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and len(summary["ranks"]) == 2
    assert summary["already_present"] == len(before) and summary["written"] == NUM_IMAGES - len(before)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_killed_rank_then_single_process_rerun_finishes_identically(reference, tiny_model, tmp_path):
    out = tmp_path / "out"
    script = tmp_path / "kill_rank_1.py"
    script.write_text(kill_rank_1_script("000005.png", "000006.png"))
    killed = torchrun(str(script), *generate_argv(tiny_model, out))
    assert killed.returncode != 0
    before = mtimes(out)
    assert "000005.png" in before and "000006.png" not in before, killed.stderr[-3000:]
    assert len(before) < NUM_IMAGES
    (out / ".000013.png.1a2b3c.tmp").write_bytes(b"\x89PNG half")  # what a write cut by SIGKILL would leave

    assert main(generate_argv(tiny_model, out)) == 0  # one process finishes what two began
    assert folder_bytes(out) == folder_bytes(reference)
    assert all(mtimes(out)[name] == mtime for name, mtime in before.items())
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--steps", "4"], "steps 3 != 4"),
        (["--sampler", "ddim"], "sampler 'ddpm' != 'ddim'"),
        (["--dtype", "bf16"], "dtype 'fp32' != 'bf16'"),
        (["--format", "npz"], "format 'png' != 'npz'"),
    ],
)
def test_manifest_mismatch_is_refused_before_sampling(reference, tiny_model, tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_bytes((reference / "manifest.json").read_bytes())
    argv = generate_argv(tiny_model, out, *extra)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fastdiff: error: ") and message in err[0], err
    assert "use the same settings or another --out-dir" in err[0]
    assert {p.name for p in out.iterdir()} == {"manifest.json"}


def test_other_model_weights_are_refused(reference, tiny_model, tmp_path, monkeypatch, capsys):
    refuse_to_sample(monkeypatch)
    out = shutil.copytree(reference, tmp_path / "out")
    other = shutil.copytree(tiny_model, tmp_path / "other")
    assert main(generate_argv(other, out)) == 0  # the same files in another folder: the same model, all done
    assert json.loads((out / "summary.json").read_text())["written"] == 0
    unet = diffusers.UNet2DModel.from_pretrained(other / "unet")
    with torch.no_grad():
        unet.conv_out.bias.add_(0.1)
    unet.save_pretrained(other / "unet")
    assert main(generate_argv(other, out)) == 2
    assert "model_hash 'sha256:" in capsys.readouterr().err


def refuse_to_sample(monkeypatch):
    def no_sampling(*args, **kwargs):
        raise AssertionError("sampled although the job should have stopped")

    monkeypatch.setattr(Pipeline, "__call__", no_sampling)


@pytest.mark.parametrize("case", ["file", "under-a-file", "images-without-manifest", "disk-full"])
def test_unusable_out_dir_is_an_error_before_sampling(tiny_model, tmp_path, monkeypatch, capsys, case):
    refuse_to_sample(monkeypatch)
    out = tmp_path / "out"
    if case == "file":
        out.write_text("x")
        message = f"--out-dir {out} is a file, not a folder"
    elif case == "under-a-file":
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "out"
        message = f"--out-dir {out}: {tmp_path / 'file'} is a file, not a folder"
    elif case == "images-without-manifest":
        out.mkdir()
        (out / "000001.png").write_bytes(b"")
        message = "holds images but no manifest.json"
    else:
        usage = namedtuple("usage", "total used free")
        monkeypatch.setattr(generate_module.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 5000, 5000))
        message = "not enough free disk"
    assert main(generate_argv(tiny_model, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    if case == "disk-full":
        assert list(out.iterdir()) == []


@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "existing-folder"])
def test_a_model_that_does_not_load_leaves_no_folder(tmp_path, capsys, existing):
    """A load error is one line and exit 2; the folders the job created are removed, one that was there stays."""
    out = tmp_path / "run" / "images"
    if existing:
        out.mkdir(parents=True)
    assert main(generate_argv(tmp_path / "no-such-model", out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model path not found" in err[0], err
    assert out.is_dir() == existing and (tmp_path / "run").exists() == existing
    if existing:
        assert list(out.iterdir()) == []


def test_npz_shards_resume_and_fid_reads_the_folder(reference, tiny_model, tmp_path, capsys):
    out = tmp_path / "npz"
    argv = generate_argv(tiny_model, out, "--format", "npz", "--shard-size", "4")
    assert main(argv) == 0
    shards = sorted(p.name for p in out.glob("*.npz"))
    assert shards == ["000003-000006.npz", "000007-000010.npz", "000011-000013.npz"]
    with np.load(out / shards[1]) as shard:
        assert shard["images"].dtype == np.uint8 and shard["images"].shape == (4, 32, 32, 1)
        np.testing.assert_array_equal(shard["seeds"], [7, 8, 9, 10])
    pngs = np.stack([np.asarray(Image.open(reference / name)) for name in sorted(PNG_NAMES)])
    shard_images = np.concatenate([np.load(out / name)["images"][..., 0] for name in shards])
    # the same seeds as the PNG run; batch composition differs (shards are sampled from their own start)
    assert np.abs(shard_images.astype(int) - pngs.astype(int)).max() <= 1

    first = folder_bytes(out)
    (out / shards[1]).unlink()
    before = mtimes(out)
    assert main(argv) == 0
    assert folder_bytes(out) == first  # the rewritten shard has the same bytes
    assert all(mtimes(out)[name] == mtime for name, mtime in before.items())

    assert main(generate_argv(tiny_model, out, "--format", "npz", "--shard-size", "4", "--num-images", "12")) == 2
    assert "overlaps this run's shards" in capsys.readouterr().err

    torch.testing.assert_close(load_images(out), load_images(reference), atol=2 / 127.5, rtol=0)
    assert main(["fid", str(out), "--ref", str(reference), "--device", "cpu"]) == 0
    assert abs(float(capsys.readouterr().out.strip())) < 1e-2


def test_npz_bytes_are_reproducible_and_load():
    arrays = {"images": np.arange(24, dtype=np.uint8).reshape(2, 3, 4, 1), "seeds": np.array([5, 6])}
    data = npz_bytes(arrays)
    assert npz_bytes(arrays) == data
    with np.load(io.BytesIO(data)) as loaded:
        np.testing.assert_array_equal(loaded["images"], arrays["images"])
        np.testing.assert_array_equal(loaded["seeds"], arrays["seeds"])


def test_random_weight_presets_have_a_model_identity():
    """sd15 / sd21 (random weights from a fixed seed) are named by preset in the manifest, not by a hash of no
    files (which every such folder would share)."""
    from fastdiff.generate import model_hash

    assert model_hash("sd15") == "preset:sd15:random-init-seed-0" != model_hash("sd21")
