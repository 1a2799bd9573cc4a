"""The CLI and the Pipeline end to end on a tiny saved model: outputs, seeds, and one-line errors (exit 2)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import stat
import subprocess
import sys

import numpy as np
import pytest
import torch

import fastdiff
import fastdiff.bench.runner
from fastdiff import cli
from fastdiff.cli import build_parser, main
from fastdiff.errors import FastdiffError
from fastdiff.images import make_grid
from fastdiff.pipelines import Pipeline


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    """A tiny diffusers UNet2DModel (odd size 12, 1 channel) saved by diffusers itself, with a scheduler config."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=12,
        in_channels=1,
        out_channels=1,
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )
    root = tmp_path_factory.mktemp("tiny")
    unet.save_pretrained(root / "unet")
    diffusers.DDPMScheduler(num_train_timesteps=1000).save_pretrained(root / "scheduler")
    return root


def run_cli(*argv: str) -> int:
    return main(list(argv))


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli("sample", "--help")
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--model",
        "--sampler",
        "--steps",
        "--batch",
        "--seed",
        "--dtype",
        "--device",
        "--out",
        "--save-dir",
    ):
        assert flag in text
    with pytest.raises(SystemExit):
        run_cli("--help")
    top = capsys.readouterr().out
    for command in ("sample", "train", "fid"):
        assert command in top


def test_sample_writes_grid_and_images(tiny_model_dir, tmp_path):
    out = tmp_path / "grid.png"
    rc = run_cli(
        "sample", "--model", str(tiny_model_dir), "--sampler", "ddim", "--steps", "4", "--batch", "3",
        "--seed", "5", "--device", "cpu", "--out", str(out), "--save-dir", str(tmp_path / "each"), "--no-progress",
    )  # fmt: skip
    assert rc == 0 and out.is_file()
    files = sorted(p.name for p in (tmp_path / "each").iterdir())
    assert files == ["000005.png", "000006.png", "000007.png"]
    assert not list(tmp_path.glob(".*.png"))  # no temporary files left


@pytest.mark.parametrize("sampler", ["ddpm", "ddim", "dpmsolver++"])
def test_image_depends_on_its_seed_only(tiny_model_dir, sampler):
    pipe = Pipeline.from_pretrained(tiny_model_dir, device="cpu", sampler=sampler, steps=5)
    eta = 0.5 if sampler == "ddim" else 0.0
    batch = pipe(batch_size=3, seeds=[11, 12, 13], eta=eta, output_type="tensor", progress=False)
    single = pipe(batch_size=1, seeds=[12], eta=eta, output_type="tensor", progress=False)
    torch.testing.assert_close(batch[1:2], single, atol=1e-5, rtol=0)
    assert not torch.allclose(batch[0], batch[1])
    again = pipe(batch_size=3, seeds=[11, 12, 13], eta=eta, output_type="tensor", progress=False)
    assert torch.equal(batch, again)


def test_output_types(tiny_model_dir):
    pipe = Pipeline.from_pretrained(tiny_model_dir, device="cpu", steps=2)
    arr = pipe(batch_size=2, output_type="np", progress=False)
    assert arr.shape == (2, 12, 12, 1) and arr.dtype == np.float32 and 0 <= arr.min() and arr.max() <= 1
    pil = pipe(batch_size=2, output_type="pil", progress=False)
    assert len(pil) == 2 and pil[0].size == (12, 12)


def test_latents_override_and_shape_error(tiny_model_dir):
    pipe = Pipeline.from_pretrained(tiny_model_dir, device="cpu", steps=2)
    latents = torch.randn(2, 1, 12, 12)
    a = pipe(batch_size=2, latents=latents, output_type="tensor", progress=False)
    b = pipe(batch_size=2, latents=latents, seeds=[7, 8], output_type="tensor", progress=False)
    torch.testing.assert_close(a, b)  # DDIM eta=0: x_T alone fixes the result
    with pytest.raises(FastdiffError, match="latents have shape"):
        pipe(batch_size=2, latents=torch.randn(2, 1, 11, 12), progress=False)


