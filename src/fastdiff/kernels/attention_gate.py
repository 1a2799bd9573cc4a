"""The ConvNeXt U-Net's attention gate on a skip connection, in one kernel.

``models.convnext_unet.AttentionGate``::

    a   = ReLU(gate_conv(g) + residual_conv(x))      # two 1x1 convs to `inter` channels, both with bias
    psi = sigmoid(psi_conv(a))                       # 1x1 conv to one channel
    out = x * psi

Argument names map to its weights: ``w_x, b_x`` = ``residual_conv`` (on the skip ``x``), ``w_g, b_g`` =
``gate_conv`` (on the decoder path ``g``), ``w_psi, b_psi`` = ``psi``; every bias is optional. 1x1 weights are
accepted as torch's ``[out, in, 1, 1]`` or as ``[out, in]``.

Layout: ``x`` ``[N, Cx, H, W]`` and ``g`` ``[N, Cg, H, W]`` are logical NCHW tensors in channels-last memory
(channel slices of wider channels-last tensors are read in place; other layouts are copied first); the output
is channels-last like ``x`` (``out`` may be a channel slice of a wider channels-last tensor: a concat part).
Each program owns BLOCK_P pixels: it loads their full x and g channel rows once, runs both 1x1 convs as
``tl.dot`` into one fp32 accumulator per BLOCK_F slice of ``inter`` (tensor cores for 16-bit inputs; exact
fp32 products for fp32 inputs: the sigmoid turns a tf32-sized logit error into ~1e-2 relative error), applies
bias + ReLU and folds the slice into the psi dot product, then writes ``x * sigmoid(psi)`` from the x rows still
in registers. x and g are read once, out written once; meant for up to ~1024 channels per input (whole rows live
in registers).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels import cost_model
from fastdiff.kernels.common import channels_last_randn, grid_dependency_sync, num_sms, pdl_launch
from fastdiff.kernels.registry import KernelOp

log = logging.getLogger(__name__)


def _as_conv1x1(weight: torch.Tensor) -> torch.Tensor:
    return weight.reshape(weight.shape[0], weight.shape[1], 1, 1)


def attention_gate_ref(
    x: torch.Tensor,
    g: torch.Tensor,
    w_x: torch.Tensor,
    w_g: torch.Tensor,
    b_g: torch.Tensor | None,
    w_psi: torch.Tensor,
    b_psi: torch.Tensor | None,
    *,
    b_x: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch definition (the model's own forward): ``x * sigmoid(psi(relu(conv_g(g) + conv_x(x))))``."""
    a = F.relu(F.conv2d(g, _as_conv1x1(w_g), b_g) + F.conv2d(x, _as_conv1x1(w_x), b_x))
    y = x * torch.sigmoid(F.conv2d(a, w_psi.reshape(1, -1, 1, 1), b_psi))
    if out is not None:
        return out.copy_(y)
    return y


