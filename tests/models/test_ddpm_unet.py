"""DDPMUNet vs diffusers' UNet2DModel: tiny random models saved with save_pretrained, read by load_unet."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from fastdiff.errors import FastdiffError
from fastdiff.models import load_unet
from fastdiff.models.ddpm_unet import DDPM_PRESETS, DDPMUNet, DDPMUNetConfig

TOL = 1e-4  # fp32 max abs diff; observed <= 1e-6 (outputs are O(1))

CASES = {
    # multi-head attention (15 / 3 = 5 heads) in down, mid (own group count) and up; DDPM padding/embedding
    "multihead_pad0": dict(
        sample_size=12,
        in_channels=3,
        out_channels=5,
        block_out_channels=(9, 15, 15),
        norm_num_groups=3,
        attn_norm_num_groups=5,
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        layers_per_block=1,
        attention_head_dim=3,
        norm_eps=1e-6,
        flip_sin_to_cos=False,
        freq_shift=1,
        downsample_padding=0,
    ),
    # single-head attention only in the up path, centred input, scaled mid block, .bin weights
    "single_head_bin": dict(
        sample_size=20,
        in_channels=2,
        out_channels=2,
        block_out_channels=(6, 12),
        norm_num_groups=3,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D"),
        layers_per_block=2,
        attention_head_dim=None,
        center_input_sample=True,
        mid_block_scale_factor=1.5,
        downsample_padding=1,
    ),
    # heads not dividing channels (9 // 4 = 2 heads of 4), mid without attention, own time-embedding width
    "uneven_heads_unet_subfolder": dict(
        sample_size=16,
        in_channels=1,
        out_channels=2,
        block_out_channels=(9, 9, 18),
        norm_num_groups=9,
        down_block_types=("AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D", "AttnUpBlock2D"),
        layers_per_block=1,
        attention_head_dim=4,
        add_attention=False,
        time_embedding_dim=20,
        norm_eps=1e-4,
        freq_shift=2,
    ),
    # one level (no resampling), no mid block, odd spatial size
    "one_level_no_mid": dict(
        sample_size=5,
        in_channels=3,
        out_channels=3,
        block_out_channels=(6,),
        norm_num_groups=2,
        down_block_types=("AttnDownBlock2D",),
        up_block_types=("AttnUpBlock2D",),
        mid_block_type=None,
        layers_per_block=1,
        attention_head_dim=2,
    ),
}


def random_diffusers_unet(kwargs: dict, seed: int) -> nn.Module:
    """A diffusers UNet2DModel whose every parameter (GroupNorm affines included) is random (skips without
    diffusers)."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(seed)
    model = diffusers.UNet2DModel(**kwargs).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model


def save(model: nn.Module, tmp_path, name: str):
    """Save like diffusers does; returns the path to hand to load_unet."""
    if name.endswith("_bin"):
        model.save_pretrained(tmp_path / name, safe_serialization=False)
    elif name.endswith("_unet_subfolder"):
        model.save_pretrained(tmp_path / name / "unet")
    else:
        model.save_pretrained(tmp_path / name)
    return tmp_path / name


def max_diff_vs_diffusers(ours: nn.Module, ref: nn.Module, size: int, chans: int, seed: int) -> float:
    """Largest |ours - diffusers| over random x and integer t, batch 1 and 3."""
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    for batch in (1, 3):
        x = torch.randn(batch, chans, size, size, generator=generator)
        t = torch.randint(0, 1000, (batch,), generator=generator)
        with torch.no_grad():
            expected = ref(x, t).sample
            got = ours(x, t)
        assert got.shape == expected.shape
        assert torch.isfinite(got).all()
        worst = max(worst, (got - expected).abs().max().item())
    return worst


@pytest.mark.parametrize("name", list(CASES))
def test_matches_diffusers(name, tmp_path):
    kwargs = CASES[name]
    seed = list(CASES).index(name)
    ref = random_diffusers_unet(kwargs, seed)
    ours = load_unet(save(ref, tmp_path, name))
    assert isinstance(ours, DDPMUNet)
    diff = max_diff_vs_diffusers(ours, ref, kwargs["sample_size"], kwargs["in_channels"], seed + 100)
    assert diff <= TOL, f"{name}: max abs diff {diff:.3g}"


