"""DDPM U-Net: a re-implementation of diffusers' ``UNet2DModel`` whose state dict loads 1:1.

Supported: DownBlock2D / AttnDownBlock2D / UpBlock2D / AttnUpBlock2D, UNetMidBlock2D (optionally without
attention), positional time embedding, ``resnet_time_scale_shift="default"``, SiLU. Anything else in a
config raises a FastdiffError naming the key and value.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdiff.errors import FastdiffError
from fastdiff.models.weights import (
    check_allowed,
    config_from_dict,
    find_weights,
    load_state_dict_checked,
    read_state_dict,
)

log = logging.getLogger(__name__)

DOWN_BLOCKS = ("DownBlock2D", "AttnDownBlock2D")
UP_BLOCKS = ("UpBlock2D", "AttnUpBlock2D")

ALLOWED_VALUES: dict[str, tuple] = {
    "time_embedding_type": ("positional",),
    "resnet_time_scale_shift": ("default",),
    "act_fn": ("silu", "swish"),
    "mid_block_type": ("UNetMidBlock2D", None),
    "class_embed_type": (None,),
    "num_class_embeds": (None,),
    "downsample_type": ("conv",),
    "upsample_type": ("conv",),
}
"""diffusers config keys that fastdiff supports only with these values (last four: not config fields)."""

IGNORED_CONFIG_KEYS = frozenset({"num_train_timesteps"})  # only used by time_embedding_type="learned"

OLD_ATTENTION_KEY = re.compile(r"^(.*\.attentions\.\d+)\.(query|key|value|proj_attn)\.(weight|bias)$")
OLD_ATTENTION_NAMES = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


@dataclass
class DDPMUNetConfig:
    """Architecture of a ``UNet2DModel`` (diffusers' config field names and defaults)."""

    sample_size: int | tuple[int, int] | None = None
    in_channels: int = 3
    out_channels: int = 3
    center_input_sample: bool = False
    time_embedding_type: str = "positional"
    time_embedding_dim: int | None = None
    freq_shift: int = 0
    flip_sin_to_cos: bool = True
    down_block_types: tuple[str, ...] = ("DownBlock2D",) + ("AttnDownBlock2D",) * 3
    mid_block_type: str | None = "UNetMidBlock2D"
    up_block_types: tuple[str, ...] = ("AttnUpBlock2D",) * 3 + ("UpBlock2D",)
    block_out_channels: tuple[int, ...] = (224, 448, 672, 896)
    layers_per_block: int = 2
    mid_block_scale_factor: float = 1.0
    downsample_padding: int = 1
    dropout: float = 0.0
    act_fn: str = "silu"
    attention_head_dim: int | None = 8
    norm_num_groups: int = 32
    attn_norm_num_groups: int | None = None
    norm_eps: float = 1e-5
    resnet_time_scale_shift: str = "default"
    add_attention: bool = True

    def __post_init__(self) -> None:
        for name in ("down_block_types", "up_block_types", "block_out_channels"):
            setattr(self, name, tuple(getattr(self, name)))
        if isinstance(self.sample_size, list):
            self.sample_size = tuple(self.sample_size)
        self._validate()

    def _validate(self) -> None:
        for key in ALLOWED_VALUES:
            if hasattr(self, key):
                check_allowed(ALLOWED_VALUES, key, getattr(self, key))
        for key, allowed in (("down_block_types", DOWN_BLOCKS), ("up_block_types", UP_BLOCKS)):
            for block in getattr(self, key):
                if block not in allowed:
                    raise FastdiffError(f"unsupported block {block!r} in {key} (supported: {', '.join(allowed)})")
        chans = self.block_out_channels
        if not chans or len(self.down_block_types) != len(chans) or len(self.up_block_types) != len(chans):
            raise FastdiffError(
                f"block_out_channels, down_block_types and up_block_types must have the same nonzero length, "
                f"got {len(chans)}, {len(self.down_block_types)}, {len(self.up_block_types)}"
            )
        if self.layers_per_block < 1:
            raise FastdiffError(f"unsupported layers_per_block={self.layers_per_block} (must be >= 1)")
        groups, attn_groups = self.norm_num_groups, self.attn_norm_num_groups
        if any(c % groups for c in chans):
            raise FastdiffError(f"block_out_channels={list(chans)} not all divisible by norm_num_groups={groups}")
        if attn_groups is not None and chans[-1] % attn_groups:
            raise FastdiffError(
                f"block_out_channels[-1]={chans[-1]} not divisible by attn_norm_num_groups={attn_groups}"
            )
        blocks = zip(chans + chans[::-1], self.down_block_types + self.up_block_types, strict=True)
        attn_channels = [c for c, block in blocks if block.startswith("Attn")]
        if self.mid_block_type and self.add_attention:
            attn_channels.append(chans[-1])
        head_dim = self.attention_head_dim
        if head_dim is not None and attn_channels and not 1 <= head_dim <= min(attn_channels):
            raise FastdiffError(f"unsupported attention_head_dim={head_dim} (None or 1..{min(attn_channels)})")

    @classmethod
    def from_dict(cls, config: dict, source: str = "config") -> DDPMUNetConfig:
        """Config from a diffusers ``config.json`` dict; unsupported values raise, ``_*`` keys are ignored."""
        return config_from_dict(cls, config, source, ALLOWED_VALUES, IGNORED_CONFIG_KEYS)


DDPM_FLAGS = dict(norm_eps=1e-6, flip_sin_to_cos=False, freq_shift=1, downsample_padding=0, attention_head_dim=None)

DDPM_PRESETS: dict[str, DDPMUNetConfig] = {
    "ddpm-cifar10": DDPMUNetConfig(
        sample_size=32,
        block_out_channels=(128, 256, 256, 256),
        down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        **DDPM_FLAGS,
    ),
    "ddpm-celebahq-256": DDPMUNetConfig(
        sample_size=256,
        block_out_channels=(128, 128, 256, 256, 512, 512),
        down_block_types=("DownBlock2D",) * 4 + ("AttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "AttnUpBlock2D") + ("UpBlock2D",) * 4,
        **DDPM_FLAGS,
    ),
}
"""Architectures of google/ddpm-cifar10-32 and google/ddpm-celebahq-256."""


def timestep_embedding(t: Tensor, dim: int, flip_sin_to_cos: bool, freq_shift: float) -> Tensor:
    """Sinusoidal embedding [B, dim] in fp32 (diffusers ``get_timestep_embedding``, max period 10000)."""
    half = dim // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device)
    angles = t[:, None].float() * torch.exp(exponent / (half - freq_shift))[None, :]
    sin, cos = torch.sin(angles), torch.cos(angles)
    parts = [cos, sin] if flip_sin_to_cos else [sin, cos]
    return F.pad(torch.cat(parts, dim=-1), (0, dim % 2))


class TimestepEmbedding(nn.Module):
    """Linear -> SiLU -> Linear on the sinusoidal embedding."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, emb: Tensor) -> Tensor:
        return self.linear_2(F.silu(self.linear_1(emb)))


class ResnetBlock2D(nn.Module):
    """GroupNorm-SiLU-conv, (+ projected time embedding), GroupNorm-SiLU-conv, (1x1-conv) shortcut, rescale."""

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        temb_ch: int | None,
        groups: int,
        eps: float,
        dropout: float = 0.0,
        output_scale_factor: float = 1.0,
    ) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch, eps=eps)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb_ch, out_ch) if temb_ch is not None else None
        self.norm2 = nn.GroupNorm(groups, out_ch, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None
        self.output_scale_factor = output_scale_factor

    def forward(self, x: Tensor, temb: Tensor | None = None) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        if self.time_emb_proj is not None:
            h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return (skip + h) / self.output_scale_factor


class Attention(nn.Module):
    """Spatial self-attention with GroupNorm, residual connection and output rescale."""

    def __init__(self, channels: int, head_dim: int, groups: int, eps: float, rescale: float = 1.0) -> None:
        super().__init__()
        self.heads, self.head_dim = channels // head_dim, head_dim
        inner = self.heads * head_dim
        self.group_norm = nn.GroupNorm(groups, channels, eps=eps)
        self.to_q = nn.Linear(channels, inner)
        self.to_k = nn.Linear(channels, inner)
        self.to_v = nn.Linear(channels, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, channels)])
        self.rescale_output_factor = rescale

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        tokens = self.group_norm(x).flatten(2).transpose(1, 2)
        q, k, v = (
            proj(tokens).view(b, h * w, self.heads, self.head_dim).transpose(1, 2)
            for proj in (self.to_q, self.to_k, self.to_v)
        )
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, h * w, -1)
        out = self.to_out[0](out).transpose(1, 2).reshape(b, c, h, w)
        return (out + x) / self.rescale_output_factor


class Downsample2D(nn.Module):
    """Stride-2 3x3 conv; ``padding=0`` pads right/bottom by one first (DDPM's asymmetric padding)."""

    def __init__(self, channels: int, padding: int) -> None:
        super().__init__()
        self.padding = padding
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=padding)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)) if self.padding == 0 else x)


