"""The bench on the CPU: the engine row is skipped cleanly, the JSON keeps its schema, the kernel-cache state."""

from __future__ import annotations

import dataclasses
import json

import torch
from safetensors.torch import save_file

from fastdiff.bench.runner import SCHEMA, BenchConfig, run_bench
from fastdiff.engine import kernel_cache_state
from fastdiff.models.ddpm_unet import DDPMUNet, DDPMUNetConfig

ROW_KEYS = {"system", "dtype", "ms_per_step", "s_per_image", "images_per_s", "time_to_ready_s", "peak_mem_mb",
            "energy_j_per_image", "avg_power_w", "psnr_db", "max_abs_diff", "notes", "error", "extra"}  # fmt: skip


def test_bench_schema_with_engine_on_cpu(tmp_path):
    torch.manual_seed(0)
    config = DDPMUNetConfig(
        sample_size=8, in_channels=3, out_channels=3, block_out_channels=(6, 9), norm_num_groups=3,
        down_block_types=("AttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "AttnUpBlock2D"),
        layers_per_block=1, attention_head_dim=3,
    )  # fmt: skip
    model = DDPMUNet(config).eval()
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel", **dataclasses.asdict(config)}))
    save_file(model.state_dict(), str(tmp_path / "diffusion_pytorch_model.safetensors"))
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
