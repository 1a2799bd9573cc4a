"""Stable Diffusion's VAE: a re-implementation of diffusers' ``AutoencoderKL`` whose state dict loads 1:1.

Encoder: conv_in, DownEncoderBlock2Ds (resnets + asymmetric-padding stride-2 conv), mid block (resnet, single-head
attention, resnet), GroupNorm-SiLU-conv to mean and log-variance; quant_conv. Decoder: post_quant_conv, conv_in,
mid block, UpDecoderBlock2Ds (resnets + nearest x2 and conv), GroupNorm-SiLU-conv. No time embedding anywhere.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdiff.errors import FastdiffError
from fastdiff.models.ddpm_unet import Attention as SpatialSelfAttention
from fastdiff.models.ddpm_unet import Downsample2D, ResnetBlock2D, Upsample2D, convert_old_attention_keys
from fastdiff.models.weights import (
    check_allowed,
    config_from_dict,
    find_weights,
    load_state_dict_checked,
    read_state_dict,
)

log = logging.getLogger(__name__)

VAE_EPS = 1e-6  # diffusers' Encoder/Decoder fix the GroupNorm eps of every layer to 1e-6

ALLOWED_VALUES: dict[str, tuple] = {
    "act_fn": ("silu", "swish"),
    "down_block_types": ("DownEncoderBlock2D",),
    "up_block_types": ("UpDecoderBlock2D",),
}
"""Config values fastdiff supports (for the block-type lists: the value of every entry)."""


@dataclass
class AutoencoderKLConfig:
    """Architecture of an ``AutoencoderKL`` (diffusers' config field names and defaults)."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int | tuple[int, int] = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    latents_mean: tuple[float, ...] | None = None
    latents_std: tuple[float, ...] | None = None
    force_upcast: bool = True
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    def __post_init__(self) -> None:
        for name in ("down_block_types", "up_block_types", "block_out_channels"):
            setattr(self, name, tuple(getattr(self, name)))
        for name in ("sample_size", "latents_mean", "latents_std"):
            if isinstance(getattr(self, name), list):
                setattr(self, name, tuple(getattr(self, name)))
        self._validate()

    def _validate(self) -> None:
        check_allowed(ALLOWED_VALUES, "act_fn", self.act_fn)
        for key in ("down_block_types", "up_block_types"):
            for block in getattr(self, key):
                if block not in ALLOWED_VALUES[key]:
                    raise FastdiffError(f"unsupported block {block!r} in {key} (supported: {ALLOWED_VALUES[key][0]})")
        chans = self.block_out_channels
        if not chans or len(self.down_block_types) != len(chans) or len(self.up_block_types) != len(chans):
            raise FastdiffError(
                f"block_out_channels, down_block_types and up_block_types must have the same nonzero length, "
                f"got {len(chans)}, {len(self.down_block_types)}, {len(self.up_block_types)}"
            )
        if not isinstance(self.layers_per_block, int) or self.layers_per_block < 1:
            raise FastdiffError(f"unsupported layers_per_block={self.layers_per_block!r} (an integer >= 1)")
        if any(c % self.norm_num_groups for c in chans):
            raise FastdiffError(
                f"block_out_channels={list(chans)} not all divisible by norm_num_groups={self.norm_num_groups}"
            )

    @classmethod
    def from_dict(cls, config: dict, source: str = "config") -> AutoencoderKLConfig:
        """Config from a diffusers ``config.json`` dict; unsupported values raise, ``_*`` keys are ignored."""
        return config_from_dict(cls, config, source)


SD_VAE_CONFIG_JSON: dict = {
    "_class_name": "AutoencoderKL",
    "_diffusers_version": "0.6.0",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 512,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}
"""runwayml/stable-diffusion-v1-5 vae/config.json (stabilityai/stable-diffusion-2-1's differs in sample_size only)."""

SD15_VAE_CONFIG = AutoencoderKLConfig.from_dict(SD_VAE_CONFIG_JSON, source="SD_VAE_CONFIG_JSON")
SD21_VAE_CONFIG = dataclasses.replace(SD15_VAE_CONFIG, sample_size=768)


class DiagonalGaussian:
    """The encoder's latent distribution: ``mean``, ``logvar`` (clamped to [-30, 20]) and ``std``."""

    def __init__(self, moments: Tensor) -> None:
        self.mean, logvar = moments.chunk(2, dim=1)
        self.logvar = logvar.clamp(-30.0, 20.0)
        self.std = torch.exp(0.5 * self.logvar)

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        """mean + std * noise; the noise is drawn on the generator's device (diffusers' ``randn_tensor``)."""
        device = generator.device if generator is not None else self.mean.device
        noise = torch.randn(self.mean.shape, generator=generator, device=device, dtype=self.mean.dtype)
        return self.mean + self.std * noise.to(self.mean.device)


class VAEMidBlock(nn.Module):
    """Resnet, single-head self-attention (optional), resnet; diffusers' ``UNetMidBlock2D`` without time input."""

    def __init__(self, channels: int, groups: int, add_attention: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock2D(channels, channels, None, groups, VAE_EPS) for _ in range(2)])
        self.attentions = None
        if add_attention:  # one head of all channels
            self.attentions = nn.ModuleList([SpatialSelfAttention(channels, channels, groups, VAE_EPS)])

    def forward(self, x: Tensor) -> Tensor:
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class DownEncoderBlock2D(nn.Module):
    """``layers_per_block`` resnets, then (except at the last level) a stride-2 conv after a right/bottom pad."""

    def __init__(self, in_ch: int, out_ch: int, layers: int, groups: int, downsample: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResnetBlock2D(in_ch if i == 0 else out_ch, out_ch, None, groups, VAE_EPS) for i in range(layers)]
        )
        self.downsamplers = nn.ModuleList([Downsample2D(out_ch, padding=0)]) if downsample else None

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return self.downsamplers[0](x) if self.downsamplers is not None else x


