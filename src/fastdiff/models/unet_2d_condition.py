"""Text-conditioned U-Net: a re-implementation of diffusers' ``UNet2DConditionModel`` whose state dict loads 1:1.

Covers the Stable Diffusion 1.x / 2.x architecture: CrossAttnDownBlock2D / DownBlock2D / UNetMidBlock2DCrossAttn /
CrossAttnUpBlock2D / UpBlock2D, ResnetBlock2D, Transformer2DModel (GroupNorm, 1x1-conv or linear projections,
BasicTransformerBlocks with self-attention, cross-attention over the text states and a GEGLU feed-forward),
positional time embedding. Anything else in a config raises a FastdiffError naming the key and value.

As in diffusers, ``attention_head_dim`` holds the number of attention heads of each level (SD1: 8 everywhere;
SD2: [5, 10, 20, 20], i.e. 64 channels per head); each head has ``channels // heads`` channels.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastdiff.errors import FastdiffError
from fastdiff.models.ddpm_unet import Downsample2D, ResnetBlock2D, TimestepEmbedding, Upsample2D, timestep_embedding
from fastdiff.models.weights import (
    check_allowed,
    config_from_dict,
    find_weights,
    load_state_dict_checked,
    read_state_dict,
)

log = logging.getLogger(__name__)

DOWN_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")
MID_BLOCKS = ("UNetMidBlock2DCrossAttn", None)

ALLOWED_VALUES: dict[str, tuple] = {
    "act_fn": ("silu", "swish"),
    "time_embedding_type": ("positional",),
    "resnet_time_scale_shift": ("default",),
    "only_cross_attention": (False,),
    "mid_block_only_cross_attention": (None, False),
    "dual_cross_attention": (False,),
    "num_attention_heads": (None,),
    "class_embed_type": (None,),
    "num_class_embeds": (None,),
    "class_embeddings_concat": (False,),
    "projection_class_embeddings_input_dim": (None,),
    "addition_embed_type": (None,),
    "addition_time_embed_dim": (None,),
    "encoder_hid_dim": (None,),
    "encoder_hid_dim_type": (None,),
    "time_embedding_act_fn": (None,),
    "timestep_post_act": (None,),
    "time_cond_proj_dim": (None,),
    "attention_type": ("default",),
    "cross_attention_norm": (None,),
    "reverse_transformer_layers_per_block": (None,),
}
"""diffusers config keys that fastdiff supports only with these values (all but act_fn are not config fields)."""

IGNORED_CONFIG_KEYS = frozenset(
    {
        "addition_embed_type_num_heads",  # only used with addition_embed_type
        "resnet_skip_time_act",  # only used by SimpleCrossAttn / ResnetDownsample blocks
        "resnet_out_scale_factor",  # same
    }
)


@dataclass
class UNet2DConditionConfig:
    """Architecture of a ``UNet2DConditionModel`` (diffusers' config field names and defaults)."""

    sample_size: int | tuple[int, int] | None = None
    in_channels: int = 4
    out_channels: int = 4
    center_input_sample: bool = False
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    down_block_types: tuple[str, ...] = ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",)
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    up_block_types: tuple[str, ...] = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int = 2
    downsample_padding: int = 1
    mid_block_scale_factor: float = 1.0
    dropout: float = 0.0
    act_fn: str = "silu"
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    cross_attention_dim: int = 1280
    transformer_layers_per_block: int | tuple[int, ...] = 1
    attention_head_dim: int | tuple[int, ...] = 8
    use_linear_projection: bool = False
    upcast_attention: bool = False
    time_embedding_dim: int | None = None
    conv_in_kernel: int = 3
    conv_out_kernel: int = 3

    def __post_init__(self) -> None:
        for name in ("down_block_types", "up_block_types", "block_out_channels"):
            setattr(self, name, tuple(getattr(self, name)))
        for name in ("sample_size", "attention_head_dim", "transformer_layers_per_block"):
            if isinstance(getattr(self, name), list):
                setattr(self, name, tuple(getattr(self, name)))
        self._validate()

    def _validate(self) -> None:
        check_allowed(ALLOWED_VALUES, "act_fn", self.act_fn)
        for key, allowed in (("down_block_types", DOWN_BLOCKS), ("up_block_types", UP_BLOCKS)):
            for block in getattr(self, key):
                if block not in allowed:
                    raise FastdiffError(f"unsupported block {block!r} in {key} (supported: {', '.join(allowed)})")
        if self.mid_block_type not in MID_BLOCKS:
            raise FastdiffError(f"unsupported mid_block_type={self.mid_block_type!r} (UNetMidBlock2DCrossAttn or None)")
        chans = self.block_out_channels
        if not chans or len(self.down_block_types) != len(chans) or len(self.up_block_types) != len(chans):
            raise FastdiffError(
                f"block_out_channels, down_block_types and up_block_types must have the same nonzero length, "
                f"got {len(chans)}, {len(self.down_block_types)}, {len(self.up_block_types)}"
            )
        if not isinstance(self.layers_per_block, int) or self.layers_per_block < 1:
            raise FastdiffError(f"unsupported layers_per_block={self.layers_per_block!r} (an integer >= 1)")
        if not isinstance(self.cross_attention_dim, int) or self.cross_attention_dim < 1:
            raise FastdiffError(f"unsupported cross_attention_dim={self.cross_attention_dim!r} (an integer >= 1)")
        if any(c % self.norm_num_groups for c in chans):
            raise FastdiffError(
                f"block_out_channels={list(chans)} not all divisible by norm_num_groups={self.norm_num_groups}"
            )
        for name in ("attention_head_dim", "transformer_layers_per_block"):
            values = self.per_level(name)
            if any(not isinstance(v, int) or v < 1 for v in values):
                raise FastdiffError(f"unsupported {name}={getattr(self, name)!r} (integers >= 1)")
        for heads, channels in zip(self.per_level("attention_head_dim"), chans, strict=True):
            if heads > channels:
                raise FastdiffError(f"attention_head_dim (heads) {heads} exceeds its level's {channels} channels")
        for name in ("conv_in_kernel", "conv_out_kernel"):
            if getattr(self, name) % 2 != 1:
                raise FastdiffError(f"unsupported {name}={getattr(self, name)} (odd kernel sizes only)")

    def per_level(self, name: str) -> tuple:
        """``attention_head_dim`` or ``transformer_layers_per_block`` as one value per level."""
        value, levels = getattr(self, name), len(self.block_out_channels)
        if isinstance(value, int):
            return (value,) * levels
        if len(value) != levels:
            raise FastdiffError(f"{name}={list(value)} needs one value per level ({levels})")
        return tuple(value)

    @classmethod
    def from_dict(cls, config: dict, source: str = "config") -> UNet2DConditionConfig:
        """Config from a diffusers ``config.json`` dict; unsupported values raise, ``_*`` keys are ignored."""
        return config_from_dict(cls, config, source, ALLOWED_VALUES, IGNORED_CONFIG_KEYS)


SD_DOWN_BLOCKS = ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"]
SD_UP_BLOCKS = ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]

