"""Lowering of :class:`fastdiff.models.autoencoder_kl.AutoencoderKL`'s decode path, as a pipeline calls it:
``decode(latents / scaling_factor)``. The ``1 / scaling_factor`` is folded into the first conv's weights, so
the graph's input ``x_in`` is the sampler's latents [B, C, h, w] and its output the image [B, 3, 8h, 8w]
(values about [-1, 1], not clamped)."""

from __future__ import annotations

import torch

from fastdiff.engine.ir import GraphBuilder
from fastdiff.models.autoencoder_kl import AutoencoderKL

MODEL_CLASS = AutoencoderKL


def default_size(model: AutoencoderKL) -> tuple[int, int]:
    """The latent size of the config's ``sample_size`` images."""
    cfg = model.config
    size = cfg.sample_size if cfg.sample_size is not None else 512
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    factor = 2 ** (len(cfg.block_out_channels) - 1)
    return h // factor, w // factor


def lower(model: AutoencoderKL, g: GraphBuilder, device: torch.device) -> None:
    cfg = model.config
    decoder = model.decoder
    x = g.input("x_in", cfg.latent_channels, g.height, g.width)
    inv_scale = 1.0 / cfg.scaling_factor
    if model.post_quant_conv is not None:  # linear in z: (W / s) z + b
        x = g.conv("post_quant_conv", model.post_quant_conv, x, weight_scale=inv_scale)
        h = g.conv("decoder.conv_in", decoder.conv_in, x)
    else:
        h = g.conv("decoder.conv_in", decoder.conv_in, x, weight_scale=inv_scale)
    mid = decoder.mid_block
    h = g.resnet("decoder.mid_block.resnets.0", mid.resnets[0], h)
    if mid.attentions is not None:
        h = g.spatial_attention("decoder.mid_block.attentions.0", mid.attentions[0], h)
    h = g.resnet("decoder.mid_block.resnets.1", mid.resnets[1], h)
    for i, block in enumerate(decoder.up_blocks):
        for j, resnet in enumerate(block.resnets):
            h = g.resnet(f"decoder.up_blocks.{i}.resnets.{j}", resnet, h)
        if block.upsamplers is not None:
            h = g.upsample_conv(f"decoder.up_blocks.{i}.upsamplers.0", block.upsamplers[0].conv, h)
    h = g.group_norm("decoder.conv_norm_out", decoder.conv_norm_out, h, "silu")
    g.output = g.conv("decoder.conv_out", decoder.conv_out, h)
