"""Lowering of :class:`fastdiff.models.ddpm_unet.DDPMUNet` (diffusers' UNet2DModel)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fastdiff.engine.ir import GraphBuilder, TimeFeatures
from fastdiff.models.ddpm_unet import DDPMUNet, timestep_embedding

MODEL_CLASS = DDPMUNet


def default_size(model: DDPMUNet) -> tuple[int, int]:
    size = model.config.sample_size if model.config.sample_size is not None else 32
    return (size, size) if isinstance(size, int) else tuple(size)


def positional_time_features(
    mlp: nn.Module, channels: int, flip_sin_to_cos: bool, freq_shift: float, device: torch.device
) -> TimeFeatures:
    """t -> SiLU(MLP(sinusoidal embedding of t)) in fp32 (diffusers' positional time embedding; the SiLU is the
    one every ResnetBlock2D applies before its projection)."""
    mlp = copy.deepcopy(mlp).to(device, torch.float32).requires_grad_(False)

    def features(t: torch.Tensor) -> torch.Tensor:
        return F.silu(mlp(timestep_embedding(t, channels, flip_sin_to_cos, freq_shift)))

    return features


def lower(model: DDPMUNet, g: GraphBuilder, device: torch.device) -> None:
    cfg = model.config
    g.time_features = positional_time_features(
        model.time_embedding, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift, device
    )
    x = g.input("x_in", cfg.in_channels, g.height, g.width)
    if cfg.center_input_sample:
        x = g.op("center_input", "center", [x], g.value("center_input", cfg.in_channels, g.height, g.width), {})
    h = g.conv("conv_in", model.conv_in, x)
    skips = [h]
    for i, block in enumerate(model.down_blocks):
        for j, resnet in enumerate(block.resnets):
            h = g.resnet(f"down_blocks.{i}.resnets.{j}", resnet, h)
            if block.attentions is not None:
                h = g.spatial_attention(f"down_blocks.{i}.attentions.{j}", block.attentions[j], h)
            skips.append(h)
        if block.downsamplers is not None:
            down = block.downsamplers[0]
            h = g.conv(f"down_blocks.{i}.downsamplers.0.conv", down.conv, h, downsample_pad0=down.padding == 0)
            skips.append(h)
    if model.mid_block is not None:
        mid = model.mid_block
        h = g.resnet("mid_block.resnets.0", mid.resnets[0], h)
        if mid.attentions is not None:
            h = g.spatial_attention("mid_block.attentions.0", mid.attentions[0], h)
        h = g.resnet("mid_block.resnets.1", mid.resnets[1], h)
    for i, block in enumerate(model.up_blocks):
        if i == len(model.up_blocks) - 1:
            g.cache(h)  # the step cache's deep feature: the last up block's input (fastdiff.models.step_cache)
        for j, resnet in enumerate(block.resnets):
            cat = g.concat(f"up_blocks.{i}.cat.{j}", [h, skips.pop()])
            h = g.resnet(f"up_blocks.{i}.resnets.{j}", resnet, cat)
            if block.attentions is not None:
                h = g.spatial_attention(f"up_blocks.{i}.attentions.{j}", block.attentions[j], h)
        if block.upsamplers is not None:
            h = g.upsample_conv(f"up_blocks.{i}.upsamplers.0", block.upsamplers[0].conv, h)
    h = g.group_norm("conv_norm_out", model.conv_norm_out, h, "silu")
    g.output = g.conv("conv_out", model.conv_out, h)
