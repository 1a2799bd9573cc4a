"""Helpers every kernel module shares: the fused activations (codes, Triton and torch forms), the SM count that
sizes launch grids, and channels-last example tensors."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError

ACTIVATIONS: dict[str | None, int] = {None: 0, "silu": 1, "gelu": 2, "relu": 3}
"""Activation name -> the constexpr code the kernels branch on (:func:`apply_activation`)."""


def check_activation(activation: str | None) -> int:
    """The kernel code of ``activation``; a FastdiffError for a name not in ``ACTIVATIONS``."""
    if activation not in ACTIVATIONS:
        raise FastdiffError(f"unknown activation {activation!r}; expected one of {list(ACTIVATIONS)}")
    return ACTIVATIONS[activation]


@triton.jit
def apply_activation(y, ACT: tl.constexpr):
    """``y`` (fp32) through the activation of code ``ACT``: 0 none, 1 SiLU, 2 GELU (exact, erf), 3 ReLU."""
    if ACT == 1:
        y = y / (1.0 + tl.exp(-y))
    elif ACT == 2:
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    elif ACT == 3:
        y = tl.maximum(y, 0.0)
    return y


def activation_ref(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The fused activations in plain torch (gelu is the exact erf form)."""
    check_activation(activation)
    if activation == "silu":
        return F.silu(y)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "relu":
        return F.relu(y)
    return y


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere.

    The interpreter runs programs one by one, so the fewest, largest programs are fastest there.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def channels_last_randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device, gen: torch.Generator
) -> torch.Tensor:
    """Standard-normal [N, C, H, W] tensor (drawn on the CPU for reproducibility) in channels-last memory."""
    t = torch.randn(shape, generator=gen, dtype=torch.float32)
    return t.to(device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
