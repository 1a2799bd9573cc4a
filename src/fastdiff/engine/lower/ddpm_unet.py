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
    g.output = g.unet(model, x, g.spatial_attention)
