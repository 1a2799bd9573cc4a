"""Stride-1 convolution on Hopper's tensor-memory accelerator (TMA): the implicit GEMM of :mod:`conv2d` with its
A and B tiles brought in by bulk tensor copies instead of per-thread gathers.

Same op, same definition (:func:`fastdiff.kernels.conv2d.conv2d_ref`), same packed weights ``[K*K*Cin, Cout]``
and the same fused epilogue (bias, time embedding, activation, residual, scale) as :func:`conv2d`; a narrower
domain: stride 1, no upsampling, no folded GroupNorm, and the layout constraints of a TMA descriptor (16-byte
aligned base and strides, unit channel stride). :func:`tma_conv_unsupported` says why a call is out of it, and
the engine then keeps the gather kernel or cuDNN.

Two ways to address the input, both one descriptor per tensor and one copy per (tap, channel chunk):

* ``"box"``: a 4-D descriptor over NHWC ``[N, H, W, Cin]``; an output tile is a box of ``TN`` images x ``TH``
  rows x ``TW`` columns (``BLOCK_M = TN*TH*TW``); tap ``(kh, kw)`` loads the box shifted by ``(kh - pad,
  kw - pad)``. The copy engine fills coordinates outside the tensor with zeros, which is exactly the conv's
  zero padding, so the tile goes to the tensor cores untouched.
* ``"rows"``: a 2-D descriptor over the pixel rows ``[N*H*W, Cin]`` (needs ``Ho == H``, ``Wo == W``); an output
  tile is ``BLOCK_M`` consecutive pixels and tap ``(kh, kw)`` loads the rows shifted by ``(kh - pad) * W +
  (kw - pad)``. Rows that wrapped into the next image row or image are zeroed in registers before the dot.

Channels past ``Cin`` in the last chunk of a tap are outside the descriptor, so they load as zeros and the
weight rows they meet (the next tap's) add nothing. Accumulation is fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fastdiff.errors import FastdiffError
from fastdiff.kernels.common import ACTIVATIONS
from fastdiff.kernels.conv2d import (
    _packed_kernel_size,
    check_epilogue_args,
    conv2d_cost,
    conv2d_example_inputs,
    conv2d_ref,
    fused_epilogue,
    pack_conv_weight,
)
from fastdiff.kernels.registry import KernelOp

LAYOUTS = ("box", "rows")


@dataclass(frozen=True)
class TmaConfig:
    """Tile shape and launch parameters of one :func:`conv2d_tma` call."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 4
    layout: str = "box"