SD15_UNET_CONFIG_JSON: dict = {
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.6.0",
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 768,
    "down_block_types": SD_DOWN_BLOCKS,
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": SD_UP_BLOCKS,
}
"""runwayml/stable-diffusion-v1-5 unet/config.json."""

SD21_UNET_CONFIG_JSON: dict = {
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.10.0.dev0",
    "act_fn": "silu",
    "attention_head_dim": [5, 10, 20, 20],
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 1024,
    "down_block_types": SD_DOWN_BLOCKS,
    "downsample_padding": 1,
    "dual_cross_attention": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "out_channels": 4,
    "sample_size": 96,
    "up_block_types": SD_UP_BLOCKS,
    "upcast_attention": True,
    "use_linear_projection": True,
}
"""stabilityai/stable-diffusion-2-1 unet/config.json."""

SD15_CONFIG = UNet2DConditionConfig.from_dict(SD15_UNET_CONFIG_JSON, source="SD15_UNET_CONFIG_JSON")
SD21_CONFIG = UNet2DConditionConfig.from_dict(SD21_UNET_CONFIG_JSON, source="SD21_UNET_CONFIG_JSON")


class Attention(nn.Module):
    """Multi-head attention of tokens [B, N, dim] over themselves or over ``context`` [B, M, context_dim].

    Query/key/value projections have no bias (diffusers' ``attention_bias=False``); the output projection has one.
    """

    def __init__(self, dim: int, heads: int, head_dim: int, context_dim: int | None = None) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(context_dim or dim, inner, bias=False)
        self.to_v = nn.Linear(context_dim or dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: Tensor, context: Tensor | None = None) -> Tensor:
        context = x if context is None else context
        b = x.shape[0]
        q = self.to_q(x).view(b, -1, self.heads, self.head_dim).transpose(1, 2)
        k = self.to_k(context).view(b, -1, self.heads, self.head_dim).transpose(1, 2)
        v = self.to_v(context).view(b, -1, self.heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, self.heads * self.head_dim)
        return self.to_out[0](out)


