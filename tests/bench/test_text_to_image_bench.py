"""The Stable Diffusion bench on a tiny preset on the CPU: every row filled, fastdiff eager equal to diffusers."""

from __future__ import annotations

import json

import pytest
import torch
from sd_fixtures import tiny_unet_config, tiny_vae_config

from fastdiff.bench import text_to_image as bench
from fastdiff.errors import FastdiffError
from fastdiff.models import stable_diffusion
from fastdiff.models.autoencoder_kl import AutoencoderKLConfig
from fastdiff.models.unet_2d_condition import UNet2DConditionConfig

TINY_TEXT = dict(vocab_size=600, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=77, hidden_act="quick_gelu", projection_dim=32)  # fmt: skip


@pytest.fixture
def tiny_preset(monkeypatch):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    unet = {k: v for k, v in tiny_unet_config("sd15").items() if not k.startswith("_")}
    vae = {k: v for k, v in tiny_vae_config("sd15").items() if not k.startswith("_")}
    preset = stable_diffusion.StableDiffusionPreset(
        UNet2DConditionConfig.from_dict(unet), AutoencoderKLConfig.from_dict(vae), TINY_TEXT,
        stable_diffusion.SD15_SCHEDULER_CONFIG,
    )  # fmt: skip
    monkeypatch.setitem(stable_diffusion.SD_PRESETS, "tiny", preset)
    return "tiny"


def test_tiny_bench_on_cpu(tiny_preset):
    cfg = bench.TextToImageBenchConfig(
        model=tiny_preset, height=64, width=64, steps=2, repeats=1, unet_calls=1, device="cpu",
        systems=("eager-fp32", "diffusers-fp32"),
    )  # fmt: skip
    partial = []
    result = bench.run_text_to_image_bench(cfg, on_row=lambda r: partial.append(len(r["results"])))
    assert partial == [1, 2]
    json.dumps(result)  # JSON-ready
    eager, diffusers = result["results"]
    for row in (eager, diffusers):
        assert row["error"] is None, row["error"]
        assert row["end_to_end_ms"] > 0 and row["unet_step_ms"] > 0 and row["weights_mib"] > 0
    assert eager["psnr_vs_diffusers_fp32_db"] > 60  # same weights, latents and scheduler: equal images


def test_unknown_system_and_preset():
    with pytest.raises(FastdiffError, match="unknown system 'tensorrt-fp16'"):
        bench.run_text_to_image_bench(bench.TextToImageBenchConfig(systems=("tensorrt-fp16",)))
    with pytest.raises(FastdiffError, match="unknown Stable Diffusion preset .sd9.: choose one of sd15, sd21"):
        bench.run_text_to_image_bench(bench.TextToImageBenchConfig(model="sd9"))
    with pytest.raises(FastdiffError, match="cache_interval must be an integer >= 1"):
        bench.run_text_to_image_bench(bench.TextToImageBenchConfig(cache_interval=0))


def test_bundled_model_bench_on_cpu():
    """The bundled fashion-mnist-t2i model at its own size (32x32, 4 pixels per latent), trained weights."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    cfg = bench.TextToImageBenchConfig(
        model="fashion-mnist-t2i", batch=2, steps=2, repeats=1, unet_calls=1, device="cpu",
        systems=("eager-fp32", "diffusers-fp32"),
    )  # fmt: skip
    result = bench.run_text_to_image_bench(cfg)
    assert result["config"]["height"] == result["config"]["width"] == 32
    assert result["config"]["random_weights"] is False
    eager, diffusers = result["results"]
    assert eager["error"] is None and diffusers["error"] is None
    assert eager["psnr_vs_diffusers_fp32_db"] > 60


def test_quality_script_on_cpu(tmp_path):
    """benchmarks/t2i_quality.py on a few images: one row per configuration, accuracy from the classifier."""
    import importlib.util
    from pathlib import Path

    pytest.importorskip("transformers")
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "t2i_quality.py"
    spec = importlib.util.spec_from_file_location("t2i_quality", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "quality.json"
    args = ["--out", str(out), "--per-class", "2", "--guidance", "1,3", "--samplers", "dpmsolver++", "--steps", "2",
            "--systems", "eager-fp32", "--device", "cpu", "--intervals", "0:1,0.5:1"]  # fmt: skip
    assert module.main(args) == 0
    rows = json.loads(out.read_text())["results"]
    got = [(r["guidance"], r.get("guidance_interval"), r["images"]) for r in rows]
    assert got == [(1.0, None, 20), (3.0, None, 20), (3.0, [0.5, 1.0], 20)]  # no interval rows without guidance
    assert all(0.0 <= r["accuracy"] <= 1.0 and "fd_fmnist" not in r for r in rows)  # 20 images: too few for an FD


@pytest.mark.slow  # (NaN convs are slow on the CPU)
def test_a_system_with_non_finite_images_is_an_error_row(tiny_preset, monkeypatch):
    """A speed for a broken image is no result: the row keeps its times but says why it failed and has no PSNR; a
    broken reference gives no PSNR to the others."""
    draw = bench.random_components

    def broken(*args, **kwargs):
        comps = draw(*args, **kwargs)
        with torch.no_grad():
            comps.unet.conv_out.bias[0] = float("nan")
        return comps

    monkeypatch.setattr(bench, "random_components", broken)
    cfg = bench.TextToImageBenchConfig(
        model=tiny_preset, height=64, width=64, steps=2, repeats=1, unet_calls=1, device="cpu",
        systems=("eager-fp32", "diffusers-fp32"),
    )  # fmt: skip
    rows = bench.run_text_to_image_bench(cfg)["results"]
    for row in rows:  # the same broken U-Net in both
        assert row["error"].startswith("non-finite output: ") and row["end_to_end_ms"] > 0
        assert row["psnr_vs_diffusers_fp32_db"] is None
