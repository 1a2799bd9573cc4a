"""LayerNorm over the channels of a token matrix (the transformer blocks' norm1/norm2/norm3).

Layout: ``x`` is a 2-D token matrix ``[M, C]`` with unit column stride and any row stride: a channels-last
``[B, C, H, W]`` activation viewed as ``[B*H*W, C]``, or a channel slice of a wider one (row stride > C), read
in place. ``out`` (same shape and dtype; allocated contiguous when not given) may have its own row stride.

Per row, with fp32 statistics (two passes over the row held in registers, so no sum-of-squares cancellation)::

    mean = sum(x) / C
    var  = sum((x - mean)^2) / C
    y    = (x - mean) * rsqrt(var + eps) * weight + bias

Each program owns BLOCK_M whole rows (several rows when C is small, so a tile holds ~``TILE`` elements); rows
up to ``MAX_CHANNELS`` wide fit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels import cost_model
from fastdiff.kernels.common import grid_dependency_sync, num_sms, pdl_launch
from fastdiff.kernels.fp8 import FP8_DTYPE, to_e4m3
from fastdiff.kernels.registry import KernelOp

MAX_CHANNELS = 8192
"""Widest row (C) one program holds in registers."""
TILE = 4096
"""Elements per program tile (BLOCK_M rows x BLOCK_C padded channels) when C is small enough to stack rows."""


def layer_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch definition: ``F.layer_norm`` over the last dim of an fp32 copy (float64 stays float64), cast
    back to ``x.dtype``."""
    compute = torch.promote_types(x.dtype, torch.float32)
    w = None if weight is None else weight.to(compute)
    b = None if bias is None else bias.to(compute)
    y = F.layer_norm(x.to(compute), (x.shape[-1],), w, b, eps).to(x.dtype)
    if out is not None:
        return out.copy_(y)
    return y


