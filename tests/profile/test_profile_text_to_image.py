"""``fastdiff profile`` of text-to-image models: the bundled fashion-mnist-t2i end to end on the CPU (report files,
the text-model sections, sane numbers), the flags that do not apply refused in one line before any loading, the
GEMM split of the rates table; the engine and compile backends on the GPU."""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from fastdiff.bench import ops
from fastdiff.bench.breakdown import OP_CLASSES
from fastdiff.cli import main
from fastdiff.engine.graph import SamplingLoop
from fastdiff.kernels.sampler_step import OP as SAMPLER_STEP
from fastdiff.profile import report
from fastdiff.profile import text_to_image as t2i
from fastdiff.profile.config import DEFAULT_GUIDANCE, DEFAULT_PROMPT, ProfileConfig, resolve_config
from fastdiff.profile.kernels import aten_kernel_rows, class_rates
from fastdiff.samplers import ScheduleConfig, make_sampler

CUDA = torch.cuda.is_available()
CEILINGS = {"tflops": 1.0, "gbps": 100.0}


def check_text_result(result: dict, backends: list[str], steps: int, batch: int) -> None:
    """What every text-to-image report holds, on any device."""
    assert result["schema"] == t2i.SCHEMA
    for key in ("gpu", "torch", "triton", "git_sha", "date"):
        assert key in result["env"]
    cfg = result["config"]
    assert cfg["backends"] == backends and cfg["steps"] == steps and cfg["batch"] == batch
    assert cfg["model_class"] == "UNet2DConditionModel" and cfg["random_weights"] is False
    assert (cfg["height"], cfg["width"], cfg["latent_shape"]) == (32, 32, [4, 16, 16])  # the model's own size
    assert cfg["guidance"] == DEFAULT_GUIDANCE and cfg["guided"] and cfg["unet_batch"] == 2 * batch
    assert cfg["prompt"] == DEFAULT_PROMPT and cfg["sampler"] == "ddim" and cfg["timed_steps"] is None
    assert result["ceilings"]["tflops"] > 0 and result["ceilings"]["gbps"] > 0
    assert list(result["backends"]) == backends == list(result["load_to_first_image"]["modes"])
    for name, b in result["backends"].items():
        split = b["time_split"]
        for phase in t2i.PHASES:
            assert split[f"{phase}_ms"] > 0, (name, phase)
        # the phases are one timed run's: they add up to its total
        assert sum(split[f"{p}_ms"] for p in t2i.PHASES) == pytest.approx(split["total_ms"])
        lat = b["latency"]
        assert lat["ms_per_step"] == pytest.approx(split["unet_loop_ms"] * batch / steps)
        assert lat["images_per_s"] == pytest.approx(1e3 / split["total_ms"])
        assert split["pipeline_call_ms_per_image"] > 0
        bd = b["breakdown"]
        assert set(bd["per_class_ms"]) == set(OP_CLASSES)
        assert bd["total_ms"] == pytest.approx(sum(bd["per_class_ms"].values()))
        assert bd["total_ms"] + bd["idle_ms"] == pytest.approx(bd["end_to_end_ms"], rel=1e-6, abs=1e-9)
        load = result["load_to_first_image"]["modes"][name]
        assert 0 < load["best_ms"] <= load["median_ms"] <= load["worst_ms"]
        assert len(load["all_ms"]) == result["load_to_first_image"]["loads"]
        comp = b["memory"]["component_weight_bytes"]
        assert set(comp) == {"text_encoder", "unet", "vae"} and all(v > 0 for v in comp.values())


