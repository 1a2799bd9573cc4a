"""The engine tests' device, tolerance and error measure; tiny DDPMUNet configs (odd channel counts, non-square
sizes that are not powers of two)."""

from __future__ import annotations

import pytest
import torch

from fastdiff.models.ddpm_unet import DDPMUNet, DDPMUNetConfig

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = 1e-4 if DEVICE.type == "cpu" else 1e-2  # fp32 on CPU (observed ~1e-7); tf32 dots on the GPU


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 on the CPU."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return float((out - ref).norm() / ref.norm())


TINY_CONFIGS = {
    # attention in down and up (3 heads of 3), DDPM's asymmetric downsample padding, DDPM embedding flags
    "attn_pad0": dict(
        sample_size=(6, 10), in_channels=3, out_channels=3, block_out_channels=(6, 9), norm_num_groups=3,
        down_block_types=("AttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "AttnUpBlock2D"),
        layers_per_block=1, attention_head_dim=3, norm_eps=1e-6, flip_sin_to_cos=False, freq_shift=1,
        downsample_padding=0,
    ),
    # centred input, scaled mid block (its attention rescales too), symmetric padding, heads not dividing C
    "center_scaled": dict(
        sample_size=(10, 6), in_channels=2, out_channels=2, block_out_channels=(9, 9), norm_num_groups=3,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
        layers_per_block=1, attention_head_dim=4, center_input_sample=True, mid_block_scale_factor=1.5,
        downsample_padding=1,
    ),
}  # fmt: skip
POW2_CONFIG = dict(
    sample_size=(8, 8), in_channels=3, out_channels=3, block_out_channels=(8, 16), norm_num_groups=4,
    down_block_types=("AttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "AttnUpBlock2D"),
    layers_per_block=1, attention_head_dim=4,
)  # fmt: skip
"""Power-of-two images (8x8, 4x4) and group widths (2, 4): the convs' epilogues can take the GroupNorms
(``engine/epilogue_norm.py``). Not among the parametrised tiny configs: only the tests of that fusion use it."""


def make_tiny(name: str, seed: int) -> DDPMUNet:
    """A tiny DDPMUNet with random weights (scaled so every layer matters); ``name`` of TINY_CONFIGS or "pow2"."""
    torch.manual_seed(seed)
    model = DDPMUNet(DDPMUNetConfig(**(POW2_CONFIG if name == "pow2" else TINY_CONFIGS[name]))).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model


@pytest.fixture(params=sorted(TINY_CONFIGS))
def tiny_name(request) -> str:
    return request.param


@pytest.fixture
def tiny_model():
    """``tiny_model(name, seed)`` -> a tiny random DDPMUNet."""
    return make_tiny
