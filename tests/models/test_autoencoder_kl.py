"""AutoencoderKL vs diffusers' on tiny VAEs (SD's structure, and a variant without quant convs / mid attention):
encoder mean / logvar / seeded samples and decoder images; plus the full-size SD VAE preset against diffusers."""

from __future__ import annotations

import pytest
import torch
from sd_fixtures import SD_VAE_CONFIG, make_diffusers_vae, tiny_vae_config

from fastdiff.errors import FastdiffError
from fastdiff.models import model_from_config
from fastdiff.models.autoencoder_kl import (
    SD15_VAE_CONFIG,
    SD21_VAE_CONFIG,
    AutoencoderKL,
    AutoencoderKLConfig,
    autoencoder_kl_from_dir,
)
from fastdiff.models.weights import read_json_object

TOL = 1e-4  # fp32 max abs diff; observed 0 (same op order as diffusers; outputs are O(1))

PLAIN_CONFIG = dict(
    # two levels of 8 / 12 channels (4 groups), two resnets per level, no quant convs, no mid attention,
    # 5 latent channels, 2 -> 1 image channels
    in_channels=2,
    out_channels=1,
    down_block_types=["DownEncoderBlock2D"] * 2,
    up_block_types=["UpDecoderBlock2D"] * 2,
    block_out_channels=[8, 12],
    layers_per_block=2,
    latent_channels=5,
    norm_num_groups=4,
    use_quant_conv=False,
    use_post_quant_conv=False,
    mid_block_add_attention=False,
)

CASES = {
    # name: (diffusers config, batch, image H x W, weights file format)
    "sd": (tiny_vae_config("sd15"), 2, (24, 40), "safetensors"),
    "sd_odd_image": (tiny_vae_config("sd21"), 1, (21, 34), "bin"),  # the encoder rounds odd sizes up
    "plain": (PLAIN_CONFIG, 3, (10, 6), "safetensors"),
}


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and torch.isfinite(a).all()
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_diffusers(name, tmp_path):
    pytest.importorskip("diffusers")
    config, batch, (h, w), weights_format = CASES[name]
    seed = 2000 + sorted(CASES).index(name)
    ref = make_diffusers_vae(config, seed)
    ref.save_pretrained(str(tmp_path), safe_serialization=weights_format == "safetensors")
    model = autoencoder_kl_from_dir(tmp_path, read_json_object(tmp_path / "config.json")).eval()

    gen = torch.Generator().manual_seed(seed)
    image = torch.rand(batch, config["in_channels"], h, w, generator=gen) * 2 - 1
    with torch.no_grad():
        expected = ref.encode(image).latent_dist
        got = model.encode(image)
        assert max_abs(got.mean, expected.mean) <= TOL
        assert max_abs(got.logvar, expected.logvar) <= TOL
        assert max_abs(got.std, expected.std) <= TOL
        sample = got.sample(torch.Generator().manual_seed(7))
        assert max_abs(sample, expected.sample(torch.Generator().manual_seed(7))) <= TOL

        latents = torch.randn(batch, config["latent_channels"], (h + 3) // 4, (w + 3) // 4, generator=gen)
        decoded = ref.decode(latents).sample
        assert decoded.abs().max() > 0.1
        assert max_abs(model.decode(latents), decoded) <= TOL


@pytest.mark.parametrize("preset", [SD15_VAE_CONFIG, SD21_VAE_CONFIG], ids=["sd15", "sd21"])
def test_full_size_preset_matches_diffusers_architecture(preset):
    diffusers = pytest.importorskip("diffusers")
    assert AutoencoderKLConfig.from_dict(SD_VAE_CONFIG).block_out_channels == preset.block_out_channels
    assert preset.scaling_factor == 0.18215
    with torch.device("meta"):
        ours = model_from_config(preset)
        ref = diffusers.AutoencoderKL.from_config(SD_VAE_CONFIG)
    shapes = {key: tuple(t.shape) for key, t in ours.state_dict().items()}
    assert shapes == {key: tuple(t.shape) for key, t in ref.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) == 83_653_863


def test_old_attention_key_names_load(tmp_path):
    """Checkpoints from before diffusers 0.14 name the mid attention query/key/value/proj_attn."""
    pytest.importorskip("diffusers")
    from safetensors.torch import save_file

    ref = make_diffusers_vae(tiny_vae_config("sd15"), 3)
    ref.save_pretrained(str(tmp_path))
    renames = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    old_state = {}
    for key, value in ref.state_dict().items():
        for new, old in renames.items():
            key = key.replace(f".attentions.0.{new}.", f".attentions.0.{old}.")
        old_state[key] = value.contiguous()
    assert any(".query." in key for key in old_state)
    save_file(old_state, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    model = autoencoder_kl_from_dir(tmp_path, read_json_object(tmp_path / "config.json"))
    latents = torch.randn(1, 4, 3, 4)
    with torch.no_grad():
        assert max_abs(model.decode(latents), ref.decode(latents).sample) <= TOL


def test_errors_are_one_line(tmp_path):
    with pytest.raises(FastdiffError, match="AttnDownEncoderBlock2D"):
        AutoencoderKLConfig.from_dict({**tiny_vae_config("sd15"), "down_block_types": ["AttnDownEncoderBlock2D"] * 4})
    with pytest.raises(FastdiffError, match="'VQModel' is not supported"):
        autoencoder_kl_from_dir(tmp_path, {"_class_name": "VQModel"})
    with pytest.raises(FastdiffError, match="no weights"):
        autoencoder_kl_from_dir(tmp_path, tiny_vae_config("sd15"))
    model = AutoencoderKL(AutoencoderKLConfig.from_dict(tiny_vae_config("sd15")))
    with pytest.raises(FastdiffError, match="image shape"):
        model.encode(torch.randn(1, 4, 8, 8))
    with pytest.raises(FastdiffError, match="latent shape"):
        model.decode(torch.randn(1, 3, 8, 8))