class UpDecoderBlock2D(nn.Module):
    """``layers_per_block + 1`` resnets, then (except at the last level) nearest x2 and a 3x3 conv."""

    def __init__(self, in_ch: int, out_ch: int, layers: int, groups: int, upsample: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            [ResnetBlock2D(in_ch if i == 0 else out_ch, out_ch, None, groups, VAE_EPS) for i in range(layers)]
        )
        self.upsamplers = nn.ModuleList([Upsample2D(out_ch)]) if upsample else None

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return self.upsamplers[0](x) if self.upsamplers is not None else x


class Encoder(nn.Module):
    """Image [B, in_channels, H, W] -> moments [B, 2 * latent_channels, ceil(H / 2**(levels-1)), ...]."""

    def __init__(self, cfg: AutoencoderKLConfig) -> None:
        super().__init__()
        chans, groups, last = cfg.block_out_channels, cfg.norm_num_groups, len(cfg.block_out_channels) - 1
        self.conv_in = nn.Conv2d(cfg.in_channels, chans[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            [
                DownEncoderBlock2D(chans[max(i - 1, 0)], chans[i], cfg.layers_per_block, groups, i < last)
                for i in range(len(chans))
            ]
        )
        self.mid_block = VAEMidBlock(chans[-1], groups, cfg.mid_block_add_attention)
        self.conv_norm_out = nn.GroupNorm(groups, chans[-1], eps=VAE_EPS)
        self.conv_out = nn.Conv2d(chans[-1], 2 * cfg.latent_channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class Decoder(nn.Module):
    """Latents [B, latent_channels, h, w] -> image [B, out_channels, h * 2**(levels-1), ...]."""

    def __init__(self, cfg: AutoencoderKLConfig) -> None:
        super().__init__()
        rev, groups, last = cfg.block_out_channels[::-1], cfg.norm_num_groups, len(cfg.block_out_channels) - 1
        self.conv_in = nn.Conv2d(cfg.latent_channels, rev[0], 3, padding=1)
        self.mid_block = VAEMidBlock(rev[0], groups, cfg.mid_block_add_attention)
        self.up_blocks = nn.ModuleList(
            [
                UpDecoderBlock2D(rev[max(i - 1, 0)], rev[i], cfg.layers_per_block + 1, groups, i < last)
                for i in range(len(rev))
            ]
        )
        self.conv_norm_out = nn.GroupNorm(groups, rev[-1], eps=VAE_EPS)
        self.conv_out = nn.Conv2d(rev[-1], cfg.out_channels, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class AutoencoderKL(nn.Module):
    """diffusers ``AutoencoderKL`` equivalent: ``encode(image) -> DiagonalGaussian``, ``decode(latents) -> image``.

    Latents here are unscaled: multiply ``encode(x).sample()`` by ``config.scaling_factor`` for the U-Net and divide
    before ``decode``, as diffusers' pipelines do.
    """

    def __init__(self, config: AutoencoderKLConfig) -> None:
        super().__init__()
        self.config = cfg = config
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        moments = 2 * cfg.latent_channels
        self.quant_conv = nn.Conv2d(moments, moments, 1) if cfg.use_quant_conv else None
        latent = cfg.latent_channels
        self.post_quant_conv = nn.Conv2d(latent, latent, 1) if cfg.use_post_quant_conv else None

    def encode(self, x: Tensor) -> DiagonalGaussian:
        """Latent distribution of images ``x`` [B, in_channels, H, W] (values in [-1, 1])."""
        if x.ndim != 4 or x.shape[1] != self.config.in_channels:
            raise FastdiffError(f"image shape {tuple(x.shape)}: expected [B, {self.config.in_channels}, H, W]")
        moments = self.encoder(x)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        return DiagonalGaussian(moments)

    def decode(self, z: Tensor) -> Tensor:
        """Images [B, out_channels, 8h, 8w] (for SD's 4 levels; values about [-1, 1]) of latents ``z``."""
        if z.ndim != 4 or z.shape[1] != self.config.latent_channels:
            raise FastdiffError(f"latent shape {tuple(z.shape)}: expected [B, {self.config.latent_channels}, h, w]")
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)


def autoencoder_kl_from_dir(root: Path, config: dict) -> AutoencoderKL:
    """An AutoencoderKL built from ``config`` (the parsed ``root/config.json``) with the weights in ``root``.

    Old checkpoints' attention names (query/key/value/proj_attn) are renamed; the model is built on the meta
    device and takes the file's tensors (and their dtype) as its parameters.
    """
    class_name = config.get("_class_name", "AutoencoderKL")
    if class_name != "AutoencoderKL":
        raise FastdiffError(f"{root / 'config.json'}: model class {class_name!r} is not supported (AutoencoderKL)")
    cfg = AutoencoderKLConfig.from_dict(config, source=str(root / "config.json"))
    weights = find_weights(root)
    with torch.device("meta"):
        model = AutoencoderKL(cfg)
    state = convert_old_attention_keys(read_state_dict(weights))
    load_state_dict_checked(model, state, str(weights), assign=True)
    return model
