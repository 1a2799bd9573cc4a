"""load_unet turns every bad model path, config or weight file into a one-line FastdiffError naming it."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from fastdiff.errors import FastdiffError
from fastdiff.models import load_unet
from fastdiff.models.ddpm_unet import DDPMUNet, DDPMUNetConfig

TINY = {
    "_class_name": "UNet2DModel",
    "_diffusers_version": "0.42.1",
    "sample_size": 8,
    "block_out_channels": [6, 9],
    "norm_num_groups": 3,
    "layers_per_block": 1,
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
    "up_block_types": ["AttnUpBlock2D", "UpBlock2D"],
    "attention_head_dim": 3,
}


def write_model(root, config: dict, weights_config: dict | None = None):
    """``root`` holding ``config`` as config.json and (optionally) weights of a ``weights_config`` model."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    if weights_config is not None:
        model = DDPMUNet(DDPMUNetConfig.from_dict(weights_config))
        save_file(model.state_dict(), str(root / "diffusion_pytorch_model.safetensors"))
    return root


def expect_error(path, *words: str) -> str:
    with pytest.raises(FastdiffError) as info:
        load_unet(path)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    return message


def test_valid_tiny_model_loads(tmp_path):
    model = load_unet(write_model(tmp_path / "ok", TINY, TINY))
    assert model.config.block_out_channels == (6, 9)


def test_missing_path(tmp_path):
    expect_error(tmp_path / "nowhere", "not found", "nowhere")


def test_file_instead_of_directory(tmp_path):
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    expect_error(file, "not a directory", "model.safetensors")


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    expect_error(tmp_path / "empty", "no config.json", "empty")


def test_config_without_weights(tmp_path):
    root = write_model(tmp_path / "noweights", TINY)
    expect_error(root, "no weights", "diffusion_pytorch_model.safetensors")


def test_invalid_json(tmp_path):
    root = tmp_path / "badjson"
    root.mkdir()
    (root / "config.json").write_text('{"block_out_channels": [6, 9],')
    expect_error(root, "config.json", "not valid JSON")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("class_embed_type", "timestep"),
        ("num_class_embeds", 10),
        ("time_embedding_type", "fourier"),
        ("resnet_time_scale_shift", "scale_shift"),
        ("act_fn", "gelu"),
        ("downsample_type", "resnet"),
        ("upsample_type", "resnet"),
        ("mid_block_type", "UNetMidBlock2DCrossAttn"),
    ],
)
def test_unsupported_config_value(tmp_path, key, value):
    root = write_model(tmp_path / "unsupported", {**TINY, key: value}, TINY)
    expect_error(root, "config.json", key, str(value))


@pytest.mark.parametrize(
    ("key", "blocks", "bad"),
    [
        ("down_block_types", ["DownBlock2D", "SkipDownBlock2D"], "SkipDownBlock2D"),
        ("up_block_types", ["CrossAttnUpBlock2D", "UpBlock2D"], "CrossAttnUpBlock2D"),
    ],
)
def test_unsupported_block_type(tmp_path, key, blocks, bad):
    expect_error(write_model(tmp_path / "block", {**TINY, key: blocks}, TINY), key, bad)


def test_inconsistent_architecture(tmp_path):
    expect_error(write_model(tmp_path / "groups", {**TINY, "norm_num_groups": 4}), "norm_num_groups=4")
    expect_error(write_model(tmp_path / "levels", {**TINY, "block_out_channels": [6]}), "same nonzero length")
    expect_error(write_model(tmp_path / "type", {**TINY, "layers_per_block": "two"}), "invalid config value")


def test_unknown_key_is_ignored(tmp_path, caplog):
    load_unet(write_model(tmp_path / "extra", {**TINY, "some_future_key": 1}, TINY))
    assert "some_future_key" in caplog.text


def test_mismatched_weight_shapes(tmp_path):
    root = write_model(tmp_path / "shapes", {**TINY, "block_out_channels": [6, 12]}, TINY)
    expect_error(root, "shape", "diffusion_pytorch_model.safetensors")


def test_missing_and_unexpected_weights(tmp_path):
    no_mid_attention = {**TINY, "add_attention": False}
    expect_error(write_model(tmp_path / "extra", no_mid_attention, TINY), "unexpected weights", "mid_block")
    expect_error(write_model(tmp_path / "missing", TINY, no_mid_attention), "weights missing", "mid_block")


def test_corrupt_weights(tmp_path):
    root = write_model(tmp_path / "corrupt", TINY)
    (root / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    expect_error(root, "cannot read weights")


def test_unknown_preset():
    expect_error("ddpm-no-such-preset", "unknown model", "ddpm-no-such-preset", "ddpm-cifar10")