@triton.jit
def _layer_norm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    C,
    stride_xm,
    stride_ym,
    eps,
    inv_scale,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: BLOCK_M rows x all C channels (padded to BLOCK_C), normalised from registers; with FP8 the
    result is stored in e4m3 at ``1 / inv_scale`` units."""
    grid_dependency_sync(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_C)
    c_mask = cols < C
    mask = (rows < M)[:, None] & c_mask[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / C
    dev = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(dev * dev, axis=1) / C + eps)
    y = dev * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    if FP8:
        y = to_e4m3(y * inv_scale)
    tl.store(y_ptr + rows64[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _check_inputs(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, out: torch.Tensor | None,
    fp8_scale: float | None = None,
) -> None:  # fmt: skip
    if x.dim() != 2:
        raise FastdiffError(f"layer_norm input must be a 2-D token matrix [M, C], got shape {tuple(x.shape)}")
    m, channels = x.shape
    if not 1 <= channels <= MAX_CHANNELS:
        raise FastdiffError(f"layer_norm supports 1 to {MAX_CHANNELS} channels, got {channels}")
    if x.stride(1) != 1 and channels > 1:
        raise FastdiffError(f"layer_norm input needs unit column stride, got strides {x.stride()}")
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and (tuple(tensor.shape) != (channels,) or tensor.device != x.device):
            raise FastdiffError(
                f"{name} must have shape ({channels},) on {x.device}, got {tuple(tensor.shape)} on {tensor.device}"
            )
    if fp8_scale is not None and not (isinstance(fp8_scale, float) and fp8_scale > 0):
        raise FastdiffError(f"fp8_scale must be a positive float, got {fp8_scale!r}")
    if out is not None:
        dtype = x.dtype if fp8_scale is None else FP8_DTYPE
        if tuple(out.shape) != (m, channels) or out.dtype != dtype or out.device != x.device:
            raise FastdiffError(
                f"out must be a {dtype} tensor of shape {(m, channels)} on {x.device}, got {out.dtype} "
                f"{tuple(out.shape)} on {out.device}"
            )
        if out.stride(1) != 1 and channels > 1:
            raise FastdiffError(f"out needs unit column stride, got strides {out.stride()}")


def _blocks(m: int, channels: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_C, num_warps): ~TILE-element tiles of whole rows, fewer rows per program while that leaves
    under two programs per SM."""
    block_c = triton.next_power_of_2(channels)
    block_m = max(1, TILE // block_c)
    while block_m > 1 and triton.cdiv(m, block_m) < 2 * num_sms(device):
        block_m //= 2
    num_warps = max(1, min(8, block_m * block_c // 512))
    return block_m, block_c, num_warps


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    out: torch.Tensor | None = None,
    fp8_scale: float | None = None,
) -> torch.Tensor:
    """``(x - mean) * rsqrt(var + eps) * weight + bias`` over the C channels of each row of ``x`` [M, C].

    ``x`` and ``out``: 2-D, unit column stride, any row stride (channel slices of wider token matrices are read
    and written in place). ``weight``/``bias``: [C] or None. Statistics in fp32; the result is in ``x.dtype``, or
    with ``fp8_scale`` in e4m3 (``fastdiff.kernels.fp8``): ``e4m3(y / fp8_scale)``, saturating, for an fp8 GEMM
    to read (the scale from the affine: ``fastdiff.kernels.fp8.norm_output_scale``).
    """
    _check_inputs(x, weight, bias, out, fp8_scale)
    m, channels = x.shape
    if out is None:
        out = torch.empty((m, channels), device=x.device, dtype=x.dtype if fp8_scale is None else FP8_DTYPE)
    if m == 0:
        return out
    block_m, block_c, num_warps = _blocks(m, channels, x.device)
    _layer_norm_kernel[(triton.cdiv(m, block_m),)](
        x, weight if weight is not None else x, bias if bias is not None else x, out,
        m, channels, x.stride(0), out.stride(0), eps, 1.0 if fp8_scale is None else 1.0 / fp8_scale,
        HAS_W=weight is not None, HAS_B=bias is not None, FP8=fp8_scale is not None, BLOCK_M=block_m,
        BLOCK_C=block_c, num_warps=num_warps, **pdl_launch(x.device),
    )  # fmt: skip
    return out


LAYER_NORM_SHAPES: dict[str, tuple[int, int]] = {
    "small": (37, 40),
    "sd15-b2": (2 * 64 * 64, 320),
    "sd15-b2-mid": (2 * 8 * 8, 1280),
}
"""size -> (M tokens, C): SD1.5 at batch 2, the first transformer block (64x64 latent, 320 channels) and the
mid block's (8x8, 1280)."""


def layer_norm_example_inputs(
    size: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A BasicTransformerBlock's LayerNorm (eps 1e-5) on contiguous tokens, non-trivial affine."""
    if size not in LAYER_NORM_SHAPES:
        raise FastdiffError(f"unknown example size {size!r}; expected one of {', '.join(LAYER_NORM_SHAPES)}")
    m, channels = LAYER_NORM_SHAPES[size]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((m, channels), generator=gen).to(device=device, dtype=dtype)
    weight = (1.0 + 0.1 * torch.randn(channels, generator=gen)).to(device=device, dtype=dtype)
    bias = (0.1 * torch.randn(channels, generator=gen)).to(device=device, dtype=dtype)
    return (x, weight, bias, 1e-5), {}


def layer_norm_cost(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float]:
    """(FLOPs, bytes) of one call by :func:`fastdiff.kernels.cost_model.layer_norm_cost`."""
    x, weight, bias = args[0], args[1], args[2]
    m, channels = x.shape
    cost = cost_model.layer_norm_cost(m, channels, x.element_size(), affine=weight is not None or bias is not None)
    return cost.flops, cost.bytes


OP = KernelOp(
    name="layer_norm",
    triton=layer_norm,
    ref=layer_norm_ref,
    example_inputs=layer_norm_example_inputs,
    cost=layer_norm_cost,
)

__all__ = ["LAYER_NORM_SHAPES", "OP", "layer_norm", "layer_norm_ref"]
