"""Lowering of :class:`fastdiff.models.convnext_unet.ConvNeXtUNet` (ConvNeXt blocks, attention gates on the
skips, a mid self-attention)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fastdiff.engine.ir import GraphBuilder, TimeFeatures, Value
from fastdiff.models.convnext_unet import AttentionGate, ConvNeXtBlock, ConvNeXtUNet, timestep_embedding

MODEL_CLASS = ConvNeXtUNet


def default_size(model: ConvNeXtUNet) -> tuple[int, int]:
    size = model.config.sample_size if model.config.sample_size is not None else 32
    return (size, size) if isinstance(size, int) else tuple(size)


def time_features(model: ConvNeXtUNet, device: torch.device) -> TimeFeatures:
    """t -> GELU(MLP(sinusoid(t))) in fp32 (the GELU every block applies before its projection)."""
    mlp = copy.deepcopy(model.time_mlp).to(device, torch.float32).requires_grad_(False)
    dim = model.config.base_dim
    return lambda t: F.gelu(mlp(timestep_embedding(t, dim)))


def _block(g: GraphBuilder, name: str, block: ConvNeXtBlock, x: Value) -> Value:
    offset = g.add_temb(block.time_proj, block.depthwise.bias)
    dw = g.value(f"{name}.depthwise", *x.shape[1:])
    weights = {"weight": block.depthwise.weight.detach().float()}
    g.op(f"{name}.depthwise", "depthwise", [x], dw, dict(temb=offset), weights)
    a = g.group_norm(f"{name}.norm1", block.norm1, dw, None)
    b = g.conv(f"{name}.conv1", block.conv1, a, act="gelu")
    c = g.group_norm(f"{name}.norm2", block.norm2, b, None)
    res = x if isinstance(block.res_conv, nn.Identity) else g.conv(f"{name}.res_conv", block.res_conv, x)
    return g.conv(f"{name}.conv2", block.conv2, c, residual=res)


def _gate(g: GraphBuilder, name: str, gate: AttentionGate, skip: Value, gating: Value) -> Value:
    out = g.value(name, *skip.shape[1:])
    weights = {
        "w_x": gate.residual_conv.weight, "b_x": gate.residual_conv.bias, "w_g": gate.gate_conv.weight,
        "b_g": gate.gate_conv.bias, "w_psi": gate.psi.weight, "b_psi": gate.psi.bias,
    }  # fmt: skip
    weights = {k: v.detach().float() for k, v in weights.items() if v is not None}
    return g.op(name, "gate", [skip, gating], out, dict(inter=gate.psi.weight.shape[1]), weights)


def lower(model: ConvNeXtUNet, g: GraphBuilder, device: torch.device) -> None:
    cfg = model.config
    g.time_features = time_features(model, device)
    x = g.input("x_in", cfg.in_channels, g.height, g.width)
    h = g.conv("init_conv", model.init_conv, x)
    skips = []
    for i, level in enumerate(model.downs):
        h = _block(g, f"downs.{i}.block1", level["block1"], h)
        h = _block(g, f"downs.{i}.block2", level["block2"], h)
        skips.append(h)
        if "downsample" in level:
            h = g.conv(f"downs.{i}.downsample", level["downsample"], h)
    h = _block(g, "mid_block1", model.mid_block1, h)
    if model.mid_attn is not None:
        attn = model.mid_attn
        normed = g.group_norm("mid_attn.norm", attn.norm, h, None)
        h = g.attention_block("mid_attn", normed, h, attn.to_qkv, attn.to_out, attn.heads, attn.head_dim, None)
    h = _block(g, "mid_block2", model.mid_block2, h)
    for i, level in enumerate(model.ups):
        if i == len(model.ups) - 1:
            g.cache(h)  # the step cache's deep feature: the last level's input (fastdiff.models.step_cache)
        skip = _gate(g, f"ups.{i}.gate", level["gate"], skips.pop(), h)
        cat = g.concat(f"ups.{i}.cat", [h, skip])
        h = _block(g, f"ups.{i}.block1", level["block1"], cat)
        h = _block(g, f"ups.{i}.block2", level["block2"], h)
        if "upsample" in level:
            h = g.upsample_conv(f"ups.{i}", level["upsample"], h)
    h = _block(g, "final_block", model.final_block, h)
    g.output = g.conv("final_conv", model.final_conv, h)
