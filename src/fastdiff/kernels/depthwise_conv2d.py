"""Depthwise 7x7 convolution (ConvNeXt), padding 3, stride 1, with + bias + time embedding fused.

Layout: activations are logical ``[N, C, H, W]`` torch tensors, channels-last in memory (NHWC) for speed; the
kernel reads through strides, so other layouts are correct but slower. The output is allocated channels-last.
Each program owns a BLOCK_H x BLOCK_W pixel tile times BLOCK_C channels and runs the 49 taps as vector FMAs in
fp32 (depthwise has no reduction over channels, so there is no tensor-core GEMM here).

``y[n, c, h, w] = sum_{kh, kw} x[n, c, h+kh-3, w+kw-3] * weight[c, 0, kh, kw] + bias[c] + time_emb[n, c]``
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels import cost_model
from fastdiff.kernels.common import channels_last_randn, grid_dependency_sync, pdl_launch
from fastdiff.kernels.conv2d import conv_shape
from fastdiff.kernels.registry import KernelOp

KERNEL_SIZE = 7
PADDING = 3


def pack_depthwise_weight(weight: torch.Tensor) -> torch.Tensor:
    """torch depthwise weight ``[C, 1, K, K]`` -> contiguous ``[K*K, C]`` (one channel vector per tap)."""
    if weight.dim() != 4 or weight.shape[1] != 1 or weight.shape[2:] != (KERNEL_SIZE, KERNEL_SIZE):
        raise FastdiffError(f"depthwise weight must be [C, 1, 7, 7], got shape {tuple(weight.shape)}")
    return weight.reshape(weight.shape[0], KERNEL_SIZE * KERNEL_SIZE).t().contiguous()


def _as_raw_weight(weight: torch.Tensor, channels: int) -> torch.Tensor:
    if weight.dim() == 2:
        return weight.t().reshape(channels, 1, KERNEL_SIZE, KERNEL_SIZE)
    return weight


def depthwise_conv2d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    time_emb: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch definition of :func:`depthwise_conv2d`; accepts raw ``[C,1,7,7]`` or packed ``[49, C]``."""
    channels = x.shape[1]
    y = F.conv2d(x, _as_raw_weight(weight, channels), bias, padding=PADDING, groups=channels)
    if time_emb is not None:
        y = y + time_emb[:, :, None, None]
    if out is not None:
        return out.copy_(y)
    return y