class Upsample2D(nn.Module):
    """Nearest-neighbour upsampling (x2, or to ``size`` for odd skip sizes) then 3x3 conv."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: Tensor, size: tuple[int, int] | None = None) -> Tensor:
        if size is None:
            return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        return self.conv(F.interpolate(x, size=size, mode="nearest"))


def _norm(cfg: DDPMUNetConfig) -> tuple[int, float, float]:
    """(groups, eps, dropout) of the config's ResnetBlock2Ds."""
    return cfg.norm_num_groups, cfg.norm_eps, cfg.dropout


def attention_for(channels: int, cfg: DDPMUNetConfig, groups: int | None = None, rescale: float = 1.0) -> Attention:
    """Attention over ``channels`` with the config's head size (one head when attention_head_dim is None)."""
    head_dim = cfg.attention_head_dim if cfg.attention_head_dim is not None else channels
    return Attention(channels, head_dim, groups or cfg.norm_num_groups, cfg.norm_eps, rescale)


class DownBlock2D(nn.Module):
    """``layers_per_block`` resnets (each followed by attention in AttnDownBlock2D), then a downsample."""

    def __init__(self, in_ch: int, out_ch: int, temb_ch: int, cfg: DDPMUNetConfig, attn: bool, down: bool) -> None:
        super().__init__()
        n = cfg.layers_per_block
        self.resnets = nn.ModuleList(
            [ResnetBlock2D(in_ch if i == 0 else out_ch, out_ch, temb_ch, *_norm(cfg)) for i in range(n)]
        )
        self.attentions = nn.ModuleList([attention_for(out_ch, cfg) for _ in range(n)]) if attn else None
        self.downsamplers = nn.ModuleList([Downsample2D(out_ch, cfg.downsample_padding)]) if down else None

    def forward(self, x: Tensor, temb: Tensor, skips: list[Tensor], downsample: bool = True) -> Tensor:
        """Appends each resnet's (attention's) output to ``skips``, then the downsampled one (unless
        ``downsample`` is False: a step cache's shallow path stops before it)."""
        for i, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[i](x)
            skips.append(x)
        return self.downsample(x, skips) if downsample else x

    def downsample(self, x: Tensor, skips: list[Tensor]) -> Tensor:
        """The downsampler on the last output ``x`` (appended to ``skips``); ``x`` itself in the last block."""
        if self.downsamplers is None:
            return x
        x = self.downsamplers[0](x)
        skips.append(x)
        return x