@pytest.fixture
def one_thread():
    """One intra-op thread: on a CPU shared with other processes, several threads that wait on each other make the
    same op 10-100x slower at times, so two time windows (the timed step, the profiled one) would not compare."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_cpu_text_report(tmp_path, capsys, one_thread):
    out = tmp_path / "report"
    argv = ["profile", "--device", "cpu", "--model", "fashion-mnist-t2i", "--steps", "2", "--repeats", "2",
            "--loads", "2", "--top", "5", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    assert sorted(p.name for p in out.iterdir()) == ["breakdown.png", "report.json", "report.md", "roofline-eager.png"]
    result = json.loads((out / "report.json").read_text())
    check_text_result(result, ["eager"], steps=2, batch=1)
    eager = result["backends"]["eager"]

    bd = eager["breakdown"]
    assert bd["per_class_ms"]["convolution"] > 0 and bd["per_class_ms"]["attention"] > 0
    assert bd["per_class_ms"]["sampler"] > 0 and bd["per_class_ms"]["transfer"] == 0
    # the profiled step (ops slowed by the profiler) against the step timed without it, and the per-op rows' step
    step_ms = eager["latency"]["ms_per_step"]
    assert 0.3 < bd["end_to_end_ms"] / step_ms < 4, (bd, eager["latency"])
    assert 0.2 < eager["roofline"]["kernel_ms_per_step"] / step_ms < 4, (eager["roofline"], eager["latency"])

    rates = eager["class_rates"]
    for group in ("convolution", "gemm", "attention", "normalisation"):  # the transformer blocks' GEMMs apart
        assert rates[group]["kernels_counted"] > 0 and rates[group]["tflops"] > 0 and rates[group]["gbps"] > 0
        assert rates[group]["bound"] in ("compute", "memory") and rates[group]["pct_of_ceiling"] > 0
    roof = eager["roofline"]
    assert 0 < roof["kernels_counted"] <= roof["kernels"] and len(roof["top"]) == 5
    # the rates table and the roofline see the same kernels
    assert sum(r["ms_per_step"] for r in rates.values()) == pytest.approx(roof["kernel_ms_per_step"])
    assert "skipped" in eager["energy"] and "skipped" in eager["memory"]
    assert eager["memory"]["weight_bytes"] == 4 * result["config"]["parameters"]

    md = (out / "report.md").read_text()
    for heading in ("## 1. End-to-end time per image", "## 2. U-Net step by op class", "## 3. Achieved rates",
                    "## 4. Load to first image", "## 5. Memory", "## 6. Roofline"):  # fmt: skip
        assert heading in md
    assert "| gemm |" in md and "![breakdown](breakdown.png)" in md and "roofline-eager.png" in md
    assert "(text to image)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--guidance", "3"], "--guidance applies to text-to-image models only"),
        (["--prompt", "a cat", "--height", "64"], "--height, --prompt apply to text-to-image models only"),
        (["--model", "fashion-mnist-t2i", "--timed-steps", "4"], "--timed-steps applies to unconditional models"),
        (["--model", "sd15", "--height", "500"], "height must be a positive multiple of 8"),
        (["--model", "fashion-mnist-t2i", "--backends", "engine"], "only the eager backend"),
        (["--model", "fashion-mnist-t2i", "--loads", "0"], "must be positive"),
    ],
)
def test_bad_flags_one_line_error_before_loading(tmp_path, capsys, monkeypatch, flags, message):
    def refuse(*args, **kwargs):
        raise AssertionError("loaded a model before checking the flags")

    monkeypatch.setattr(t2i, "load_components", refuse)
    monkeypatch.setattr(report, "load_unet", refuse)
    out = tmp_path / "report"
    assert main(["profile", "--device", "cpu", "--steps", "2", "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastdiff: error:") and message in err and "\n" not in err, err
    assert not out.exists()


def test_defaults_per_kind_of_model():
    text = resolve_config(ProfileConfig(model="sd21", device="cpu"))
    assert (text.sampler, text.steps, text.loads, text.timed_steps) == ("ddim", 50, 2, None)
    assert (text.guidance, text.prompt, text.height, text.width) == (DEFAULT_GUIDANCE, DEFAULT_PROMPT, None, None)
    given = resolve_config(ProfileConfig(model="sd15", guidance=1.0, prompt="x", height=256, width=320, steps=4))
    assert (given.guidance, given.prompt, given.height, given.width, given.steps) == (1.0, "x", 256, 320, 4)
    uncond = resolve_config(ProfileConfig(model="ddpm-cifar10"))
    assert (uncond.sampler, uncond.steps, uncond.loads, uncond.timed_steps) == ("ddpm", 1000, 20, 20)


def test_help_explains_the_text_flags(capsys):
    with pytest.raises(SystemExit):
        main(["profile", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--guidance", "--height", "--width", "--prompt", "sd15, sd21, fashion-mnist-t2i"):
        assert flag in text
    assert "2x the batch" in text and "768 for sd21" in text


def test_rates_split_gemms_from_convolutions():
    """Linear layers count as convolution in the breakdown's classes; the rates table puts them apart as gemm, with
    each class's FLOPs and bytes over its time."""
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.Flatten(2), nn.Linear(36, 16))
    x = torch.randn(2, 4, 6, 6)
    rows = aten_kernel_rows(lambda: model(x), torch.device("cpu"), elem_bytes=4, steps=1)
    assert {r["group"] for r in rows if r["class"] == "convolution"} == {"convolution", "gemm"}
    rates = class_rates(rows, CEILINGS)
    gemm = rates["gemm"]
    counted = [r for r in rows if r["group"] == "gemm"]
    seconds = sum(r["us_per_call"] * r["calls_per_step"] for r in counted) / 1e6
    assert gemm["tflops"] == pytest.approx(sum(r["flops"] for r in counted) / seconds / 1e12)
    assert gemm["gbps"] == pytest.approx(sum(r["bytes"] for r in counted) / seconds / 1e9)
    assert list(rates)[:2] == ["convolution", "gemm"]


