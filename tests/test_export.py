"""fastdiff export --format onnx: the ONNX U-Net runs in ONNX Runtime at any batch size and matches eager fp32;
the output folder is complete or absent."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from fastdiff import export
from fastdiff.cli import main
from fastdiff.errors import FastdiffError
from fastdiff.models.ddpm_unet import DDPMUNet, DDPMUNetConfig

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

TINY_DDPM = {
    "_class_name": "UNet2DModel",
    "sample_size": [8, 12],
    "in_channels": 3,
    "out_channels": 3,
    "block_out_channels": [6, 9],
    "norm_num_groups": 3,
    "layers_per_block": 1,
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
    "up_block_types": ["AttnUpBlock2D", "UpBlock2D"],
    "attention_head_dim": 3,
}


@pytest.fixture
def tiny_ddpm_dir(tmp_path):
    """A tiny diffusers-format UNet2DModel folder with seeded random weights."""
    root = tmp_path / "tiny-ddpm"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(TINY_DDPM))
    torch.manual_seed(3)
    model = DDPMUNet(DDPMUNetConfig.from_dict(TINY_DDPM))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))  # no all-zero layer hides a wrong export
    save_file(model.state_dict(), str(root / "diffusion_pytorch_model.safetensors"))
    return root


def run_onnx(folder, sample: np.ndarray, timestep: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(folder / "unet.onnx"), providers=["CPUExecutionProvider"])
    return session.run(None, {"sample": sample, "timestep": timestep})[0]


@pytest.mark.parametrize("model", ["fashion-mnist", "tiny-ddpm"])
def test_onnx_matches_eager_at_other_batch_sizes(model, tiny_ddpm_dir, tmp_path):
    source = str(tiny_ddpm_dir) if model == "tiny-ddpm" else model
    out = tmp_path / "onnx"
    assert main(["export", "--format", "onnx", "--model", source, "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "unet.onnx"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left
    info = json.loads((out / "model.json").read_text())
    unet = export.load_fp32_unet(source)
    channels, size = unet.config.in_channels, unet.config.sample_size
    height, width = (size, size) if isinstance(size, int) else size
    assert info["inputs"][0] == {"name": "sample", "dtype": "float32", "shape": ["batch", channels, height, width]}
    assert info["inputs"][1]["name"] == "timestep" and info["outputs"][0]["shape"][0] == "batch"
    assert set(info["check"]["max_abs_diff"]) == {"1", "3"}
    assert max(info["check"]["max_abs_diff"].values()) <= 1e-4
    for batch in (2, 5):
        gen = torch.Generator().manual_seed(100 + batch)
        sample = torch.randn(batch, channels, height, width, generator=gen)
        timestep = torch.tensor([999, 0, 500, 17, 250][:batch])
        with torch.no_grad():
            expected = unet(sample, timestep).numpy()
        got = run_onnx(out, sample.numpy(), timestep.numpy())
        assert got.shape == expected.shape
        assert np.abs(got - expected).max() <= 1e-4
        assert np.abs(expected).max() > 1e-2


def test_existing_output_needs_overwrite_and_failures_leave_nothing(tiny_ddpm_dir, tmp_path, monkeypatch):
    out = tmp_path / "onnx"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    with pytest.raises(FastdiffError, match="exists and is not empty"):
        export.export_onnx(str(tiny_ddpm_dir), out)
    assert (out / "old.txt").read_text() == "keep me"

    monkeypatch.setattr(export, "TOLERANCE", -1.0)  # no export can pass: the check must refuse it
    with pytest.raises(FastdiffError, match="ONNX Runtime differs from eager fp32"):
        export.export_onnx(str(tiny_ddpm_dir), out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["old.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx", "tiny-ddpm"]

    monkeypatch.undo()
    export.export_onnx(str(tiny_ddpm_dir), out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "unet.onnx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx", "tiny-ddpm"]


def test_bad_output_location(tmp_path, tiny_ddpm_dir, capsys):
    file = tmp_path / "file"
    file.write_text("")
    assert main(["export", "--model", str(tiny_ddpm_dir), "--out", str(file)]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_float_timestep_export_takes_fractional_timesteps(tiny_ddpm_dir, tmp_path):
    out = tmp_path / "onnx"
    assert main(["export", "--model", str(tiny_ddpm_dir), "--out", str(out), "--timestep-dtype", "float32"]) == 0
    info = json.loads((out / "model.json").read_text())
    assert info["inputs"][1] == {"name": "timestep", "dtype": "float32", "shape": ["batch"]}
    unet = export.load_fp32_unet(str(tiny_ddpm_dir))
    sample = torch.randn(3, 3, 8, 12, generator=torch.Generator().manual_seed(7))
    timestep = torch.tensor([999.0, 0.25, 417.6])
    with torch.no_grad():
        expected = unet(sample, timestep).numpy()
    got = run_onnx(out, sample.numpy(), timestep.numpy())
    assert np.abs(got - expected).max() <= 1e-4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--format", "tflite"], "argument --format: invalid choice: 'tflite'"),
        (["--timestep-dtype", "float16"], "argument --timestep-dtype: invalid choice: 'float16'"),
        (["--opset", "99"], "--opset must be in"),
    ],
)
def test_text_to_image_errors_are_one_line_before_loading(argv, message, tmp_path, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("loaded the model before refusing the arguments")

    monkeypatch.setattr(export, "export_text_to_image", no_loading)
    out = tmp_path / "onnx"
    try:
        code = main(["export", "--model", "fashion-mnist-t2i", "--out", str(out), *argv])
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1
    assert not out.exists()


@pytest.mark.slow
def test_text_to_image_export_reproduces_the_pipeline(tmp_path):
    """The exported fashion-mnist-t2i in an ONNX Runtime loop (tokenizer, text encoder, DDIM with guidance, VAE
    decode) gives fastdiff's own TextToImagePipeline image for the same initial latents."""
    from diffusers import DDIMScheduler
    from transformers import CLIPTokenizer

    from fastdiff.pipelines.text_to_image import TextToImagePipeline

    out = tmp_path / "onnx"
    assert main(["export", "--model", "fashion-mnist-t2i", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "model.json", "scheduler", "text_encoder.onnx", "tokenizer", "unet.onnx", "vae_decoder.onnx",
    ]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx"]  # no staging folder left
    info = json.loads((out / "model.json").read_text())
    assert info["graphs"]["unet"]["inputs"][1] == {"name": "timestep", "dtype": "float32", "shape": ["batch"]}
    for graph in info["graphs"].values():
        assert set(graph["check"]["max_abs_diff"]) == {"1", "3"}
        assert max(graph["check"]["max_abs_diff"].values()) <= graph["check"]["tolerance"] <= 1e-4

    prompt, guidance, steps = "ankle boot", 3.0, 4
    pipe = TextToImagePipeline.from_pretrained("fashion-mnist-t2i", device="cpu", sampler="ddim", steps=steps)
    latents = torch.randn(1, *pipe.latent_shape(), generator=torch.Generator().manual_seed(5))  # 4x16x16
    expected = pipe(prompt, guidance_scale=guidance, latents=latents, output_type="pt", progress=False).numpy()

    def session(name):
        return ort.InferenceSession(str(out / info["graphs"][name]["file"]), providers=["CPUExecutionProvider"])

    tokenizer = CLIPTokenizer.from_pretrained(str(out / info["tokenizer"]["folder"]), local_files_only=True)
    ids = tokenizer(["", prompt], padding="max_length", max_length=info["tokenizer"]["max_length"], truncation=True)
    (states,) = session("text_encoder").run(None, {"input_ids": np.asarray(ids.input_ids, dtype=np.int64)})
    scheduler = DDIMScheduler.from_config(info["scheduler_config"])
    scheduler.set_timesteps(steps)
    unet = session("unet")
    x = latents.numpy() * float(scheduler.init_noise_sigma)
    for t in scheduler.timesteps:
        timestep = np.full(2, float(t), dtype=np.float32)
        (out_both,) = unet.run(
            None, {"sample": np.concatenate([x, x]), "timestep": timestep, "encoder_hidden_states": states}
        )
        uncond, cond = out_both[:1], out_both[1:]
        eps = uncond + guidance * (cond - uncond)
        x = scheduler.step(torch.from_numpy(eps), t, torch.from_numpy(x)).prev_sample.numpy()
    (image,) = session("vae_decoder").run(None, {"latents": x.astype(np.float32)})
    got = np.clip(image / 2 + 0.5, 0, 1)
    assert got.shape == expected.shape == (1, 1, 32, 32)
    assert np.abs(got - expected).max() <= 1e-3
    assert expected.std() > 0.05  # an image, not a flat field


@pytest.mark.slow
def test_text_to_image_export_failing_its_last_check_leaves_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(export, "VAE_TOLERANCE", -1.0)  # text encoder and U-Net pass; the VAE decoder cannot
    out = tmp_path / "onnx"
    assert main(["export", "--model", "fashion-mnist-t2i", "--out", str(out)]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # (transformers' weight-loading bar comes before it)
    assert last.startswith("fastdiff: error: vae_decoder: ONNX Runtime differs from eager fp32 by ")
    assert sorted(p.name for p in tmp_path.iterdir()) == []