@triton.jit
def _attention_gate_kernel(
    x_ptr,
    g_ptr,
    wx_ptr,
    wg_ptr,
    bx_ptr,
    bg_ptr,
    wpsi_ptr,
    bpsi_ptr,
    out_ptr,
    P,
    CX,
    CG,
    INTER,
    stride_xp,
    stride_gp,
    stride_op,
    HAS_BX: tl.constexpr,
    HAS_BG: tl.constexpr,
    HAS_BPSI: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_CX: tl.constexpr,
    BLOCK_CG: tl.constexpr,
    BLOCK_F: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_dependency_sync(PDL)
    rows = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    row_mask = rows < P
    rows64 = rows.to(tl.int64)
    offs_cx = tl.arange(0, BLOCK_CX)
    offs_cg = tl.arange(0, BLOCK_CG)
    cx_mask = offs_cx < CX
    cg_mask = offs_cg < CG
    x_mask = row_mask[:, None] & cx_mask[None, :]
    xa = tl.load(x_ptr + rows64[:, None] * stride_xp + offs_cx[None, :], mask=x_mask, other=0.0)
    ga = tl.load(
        g_ptr + rows64[:, None] * stride_gp + offs_cg[None, :], mask=row_mask[:, None] & cg_mask[None, :], other=0.0
    )

    logit = tl.zeros([BLOCK_P], dtype=tl.float32)
    for f0 in range(0, INTER, BLOCK_F):
        offs_f = f0 + tl.arange(0, BLOCK_F)
        f_mask = offs_f < INTER
        # [C, F] views of the row-major [INTER, C] weights.
        wx = tl.load(
            wx_ptr + offs_f[None, :] * CX + offs_cx[:, None],
            mask=cx_mask[:, None] & f_mask[None, :],
            other=0.0,
        )
        wg = tl.load(
            wg_ptr + offs_f[None, :] * CG + offs_cg[:, None],
            mask=cg_mask[:, None] & f_mask[None, :],
            other=0.0,
        )
        acc = tl.dot(xa, wx, input_precision=DOT_PRECISION)
        acc = tl.dot(ga, wg, acc, input_precision=DOT_PRECISION)
        if HAS_BX:
            acc += tl.load(bx_ptr + offs_f, mask=f_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_BG:
            acc += tl.load(bg_ptr + offs_f, mask=f_mask, other=0.0).to(tl.float32)[None, :]
        acc = tl.maximum(acc, 0.0)
        w_psi = tl.load(wpsi_ptr + offs_f, mask=f_mask, other=0.0).to(tl.float32)
        logit += tl.sum(acc * w_psi[None, :], axis=1)
    if HAS_BPSI:
        logit += tl.load(bpsi_ptr).to(tl.float32)
    psi = 1.0 / (1.0 + tl.exp(-logit))
    y = xa.to(tl.float32) * psi[:, None]
    tl.store(out_ptr + rows64[:, None] * stride_op + offs_cx[None, :], y.to(out_ptr.dtype.element_ty), mask=x_mask)


def _is_pixel_rows(t: torch.Tensor) -> bool:
    """Whether ``t`` [N, C, H, W] is pixel rows ``t.stride(3)`` apart with unit channel stride, over all N*H*W
    pixels in order: dense channels-last, or a channel slice of a wider channels-last tensor (read in place)."""
    n, channels, h, w = t.shape
    row = t.stride(3)
    return t.stride(1) == 1 and row >= channels and t.stride(2) == w * row and (n == 1 or t.stride(0) == h * w * row)


def _weight_2d(name: str, weight: torch.Tensor, inter: int | None, channels: int) -> torch.Tensor:
    if weight.dim() == 4 and weight.shape[2:] == (1, 1):
        weight = weight.reshape(weight.shape[0], weight.shape[1])
    if weight.dim() != 2 or weight.shape[1] != channels or (inter is not None and weight.shape[0] != inter):
        raise FastdiffError(f"{name} must be a 1x1 conv weight [inter, {channels}(, 1, 1)], got {tuple(weight.shape)}")
    return weight.contiguous()


GATE_SMEM_BUDGET = 200 * 1024
"""Bytes of shared memory a gate launch may ask for (the H100 allows 227 KiB per block)."""


def _gate_blocks(pixels: int, cx: int, cg: int, inter: int, elem_bytes: int, device: torch.device) -> tuple[int, ...]:
    """(BLOCK_P, BLOCK_CX, BLOCK_CG, BLOCK_F). BLOCK_P: 128 pixels, fewer for wide rows (registers) or when the
    grid would not fill the GPU. Shared memory holds the pixel tiles once and the weight tiles twice (the
    pipelined loop over F); BLOCK_F, then BLOCK_P, halve until that fits ``GATE_SMEM_BUDGET`` (wide fp32 gates)."""
    block_cx = max(16, triton.next_power_of_2(cx))
    block_cg = max(16, triton.next_power_of_2(cg))
    block_f = max(16, min(64, triton.next_power_of_2(inter)))
    block_p = max(16, min(128, 16384 // max(block_cx, block_cg)))
    while block_p > 16 and triton.cdiv(pixels, block_p) < num_sms(device):
        block_p //= 2

    def smem(block_p: int, block_f: int) -> int:
        return elem_bytes * (block_cx + block_cg) * (block_p + 2 * block_f)

    while smem(block_p, block_f) > GATE_SMEM_BUDGET and block_f > 16:
        block_f //= 2
    while smem(block_p, block_f) > GATE_SMEM_BUDGET and block_p > 16:
        block_p //= 2
    return block_p, block_cx, block_cg, block_f


def attention_gate(
    x: torch.Tensor,
    g: torch.Tensor,
    w_x: torch.Tensor,
    w_g: torch.Tensor,
    b_g: torch.Tensor | None,
    w_psi: torch.Tensor,
    b_psi: torch.Tensor | None,
    *,
    b_x: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x * sigmoid(w_psi . relu(w_g g + b_g + w_x x + b_x) + b_psi)`` per pixel in one launch."""
    if x.dim() != 4 or g.dim() != 4 or g.shape[0] != x.shape[0] or g.shape[2:] != x.shape[2:]:
        raise FastdiffError(
            f"attention_gate needs x [N, Cx, H, W] and g [N, Cg, H, W] at one resolution, got "
            f"{tuple(x.shape)} and {tuple(g.shape)}"
        )
    n, cx, h, w = x.shape
    cg = g.shape[1]
    w_x = _weight_2d("w_x", w_x, None, cx)
    inter = w_x.shape[0]
    w_g = _weight_2d("w_g", w_g, inter, cg)
    w_psi = w_psi.reshape(-1).contiguous()
    if w_psi.numel() != inter:
        raise FastdiffError(f"w_psi must hold {inter} weights ([1, {inter}(, 1, 1)]), got {w_psi.numel()}")
    for name, tensor in (("g", g), ("w_x", w_x), ("w_g", w_g), ("w_psi", w_psi)):
        if tensor.dtype != x.dtype or tensor.device != x.device:
            raise FastdiffError(f"{name} ({tensor.dtype}, {tensor.device}) must match x ({x.dtype}, {x.device})")
    for name, tensor, numel in (("b_x", b_x, inter), ("b_g", b_g, inter), ("b_psi", b_psi, 1)):
        if tensor is not None and (tensor.numel() != numel or tensor.device != x.device):
            raise FastdiffError(f"{name} must hold {numel} values on {x.device}, got shape {tuple(tensor.shape)}")
    if not _is_pixel_rows(x):
        x = x.contiguous(memory_format=torch.channels_last)
    if not _is_pixel_rows(g):
        g = g.contiguous(memory_format=torch.channels_last)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.channels_last)
    elif tuple(out.shape) != tuple(x.shape) or out.dtype != x.dtype or not _is_pixel_rows(out):
        raise FastdiffError(
            f"out must be a channels-last {x.dtype} tensor of shape {tuple(x.shape)} (or a channel slice of one)"
        )
    pixels = n * h * w
    block_p, block_cx, block_cg, block_f = _gate_blocks(pixels, cx, cg, inter, x.element_size(), x.device)
    _attention_gate_kernel[(triton.cdiv(pixels, block_p),)](
        x, g, w_x, w_g,
        b_x if b_x is not None else w_x, b_g if b_g is not None else w_x, w_psi,
        b_psi if b_psi is not None else w_x, out, pixels, cx, cg, inter, x.stride(3), g.stride(3), out.stride(3),
        HAS_BX=b_x is not None, HAS_BG=b_g is not None, HAS_BPSI=b_psi is not None,
        BLOCK_P=block_p, BLOCK_CX=block_cx, BLOCK_CG=block_cg, BLOCK_F=block_f,
        DOT_PRECISION="tf32" if x.dtype in (torch.float16, torch.bfloat16) else "ieee",
        num_warps=4 if block_p * max(block_cx, block_cg) <= 8192 else 8, **pdl_launch(x.device),
    )  # fmt: skip
    return out


GATE_SHAPES: dict[str, tuple[int, int, int, int, int, int]] = {
    "small": (2, 12, 20, 6, 7, 9),
    "cifar10-b1": (1, 64, 64, 32, 32, 32),
    "cifar10-b256": (256, 64, 64, 32, 32, 32),
    "large": (256, 64, 64, 32, 32, 32),
    "sd15-b2": (2, 64, 64, 32, 64, 64),
}
"""size -> (N, Cx, Cg, inter, H, W): the convnext-cifar10 preset's outermost gate (64 channels, 32x32).
SD1.5 has no gate: "sd15-b2" stands for the convnext-64 preset's 64x64 gate at batch 2."""


def attention_gate_example_inputs(
    size: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Skip x, decoder path g and the gate's three 1x1 convs with biases (torch's default-init scale)."""
    if size not in GATE_SHAPES:
        raise FastdiffError(f"unknown example size {size!r}; expected one of {', '.join(GATE_SHAPES)}")
    n, cx, cg, inter, h, w = GATE_SHAPES[size]
    gen = torch.Generator().manual_seed(seed)
    x = channels_last_randn((n, cx, h, w), dtype, device, gen)
    g = channels_last_randn((n, cg, h, w), dtype, device, gen)

    def param(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.rand(shape, generator=gen) * 2 - 1).div(fan_in**0.5).to(device=device, dtype=dtype)

    w_x, b_x = param(inter, cx, 1, 1, fan_in=cx), param(inter, fan_in=cx)
    w_g, b_g = param(inter, cg, 1, 1, fan_in=cg), param(inter, fan_in=cg)
    w_psi, b_psi = param(1, inter, 1, 1, fan_in=inter), param(1, fan_in=inter)
    return (x, g, w_x, w_g, b_g, w_psi, b_psi), {"b_x": b_x}


def attention_gate_cost(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float]:
    """(FLOPs, bytes) of one call by :func:`fastdiff.kernels.cost_model.attention_gate_cost`."""
    x, g, w_x, _, b_g, _, b_psi = args[:7]
    n, c_x, h, w = x.shape
    hidden_biases = int(b_g is not None) + int(kwargs.get("b_x") is not None)
    cost = cost_model.attention_gate_cost(
        n * h * w, c_x, g.shape[1], w_x.shape[0], x.element_size(), hidden_biases, b_psi is not None
    )
    return cost.flops, cost.bytes


OP = KernelOp(
    name="attention_gate",
    triton=attention_gate,
    ref=attention_gate_ref,
    example_inputs=attention_gate_example_inputs,
    cost=attention_gate_cost,
)

__all__ = ["GATE_SHAPES", "OP", "attention_gate", "attention_gate_ref"]
