"""The bench on the CPU: the engine row is skipped cleanly, the JSON keeps its schema, step caching reaches the
loops and the JSON, the kernel-cache state."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from fastdiff.bench.report import markdown_table
from fastdiff.bench.runner import SCHEMA, BenchConfig, run_bench
from fastdiff.bench.systems import COMPILE_CONFIGS, CompileConfig, EagerSystem, compile_model
from fastdiff.engine import kernel_cache_state
from fastdiff.errors import FastdiffError
from fastdiff.models.ddpm_unet import DDPMUNet, DDPMUNetConfig
from fastdiff.pipelines.unconditional import sample_loop
from fastdiff.samplers import ScheduleConfig, initial_noise, make_sampler, seed_tensor

ROW_KEYS = {"system", "dtype", "ms_per_step", "s_per_image", "images_per_s", "time_to_ready_s", "peak_mem_mb",
            "energy_j_per_image", "avg_power_w", "psnr_db", "max_abs_diff", "notes", "error", "extra"}  # fmt: skip


CONFIG = DDPMUNetConfig(
    sample_size=8, in_channels=3, out_channels=3, block_out_channels=(6, 9), norm_num_groups=3,
    down_block_types=("AttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "AttnUpBlock2D"),
    layers_per_block=1, attention_head_dim=3,
)  # fmt: skip


def save_tiny_model(root) -> DDPMUNet:
    torch.manual_seed(0)
    model = DDPMUNet(CONFIG).eval()
    (root / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel", **dataclasses.asdict(CONFIG)}))
    save_file(model.state_dict(), str(root / "diffusion_pytorch_model.safetensors"))
    return model


def test_bench_schema_with_engine_on_cpu(tmp_path):
    save_tiny_model(tmp_path)
    cfg = BenchConfig(model=str(tmp_path), batch=1, steps=2, timed_steps=2, repeats=1, quality_steps=2,
                      systems=("eager-fp32", "engine-fp16"), device="cpu")  # fmt: skip
    result = run_bench(cfg)
    json.dumps(result)  # serialisable
    assert result["schema"] == SCHEMA
    rows = {r["system"]: r for r in result["results"]}
    assert set(rows) == {"eager", "engine"}
    assert all(set(r) == ROW_KEYS for r in result["results"])
    assert rows["engine"]["error"] == "skipped: needs CUDA"
    assert rows["eager"]["error"] is None and rows["eager"]["ms_per_step"] > 0


def test_bench_step_cache(tmp_path):
    """cache_interval reaches the config, the eager system's loop (its quality run is the cached sample loop) and
    each row's extra; 0 is refused before any work."""
    model = save_tiny_model(tmp_path)
    cfg = BenchConfig(model=str(tmp_path), steps=3, timed_steps=3, repeats=1, quality_sampler="ddim", quality_steps=3,
                      systems=("eager-fp32",), device="cpu", cache_interval=2)  # fmt: skip
    result = run_bench(cfg)
    (row,) = result["results"]
    assert result["config"]["cache_interval"] == 2 and row["extra"]["cache_interval"] == 2
    assert row["error"] is None and "step cache: full U-Net every 2 steps" in row["notes"]
    assert "Step caching: a full U-Net every 2 steps in the eager and engine rows" in markdown_table(result)
    system = EagerSystem(lambda: model, torch.float32, torch.device("cpu"), cache_interval=2)
    system.prepare()
    sampler = make_sampler("ddim", ScheduleConfig(), 3)
    seeds = seed_tensor([0], "cpu")
    x_t = initial_noise(seeds, (3, 8, 8), "cpu")
    cached = system.run(x_t, seeds, sampler, 3)
    assert torch.equal(cached.clamp(-1, 1), sample_loop(model, sampler, x_t, seeds, torch.float32, cache_interval=2))
    assert not torch.equal(cached.clamp(-1, 1), sample_loop(model, sampler, x_t, seeds, torch.float32))
    with pytest.raises(FastdiffError, match="cache_interval must be an integer >= 1"):
        run_bench(dataclasses.replace(cfg, cache_interval=0, model="no-such-model"))


def test_kernel_cache_state(tmp_path, monkeypatch):
    triton_dir, fastdiff_dir = tmp_path / "triton", tmp_path / "fastdiff"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_dir))
    monkeypatch.setenv("FASTDIFF_CACHE_DIR", str(fastdiff_dir))
    assert kernel_cache_state() == "cold"  # neither exists
    (triton_dir / "abc").mkdir(parents=True)
    assert kernel_cache_state() == "cold"  # compiled kernels but no tuning cache
    fastdiff_dir.mkdir()
    (fastdiff_dir / "engine_tuning.json").write_text("{}")
    assert kernel_cache_state() == "warm"


@pytest.mark.parametrize("name", sorted(COMPILE_CONFIGS))
def test_compile_configs_are_accepted_by_torch_compile(name):
    """torch.compile checks each option's name and type when called (no compiling happens here); channels-last
    configurations hand it channels-last weights."""
    config = COMPILE_CONFIGS[name]
    compiled = compile_model(torch.nn.Conv2d(2, 4, 3), config)
    weight = compiled._orig_mod.weight
    assert weight.is_contiguous(memory_format=torch.channels_last) == config.channels_last
    assert weight.is_contiguous() != config.channels_last
    assert config.options["triton.cudagraphs"]  # every configuration is a CUDA-graph mode, like the engine


def test_compile_model_rejects_a_misspelt_option():
    with pytest.raises(RuntimeError, match="max_autotun"):
        compile_model(torch.nn.Conv2d(2, 4, 3), CompileConfig("reduce-overhead", (("max_autotun", True),)))


def test_plan_reaches_the_engine_systems_and_a_bad_file_fails_first(tmp_path, capsys):
    """``fastdiff bench --plan FILE``: the engine systems (pixel and text-to-image) take the plan; a plan file that
    is not one is a one-line error before any model loads."""
    from fastdiff.bench.runner import build_system
    from fastdiff.bench.text_to_image import FastdiffT2I
    from fastdiff.cli import main
    from fastdiff.engine.kernel_plan import KernelPlan

    plan = KernelPlan("NVIDIA H100 80GB HBM3")
    system = build_system("engine-fp16", lambda: None, torch.device("cpu"), torch.zeros(1), plan=plan)
    assert system.plan is plan
    assert build_system("engine-fp8", lambda: None, torch.device("cpu"), torch.zeros(1), plan=plan).plan is plan
    assert FastdiffT2I(None, torch.float16, torch.device("cpu"), "engine", plan=plan).plan is plan
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    for model in ("ddpm-cifar10", "fashion-mnist-t2i"):
        assert main(["bench", "--model", model, "--device", "cpu", "--plan", str(bad), "--out-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "plan.json" in err[0], err
