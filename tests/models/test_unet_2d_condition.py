"""UNet2DConditionModel vs diffusers' on tiny models with SD 1.5 / SD 2.1 structure, saved by diffusers, read by
load_unet; plus the full-size SD presets checked key by key against diffusers on the meta device."""

from __future__ import annotations

import pytest
import torch
from sd_fixtures import SD15_UNET_CONFIG, SD21_UNET_CONFIG, make_diffusers_unet, tiny_unet_config

from fastdiff.errors import FastdiffError
from fastdiff.models import load_unet, model_from_config
from fastdiff.models.unet_2d_condition import (
    SD15_CONFIG,
    SD21_CONFIG,
    UNet2DConditionConfig,
    UNet2DConditionModel,
)

TOL = 1e-4  # fp32 max abs diff; observed <= 3e-6 (outputs are O(1))

ODD_CONFIG = dict(
    # 3 levels of 12/20/28 channels (4 groups), heads 2/3/4 (20 // 3 = 6 channels per head: attention width 18),
    # two transformer layers in the mid block and the first up block, linear projections, no flip, shifted
    # frequencies, own time-embedding width, centred input, scaled mid block, DDPM-style downsample padding,
    # 5x5 conv_in and 1x1 conv_out
    in_channels=3,
    out_channels=5,
    block_out_channels=[12, 20, 28],
    norm_num_groups=4,
    norm_eps=1e-4,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    layers_per_block=2,
    attention_head_dim=[2, 3, 4],
    transformer_layers_per_block=[1, 1, 2],
    cross_attention_dim=10,
    use_linear_projection=True,
    flip_sin_to_cos=False,
    freq_shift=1,
    time_embedding_dim=36,
    center_input_sample=True,
    mid_block_scale_factor=1.3,
    downsample_padding=0,
    conv_in_kernel=5,
    conv_out_kernel=1,
)

NO_MID_CONFIG = dict(
    # two levels without a mid block, 1x1-conv projections, cross-attention only on the way down
    in_channels=4,
    out_channels=4,
    block_out_channels=[8, 16],
    norm_num_groups=8,
    down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
    up_block_types=["UpBlock2D", "UpBlock2D"],
    mid_block_type=None,
    layers_per_block=1,
    attention_head_dim=2,
    cross_attention_dim=6,
)

CASES = {
    # name: (diffusers config, batch, latent H x W, text tokens, weights file format, saved in a unet/ subfolder)
    "sd15": (tiny_unet_config("sd15"), 2, (16, 24), 77, "safetensors", False),
    "sd21_odd_latent": (tiny_unet_config("sd21"), 2, (12, 20), 77, "safetensors", True),  # not multiples of 8
    "odd": (ODD_CONFIG, 3, (7, 13), 5, "bin", False),
    "no_mid": (NO_MID_CONFIG, 1, (6, 10), 3, "safetensors", False),
}


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and torch.isfinite(a).all()
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_diffusers(name, tmp_path):
    pytest.importorskip("diffusers")
    config, batch, (h, w), tokens, weights_format, subfolder = CASES[name]
    seed = 1000 + sorted(CASES).index(name)
    ref = make_diffusers_unet(config, seed)
    save_dir = tmp_path / "unet" if subfolder else tmp_path
    ref.save_pretrained(str(save_dir), safe_serialization=weights_format == "safetensors")
    model = load_unet(tmp_path)
    assert isinstance(model, UNet2DConditionModel) and model.scheduler_config is None

    gen = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, config["in_channels"], h, w, generator=gen)
    text = torch.randn(batch, tokens, config["cross_attention_dim"], generator=gen)
    timesteps = [
        torch.randint(0, 1000, (batch,), generator=gen),  # one integer timestep per sample
        torch.tensor(637.25),  # 0-d fractional, broadcast over the batch
        981,  # a Python int
    ]
    with torch.no_grad():
        for t in timesteps:
            expected = ref(sample, t, text).sample
            got = model(sample, t, text)
            assert expected.abs().max() > 0.1
            assert max_abs(got, expected) <= TOL, (name, t)


@pytest.mark.parametrize(
    ("preset", "shipped", "params"),
    [(SD15_CONFIG, SD15_UNET_CONFIG, 859_520_964), (SD21_CONFIG, SD21_UNET_CONFIG, 865_910_724)],
    ids=["sd15", "sd21"],
)
def test_full_size_presets_match_diffusers_architecture(preset, shipped, params):
    diffusers = pytest.importorskip("diffusers")
    assert UNet2DConditionConfig.from_dict(shipped) == preset
    with torch.device("meta"):
        ours = model_from_config(preset)
        ref = diffusers.UNet2DConditionModel.from_config(shipped)
    shapes = {key: tuple(t.shape) for key, t in ours.state_dict().items()}
    assert shapes == {key: tuple(t.shape) for key, t in ref.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) == params


def config_error(**changes) -> str:
    config = {**tiny_unet_config("sd15"), **changes}
    with pytest.raises(FastdiffError) as info:
        UNet2DConditionConfig.from_dict(config, source="unet/config.json")
    message = str(info.value)
    assert "\n" not in message and message.startswith("unet/config.json: ")
    return message


def test_unsupported_config_values_raise_one_line_errors():
    assert "class_embed_type='timestep'" in config_error(class_embed_type="timestep")
    assert "SimpleCrossAttnDownBlock2D" in config_error(
        down_block_types=["SimpleCrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"]
    )
    assert "attention_head_dim" in config_error(attention_head_dim=[5, 10, 20])
    assert "addition_embed_type" in config_error(addition_embed_type="text_time")
    assert "only_cross_attention" in config_error(only_cross_attention=True)
    assert "norm_num_groups" in config_error(norm_num_groups=24)
    assert "layers_per_block" in config_error(layers_per_block=[1, 1, 1, 1])


def test_unknown_config_key_warns(caplog):
    config = {**tiny_unet_config("sd15"), "some_future_key": 1}
    with caplog.at_level("WARNING"):
        UNet2DConditionConfig.from_dict(config)
    assert "some_future_key" in caplog.text


def test_wrong_input_shapes_raise():
    model = UNet2DConditionModel(UNet2DConditionConfig.from_dict(tiny_unet_config("sd15"))).eval()
    sample, text = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 32)
    for args, words in [
        ((torch.randn(2, 3, 8, 8), 1, text), "sample shape"),
        ((sample, 1, torch.randn(2, 5, 31)), "encoder_hidden_states"),
        ((sample, 1, torch.randn(1, 5, 32)), "encoder_hidden_states"),
        ((sample, torch.tensor([1, 2, 3]), text), "timestep shape"),
    ]:
        with pytest.raises(FastdiffError, match=words):
            model(*args)
