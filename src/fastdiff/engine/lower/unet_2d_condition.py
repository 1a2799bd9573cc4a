"""Lowering of :class:`fastdiff.models.unet_2d_condition.UNet2DConditionModel` (Stable Diffusion 1.x / 2.x).

Inputs: ``x_in`` (latents [B, 4, h, w]) and ``context`` (text states [B, D, L, 1] channels-last, i.e. the token
matrix [B, L, D]). Per transformer block: LayerNorm -> one q|k|v projection -> flash self-attention -> output
projection + residual; LayerNorm -> q projection -> flash cross-attention over K/V that a ``context``-stage op
projected once per prompt (all steps read them) -> output projection + residual; LayerNorm -> GEGLU projection
(value * gelu(gate) in the GEMM's epilogue) -> output projection + residual. SD1's 1x1-conv ``proj_in/out`` and
SD2's linear ones are the same per-token GEMM.
"""

from __future__ import annotations

import torch

from fastdiff.engine.ir import GraphBuilder, Value
from fastdiff.engine.lower.ddpm_unet import positional_time_features
from fastdiff.errors import FastdiffError
from fastdiff.models.unet_2d_condition import BasicTransformerBlock, Transformer2DModel, UNet2DConditionModel

MODEL_CLASS = UNet2DConditionModel
DEFAULT_CONTEXT_TOKENS = 77
"""CLIP's context length (SD 1.x / 2.x tokenizers pad every prompt to 77 tokens)."""


def default_size(model: UNet2DConditionModel) -> tuple[int, int]:
    size = model.config.sample_size if model.config.sample_size is not None else 64
    return (size, size) if isinstance(size, int) else tuple(size)


def _block(g: GraphBuilder, name: str, block: BasicTransformerBlock, x: Value, context: Value) -> Value:
    a1, a2 = block.attn1, block.attn2
    n1 = g.layer_norm(f"{name}.norm1", block.norm1, x)
    qkv_weight = torch.cat([a1.to_q.weight, a1.to_k.weight, a1.to_v.weight])
    qkv = g.linear(f"{name}.attn1.to_qkv", qkv_weight, None, n1)
    core = g.attention(f"{name}.attn1.core", a1.heads, a1.head_dim, qkv=qkv)
    x = g.linear(f"{name}.attn1.to_out", a1.to_out[0].weight, a1.to_out[0].bias, core, residual=x)
    n2 = g.layer_norm(f"{name}.norm2", block.norm2, x)
    q = g.linear(f"{name}.attn2.to_q", a2.to_q.weight, None, n2)
    kv_weight = torch.cat([a2.to_k.weight, a2.to_v.weight])
    kv = g.linear(f"{name}.attn2.to_kv", kv_weight, None, context, stage="context")
    core = g.attention(f"{name}.attn2.core", a2.heads, a2.head_dim, q=q, kv=kv)
    x = g.linear(f"{name}.attn2.to_out", a2.to_out[0].weight, a2.to_out[0].bias, core, residual=x)
    n3 = g.layer_norm(f"{name}.norm3", block.norm3, x)
    geglu, out = block.ff.net[0].proj, block.ff.net[2]
    hidden = g.linear(f"{name}.ff.net.0.proj", geglu.weight, geglu.bias, n3, geglu=True)
    return g.linear(f"{name}.ff.net.2", out.weight, out.bias, hidden, residual=x)


def _transformer(g: GraphBuilder, name: str, t: Transformer2DModel, x: Value, context: Value) -> Value:
    normed = g.group_norm(f"{name}.norm", t.norm, x, None)
    h = g.linear(f"{name}.proj_in", t.proj_in.weight, t.proj_in.bias, normed)
    for k, block in enumerate(t.transformer_blocks):
        h = _block(g, f"{name}.transformer_blocks.{k}", block, h, context)
    return g.linear(f"{name}.proj_out", t.proj_out.weight, t.proj_out.bias, h, residual=x)


def lower(model: UNet2DConditionModel, g: GraphBuilder, device: torch.device) -> None:
    cfg = model.config
    levels = len(cfg.block_out_channels)
    factor = 2 ** (levels - 1)
    if g.height % factor or g.width % factor:
        raise FastdiffError(
            f"the engine runs this U-Net on latents whose sides are multiples of {factor} "
            f"(images in multiples of {8 * factor} pixels); got {g.height}x{g.width} latents"
        )
    g.time_features = positional_time_features(
        model.time_embedding, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift, device
    )
    x = g.input("x_in", cfg.in_channels, g.height, g.width)
    context = g.input("context", cfg.cross_attention_dim, g.context_tokens or DEFAULT_CONTEXT_TOKENS, 1)
    if cfg.center_input_sample:
        x = g.op("center_input", "center", [x], g.value("center_input", cfg.in_channels, g.height, g.width), {})
    h = g.conv("conv_in", model.conv_in, x)
    skips = [h]
    for i, block in enumerate(model.down_blocks):
        for j, resnet in enumerate(block.resnets):
            h = g.resnet(f"down_blocks.{i}.resnets.{j}", resnet, h)
            if block.attentions is not None:
                h = _transformer(g, f"down_blocks.{i}.attentions.{j}", block.attentions[j], h, context)
            skips.append(h)
        if block.downsamplers is not None:
            down = block.downsamplers[0]
            h = g.conv(f"down_blocks.{i}.downsamplers.0.conv", down.conv, h, downsample_pad0=down.padding == 0)
            skips.append(h)
    if model.mid_block is not None:
        mid = model.mid_block
        h = g.resnet("mid_block.resnets.0", mid.resnets[0], h)
        h = _transformer(g, "mid_block.attentions.0", mid.attentions[0], h, context)
        h = g.resnet("mid_block.resnets.1", mid.resnets[1], h)
    for i, block in enumerate(model.up_blocks):
        if i == len(model.up_blocks) - 1:
            g.cache(h)  # the step cache's deep feature: the last up block's input (fastdiff.models.step_cache)
        for j, resnet in enumerate(block.resnets):
            cat = g.concat(f"up_blocks.{i}.cat.{j}", [h, skips.pop()])
            h = g.resnet(f"up_blocks.{i}.resnets.{j}", resnet, cat)
            if block.attentions is not None:
                h = _transformer(g, f"up_blocks.{i}.attentions.{j}", block.attentions[j], h, context)
        if block.upsamplers is not None:
            h = g.upsample_conv(f"up_blocks.{i}.upsamplers.0", block.upsamplers[0].conv, h)
    h = g.group_norm("conv_norm_out", model.conv_norm_out, h, "silu")
    g.output = g.conv("conv_out", model.conv_out, h)