class UpBlock2D(nn.Module):
    """``layers_per_block + 1`` resnets on [x, skip] (each + attention in AttnUpBlock2D), then an upsample."""

    def __init__(
        self, prev_ch: int, skip_ch: int, out_ch: int, temb_ch: int, cfg: DDPMUNetConfig, attn: bool, up: bool
    ) -> None:
        super().__init__()
        n = cfg.layers_per_block + 1
        in_chs = [(prev_ch if i == 0 else out_ch) + (skip_ch if i == n - 1 else out_ch) for i in range(n)]
        self.resnets = nn.ModuleList([ResnetBlock2D(c, out_ch, temb_ch, *_norm(cfg)) for c in in_chs])
        self.attentions = nn.ModuleList([attention_for(out_ch, cfg) for _ in range(n)]) if attn else None
        self.upsamplers = nn.ModuleList([Upsample2D(out_ch)]) if up else None

    def forward(self, x: Tensor, temb: Tensor, skips: list[Tensor]) -> Tensor:
        for i, resnet in enumerate(self.resnets):
            x = resnet(torch.cat([x, skips.pop()], dim=1), temb)
            if self.attentions is not None:
                x = self.attentions[i](x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        return x


class UNetMidBlock2D(nn.Module):
    """Resnet, (attention), resnet at the lowest resolution."""

    def __init__(self, channels: int, temb_ch: int, cfg: DDPMUNetConfig) -> None:
        super().__init__()
        scale = cfg.mid_block_scale_factor
        resnets = [ResnetBlock2D(channels, channels, temb_ch, *_norm(cfg), scale) for _ in range(2)]
        self.resnets = nn.ModuleList(resnets)
        self.attentions = None
        if cfg.add_attention:
            self.attentions = nn.ModuleList([attention_for(channels, cfg, cfg.attn_norm_num_groups, scale)])

    def forward(self, x: Tensor, temb: Tensor) -> Tensor:
        x = self.resnets[0](x, temb)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x, temb)