class GEGLU(nn.Module):
    """Linear to 2x width, then value * GELU(gate)."""

    def __init__(self, dim: int, inner: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, inner * 2)

    def forward(self, x: Tensor) -> Tensor:
        value, gate = self.proj(x).chunk(2, dim=-1)
        return value * F.gelu(gate)


class FeedForward(nn.Module):
    """GEGLU (4x width) -> dropout -> linear; ``net`` indices match diffusers' keys (ff.net.0 / ff.net.2)."""

    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.net = nn.ModuleList([GEGLU(dim, 4 * dim), nn.Dropout(dropout), nn.Linear(4 * dim, dim)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.net:
            x = layer(x)
        return x


class BasicTransformerBlock(nn.Module):
    """Pre-LayerNorm self-attention, cross-attention over the text states and GEGLU feed-forward, each residual."""

    def __init__(self, dim: int, heads: int, head_dim: int, context_dim: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads, head_dim)
        self.norm2 = nn.LayerNorm(dim)
        self.attn2 = Attention(dim, heads, head_dim, context_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, dropout)

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        x = x + self.attn1(self.norm1(x))
        x = x + self.attn2(self.norm2(x), context)
        return x + self.ff(self.norm3(x))


class Transformer2DModel(nn.Module):
    """GroupNorm, projection to tokens (1x1 conv, or linear for SD2), transformer blocks, projection back, residual."""

    def __init__(self, channels: int, heads: int, layers: int, cfg: UNet2DConditionConfig) -> None:
        super().__init__()
        head_dim = channels // heads
        inner = heads * head_dim
        self.use_linear_projection = cfg.use_linear_projection
        self.norm = nn.GroupNorm(cfg.norm_num_groups, channels, eps=1e-6)
        if cfg.use_linear_projection:
            self.proj_in, self.proj_out = nn.Linear(channels, inner), nn.Linear(inner, channels)
        else:
            self.proj_in, self.proj_out = nn.Conv2d(channels, inner, 1), nn.Conv2d(inner, channels, 1)
        self.transformer_blocks = nn.ModuleList(
            [BasicTransformerBlock(inner, heads, head_dim, cfg.cross_attention_dim, cfg.dropout) for _ in range(layers)]
        )

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        b, _, h, w = x.shape
        tokens = self.norm(x)
        if self.use_linear_projection:
            tokens = self.proj_in(tokens.permute(0, 2, 3, 1).reshape(b, h * w, -1))
        else:
            tokens = self.proj_in(tokens)
            tokens = tokens.permute(0, 2, 3, 1).reshape(b, h * w, -1)
        for block in self.transformer_blocks:
            tokens = block(tokens, context)
        if self.use_linear_projection:
            out = self.proj_out(tokens).reshape(b, h, w, -1).permute(0, 3, 1, 2)
        else:
            out = self.proj_out(tokens.reshape(b, h, w, -1).permute(0, 3, 1, 2).contiguous())
        return out + x


class DownBlock(nn.Module):
    """DownBlock2D: resnets then a stride-2 conv; CrossAttnDownBlock2D adds a Transformer2DModel after each resnet."""

    def __init__(
        self, in_ch: int, out_ch: int, temb_ch: int, level: int, cross_attn: bool, cfg: UNet2DConditionConfig
    ) -> None:
        super().__init__()
        n, groups, eps = cfg.layers_per_block, cfg.norm_num_groups, cfg.norm_eps
        self.resnets = nn.ModuleList(
            [ResnetBlock2D(in_ch if i == 0 else out_ch, out_ch, temb_ch, groups, eps, cfg.dropout) for i in range(n)]
        )
        self.attentions = None
        if cross_attn:
            heads = cfg.per_level("attention_head_dim")[level]
            layers = cfg.per_level("transformer_layers_per_block")[level]
            self.attentions = nn.ModuleList([Transformer2DModel(out_ch, heads, layers, cfg) for _ in range(n)])
        last = len(cfg.block_out_channels) - 1
        self.downsamplers = nn.ModuleList([Downsample2D(out_ch, cfg.downsample_padding)]) if level < last else None

    def forward(self, x: Tensor, temb: Tensor, context: Tensor, skips: list[Tensor], downsample: bool = True) -> Tensor:
        """Appends each resnet's (transformer's) output to ``skips``, then the downsampled one (unless
        ``downsample`` is False: a step cache's shallow path stops before it)."""
        for i, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[i](x, context)
            skips.append(x)
        return self.downsample(x, skips) if downsample else x

    def downsample(self, x: Tensor, skips: list[Tensor]) -> Tensor:
        """The downsampler on the last output ``x`` (appended to ``skips``); ``x`` itself in the last block."""
        if self.downsamplers is None:
            return x
        x = self.downsamplers[0](x)
        skips.append(x)
        return x


class UpBlock(nn.Module):
    """UpBlock2D: ``layers_per_block + 1`` resnets on [x, skip] then an upsample; CrossAttnUpBlock2D adds attention."""

    def __init__(
        self,
        prev_ch: int,
        skip_ch: int,
        out_ch: int,
        temb_ch: int,
        level: int,
        cross_attn: bool,
        cfg: UNet2DConditionConfig,
    ) -> None:
        super().__init__()
        n = cfg.layers_per_block + 1
        in_chs = [(prev_ch if i == 0 else out_ch) + (skip_ch if i == n - 1 else out_ch) for i in range(n)]
        groups, eps = cfg.norm_num_groups, cfg.norm_eps
        self.resnets = nn.ModuleList([ResnetBlock2D(c, out_ch, temb_ch, groups, eps, cfg.dropout) for c in in_chs])
        self.attentions = None
        if cross_attn:
            # up block i mirrors down level len-1-i: reversed per-level heads and transformer depths
            heads = cfg.per_level("attention_head_dim")[::-1][level]
            layers = cfg.per_level("transformer_layers_per_block")[::-1][level]
            self.attentions = nn.ModuleList([Transformer2DModel(out_ch, heads, layers, cfg) for _ in range(n)])
        last = len(cfg.block_out_channels) - 1
        self.upsamplers = nn.ModuleList([Upsample2D(out_ch)]) if level < last else None

    def forward(self, x: Tensor, temb: Tensor, context: Tensor, skips: list[Tensor]) -> Tensor:
        for i, resnet in enumerate(self.resnets):
            x = resnet(torch.cat([x, skips.pop()], dim=1), temb)
            if self.attentions is not None:
                x = self.attentions[i](x, context)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, tuple(skips[-1].shape[2:]))
        return x


class UNetMidBlock2DCrossAttn(nn.Module):
    """Resnet, Transformer2DModel, resnet at the lowest resolution."""

    def __init__(self, channels: int, temb_ch: int, cfg: UNet2DConditionConfig) -> None:
        super().__init__()
        groups, eps, scale = cfg.norm_num_groups, cfg.norm_eps, cfg.mid_block_scale_factor
        self.resnets = nn.ModuleList(
            [ResnetBlock2D(channels, channels, temb_ch, groups, eps, cfg.dropout, scale) for _ in range(2)]
        )
        heads, layers = cfg.per_level("attention_head_dim")[-1], cfg.per_level("transformer_layers_per_block")[-1]
        self.attentions = nn.ModuleList([Transformer2DModel(channels, heads, layers, cfg)])

    def forward(self, x: Tensor, temb: Tensor, context: Tensor) -> Tensor:
        x = self.resnets[0](x, temb)
        x = self.attentions[0](x, context)
        return self.resnets[1](x, temb)


class UNet2DConditionModel(nn.Module):
    """diffusers ``UNet2DConditionModel`` equivalent; ``forward(sample, timestep, encoder_hidden_states)``.

    ``upcast_attention`` is kept in the config but changes nothing, as with diffusers' default attention processor
    (``AttnProcessor2_0``): PyTorch's fused ``scaled_dot_product_attention`` kernels compute the softmax in fp32.
    """

    def __init__(self, config: UNet2DConditionConfig) -> None:
        super().__init__()
        self.config = cfg = config
        chans = cfg.block_out_channels
        temb_ch = cfg.time_embedding_dim or chans[0] * 4
        self.conv_in = nn.Conv2d(cfg.in_channels, chans[0], cfg.conv_in_kernel, padding=cfg.conv_in_kernel // 2)
        self.time_embedding = TimestepEmbedding(chans[0], temb_ch)
        last = len(chans) - 1
        self.down_blocks = nn.ModuleList(
            [
                DownBlock(chans[max(i - 1, 0)], chans[i], temb_ch, i, kind == "CrossAttnDownBlock2D", cfg)
                for i, kind in enumerate(cfg.down_block_types)
            ]
        )
        self.mid_block = UNetMidBlock2DCrossAttn(chans[-1], temb_ch, cfg) if cfg.mid_block_type else None
        rev = chans[::-1]
        self.up_blocks = nn.ModuleList()
        for i, kind in enumerate(cfg.up_block_types):
            prev_ch, skip_ch = rev[max(i - 1, 0)], rev[min(i + 1, last)]
            self.up_blocks.append(UpBlock(prev_ch, skip_ch, rev[i], temb_ch, i, kind == "CrossAttnUpBlock2D", cfg))
        self.conv_norm_out = nn.GroupNorm(cfg.norm_num_groups, chans[0], eps=cfg.norm_eps)
        self.conv_out = nn.Conv2d(chans[0], cfg.out_channels, cfg.conv_out_kernel, padding=cfg.conv_out_kernel // 2)

    def forward(self, sample: Tensor, timestep: Tensor | int | float, encoder_hidden_states: Tensor) -> Tensor:
        """Model output for latents ``sample`` [B, C, H, W] at ``timestep`` ([B], 0-d tensor or a number),
        conditioned on text states ``encoder_hidden_states`` [B, tokens, cross_attention_dim].

        Any H and W work: when they are not multiples of 2**(levels - 1), each upsample matches its skip's size.
        """
        x, temb = self.embed(sample, timestep, encoder_hidden_states)
        context = encoder_hidden_states
        skips = self.shallow_in(x, temb, context)
        return self.shallow_out(self.deep_path(skips, temb, context), skips, temb, context)

    # The forward in three parts, cut where step caching (``fastdiff.models.step_cache``) cuts it: a shallow step
    # runs ``shallow_in`` and ``shallow_out`` on the deep feature (``deep_path``'s output) of an earlier full step.

    def shallow_in(self, x: Tensor, temb: Tensor, context: Tensor) -> list[Tensor]:
        """``conv_in`` and the first down block without its downsampler: the skips the last up block reads."""
        skips = [self.conv_in(x)]
        self.down_blocks[0](skips[0], temb, context, skips, downsample=False)
        return skips

    def deep_path(self, skips: list[Tensor], temb: Tensor, context: Tensor) -> Tensor:
        """From the first block's ``skips`` to the input of the last up block (the step cache's deep feature): the
        first downsampler, the deeper down blocks, the mid block, every up block but the last (``skips`` is left as
        it came: what the deeper blocks push, the up blocks pop)."""
        h = self.down_blocks[0].downsample(skips[-1], skips)
        for block in self.down_blocks[1:]:
            h = block(h, temb, context, skips)
        if self.mid_block is not None:
            h = self.mid_block(h, temb, context)
        for block in self.up_blocks[:-1]:
            h = block(h, temb, context, skips)
        return h

    def shallow_out(self, deep: Tensor, skips: list[Tensor], temb: Tensor, context: Tensor) -> Tensor:
        """The last up block on (``deep``, ``skips``; it pops them) and the output head."""
        h = self.up_blocks[-1](deep, temb, context, skips)
        return self.conv_out(F.silu(self.conv_norm_out(h)))

    def embed(
        self, sample: Tensor, timestep: Tensor | int | float, encoder_hidden_states: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The checked input (centred where the config says so) and the time embedding [B, D] every resnet reads
        (see ``forward``; the text states are only checked)."""
        cfg = self.config
        x, context = sample, encoder_hidden_states
        if x.ndim != 4 or x.shape[1] != cfg.in_channels:
            raise FastdiffError(f"sample shape {tuple(x.shape)}: expected [B, {cfg.in_channels}, H, W]")
        if context.ndim != 3 or context.shape[0] != x.shape[0] or context.shape[2] != cfg.cross_attention_dim:
            raise FastdiffError(
                f"encoder_hidden_states shape {tuple(context.shape)}: expected "
                f"[{x.shape[0]}, tokens, {cfg.cross_attention_dim}] for sample batch {x.shape[0]}"
            )
        t = torch.as_tensor(timestep, device=x.device).reshape(-1)
        if t.shape[0] not in (1, x.shape[0]):
            raise FastdiffError(f"timestep shape {tuple(t.shape)} does not match batch size {x.shape[0]}")
        if cfg.center_input_sample:
            x = 2 * x - 1.0
        emb = timestep_embedding(t.expand(x.shape[0]), cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift)
        return x, self.time_embedding(emb.to(x.dtype))


def unet_2d_condition_from_dir(root: Path, config: dict) -> UNet2DConditionModel:
    """A UNet2DConditionModel built from ``config`` (the parsed ``root/config.json``) with the weights in ``root``.

    The model is built on the meta device and takes the file's tensors (and their dtype) as its parameters.
    """
    class_name = config.get("_class_name", "UNet2DConditionModel")
    if class_name != "UNet2DConditionModel":
        raise FastdiffError(
            f"{root / 'config.json'}: model class {class_name!r} is not supported (UNet2DConditionModel)"
        )
    cfg = UNet2DConditionConfig.from_dict(config, source=str(root / "config.json"))
    weights = find_weights(root)
    with torch.device("meta"):
        model = UNet2DConditionModel(cfg)
    load_state_dict_checked(model, read_state_dict(weights), str(weights), assign=True)
    return model