def test_timestep_forms(tmp_path):
    """A Python int, a 0-d tensor and a one-element tensor broadcast over the batch like diffusers."""
    kwargs = CASES["multihead_pad0"]
    ref = random_diffusers_unet(kwargs, 7)
    ours = load_unet(save(ref, tmp_path, "multihead_pad0"))
    x = torch.randn(2, 3, 12, 12)
    with torch.no_grad():
        expected = ref(x, 417).sample
        for t in (417, torch.tensor(417), torch.tensor([417]), torch.tensor([417.0, 417.0])):
            assert (ours(x, t) - expected).abs().max().item() <= TOL


def test_old_attention_keys_are_converted(tmp_path):
    """google/ddpm-* checkpoints name attention weights query/key/value/proj_attn."""
    kwargs = CASES["multihead_pad0"]
    ref = random_diffusers_unet(kwargs, 11)
    path = save(ref, tmp_path, "multihead_pad0")
    weights = path / "diffusion_pytorch_model.safetensors"
    new_to_old = {".to_q.": ".query.", ".to_k.": ".key.", ".to_v.": ".value.", ".to_out.0.": ".proj_attn."}
    original = load_file(str(weights))
    state = {}
    for key, value in original.items():
        for new, old in new_to_old.items():
            key = key.replace(new, old)
        state[key] = value
    assert sum(".proj_attn." in key for key in state) == sum(".to_out.0." in key for key in original) == 14
    save_file(state, str(weights))
    diff = max_diff_vs_diffusers(load_unet(path), ref, 12, 3, 12)
    assert diff <= TOL


@pytest.mark.parametrize("preset", list(DDPM_PRESETS))
def test_preset_layout_matches_diffusers(preset):
    """Every parameter name and shape of a preset equals diffusers' UNet2DModel with the same config."""
    diffusers = pytest.importorskip("diffusers")
    config = DDPM_PRESETS[preset]
    with torch.device("meta"):
        ours = DDPMUNet(config)
        ref = diffusers.UNet2DModel(**dataclasses.asdict(config))
    shapes = {k: v.shape for k, v in ours.state_dict().items()}
    assert shapes == {k: v.shape for k, v in ref.state_dict().items()}


def test_celebahq_preset_config():
    config = DDPM_PRESETS["ddpm-celebahq-256"]
    assert config.sample_size == 256
    assert config.block_out_channels == (128, 128, 256, 256, 512, 512)
    assert config.down_block_types == ("DownBlock2D",) * 4 + ("AttnDownBlock2D", "DownBlock2D")
    assert config.up_block_types == ("UpBlock2D", "AttnUpBlock2D") + ("UpBlock2D",) * 4
    assert (config.norm_eps, config.flip_sin_to_cos, config.freq_shift) == (1e-6, False, 1)
    assert (config.downsample_padding, config.attention_head_dim) == (0, None)


def test_cifar10_preset_runs():
    model = load_unet("ddpm-cifar10")
    assert model.config == DDPM_PRESETS["ddpm-cifar10"]
    with torch.no_grad():
        out = model(torch.randn(1, 3, 32, 32), torch.tensor([999]))
    assert out.shape == (1, 3, 32, 32)
    assert torch.isfinite(out).all()


def test_bad_forward_arguments():
    model = DDPMUNet(DDPMUNetConfig.from_dict(CASES["multihead_pad0"]))
    with pytest.raises(FastdiffError, match="multiples of 4"):
        model(torch.randn(1, 3, 10, 12), 5)
    with pytest.raises(FastdiffError, match=r"\[B, 3, H, W\]"):
        model(torch.randn(1, 4, 12, 12), 5)
    with pytest.raises(FastdiffError, match="batch size 3"):
        model(torch.randn(3, 3, 12, 12), torch.tensor([1, 2]))