@triton.jit
def _depthwise_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    temb_ptr,
    out_ptr,
    C,
    H,
    W,
    stride_xn,
    stride_xc,
    stride_xh,
    stride_xw,
    stride_tn,
    stride_tc,
    stride_on,
    stride_oc,
    stride_oh,
    stride_ow,
    KSIZE: tl.constexpr,
    PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_TEMB: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_dependency_sync(PDL)
    pid_pix = tl.program_id(0)
    pid_c = tl.program_id(1)
    tiles_w = tl.cdiv(W, BLOCK_W)
    tiles_h = tl.cdiv(H, BLOCK_H)
    tile_w = pid_pix % tiles_w
    tile_h = (pid_pix // tiles_w) % tiles_h
    n = pid_pix // (tiles_w * tiles_h)

    offs_p = tl.arange(0, BLOCK_H * BLOCK_W)
    oh = tile_h * BLOCK_H + offs_p // BLOCK_W
    ow = tile_w * BLOCK_W + offs_p % BLOCK_W
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    x_base = x_ptr + n.to(tl.int64) * stride_xn + offs_c[None, :] * stride_xc

    acc = tl.zeros((BLOCK_H * BLOCK_W, BLOCK_C), dtype=tl.float32)
    for kh in tl.static_range(KSIZE):
        ih = oh + (kh - PAD)
        h_ok = (ih >= 0) & (ih < H)
        for kw in tl.static_range(KSIZE):
            iw = ow + (kw - PAD)
            ok = h_ok & (iw >= 0) & (iw < W)
            xv = tl.load(
                x_base + (ih * stride_xh + iw * stride_xw)[:, None],
                mask=ok[:, None] & c_mask[None, :],
                other=0.0,
            )
            wv = tl.load(w_ptr + (kh * KSIZE + kw) * C + offs_c, mask=c_mask, other=0.0)
            acc += xv.to(tl.float32) * wv.to(tl.float32)[None, :]

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_TEMB:
        acc += tl.load(temb_ptr + n * stride_tn + offs_c * stride_tc, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    p_mask = (oh < H) & (ow < W)
    out_ptrs = (
        out_ptr + n.to(tl.int64) * stride_on + (oh * stride_oh + ow * stride_ow)[:, None] + offs_c[None, :] * stride_oc
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=p_mask[:, None] & c_mask[None, :])


def _depthwise_blocks(channels: int, h: int, w: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_W, BLOCK_C, num_warps).

    GPU: 64 channels (128 B of fp16 per pixel) x an 8x8 pixel tile. Interpreter: the whole image and up to 128
    channels per program, since it runs programs one after another.
    """
    if device.type != "cuda":
        return (
            triton.next_power_of_2(min(h, 32)), triton.next_power_of_2(min(w, 32)), max(16,
            triton.next_power_of_2(min(channels, 128))), 4,
        )  # fmt: skip
    block_c = max(16, min(64, triton.next_power_of_2(channels)))
    block_w = max(4, min(8, triton.next_power_of_2(w)))
    block_h = max(4, min(8, triton.next_power_of_2(h)))
    return block_h, block_w, block_c, 4


def depthwise_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    time_emb: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """7x7 depthwise conv, padding 3: ``conv(x) + bias[c] + time_emb[n, c]`` with fp32 accumulation.

    ``x`` is a logical ``[N, C, H, W]`` tensor (channels-last memory for speed); ``weight`` is raw
    ``[C, 1, 7, 7]`` or packed ``[49, C]`` (:func:`pack_depthwise_weight`; pack once at load). Returns a
    channels-last tensor (or writes ``out``).
    """
    if x.dim() != 4:
        raise FastdiffError(f"depthwise_conv2d input must be 4-D [N, C, H, W], got shape {tuple(x.shape)}")
    n, channels, h, w = x.shape
    if weight.dim() == 4:
        weight = pack_depthwise_weight(weight)
    if tuple(weight.shape) != (KERNEL_SIZE * KERNEL_SIZE, channels):
        raise FastdiffError(f"packed depthwise weight must be [49, {channels}], got {tuple(weight.shape)}")
    if weight.device != x.device or weight.dtype != x.dtype:
        raise FastdiffError(f"weight ({weight.dtype}, {weight.device}) must match input ({x.dtype}, {x.device})")
    weight = weight.contiguous()
    for name, tensor, shape in (
        ("bias", bias, (channels,)),
        ("time_emb", time_emb, (n, channels)),
        ("out", out, (n, channels, h, w)),
    ):
        if tensor is not None and (tuple(tensor.shape) != shape or tensor.device != x.device):
            raise FastdiffError(f"{name} must have shape {shape} on {x.device}, got {tuple(tensor.shape)}")
    if bias is not None:
        bias = bias.contiguous()
    if out is None:
        out = torch.empty_like(x, memory_format=torch.channels_last)
    block_h, block_w, block_c, num_warps = _depthwise_blocks(channels, h, w, x.device)
    grid = (n * triton.cdiv(h, block_h) * triton.cdiv(w, block_w), triton.cdiv(channels, block_c))
    temb_strides = time_emb.stride() if time_emb is not None else (0, 0)
    _depthwise_kernel[grid](
        x, weight, bias if bias is not None else out, time_emb if time_emb is not None else out, out,
        channels, h, w, *x.stride(), *temb_strides, *out.stride(),
        KSIZE=KERNEL_SIZE, PAD=PADDING, HAS_BIAS=bias is not None, HAS_TEMB=time_emb is not None,
        BLOCK_H=block_h, BLOCK_W=block_w, BLOCK_C=block_c, num_warps=num_warps, **pdl_launch(x.device),
    )  # fmt: skip
    return out


def depthwise_conv2d_example_inputs(
    size: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A ConvNeXt block's 7x7 depthwise conv (+ bias + time embedding) at the model's largest resolution."""
    n, channels, _, h, w = conv_shape(size)
    gen = torch.Generator().manual_seed(seed)
    x = channels_last_randn((n, channels, h, w), dtype, device, gen)
    weight = torch.randn((channels, 1, KERNEL_SIZE, KERNEL_SIZE), generator=gen) / KERNEL_SIZE
    bias = torch.randn(channels, generator=gen)
    time_emb = torch.randn((n, channels), generator=gen)
    packed = pack_depthwise_weight(weight).to(device=device, dtype=dtype)
    return (x, packed, bias.to(device=device, dtype=dtype)), {"time_emb": time_emb.to(device=device, dtype=dtype)}


def depthwise_conv2d_cost(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float]:
    """(FLOPs, bytes) of one call by :func:`fastdiff.kernels.cost_model.conv2d_cost` with one group per channel."""
    x = args[0]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    n, channels, h, w = x.shape
    cost = cost_model.conv2d_cost(
        n, channels, channels, h, w, KERNEL_SIZE, channels, x.element_size(), bias=bias is not None,
        temb=kwargs.get("time_emb") is not None,
    )  # fmt: skip
    return cost.flops, cost.bytes


OP = KernelOp(
    name="depthwise_conv2d",
    triton=depthwise_conv2d,
    ref=depthwise_conv2d_ref,
    example_inputs=depthwise_conv2d_example_inputs,
    cost=depthwise_conv2d_cost,
)