class DDPMUNet(nn.Module):
    """diffusers ``UNet2DModel`` equivalent; ``forward(x, t)`` returns the model output (e.g. noise)."""

    def __init__(self, config: DDPMUNetConfig) -> None:
        super().__init__()
        self.config = cfg = config
        chans = cfg.block_out_channels
        temb_ch = cfg.time_embedding_dim or chans[0] * 4
        self.conv_in = nn.Conv2d(cfg.in_channels, chans[0], 3, padding=1)
        self.time_embedding = TimestepEmbedding(chans[0], temb_ch)
        last = len(chans) - 1
        self.down_blocks = nn.ModuleList()
        for i, kind in enumerate(cfg.down_block_types):
            block = DownBlock2D(chans[max(i - 1, 0)], chans[i], temb_ch, cfg, kind == "AttnDownBlock2D", i < last)
            self.down_blocks.append(block)
        self.mid_block = UNetMidBlock2D(chans[-1], temb_ch, cfg) if cfg.mid_block_type else None
        rev = chans[::-1]
        self.up_blocks = nn.ModuleList()
        for i, kind in enumerate(cfg.up_block_types):
            prev_ch, skip_ch = rev[max(i - 1, 0)], rev[min(i + 1, last)]
            block = UpBlock2D(prev_ch, skip_ch, rev[i], temb_ch, cfg, kind == "AttnUpBlock2D", i < last)
            self.up_blocks.append(block)
        self.conv_norm_out = nn.GroupNorm(cfg.norm_num_groups, chans[0], eps=cfg.norm_eps)
        self.conv_out = nn.Conv2d(chans[0], cfg.out_channels, 3, padding=1)

    def forward(self, x: Tensor, t: Tensor | int | float) -> Tensor:
        """Model output for samples ``x`` [B, C, H, W] at timesteps ``t`` ([B], scalar tensor, or a number).

        A Python float stays fractional (diffusers truncates Python numbers to integers).
        """
        x, temb = self.embed(x, t)
        skips = self.shallow_in(x, temb)
        return self.shallow_out(self.deep_path(skips, temb), skips, temb)

    # The forward in three parts, cut where step caching (``fastdiff.models.step_cache``) cuts it: a shallow step
    # runs ``shallow_in`` and ``shallow_out`` on the deep feature (``deep_path``'s output) of an earlier full step.

    def shallow_in(self, x: Tensor, temb: Tensor) -> list[Tensor]:
        """``conv_in`` and the first down block without its downsampler: the skips the last up block reads."""
        skips = [self.conv_in(x)]
        self.down_blocks[0](skips[0], temb, skips, downsample=False)
        return skips

    def deep_path(self, skips: list[Tensor], temb: Tensor) -> Tensor:
        """From the first block's ``skips`` to the input of the last up block (the step cache's deep feature): the
        first downsampler, the deeper down blocks, the mid block, every up block but the last (``skips`` is left as
        it came: what the deeper blocks push, the up blocks pop)."""
        h = self.down_blocks[0].downsample(skips[-1], skips)
        for block in self.down_blocks[1:]:
            h = block(h, temb, skips)
        if self.mid_block is not None:
            h = self.mid_block(h, temb)
        for block in self.up_blocks[:-1]:
            h = block(h, temb, skips)
        return h

    def shallow_out(self, deep: Tensor, skips: list[Tensor], temb: Tensor) -> Tensor:
        """The last up block on (``deep``, ``skips``; it pops them) and the output head."""
        h = self.up_blocks[-1](deep, temb, skips)
        return self.conv_out(F.silu(self.conv_norm_out(h)))

    def embed(self, x: Tensor, t: Tensor | int | float) -> tuple[Tensor, Tensor]:
        """The checked input (centred where the config says so) and the time embedding [B, D] every resnet reads
        (see ``forward``)."""
        cfg = self.config
        factor = 2 ** (len(cfg.block_out_channels) - 1)
        if x.ndim != 4 or x.shape[1] != cfg.in_channels or x.shape[2] % factor or x.shape[3] % factor:
            raise FastdiffError(
                f"input shape {tuple(x.shape)}: expected [B, {cfg.in_channels}, H, W] "
                f"with H and W multiples of {factor}"
            )
        t = torch.as_tensor(t, device=x.device).reshape(-1)
        if t.shape[0] not in (1, x.shape[0]):
            raise FastdiffError(f"timestep shape {tuple(t.shape)} does not match batch size {x.shape[0]}")
        if cfg.center_input_sample:
            x = 2 * x - 1.0
        t = t.expand(x.shape[0])
        emb = timestep_embedding(t, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift)
        return x, self.time_embedding(emb.to(self.time_embedding.linear_1.weight.dtype))


def convert_old_attention_keys(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """Rename old diffusers attention weights (query/key/value/proj_attn) to to_q/to_k/to_v/to_out.0."""
    renamed = {}
    for key, value in state.items():
        match = OLD_ATTENTION_KEY.match(key)
        if match:
            path, name, kind = match.groups()
            key = f"{path}.{OLD_ATTENTION_NAMES[name]}.{kind}"
        renamed[key] = value
    return renamed


def ddpm_unet_from_dir(root: Path, config: dict) -> nn.Module:
    """A DDPMUNet built from ``config`` (the parsed ``root/config.json``) with the weights in ``root``."""
    model = DDPMUNet(DDPMUNetConfig.from_dict(config, source=str(root / "config.json")))
    weights = find_weights(root)
    load_state_dict_checked(model, convert_old_attention_keys(read_state_dict(weights)), str(weights))
    return model
