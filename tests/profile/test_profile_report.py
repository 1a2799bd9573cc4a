"""``fastdiff profile`` end to end on a tiny saved model: the report's files and schema on the CPU (CUDA-only parts
skipped with a reason), the conv counter on a strided conv, one-line errors, nothing half-written; the CUDA parts
on the GPU."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from fastdiff.bench.breakdown import OP_CLASSES
from fastdiff.cli import main
from fastdiff.kernels.cost_model import conv2d_cost
from fastdiff.profile import report
from fastdiff.profile.report import ProfileConfig, aten_kernel_rows, run_profile

CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny UNet2DModel (odd size 12, 3 channels, attention) saved by diffusers, with a scheduler config."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=12, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
        norm_num_groups=4, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    )  # fmt: skip
    root = tmp_path_factory.mktemp("tiny")
    unet.save_pretrained(root / "unet")
    diffusers.DDPMScheduler(num_train_timesteps=1000).save_pretrained(root / "scheduler")
    return root


def test_cpu_report_files_and_schema(tiny_dir, tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["profile", "--device", "cpu", "--model", str(tiny_dir), "--batch", "2", "--steps", "7",
            "--timed-steps", "4", "--repeats", "1", "--loads", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["breakdown.png", "report.json", "report.md", "roofline-eager.png"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    result = json.loads((out / "report.json").read_text())
    assert result["schema"] == report.SCHEMA
    assert result["config"]["backends"] == ["eager"] and result["config"]["dtype"] == "fp32"
    assert result["ceilings"]["tflops"] > 0 and result["ceilings"]["gbps"] > 0  # measured, not assumed
    assert result["idle_watts"] is None
    eager = result["backends"]["eager"]

    bd = eager["breakdown"]
    assert set(bd["per_class_ms"]) == set(OP_CLASSES)
    assert bd["total_ms"] == pytest.approx(sum(bd["per_class_ms"].values()))
    assert bd["per_class_ms"]["convolution"] > 0 and bd["per_class_ms"]["sampler"] > 0
    assert bd["per_class_ms"]["transfer"] == 0  # nothing moves between host and device on the CPU
    # On the CPU the profiler slows every op: shares are of the profiled step, so classes + idle add up to it
    assert bd["end_to_end_ms"] == pytest.approx(bd["wall_ms"])
    assert bd["total_ms"] + bd["idle_ms"] == pytest.approx(bd["end_to_end_ms"], rel=1e-6)

    lat = eager["latency"]
    assert lat["s_per_image"] == pytest.approx(lat["ms_per_step"] * 7 / 1e3 / 2)
    assert lat["images_per_s"] == pytest.approx(1 / lat["s_per_image"])

    assert "skipped" in eager["energy"] and "skipped" in eager["memory"]
    assert eager["memory"]["weight_bytes"] == 4 * result["config"]["parameters"]

    roof = eager["roofline"]
    assert 0 < roof["kernels_counted"] <= roof["kernels"] and 0 < len(roof["top"]) <= 10
    assert [p["ms_per_step"] for p in roof["top"]] == sorted((p["ms_per_step"] for p in roof["top"]), reverse=True)
    ridge = result["ceilings"]["tflops"] * 1e12 / (result["ceilings"]["gbps"] * 1e9)
    for p in roof["top"]:
        assert p["bound"] == ("memory" if p["intensity"] < ridge else "compute")
        assert p["intensity"] == pytest.approx(p["flops"] / p["bytes"])

    loads = result["load_to_first_step"]
    sync = loads["modes"]["sync"]
    assert sync["best_ms"] <= sync["avg_ms"] <= sync["worst_ms"]
    assert loads["modes"]["async"] == {"skipped": "needs CUDA"} == loads["modes"]["early-start"]

    md = (out / "report.md").read_text()
    for heading in ("## 1. Time per step by op class", "## 2. Weight load", "## 3. Latency", "## 4. Roofline"):
        assert heading in md
    assert "![breakdown](breakdown.png)" in md and "roofline-eager.png" in md
    assert "# fastdiff profile" in capsys.readouterr().out


def test_strided_conv_counted_at_its_output_size():
    """The profiler records no output shapes: the conv's stride and padding give it (a stride-2 conv on 9x9 -> 5x5)."""
    conv = nn.Conv2d(3, 5, 3, stride=2, padding=1)
    x = torch.randn(2, 3, 9, 9)
    rows = aten_kernel_rows(lambda: conv(x), torch.device("cpu"), elem_bytes=4, steps=1)
    (row,) = [r for r in rows if r["name"].startswith("conv2d")]
    expected = conv2d_cost(2, 3, 5, 5, 5, 3, elem_bytes=4, h_in=9, w_in=9)
    assert (row["flops"], row["bytes"]) == (expected.flops, expected.bytes)
    assert row["calls_per_step"] == 1 and row["class"] == "convolution"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--backends", "engine"], "only the eager backend"),
        (["--backends", "eager,warp"], "unknown backend 'warp'"),
        (["--dtype", "fp16"], "runs fp32"),
        (["--loads", "0"], "must be positive"),
        (["--model", "/nonexistent/model"], "nonexistent"),
    ],
)
def test_bad_input_one_line_error_and_no_output(tiny_dir, tmp_path, capsys, flags, message):
    out = tmp_path / "report"
    argv = ["profile", "--device", "cpu", "--model", str(tiny_dir), "--steps", "3", "--out", str(out), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastdiff: error:") and message in err and "\n" not in err
    assert not out.exists()


@pytest.mark.slow
def test_failure_while_writing_leaves_nothing(tiny_dir, tmp_path, monkeypatch):
    cfg = ProfileConfig(model=str(tiny_dir), batch=1, steps=3, timed_steps=3, repeats=1, loads=1, dtype="fp32",
                        device="cpu", backends=("eager",))  # fmt: skip
    result = run_profile(cfg)

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(report, "plot_breakdown", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        report.write_report(result, tmp_path / "report")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_report_engine_and_eager(tiny_dir, tmp_path):
    cfg = ProfileConfig(model=str(tiny_dir), batch=3, steps=10, timed_steps=5, repeats=2, loads=2, dtype="fp16",
                        device="cuda", backends=("engine", "eager"), energy_seconds=0.5)  # fmt: skip
    result = run_profile(cfg)
    report.write_report(result, tmp_path / "report")
    engine, eager = result["backends"]["engine"], result["backends"]["eager"]
    for backend in (engine, eager):
        assert backend["breakdown"]["kernels_per_step"] > 0
        assert backend["memory"]["peak_allocated_bytes"] >= backend["memory"]["weight_bytes"]
        assert backend["roofline"]["kernels_counted"] > 0
    assert engine["memory"]["plan_peak_bytes"] > 0
    # every fused op and the sampler update are counted, each once per step
    assert engine["roofline"]["kernels_counted"] == engine["roofline"]["kernels"]
    assert engine["breakdown"]["per_class_ms"]["sampler"] > 0
    for mode in ("sync", "async", "early-start"):
        assert result["load_to_first_step"]["modes"][mode]["best_ms"] > 0
    assert (tmp_path / "report" / "roofline-engine.png").is_file()
