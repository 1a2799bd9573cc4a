"""Kernel plans on the command line: ``--plan`` read (and refused in one line) before any model loads, the plan's
digest in each PNG that ``fastdiff sample`` writes, and ``fastdiff tune``'s own checks."""

from __future__ import annotations

import json

import pytest
from PIL import Image

import fastdiff.models
import fastdiff.pipelines.unconditional
from fastdiff.cli import main
from fastdiff.engine.kernel_plan import KernelPlan, PlanEntry
from fastdiff.models.convnext_unet import ConvNeXtUNet, ConvNeXtUNetConfig
from fastdiff.pipelines.base import EnginePipeline


def _no_loading(*args, **kwargs):
    raise AssertionError("a model loaded before the flags were checked")


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "does not exist"), ("{", "cannot be read"), ('{"format": "x"}', "is not a fastdiff kernel plan")],
)
def test_bad_plan_is_one_line_before_loading(tmp_path, capsys, monkeypatch, content, message):
    monkeypatch.setattr(fastdiff.pipelines.unconditional, "load_unet", _no_loading)
    plan = tmp_path / "plan.json"
    if content is not None:
        plan.write_text(content)
    out = tmp_path / "grid.png"
    assert main(["sample", "--plan", str(plan), "--out", str(out), "--batch", "1", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists()


def test_sample_records_the_kernel_plan_digest(tmp_path, monkeypatch):
    """The grid's and each image's parameters name the digest of the kernels that ran (here the engine's digest
    is stood in for: on the CPU the CLI samples eagerly and runs no plan)."""
    digest = PlanEntry({"conv_in": "triton"}).digest()
    monkeypatch.setattr(EnginePipeline, "plan_digest", property(lambda self: digest))
    config = ConvNeXtUNetConfig(
        sample_size=8, in_channels=1, out_channels=1, base_dim=8, dim_mults=(1, 2), attention=False
    )
    tiny = ConvNeXtUNet(config)
    monkeypatch.setattr(fastdiff.pipelines.unconditional, "load_unet", lambda *a, **k: tiny.eval())
    out, images = tmp_path / "grid.png", tmp_path / "images"
    argv = ["sample", "--out", str(out), "--save-dir", str(images), "--batch", "2", "--steps", "1", "--no-progress"]
    assert main(argv) == 0
    for path in (out, images / "000000.png", images / "000001.png"):
        assert json.loads(Image.open(path).text["parameters"])["kernel_plan"] == digest


def test_tune_refuses_the_cpu_and_a_foreign_plan_in_one_line(tmp_path, capsys):
    assert main(["tune", "--device", "cpu", "--out", str(tmp_path / "p.json")]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
    assert main(["tune", "--out", str(tmp_path / "p.txt")]) == 2
    assert ".json" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_plan_file_is_readable_json(tmp_path):
    plan = KernelPlan("NVIDIA H100 80GB HBM3", {"s": PlanEntry({"a": "cudnn"}, "ddpm step batch 1")})
    data = json.loads(plan.save(tmp_path / "p.json").read_text())
    assert data["format"] == "fastdiff-kernel-plan" and data["entries"]["s"]["choices"] == {"a": "cudnn"}


def test_serve_and_generate_refuse_a_missing_plan_before_loading(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(fastdiff.pipelines.unconditional, "load_unet", _no_loading)
    missing = str(tmp_path / "missing.json")
    assert main(["serve", "--plan", missing, "--port", "0"]) == 2
    argv = ["generate", "--model", "fashion-mnist", "--num-images", "1", "--out-dir", str(tmp_path / "out")]
    assert main([*argv, "--plan", missing, "--no-progress"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all("does not exist" in line for line in lines)
    assert not (tmp_path / "out").exists()