@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_text_report_engine_eager_compile(tmp_path):
    cfg = ProfileConfig(model="fashion-mnist-t2i", batch=1, steps=6, repeats=2, loads=1, dtype="fp16", device="cuda",
                        backends=("engine", "eager", "compile"), energy_seconds=0.5)  # fmt: skip
    result = report.run_profile(cfg)
    report.write_report(result, tmp_path / "report")
    check_text_result(result, ["engine", "eager", "compile"], steps=6, batch=1)  # b1: the shipped kernel plan
    b = result["backends"]
    for name in ("engine", "eager", "compile"):
        assert b[name]["memory"]["peak_allocated_bytes"] >= b[name]["memory"]["weight_bytes"] > 0
        assert "skipped" in b[name]["energy"] or b[name]["energy"]["j_per_image"] > 0  # NVML may be missing
    for name in ("engine", "eager"):
        assert b[name]["breakdown"]["kernels_per_step"] > 0
        assert b[name]["roofline"]["kernels_counted"] > 0 and b[name]["class_rates"]["gemm"]["tflops"] > 0
    assert b["engine"]["class_rates"]["sampler"]["kernels_counted"] == 1  # the guided sampler step
    assert b["engine"]["memory"]["plan_peak_bytes"] > 0
    assert "skipped" in b["compile"]["roofline"]
    assert (tmp_path / "report" / "roofline-engine.png").is_file()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not CUDA, reason="the Triton kernel needs CUDA or "
                    "TRITON_INTERPRET=1")  # fmt: skip
@pytest.mark.parametrize("sampler_name", ["ddim", "dpmsolver++_sde"])
def test_guided_sampler_row_runs_the_guided_step(monkeypatch, sampler_name):
    """The engine's sampler-step row of a guided loop (``bench.ops.sampler_step_row``): the fused step on the 2B-row
    model output with the loop's guidance scales, its cost counting the guidance FLOPs."""
    device = torch.device("cuda" if CUDA else "cpu")
    sampler = make_sampler(sampler_name, ScheduleConfig(), 4, device=device)
    b, shape = 2, (4, 3, 5)
    output = torch.randn((2 * b, *shape), device=device).contiguous(memory_format=torch.channels_last)

    class Fused:  # the one FusedModel method the row calls
        def forward_from_row(self, x_in):
            assert tuple(x_in.shape) == (2 * b, *shape)
            return output

    loop = SamplingLoop(lambda x_in, index: output, sampler, (b, *shape), torch.float32, device, use_graphs=False,
                        guided=True)  # fmt: skip
    guidance = torch.tensor([3.0, 7.5], device=device)
    loop.load(torch.randn((b, *shape), device=device), torch.arange(b, device=device), guidance)
    calls = []

    def time_once(call, reps):
        call()
        calls.append(reps)
        return 12.5

    monkeypatch.setattr(ops, "time_call_us", time_once)
    x_before = loop.x.clone()
    row = ops.sampler_step_row(Fused(), loop)
    assert calls and row["us"] == 12.5 and row["class"] == "sampler" and row["shape"] == [b, *shape]
    assert torch.equal(loop.x, x_before)  # timed on copies of the loop's state
    history = (loop.h1 if sampler.uses_h1 else None, loop.h2, loop.aux)
    seeds = {"seeds": loop.seeds if sampler.needs_noise else None}
    unguided, _ = SAMPLER_STEP.cost((loop.x, output, sampler.coefs, 0, *history), seeds)
    assert row["flops"] == unguided + 3 * loop.x.numel() and row["bytes"] > 0  # guidance: 3 FLOPs per element
