"""A KxK stride-1 conv with few output channels (a U-Net's ``conv_out``: 128 -> 3) as one GEMM and a tap sum.

The implicit-GEMM kernels (:mod:`conv2d`, :mod:`conv2d_tma`) read each input pixel once per tap, K*K times; with
a hundred output channels that is paid for by the multiply-adds, with three it is the whole cost. On the H100 at
ddpm-cifar10 batch 256 (256 x 128 x 32 x 32 fp16 in, 3 channels out: 67 MB) cuDNN took 110.9 us and the gather
kernel 113.7 (``benchmarks/results/sweep-conv-persistent-ddpm-cifar10-b256-h100-2026-11-25.json``, row
``conv_out``); this form took 69.0 us in the op table of ``bench-ddpm-cifar10-b256-h100-2026-11-26.json`` (git
860faf6). Here the input is read once:

1. tap partials: a 1x1 conv of ``x`` to ``K*K*Cout`` channels (tap-major, padded to a multiple of 8),
   ``P[n, h, w, (kh*K + kw)*Cout + c] = sum_ci x[n, ci, h, w] * W[c, ci, kh, kw]``, fp32
   (:func:`fastdiff.kernels.conv2d_tma.conv2d_tma` on Hopper, else :func:`fastdiff.kernels.conv2d.conv2d`);
2. the tap sum (:func:`_tap_sum_kernel`): ``y[n, c, h, w] = bias[c] + sum_{kh, kw} P[n, h + kh - pad,
   w + kw - pad, (kh*K + kw)*Cout + c]`` over the taps inside the image (zero padding), in fp32, then the output
   dtype.

Same op and definition as :func:`fastdiff.kernels.conv2d.conv2d_ref` (bias only: no time embedding, activation,
residual or scale); the sums run in another order (per tap, then over taps), within the fp16 tolerance.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels.common import channels_last_randn, grid_dependency_sync, pdl_launch
from fastdiff.kernels.conv2d import conv2d, conv2d_cost, conv2d_ref, padding_pair
from fastdiff.kernels.conv2d_tma import conv2d_tma, tma_conv_unsupported
from fastdiff.kernels.registry import KernelOp

MAX_COUT = 8
"""Most output channels this form takes: its partials hold ``K*K*Cout`` channels per pixel, written and read
once, against ``Cin`` read K*K times by the implicit GEMM (``Cout`` up to a few, as in an image-output conv)."""
BLOCK_PIXELS = 128
"""Output pixels per program of the tap sum."""


def tap_columns(ksize: int, cout: int) -> int:
    """Channels of the tap partials: ``K*K*Cout`` rounded up to a multiple of 8 (16-byte fp16 weight rows for
    the TMA conv)."""
    return triton.cdiv(ksize * ksize * cout, 8) * 8


def pack_tap_weight(weight: torch.Tensor) -> torch.Tensor:
    """``[Cout, Cin, K, K]`` -> ``[Cin, cols]``: column ``(kh*K + kw)*Cout + c`` is ``weight[c, :, kh, kw]``; ``cols``
    is ``K*K*Cout`` rounded up to a multiple of 8 (16-byte fp16 rows for the TMA conv), the extra columns zero."""
    if weight.dim() != 4 or weight.shape[2] != weight.shape[3]:
        raise FastdiffError(f"conv weight must be [Cout, Cin, K, K], got shape {tuple(weight.shape)}")
    cout, cin, k, _ = weight.shape
    taps = weight.permute(1, 2, 3, 0).reshape(cin, k * k * cout)  # [Cin, (kh, kw, c)]
    return torch.nn.functional.pad(taps, (0, tap_columns(k, cout) - k * k * cout)).contiguous()


def tap_sum_unsupported(x: torch.Tensor, cout: int, ksize: int, stride: int, padding: Any) -> str | None:
    """Why :func:`tap_sum_conv2d` cannot run this conv, or None."""
    if cout > MAX_COUT:
        return f"{cout} output channels: the tap-sum form is for at most {MAX_COUT}"
    if stride != 1:
        return "stride 1 only"
    before, after = padding_pair(padding)
    if before != after or not 0 <= before < ksize:
        return "symmetric padding smaller than the kernel only"
    if x.dim() != 4:
        return "the input must be 4-D [N, C, H, W]"
    return None


@triton.jit
def _tap_sum_kernel(
    p_ptr, bias_ptr, out_ptr,
    H, W, Ho, Wo, P_TOTAL, COUT,
    stride_pn, stride_ph, stride_pw, stride_on, stride_oc, stride_oh, stride_ow,
    KSIZE: tl.constexpr, PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Stage 2: BLOCK_P output pixels x all channels; each tap adds its partials from the shifted pixel."""
    grid_dependency_sync(PDL)
    offs_p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    p_mask = offs_p < P_TOTAL
    n = offs_p // (Ho * Wo)
    oh = (offs_p // Wo) % Ho
    ow = offs_p % Wo
    offs_c = tl.arange(0, BLOCK_C)
    c_mask = offs_c < COUT
    acc = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for tap in tl.static_range(KSIZE * KSIZE):
        ih = oh + tap // KSIZE - PAD
        iw = ow + tap % KSIZE - PAD
        inside = p_mask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        rows = p_ptr + n.to(tl.int64) * stride_pn + ih * stride_ph + iw * stride_pw + tap * COUT
        acc += tl.load(rows[:, None] + offs_c[None, :], mask=inside[:, None] & c_mask[None, :], other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    out_rows = out_ptr + n.to(tl.int64) * stride_on + oh * stride_oh + ow * stride_ow
    tl.store(out_rows[:, None] + offs_c[None, :] * stride_oc, acc.to(out_ptr.dtype.element_ty),
             mask=p_mask[:, None] & c_mask[None, :])  # fmt: skip


def tap_sum_conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    padding: int | tuple[int, int] = 0,
    out: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
) -> torch.Tensor:
    """``conv2d(x, weight, bias, padding=padding)`` for a stride-1 conv of at most :data:`MAX_COUT` output
    channels, as tap partials then a tap sum (module docstring).

    ``weight``: ``[Cout, Cin, K, K]``; ``packed`` (optional): its :func:`pack_tap_weight` in ``x``'s dtype, packed
    once by a caller that repeats the conv. ``partials`` (optional, reused between calls): an fp32 channels-last
    ``[N, cols, H, W]`` buffer for stage 1. ``out`` (optional): a ``[N, Cout, Ho, Wo]`` tensor; otherwise a new
    channels-last one in ``x``'s dtype.
    """
    if weight.dim() != 4 or weight.shape[2] != weight.shape[3]:
        raise FastdiffError(f"conv weight must be [Cout, Cin, K, K], got shape {tuple(weight.shape)}")
    cout, ksize = weight.shape[0], weight.shape[2]
    if packed is None:
        packed = pack_tap_weight(weight).to(x.dtype)
    weight = packed
    reason = tap_sum_unsupported(x, cout, ksize, 1, padding)
    if reason is not None:
        raise FastdiffError(f"tap_sum_conv2d: {reason}")
    n, cin, h, w = x.shape
    cols = tap_columns(ksize, cout)
    if tuple(weight.shape) != (cin, cols) or weight.dtype != x.dtype or weight.device != x.device:
        raise FastdiffError(
            f"packed tap weight {tuple(weight.shape)} {weight.dtype} on {weight.device} does not fit input "
            f"{tuple(x.shape)} {x.dtype} on {x.device}"
        )
    pad = padding_pair(padding)[0]
    ho, wo = h + 2 * pad - ksize + 1, w + 2 * pad - ksize + 1
    if ho < 1 or wo < 1:
        raise FastdiffError(f"conv output would be empty for input {h}x{w}, kernel {ksize}, padding {pad}")
    if bias is not None and (tuple(bias.shape) != (cout,) or bias.device != x.device):
        raise FastdiffError(f"bias must have shape ({cout},) on {x.device}, got {tuple(bias.shape)}")
    if out is None:
        out = torch.empty((n, cout, ho, wo), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    elif tuple(out.shape) != (n, cout, ho, wo) or out.device != x.device:
        raise FastdiffError(f"out must have shape {(n, cout, ho, wo)} on {x.device}, got {tuple(out.shape)}")
    if partials is None:
        partials = torch.empty((n, cols, h, w), device=x.device, dtype=torch.float32, memory_format=torch.channels_last)
    elif (
        tuple(partials.shape) != (n, cols, h, w) or partials.dtype != torch.float32
        or not partials.is_contiguous(memory_format=torch.channels_last)
    ):  # fmt: skip
        raise FastdiffError(f"partials must be a channels-last fp32 tensor of shape {(n, cols, h, w)}")
    if x.device.type == "cuda" and tma_conv_unsupported(x, cols, 1) is None:
        conv2d_tma(x, weight, out=partials)
    else:
        conv2d(x, weight, out=partials)
    total = n * ho * wo
    _tap_sum_kernel[(triton.cdiv(total, BLOCK_PIXELS),)](
        partials, bias if bias is not None else out, out, h, w, ho, wo, total, cout,
        partials.stride(0), partials.stride(2), partials.stride(3), *out.stride(),
        KSIZE=ksize, PAD=pad, HAS_BIAS=bias is not None, BLOCK_P=BLOCK_PIXELS,
        BLOCK_C=triton.next_power_of_2(cout), num_warps=4, **pdl_launch(x.device),
    )  # fmt: skip
    return out


def tap_sum_conv2d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    padding: int | tuple[int, int] = 0,
    out: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch definition: :func:`fastdiff.kernels.conv2d.conv2d_ref` (``packed``, ``partials`` ignored)."""
    y = conv2d_ref(x, weight, bias, padding=padding)
    return y if out is None else out.copy_(y)


TAP_SUM_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "small": (2, 24, 7, 9),
    "cifar10-b1": (1, 128, 32, 32),
    "cifar10-b256": (256, 128, 32, 32),
    "large": (256, 128, 32, 32),
}
"""size -> (N, Cin, H, W) of a U-Net's conv_out (small: interpreter-sized, odd)."""


def tap_sum_conv2d_example_inputs(
    size: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A U-Net's conv_out: 3x3, padding 1, to 3 channels, at the sizes of :data:`TAP_SUM_SHAPES`."""
    if size not in TAP_SUM_SHAPES:
        raise FastdiffError(f"unknown example size {size!r}; expected one of {', '.join(TAP_SUM_SHAPES)}")
    n, cin, h, w = TAP_SUM_SHAPES[size]
    gen = torch.Generator().manual_seed(seed)
    x = channels_last_randn((n, cin, h, w), dtype, device, gen)
    weight = (torch.randn((3, cin, 3, 3), generator=gen) / (9 * cin) ** 0.5).to(device=device, dtype=dtype)
    bias = torch.randn(3, generator=gen).to(device=device, dtype=dtype)
    return (x, weight, bias), {"padding": 1}


OP = KernelOp(
    name="tap_sum_conv2d",
    triton=tap_sum_conv2d,
    ref=tap_sum_conv2d_ref,
    example_inputs=tap_sum_conv2d_example_inputs,
    cost=conv2d_cost,
)

__all__ = [
    "MAX_COUT",
    "OP",
    "TAP_SUM_SHAPES",
    "pack_tap_weight",
    "tap_columns",
    "tap_sum_conv2d",
    "tap_sum_conv2d_ref",
    "tap_sum_unsupported",
]