BAD_INPUTS = [
    (["--model", "/no/such/model"], "not found"),
    (["--steps", "0"], "must be positive"),
    (["--batch", "-2"], "must be positive"),
    (["--sampler", "no-such-sampler"], "invalid choice"),
    (["--dtype", "fp64"], "invalid choice"),
    (["--device", "tpu"], "device"),
    (["--model", "no-such-preset"], "unknown model"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_exits_2_with_one_line_and_no_file(tiny_model_dir, tmp_path, extra, message):
    out = tmp_path / "grid.png"
    argv = [
        "sample",
        "--model",
        str(tiny_model_dir),
        "--steps",
        "2",
        "--batch",
        "1",
        "--out",
        str(out),
        *extra,
    ]
    proc = subprocess.run([sys.executable, "-m", "fastdiff.cli", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    err_lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(err_lines) == 1 and message in err_lines[0], proc.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_gpu_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "grid.png"
    rc = run_cli("sample", "--model", str(tiny_model_dir), "--device", "cuda", "--out", str(out))
    assert rc == 2 and not out.exists()
    assert "no CUDA GPU" in capsys.readouterr().err


@pytest.mark.slow
def test_directory_without_weights(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text('{"_class_name": "UNet2DModel"}')
    rc = run_cli("sample", "--model", str(tmp_path / "m"), "--out", str(tmp_path / "g.png"))
    assert rc == 2 and "no weights" in capsys.readouterr().err
    assert not (tmp_path / "g.png").exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        run_cli("--version")
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"fastdiff {fastdiff.__version__}\n"
    assert fastdiff.__version__ == importlib.metadata.version("fastdiff")  # one version, the package's


@pytest.mark.parametrize(
    "command", ["sample", "generate", "train", "fid", "bench", "profile", "serve", "loadtest", "export"]
)
def test_help_names_each_default_once(command):
    """ "(default: X)" once for every flag that has a default; never "(default: None)", never twice."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    parser = commands[command].complete()  # the flags are added on first use
    assert len(parser._actions) > 3
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help in (None, argparse.SUPPRESS):
            continue
        text = formatter._expand_help(action)
        assert text.count("(default") <= 1, text
        assert "(default: None)" not in text and "(default: False)" not in text, text
        if action.default not in (None, False, argparse.SUPPRESS) and not action.required:
            assert f"(default: {action.default})" in text, text


def test_save_dir_help_names_the_files_it_writes(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        run_cli("sample", "--help")
    example = re.search(r"seed (\d+): (\d+\.png)", " ".join(capsys.readouterr().out.split()))
    assert example, "the --save-dir help gives an example file name"
    seed, name = example.groups()
    rc = run_cli("sample", "--model", str(tiny_model_dir), "--steps", "2", "--batch", "1", "--seed", seed,
                 "--device", "cpu", "--out", str(tmp_path / "g.png"), "--save-dir", str(tmp_path / "each"),
                 "--no-progress")  # fmt: skip
    assert rc == 0 and os.listdir(tmp_path / "each") == [name]


def test_output_files_have_the_umask_mode(tiny_model_dir, tmp_path, umask):
    each = tmp_path / "each"
    rc = run_cli("sample", "--model", str(tiny_model_dir), "--steps", "2", "--batch", "2", "--device", "cpu",
                 "--out", str(tmp_path / "grid.png"), "--save-dir", str(each), "--no-progress")  # fmt: skip
    assert rc == 0
    files = [tmp_path / "grid.png", *sorted(each.iterdir())]
    assert len(files) == 3
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o666 & ~umask}  # 0o644 / 0o640, not mkstemp's 0o600


def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1, err
    return err[0]


def run_expecting_error(*argv: str) -> int:
    """``main(argv)``; an argparse error (SystemExit) counts as its exit code."""
    try:
        return run_cli(*argv)
    except SystemExit as exc:
        return int(exc.code)


def test_output_location_checked_before_any_work(tiny_model_dir, tmp_path, capsys, monkeypatch):
    (tmp_path / "file").write_text("x")

    def no_work(*args, **kwargs):
        raise AssertionError("the model was loaded before the output locations were checked")

    monkeypatch.setattr(fastdiff.pipelines.unconditional.Pipeline, "from_pretrained", no_work)
    cases = [
        (["--out", str(tmp_path / "file" / "grid.png")], "--out"),
        (["--out", str(tmp_path / "file" / "sub" / "grid.png")], "--out"),
        (["--out", str(tmp_path / "g.png"), "--save-dir", str(tmp_path / "file")], "--save-dir"),
        (["--out", str(tmp_path / "g.png"), "--save-dir", str(tmp_path / "file" / "each")], "--save-dir"),
    ]
    for flags, flag in cases:
        rc = run_cli("sample", "--model", str(tiny_model_dir), "--steps", "2", "--batch", "1", *flags)
        assert rc == 2
        line = one_error_line(capsys)
        assert line.startswith(f"fastdiff: error: {flag} ") and "is a file, not a folder" in line, line
    assert os.listdir(tmp_path) == ["file"] and (tmp_path / "file").read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_output_folder_is_refused_before_any_work(tiny_model_dir, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        rc = run_cli("sample", "--model", str(tiny_model_dir), "--steps", "2", "--out", str(locked / "grid.png"))
        assert rc == 2 and "permission denied" in one_error_line(capsys)
        assert not os.listdir(locked)
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("nrow", ["0", "-1"])
def test_nrow_must_be_positive(tiny_model_dir, tmp_path, capsys, nrow):
    rc = run_expecting_error("sample", "--model", str(tiny_model_dir), "--out", str(tmp_path / "g.png"), "--nrow", nrow)
    assert rc == 2 and "--nrow: must be positive" in one_error_line(capsys)
    assert not os.listdir(tmp_path)


@pytest.mark.skipif(torch.cuda.device_count() > 1, reason="needs a machine without a second GPU")
def test_missing_gpu_is_named(tiny_model_dir, tmp_path, capsys):
    rc = run_cli("sample", "--model", str(tiny_model_dir), "--device", "cuda:1", "--out", str(tmp_path / "g.png"))
    assert rc == 2 and "cuda:1" in one_error_line(capsys)
    assert not os.listdir(tmp_path)


def test_batch_that_cannot_fit_is_refused_up_front(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "g.png"
    rc = run_cli("sample", "--model", str(tiny_model_dir), "--steps", "1", "--device", "cpu", "--out", str(out),
                 "--batch", "1000000000")  # fmt: skip
    line = one_error_line(capsys)  # 10^9 images of 1x12x12: terabytes on any machine
    assert rc == 2 and "--batch 1000000000 cannot fit in memory" in line and not out.exists()


def test_batch_bound_is_the_largest_that_fits(monkeypatch):
    monkeypatch.setattr(cli, "memory_bytes", lambda device: 50 * 2**20)
    cpu = torch.device("cpu")
    with pytest.raises(FastdiffError, match=r"at most 711 images could fit"):
        cli.check_batch_fits(1000, (1, 12, 12), cpu)  # 4 bytes * 144 * 128 copies = 73728 per image; 52428800 / 73728
    cli.check_batch_fits(711, (1, 12, 12), cpu)
    with pytest.raises(FastdiffError, match="cannot fit"):
        cli.check_batch_fits(712, (1, 12, 12), cpu)


def test_cache_interval_flag(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """--cache-interval 2: the grid holds the Pipeline's step-cached images (not the uncached ones) and its PNG
    records the interval; a bad interval is a one-line error before any loading, in sample and bench."""
    from PIL import Image

    out = tmp_path / "grid.png"
    rc = run_cli("sample", "--model", str(tiny_model_dir), "--steps", "3", "--batch", "2", "--seed", "4",
                 "--device", "cpu", "--cache-interval", "2", "--out", str(out), "--no-progress")  # fmt: skip
    assert rc == 0
    with Image.open(out) as image:
        assert json.loads(image.text["parameters"])["cache_interval"] == 2
        grid = np.asarray(image)
    pipe = Pipeline.from_pretrained(tiny_model_dir, device="cpu", steps=3)
    cached, plain = (make_grid(pipe(batch_size=2, seeds=4, progress=False, cache_interval=n)) for n in (2, 1))
    assert np.array_equal(grid, np.asarray(cached)) and not np.array_equal(grid, np.asarray(plain))

    def no_work(*args, **kwargs):
        raise AssertionError("the model was loaded before --cache-interval was checked")

    monkeypatch.setattr(fastdiff.pipelines.unconditional.Pipeline, "from_pretrained", no_work)
    monkeypatch.setattr(fastdiff.bench.runner, "run_bench", no_work)
    expected = "fastdiff: error: --cache-interval must be an integer >= 1 (1: no step caching), got 0"
    for command in ("sample", "bench"):
        flags = ["--out", str(tmp_path / "bad.png")] if command == "sample" else ["--out-dir", str(tmp_path / "b")]
        rc = run_expecting_error(command, "--model", str(tiny_model_dir), "--cache-interval", "0", *flags)
        assert rc == 2 and one_error_line(capsys) == expected
    assert os.listdir(tmp_path) == ["grid.png"]
