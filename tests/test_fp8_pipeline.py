"""``dtype="fp8"`` in ``Pipeline`` / ``Pipeline.from_pretrained`` and ``fastdiff sample --dtype fp8``: the engine's fp8
mode, checked (device, dtype, backend) before any loading, for pixel and text-to-image models, and a tiny U-Net
sampled with it (Triton's interpreter on the CPU, the TMA kernel on a Hopper GPU)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import fastdiff.pipelines.text_to_image
import fastdiff.pipelines.unconditional
from fastdiff.cli import main
from fastdiff.errors import FastdiffError
from fastdiff.kernels.fp8 import fp8_supported
from fastdiff.models.ddpm_unet import DDPMUNet, DDPMUNetConfig
from fastdiff.pipelines import Pipeline
from fastdiff.samplers import ScheduleConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU runs the engine's interpreter mode
FP8_UNET = dict(
    sample_size=(8, 12), in_channels=3, out_channels=3, block_out_channels=(16, 32), norm_num_groups=4,
    down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    layers_per_block=1, attention_head_dim=8,
)  # fmt: skip
"""As tests/engine/test_fp8.py: channels that are multiples of 16 (what the fp8 conv's TMA rows need)."""


@pytest.fixture
def no_loading(monkeypatch):
    """Loading any weights fails the test: the fp8 checks must come first."""

    def fail(*args, **kwargs):
        raise AssertionError("weights were loaded before the fp8 checks")

    monkeypatch.setattr(fastdiff.pipelines.unconditional, "load_unet", fail)
    monkeypatch.setattr(fastdiff.pipelines.text_to_image, "load_stable_diffusion", fail)


def tiny_unet() -> DDPMUNet:
    """A tiny DDPMUNet with unit-variance layer outputs, as a trained U-Net has (random weights, seed 0)."""
    torch.manual_seed(0)
    model = DDPMUNet(DDPMUNetConfig(**FP8_UNET)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 1.0 / p[0].numel() ** 0.5)
            else:
                p.normal_(1.0 if "norm" in name and name.endswith("weight") else 0.0, 0.2)
    return model


def test_fp8_needs_the_engine_backend(monkeypatch, no_loading):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    message = r"^fp8 runs only in the engine backend \(e4m3 convs on Hopper\): not with backend='eager'$"
    with pytest.raises(FastdiffError, match=message):
        Pipeline.from_pretrained("fashion-mnist", device="cpu", dtype="fp8", backend="eager")


def test_fp8_without_support_fails_before_loading(monkeypatch, no_loading):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = fp8_supported(torch.device("cpu"))
    assert reason is not None
    for model in ("fashion-mnist", "/no/such/model"):
        with pytest.raises(FastdiffError) as exc:
            Pipeline.from_pretrained(model, device="cpu", dtype="fp8")
        assert str(exc.value) == reason


def test_fp8_text_to_image_is_checked_before_loading(monkeypatch, no_loading):
    """A text-to-image model takes fp8 too (its U-Net's convs after each GroupNorm), with the same checks first."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(FastdiffError, match="^fp8 runs only in the engine backend"):
        Pipeline.from_pretrained("fashion-mnist-t2i", device="cpu", dtype="fp8", backend="eager")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(FastdiffError, match=f"^{re.escape(fp8_supported(torch.device('cpu')))}$"):
        Pipeline.from_pretrained("fashion-mnist-t2i", device="cpu", dtype="fp8")


def test_unknown_dtype_names_fp8(no_loading):
    with pytest.raises(FastdiffError, match="^unknown dtype 'fp64': use one of fp32, fp16, bf16, fp8$"):
        Pipeline.from_pretrained("fashion-mnist", device="cpu", dtype="fp64")


def test_pipeline_fp8_arguments_are_checked_in_init(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model, schedule, cpu = tiny_unet(), ScheduleConfig(), torch.device("cpu")
    with pytest.raises(FastdiffError, match="fp16 or bf16 activations: the pipeline dtype cannot be torch.float32"):
        Pipeline(model, schedule, device=cpu, dtype=torch.float32, fp8=True)
    with pytest.raises(FastdiffError, match="not with backend='eager'"):
        Pipeline(model, schedule, device=cpu, dtype=torch.float16, backend="eager", fp8=True)
    with pytest.raises(FastdiffError, match="the fused engine supports"):
        Pipeline(nn.Conv2d(1, 1, 3), schedule, device=cpu, dtype=torch.float16, fp8=True)
    pipe = Pipeline(model, schedule, device=cpu, dtype=torch.bfloat16, fp8=True)
    assert pipe.backend == "engine" and pipe.fp8  # fp8 lives in the engine: its default backend
    assert not Pipeline(model, schedule, device=cpu, dtype=torch.float16).fp8
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(FastdiffError, match=f"^{re.escape(fp8_supported(cpu))}$"):
        Pipeline(model, schedule, device=cpu, dtype=torch.float16, fp8=True)


@pytest.mark.slow
@pytest.mark.skipif(fp8_supported(DEVICE) is not None, reason="fp8 needs a Hopper GPU or Triton's interpreter")
def test_fp8_pipeline_samples_close_to_fp16():
    """Two DDIM steps (t = 500, 0) of a tiny U-Net: the fp8 engine's images are finite and within 15% of the fp16
    eager loop's (about 6% here: e4m3 steps of 1/16 .. 1/8 in every conv after a GroupNorm). (A first step at
    t = 999, trailing spacing, divides the noise estimate's error by sqrt(alpha_bar) ~ 0.006: 25% there.)"""
    model, schedule = tiny_unet().to(DEVICE), ScheduleConfig()
    kwargs = dict(batch_size=1, seeds=[3], output_type="tensor", progress=False)
    fp8 = Pipeline(model, schedule, steps=2, device=DEVICE, dtype=torch.float16, fp8=True)
    half = copy.deepcopy(model).half()  # the eager loop runs the model as given
    fp16 = Pipeline(half, schedule, steps=2, device=DEVICE, dtype=torch.float16, backend="eager")
    got, ref = fp8(**kwargs), fp16(**kwargs)
    assert fp8.engine.fp8 and fp8.engine.current_step_model.fp8_ops > 0
    assert got.shape == ref.shape == (1, 3, 8, 12) and torch.isfinite(got).all()
    err = float((got.double() - ref.double()).norm() / ref.double().norm())
    assert 0 < err < 0.15


def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1, err
    return err[0]


def test_cli_fp8_text_to_image_without_support_is_one_line(tmp_path, capsys, monkeypatch, no_loading):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "g.png"
    rc = main(["sample", "--model", "fashion-mnist-t2i", "--prompt", "ankle boot", "--dtype", "fp8",
               "--device", "cpu", "--out", str(out)])  # fmt: skip
    assert rc == 2 and one_error_line(capsys) == f"fastdiff: error: {fp8_supported(torch.device('cpu'))}"
    assert not out.exists()


def test_cli_fp8_without_support_is_one_line(tmp_path, capsys, monkeypatch, no_loading):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc = main(["sample", "--dtype", "fp8", "--device", "cpu", "--out", str(tmp_path / "g.png")])
    assert rc == 2 and one_error_line(capsys) == f"fastdiff: error: {fp8_supported(torch.device('cpu'))}"
    assert not list(tmp_path.iterdir())


def test_cli_help_explains_fp8(capsys):
    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "fp8: fp16 activations with e4m3 convs after each GroupNorm (Hopper GPUs, engine backend" in text


def test_generate_fp8_without_support_is_one_line(tmp_path, capsys, monkeypatch, no_loading):
    """``fastdiff generate --dtype fp8`` reaches the pipeline's fp8 checks: one line, exit 2, no image."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "run" / "images"
    rc = main(["generate", "--model", "fashion-mnist", "--num-images", "2", "--out-dir", str(out), "--dtype", "fp8",
               "--device", "cpu", "--no-progress"])  # fmt: skip
    assert rc == 2 and one_error_line(capsys) == f"fastdiff: error: {fp8_supported(torch.device('cpu'))}"
    assert not list(tmp_path.iterdir())  # the folders the job made for its output are gone again


def test_serve_fp8_without_support_is_one_line(capsys, monkeypatch, no_loading):
    """``fastdiff serve --dtype fp8`` loads its pipeline before serving: the fp8 check is its one-line error."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc = main(["serve", "--model", "fashion-mnist", "--dtype", "fp8", "--device", "cpu", "--port", "1"])
    assert rc == 2 and one_error_line(capsys) == f"fastdiff: error: {fp8_supported(torch.device('cpu'))}"


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_generate_and_serve_help_explain_fp8(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "fp8: fp16 activations with e4m3 convs after each GroupNorm (Hopper GPUs, engine backend)" in text
    assert "auto: fp16 on a GPU, fp32 on the CPU" in text
