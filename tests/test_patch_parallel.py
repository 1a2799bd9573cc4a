"""Patch-parallel (``fastdiff.pipelines.patch_parallel``): the latent's rows split over two processes (gloo on the
CPU) on the bundled text-to-image model. Synchronous exchanges give one process's image up to the order of the
GroupNorm sums; stale ones (DistriFusion) a close image; both ranks always hold the same bytes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastdiff.errors import FastdiffError
from fastdiff.pipelines.patch_parallel import Exchange, check_launch

MODEL = "fashion-mnist-t2i"
PROMPTS = ["a photo of a bag", "a photo of a sandal"]
STEPS = 6
CALL = dict(negative_prompt="a photo of a shirt", guidance_scale=3.0, seeds=[5, 6], steps=STEPS, sampler="dpmsolver++",
            output_type="tensor", progress=False)  # fmt: skip
STALE = {**CALL, "steps": 20, "sampler": "ddim"}
"""Stale exchanges after the default 4 synchronous steps, DDIM 20. Measured on the CPU with the first bundled model
(8x8x4 latents; the bundled model has 16x16x4 latents since, and this test's bounds still hold): 23.7 dB against one
process for these two prompts, 27.7 dB for four others (bag, sandal, coat, sneaker; no negative prompt), where 8
synchronous steps gave 33.9, 2 gave 24.3, DPM-Solver++ 20 after 4 gave 20.9 and DDIM 50 after 4 gave 22.5. The 8x8
latent gave each band 4 rows, and 1 at the lowest level, so most of every band's convolution windows read stale rows."""


def test_launch_checks_are_one_line(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(FastdiffError, match="launch it with torchrun --nproc-per-node N"):
        check_launch()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(FastdiffError, match="2 or more processes, got 1"):
        check_launch()
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert check_launch() == 4
    if not dist.is_initialized():
        with pytest.raises(FastdiffError, match="needs torch.distributed initialised"):
            Exchange(None, 4)


def run_rank(rank: int, init_file: str, out_dir: str) -> None:
    import fastdiff

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        pipe = fastdiff.Pipeline.from_pretrained(MODEL, device="cpu", backend="eager")
        pipe.split_patches(warmup=STEPS)
        torch.save(pipe(PROMPTS, **CALL), os.path.join(out_dir, f"sync-rank{rank}.pt"))
        pipe.split_patches()
        torch.save(pipe(PROMPTS, **STALE), os.path.join(out_dir, f"stale-rank{rank}.pt"))
        with pytest.raises(FastdiffError, match="multiple of 8") as err:  # 40 px: a 20-row latent
            pipe(PROMPTS[0], height=40, width=32, steps=2, output_type="tensor")
        assert "\n" not in str(err.value)
        with pytest.raises(FastdiffError, match="do not combine"):
            pipe.split_guidance()
    finally:
        dist.destroy_process_group()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR of two images in [-1, 1] (peak 2)."""
    return (10 * torch.log10(4 / (a.double() - b.double()).square().mean())).item()


@pytest.mark.slow
def test_two_ranks_agree_and_match_one_process(tmp_path):
    import fastdiff

    mp.spawn(run_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    pipe = fastdiff.Pipeline.from_pretrained(MODEL, device="cpu", backend="eager")
    for mode, call in (("sync", CALL), ("stale", STALE)):
        rank0, rank1 = (torch.load(tmp_path / f"{mode}-rank{r}.pt") for r in (0, 1))
        assert torch.equal(rank0, rank1)  # both ranks took the same steps on the same gathered outputs
        alone = pipe(PROMPTS, **call)
        assert (alone[0] - alone[1]).abs().max() > 0.1  # the two prompts make different images
        if mode == "sync":  # one process's computation, but for the order of the GroupNorm sums
            torch.testing.assert_close(rank0, alone, atol=2e-4, rtol=0)
        else:  # the other bands' activations one step old: close to, not equal to, one process's
            assert (rank0 - alone).abs().max() > 1e-3
            assert 20 < psnr(rank0, alone) < 40


def test_cli_refuses_before_loading(tmp_path, capsys, monkeypatch):
    """Without torchrun, combined with --guidance-parallel, --patch-warmup alone, without a prompt: one line,
    exit 2, nothing written."""
    from fastdiff.cli import main

    out = tmp_path / "pp.png"
    base = ["sample", "--model", MODEL, "--out", str(out), "--steps", "2", "--device", "cpu", "--prompt", "bag"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([*base, "--patch-parallel"]) == 2
    assert "torchrun --nproc-per-node N" in capsys.readouterr().err
    assert main([*base, "--patch-parallel", "--guidance-parallel"]) == 2
    assert "do not combine" in capsys.readouterr().err
    assert main([*base, "--patch-warmup", "2"]) == 2
    assert "--patch-warmup needs --patch-parallel" in capsys.readouterr().err
    assert main([*base[:-2], "--patch-parallel"]) == 2
    assert "--patch-parallel needs --prompt" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    assert main([*base, "--patch-parallel"]) == 2  # an 8-row latent in 3 bands: refused before loading
    assert "needs a latent height that is a multiple of 12" in capsys.readouterr().err
    assert main(
        ["sample", "--model", "sd15", "--prompt", "x", "--height", "520", "--patch-parallel", "--out", str(out)]
    )
    assert "multiple of 24" in capsys.readouterr().err  # SD 1.5's 65-row latent, 3 bands, 3 downsamplers
    assert not out.exists()


@pytest.mark.slow
def test_cli_under_torchrun_matches_one_process(tmp_path):
    """``torchrun --nproc-per-node 2 ... sample --patch-parallel --patch-warmup STEPS`` (every exchange synchronous):
    the one-process PNGs up to one grey level; the parameters say how it ran; rank 1 writes nothing."""
    import json

    import numpy as np
    from PIL import Image
    from torchrun_helpers import torchrun

    from fastdiff.cli import main
    from fastdiff.images import PNG_PARAMETERS_KEY

    flags = ["--model", MODEL, "--prompt", PROMPTS[0], "--guidance", "3", "--batch", "2", "--steps", "3",
             "--device", "cpu", "--no-progress"]  # fmt: skip
    proc = torchrun("-m", "fastdiff.cli", "sample", *flags, "--patch-parallel", "--patch-warmup", "3",
                    "--out", str(tmp_path / "pp.png"), "--save-dir", str(tmp_path / "pp"), timeout_s=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert main(["sample", *flags, "--out", str(tmp_path / "one.png"), "--save-dir", str(tmp_path / "one")]) == 0
    for name in ("000000.png", "000001.png"):
        split, alone = (np.asarray(Image.open(tmp_path / d / name), dtype=np.int16) for d in ("pp", "one"))
        assert np.abs(split - alone).max() <= 1
    params = json.loads(Image.open(tmp_path / "pp.png").text[PNG_PARAMETERS_KEY])
    assert params["patch_parallel"] == {"processes": 2, "warmup_steps": 3}


class WholeExchange:
    """An exchange that hands every rank's edge rows cut from a given whole tensor (one process standing in for
    every rank)."""

    def __init__(self, rank: int, world: int, whole: torch.Tensor) -> None:
        self.rank, self.world, self.whole = rank, world, whole
        self.edges_of = None  # the band module's own edge cut, set once it exists

    def parts(self, key, local, fresh=False):
        h = self.whole.shape[2] // self.world
        parts = [self.edges_of(self.whole[:, :, r * h : (r + 1) * h]) for r in range(self.world)]
        torch.testing.assert_close(parts[self.rank], local, atol=0, rtol=0)
        return parts


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "world", "height"),
    [(3, 1, 1, 2, 16), (3, 2, 1, 2, 16), (5, 1, 2, 4, 16), (3, 2, 1, 4, 16), (3, 3, 1, 2, 24), (4, 2, 1, 2, 16)],
)
def test_band_conv_is_the_whole_conv_sliced(kernel, stride, padding, world, height):
    """Each band's conv of its rows and its neighbours' edge rows equals the whole conv's rows of that band (zeros
    beyond the image at the top and bottom bands, a stride-2 downsampler's one row above, a stride-3 conv that
    reads fewer rows than its band holds, an even kernel that reads one row below)."""
    from torch import nn

    from fastdiff.pipelines.patch_parallel import BandConv2d

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, kernel, stride=stride, padding=padding)
    whole = torch.randn(2, 3, height, 12)
    reference = conv(whole)
    band, out_band = height // world, height // world // stride
    for rank in range(world):
        exchange = WholeExchange(rank, world, whole)
        banded = BandConv2d(conv, exchange, "conv")
        exchange.edges_of = banded.edges
        got = banded(whole[:, :, rank * band : (rank + 1) * band])
        torch.testing.assert_close(got, reference[:, :, rank * out_band : (rank + 1) * out_band], atol=1e-6, rtol=0)


def test_band_conv_refuses_convs_that_change_the_size():
    from torch import nn

    from fastdiff.pipelines.patch_parallel import BandConv2d

    with pytest.raises(FastdiffError, match="changes the size"):
        BandConv2d(nn.Conv2d(3, 5, 3, padding=0), None, "valid")
    with pytest.raises(FastdiffError, match="not a plain zero-padded conv"):
        BandConv2d(nn.Conv2d(3, 5, 3, padding=1, padding_mode="reflect"), None, "reflect")
