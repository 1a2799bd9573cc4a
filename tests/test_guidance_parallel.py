"""Guidance-parallel (``fastdiff.pipelines.guidance_parallel``): the two guidance halves on two processes (gloo on
the CPU) give both ranks the same bytes, and one process's image up to the U-Net's batch-size rounding."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from torchrun_helpers import torchrun

from fastdiff.cli import main
from fastdiff.errors import FastdiffError
from fastdiff.images import PNG_PARAMETERS_KEY
from fastdiff.pipelines.guidance_parallel import GuidanceSplit, check_launch

MODEL = "fashion-mnist-t2i"
PROMPTS = ["a photo of a bag", "a photo of a sandal"]
CALL = dict(negative_prompt="a photo of a shirt", guidance_scale=3.0, seeds=[5, 6], steps=3, sampler="dpmsolver++",
            output_type="tensor", progress=False)  # fmt: skip


def test_launch_and_group_checks_are_one_line(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(FastdiffError, match="launch it with torchrun --nproc-per-node 2"):
        check_launch()
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(FastdiffError, match="over 2 processes, got 4"):
        check_launch()
    if not dist.is_initialized():
        with pytest.raises(FastdiffError, match="needs torch.distributed initialised"):
            GuidanceSplit()


def test_cli_refuses_before_loading(tmp_path, capsys, monkeypatch):
    """Without torchrun, with guidance off, without a prompt: one line, exit 2, nothing written, nothing loaded."""
    out = tmp_path / "gp.png"
    base = ["sample", "--model", MODEL, "--out", str(out), "--steps", "2", "--device", "cpu"]
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main([*base, "--prompt", "bag", "--guidance-parallel"]) == 2
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main([*base, "--prompt", "bag", "--guidance", "1", "--guidance-parallel"]) == 2
    assert "--guidance 1.0 is off" in capsys.readouterr().err
    assert main([*base, "--guidance-parallel"]) == 2
    assert "--guidance-parallel needs --prompt" in capsys.readouterr().err
    cuda_n = [*base[:-2], "--device", "cuda:1", "--prompt", "bag", "--guidance-parallel"]
    assert main(cuda_n) == 2
    assert "--guidance-parallel takes --device auto, cuda or cpu" in capsys.readouterr().err
    assert not out.exists()


def run_rank(rank: int, init_file: str, out_dir: str) -> None:
    import fastdiff

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        pipe = fastdiff.Pipeline.from_pretrained(MODEL, device="cpu", backend="eager")
        pipe.split_guidance()
        torch.save(pipe(PROMPTS, **CALL), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_agree_and_match_one_process(tmp_path):
    import fastdiff

    mp.spawn(run_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert torch.equal(rank0, rank1)  # both ranks took the same steps on the same gathered outputs
    alone = fastdiff.Pipeline.from_pretrained(MODEL, device="cpu", backend="eager")(PROMPTS, **CALL)
    torch.testing.assert_close(rank0, alone, atol=1e-4, rtol=0)  # the U-Net at batch B against 2B
    assert (rank0[0] - rank0[1]).abs().max() > 0.1  # the two prompts make different images


ENGINE_CALL = {**CALL, "negative_prompt": "a shirt", "seeds": [5, 6], "steps": 2, "sampler": "ddim"}
"""On the tiny random SD 1.5 pipeline of ``sd_fixtures`` (the engine runs in the Triton interpreter here)."""


def run_engine_rank(rank: int, init_file: str, out_dir: str) -> None:
    import fastdiff

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        pipe = fastdiff.Pipeline.from_pretrained(os.path.join(out_dir, "sd"), device="cpu", backend="engine")
        pipe.split_guidance()
        torch.save(pipe(PROMPTS, **ENGINE_CALL), os.path.join(out_dir, f"engine-rank{rank}.pt"))
        assert pipe.engine.current_step_model.inner.batch == 2  # this rank's U-Net: its half of the 4 rows
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_engine_split_matches_one_engine(tmp_path):
    """On the engine (the Triton interpreter here), each rank's fused U-Net runs B rows and the halves are gathered
    inside the sampling loop before the fused sampler step: both ranks hold the same bytes, one process's engine's
    image up to float rounding."""
    from sd_fixtures import write_tiny_sd_pipeline

    import fastdiff

    write_tiny_sd_pipeline(tmp_path / "sd", "sd15")
    mp.spawn(run_engine_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"engine-rank{r}.pt") for r in (0, 1))
    assert torch.equal(rank0, rank1)
    alone = fastdiff.Pipeline.from_pretrained(tmp_path / "sd", device="cpu", backend="engine")
    torch.testing.assert_close(rank0, alone(PROMPTS, **ENGINE_CALL), atol=1e-4, rtol=0)  # B rows against 2B
    assert (rank0[0] - rank0[1]).abs().max() > 0.01  # two prompts, two images


@pytest.mark.slow
def test_cli_under_torchrun_writes_rank_zeros_images(tmp_path):
    """``torchrun --nproc-per-node 2 ... sample --guidance-parallel``: the same PNGs as one process, up to one grey
    level where the batch-size rounding crosses a pixel boundary; rank 1 writes nothing."""
    flags = ["--model", MODEL, "--prompt", PROMPTS[0], "--guidance", "3", "--batch", "2", "--steps", "3",
             "--device", "cpu", "--no-progress"]  # fmt: skip
    proc = torchrun("-m", "fastdiff.cli", "sample", *flags, "--guidance-parallel", "--out", str(tmp_path / "gp.png"),
                    "--save-dir", str(tmp_path / "gp"), timeout_s=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert main(["sample", *flags, "--out", str(tmp_path / "one.png"), "--save-dir", str(tmp_path / "one")]) == 0
    for name in ("000000.png", "000001.png"):
        split, alone = (np.asarray(Image.open(tmp_path / d / name), dtype=np.int16) for d in ("gp", "one"))
        assert np.abs(split - alone).max() <= 1
    assert json.loads(Image.open(tmp_path / "gp.png").text[PNG_PARAMETERS_KEY])["guidance_parallel"] is True
