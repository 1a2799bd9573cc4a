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

    def attend(name: str, transformer: Transformer2DModel, h: Value) -> Value:
        return _transformer(g, name, transformer, h, context)

    g.output = g.unet(model, x, attend)