@triton.jit
def _conv2d_tma_kernel(
    x_desc, w_desc, bias_ptr, temb_ptr, res_ptr, out_ptr,
    N, H, W, Cin, Ho, Wo, Cout,
    stride_tn, stride_tc, stride_rn, stride_rc, stride_rh, stride_rw, stride_on, stride_oc, stride_oh, stride_ow,
    out_scale,
    PAD: tl.constexpr, KSIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_TEMB: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BOX: tl.constexpr, TN: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    BLOCK_M: tl.constexpr = TN * TH * TW
    # Output-channel tiles vary fastest: the programs that share an input tile run together (L2 reuse).
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(Cout, BLOCK_N)
    pid_n = pid % num_pid_n
    tile = pid // num_pid_n
    r = tl.arange(0, BLOCK_M)
    if BOX:
        tiles_w = tl.cdiv(Wo, TW)
        tiles_h = tl.cdiv(Ho, TH)
        n0 = (tile // (tiles_w * tiles_h)) * TN
        h0 = ((tile // tiles_w) % tiles_h) * TH
        w0 = (tile % tiles_w) * TW
        n_idx = n0 + r // (TH * TW)
        oh = h0 + (r // TW) % TH
        ow = w0 + r % TW
        m_mask = (n_idx < N) & (oh < Ho) & (ow < Wo)
    else:
        m0 = tile * BLOCK_M
        offs_m = m0 + r
        ow = offs_m % Wo
        oh = (offs_m // Wo) % Ho
        n_idx = offs_m // (Wo * Ho)
        m_mask = offs_m < N * Ho * Wo

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_chunks = tl.cdiv(Cin, BLOCK_K)
    for step in range(0, KSIZE * KSIZE * k_chunks):
        tap = step // k_chunks
        c0 = (step - tap * k_chunks) * BLOCK_K
        dh = tap // KSIZE - PAD
        dw = tap % KSIZE - PAD
        if BOX:
            a = x_desc.load([n0, h0 + dh, w0 + dw, c0]).reshape(BLOCK_M, BLOCK_K)
        else:
            a = x_desc.load([m0 + dh * W + dw, c0])
            ih = oh + dh
            iw = ow + dw
            ok = (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            a = tl.where(ok[:, None], a, 0.0)
        b = w_desc.load([tap * Cin + c0, pid_n * BLOCK_N])
        acc = tl.dot(a, b, acc)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < Cout
    n64 = n_idx.to(tl.int64)
    res_rows = res_ptr + n64 * stride_rn + oh * stride_rh + ow * stride_rw
    acc = fused_epilogue(
        acc, n_idx, offs_n, m_mask, n_mask, bias_ptr, temb_ptr, stride_tn, stride_tc, res_rows, stride_rc,
        out_scale, HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip
    out_rows = out_ptr + n64 * stride_on + oh * stride_oh + ow * stride_ow
    tl.store(out_rows[:, None] + offs_n[None, :] * stride_oc, acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip


def _pow2_at_most(value: int, high: int) -> int:
    return min(high, triton.next_power_of_2(max(value, 1)))


def box_tile(block_m: int, n: int, ho: int, wo: int) -> tuple[int, int, int]:
    """(TN, TH, TW) of a ``block_m``-pixel output box: whole rows when they fit, then whole images."""
    tw = _pow2_at_most(wo, block_m)
    th = _pow2_at_most(ho, block_m // tw)
    return block_m // (tw * th), th, tw


def _aligned(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    size = t.element_size()
    return t.data_ptr() % 16 == 0 and all(s * size % 16 == 0 for s in strides)


def tma_conv_unsupported(
    x: torch.Tensor,
    cout: int,
    ksize: int,
    *,
    stride: int = 1,
    padding: int = 0,
    upsample: int = 1,
    layout: str = "box",
) -> str | None:
    """Why :func:`conv2d_tma` cannot run a ``ksize`` x ``ksize`` conv of ``x`` to ``cout`` channels, or None
    when it can (the packed weight ``[K*K*Cin, Cout]`` is contiguous: its row stride is ``cout``)."""
    if layout not in LAYOUTS:
        return f"unknown layout {layout!r}; expected one of {LAYOUTS}"
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
        return "TMA needs a Hopper-class GPU (compute capability 9.0 or newer)"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {x.dtype} is not fp16, bf16 or fp32"
    if stride != 1 or upsample != 1:
        return "stride 1 and no upsampling only"
    n, cin, h, w = x.shape
    if x.stride(1) != 1:
        return "the input's channels must be contiguous (channels-last)"
    if not _aligned(x, (x.stride(0), x.stride(2), x.stride(3))) or cout * x.element_size() % 16:
        return "TMA needs 16-byte aligned base pointers and strides"
    if layout == "rows":
        if h + 2 * padding - ksize + 1 != h or w + 2 * padding - ksize + 1 != w:
            return "the rows layout needs a 'same' conv (output size = input size)"
        if x.stride(2) != w * x.stride(3) or x.stride(0) != h * x.stride(2):
            return "the rows layout needs densely stored pixels"
    return None


def default_config(n: int, ho: int, wo: int, cin: int, cout: int) -> TmaConfig:
    """The tile shape for a conv of this size (from timings on the H100 at the U-Nets' shapes)."""
    block_n = max(16, _pow2_at_most(cout, 128))
    block_k = 64 if cin >= 64 else max(16, triton.next_power_of_2(cin))
    return TmaConfig(block_n=block_n, block_k=block_k)


def conv2d_tma(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    stride: int = 1,
    padding: int = 0,
    time_emb: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    out_scale: float | None = None,
    out: torch.Tensor | None = None,
    upsample: int = 1,
    config: TmaConfig | None = None,
) -> torch.Tensor:
    """:func:`fastdiff.kernels.conv2d.conv2d` for stride-1 convs, tiles loaded by TMA (module docstring).

    ``weight`` is packed ``[K*K*Cin, Cout]`` or raw ``[Cout, Cin, K, K]``; ``config`` (default
    :func:`default_config`) picks the tile shape and the input layout. A conv outside the TMA domain raises
    FastdiffError with :func:`tma_conv_unsupported`'s reason.
    """
    if x.dim() != 4:
        raise FastdiffError(f"conv2d input must be 4-D [N, C, H, W], got shape {tuple(x.shape)}")
    n, cin, h, w = x.shape
    if weight.dim() == 4:
        weight = pack_conv_weight(weight)
    ksize = _packed_kernel_size(weight, cin)
    cout = weight.shape[1]
    ho, wo = h + 2 * padding - ksize + 1, w + 2 * padding - ksize + 1
    if padding < 0 or ho < 1 or wo < 1:
        raise FastdiffError(f"conv output would be empty for input {h}x{w}, kernel {ksize}, padding {padding}")
    config = config or default_config(n, ho, wo, cin, cout)
    reason = tma_conv_unsupported(x, cout, ksize, stride=stride, padding=padding, upsample=upsample,
                                  layout=config.layout)  # fmt: skip
    if weight.dtype != x.dtype or weight.device != x.device:
        reason = f"weight ({weight.dtype}, {weight.device}) must match input ({x.dtype}, {x.device})"
    if reason is not None:
        raise FastdiffError(f"conv2d_tma: {reason}")
    weight = weight.contiguous()
    check_epilogue_args(n, cout, (ho, wo), x.device, bias, time_emb, residual, activation, out)
    if out is None:
        out = torch.empty((n, cout, ho, wo), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    box = config.layout == "box"
    if box:
        tn, th, tw = box_tile(config.block_m, n, ho, wo)
        x_desc = TensorDescriptor(
            x, [n, h, w, cin], [x.stride(0), x.stride(2), x.stride(3), 1], [tn, th, tw, config.block_k]
        )
        tiles = triton.cdiv(n, tn) * triton.cdiv(ho, th) * triton.cdiv(wo, tw)
    else:
        tn, th, tw = 1, 1, config.block_m
        x_desc = TensorDescriptor(x, [n * h * w, cin], [x.stride(3), 1], [config.block_m, config.block_k])
        tiles = triton.cdiv(n * ho * wo, config.block_m)
    w_desc = TensorDescriptor(weight, list(weight.shape), [cout, 1], [config.block_k, config.block_n])
    temb = time_emb if time_emb is not None else out
    res = residual if residual is not None else out
    temb_strides = time_emb.stride() if time_emb is not None else (0, 0)
    grid = (tiles * triton.cdiv(cout, config.block_n),)
    _conv2d_tma_kernel[grid](
        x_desc, w_desc, bias if bias is not None else out, temb, res, out,
        n, h, w, cin, ho, wo, cout, *temb_strides, *res.stride(), *out.stride(),
        1.0 if out_scale is None else float(out_scale),
        PAD=padding, KSIZE=ksize,
        HAS_BIAS=bias is not None, HAS_TEMB=time_emb is not None, HAS_RES=residual is not None,
        ACT=ACTIVATIONS[activation], HAS_SCALE=out_scale is not None,
        BOX=box, TN=tn, TH=th, TW=tw, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return out


def conv2d_tma_example_inputs(
    size: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """conv1 of a ResnetBlock2D (3x3 pad 1, + bias + time embedding): the shapes of :mod:`conv2d`."""
    return conv2d_example_inputs(size, dtype, device, seed)


OP = KernelOp(
    name="conv2d_tma",
    triton=conv2d_tma,
    ref=conv2d_ref,
    example_inputs=conv2d_tma_example_inputs,
    cost=conv2d_cost,
)
