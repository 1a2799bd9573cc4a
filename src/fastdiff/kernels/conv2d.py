"""2-D convolution as an implicit GEMM on the tensor cores, with a fused ResnetBlock epilogue.

Layout: activations are logical ``[N, C, H, W]`` torch tensors; the kernel is written for channels-last
memory (``x.is_contiguous(memory_format=torch.channels_last)``, i.e. NHWC in memory) and reads every tensor
through its strides, so other layouts still give the right answer, only slower. The output is always allocated
channels-last.

GEMM view: rows ``M = N*Ho*Wo`` (one per output pixel), columns ``Cout``, reduction ``K = KH*KW*Cin``
ordered ``(kh, kw, cin)``. Weights are packed once into ``[KH*KW*Cin, Cout]`` (:func:`pack_conv_weight`); the
A operand is gathered straight from the activation (no im2col buffer), padding taps load zeros.

Epilogue order, in fp32, per output element ``(n, c, h, w)``::

    y = acc + bias[c] + time_emb[n, c]   # conv1 of a ResnetBlock2D: conv output + time embedding (pre-norm)
    y = activation(y)                     # None | "silu" | "gelu" (exact, erf) | "relu"
    y = y + residual[n, c, h, w]          # conv2: hidden + shortcut ...
    y = y * out_scale                     # ... then x 1/output_scale_factor
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels import cost_model
from fastdiff.kernels.common import (
    ACTIVATIONS,
    activation_ref,
    apply_activation,
    channels_last_randn,
    check_activation,
    num_sms,
)
from fastdiff.kernels.registry import KernelOp


def pack_conv_weight(weight: torch.Tensor) -> torch.Tensor:
    """torch conv weight ``[Cout, Cin, KH, KW]`` -> contiguous ``[KH*KW*Cin, Cout]`` (rows: kh, kw, cin)."""
    if weight.dim() != 4:
        raise FastdiffError(f"conv weight must be 4-D [Cout, Cin, KH, KW], got shape {tuple(weight.shape)}")
    cout, cin, kh, kw = weight.shape
    return weight.permute(2, 3, 1, 0).reshape(kh * kw * cin, cout).contiguous()


def unpack_conv_weight(packed: torch.Tensor, cin: int) -> torch.Tensor:
    """Inverse of :func:`pack_conv_weight` (square kernels): ``[K*K*Cin, Cout]`` -> ``[Cout, Cin, K, K]``."""
    ksize = _packed_kernel_size(packed, cin)
    return packed.reshape(ksize, ksize, cin, packed.shape[1]).permute(3, 2, 0, 1).contiguous()


def _packed_kernel_size(packed: torch.Tensor, cin: int) -> int:
    rows = packed.shape[0]
    taps = rows // cin if cin > 0 else 0
    ksize = round(taps**0.5)
    if packed.dim() != 2 or rows != ksize * ksize * cin or ksize < 1:
        raise FastdiffError(
            f"packed conv weight shape {tuple(packed.shape)} does not match [KH*KW*Cin, Cout] for Cin={cin}"
        )
    return ksize


def epilogue_ref(
    y: torch.Tensor,
    bias: torch.Tensor | None,
    time_emb: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str | None,
    out_scale: float | None,
) -> torch.Tensor:
    """The fused epilogue in plain torch, in order: bias, time_emb, activation, residual, scale."""
    if bias is not None:
        y = y + bias[None, :, None, None]
    if time_emb is not None:
        y = y + time_emb[:, :, None, None]
    y = activation_ref(y, activation)
    if residual is not None:
        y = y + residual
    if out_scale is not None:
        y = y * out_scale
    return y


def conv2d_ref(
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
) -> torch.Tensor:
    """Plain torch definition of :func:`conv2d`: (nearest upsampling,) ``F.conv2d``, then the epilogue; raw or
    packed weights."""
    if weight.dim() == 2:
        weight = unpack_conv_weight(weight, x.shape[1])
    if upsample > 1:
        x = F.interpolate(x, scale_factor=upsample, mode="nearest")
    y = epilogue_ref(
        F.conv2d(x, weight, None, stride=stride, padding=padding),
        bias,
        time_emb,
        residual,
        activation,
        out_scale,
    )
    if out is not None:
        return out.copy_(y)
    return y


@triton.jit
def fused_epilogue(
    acc,
    n_idx,
    offs_c,
    row_mask,
    c_mask,
    bias_ptr,
    temb_ptr,
    stride_tn,
    stride_tc,
    res_row_ptrs,
    stride_rc,
    out_scale,
    HAS_BIAS: tl.constexpr,
    HAS_TEMB: tl.constexpr,
    HAS_RES: tl.constexpr,
    ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    """acc [rows, channels] fp32 -> (act(acc + bias + temb) + residual) * scale; row r is sample n_idx[r]."""
    mask = row_mask[:, None] & c_mask[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_TEMB:
        temb_ptrs = temb_ptr + n_idx[:, None] * stride_tn + offs_c[None, :] * stride_tc
        acc += tl.load(temb_ptrs, mask=mask, other=0.0).to(tl.float32)
    acc = apply_activation(acc, ACT)
    if HAS_RES:
        acc += tl.load(res_row_ptrs[:, None] + offs_c[None, :] * stride_rc, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        acc = acc * out_scale
    return acc


@triton.jit
def _conv2d_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    temb_ptr,
    res_ptr,
    out_ptr,
    M,
    H,
    W,
    Cin,
    Ho,
    Wo,
    Cout,
    stride_xn,
    stride_xc,
    stride_xh,
    stride_xw,
    stride_tn,
    stride_tc,
    stride_rn,
    stride_rc,
    stride_rh,
    stride_rw,
    stride_on,
    stride_oc,
    stride_oh,
    stride_ow,
    out_scale,
    STRIDE: tl.constexpr,
    PAD: tl.constexpr,
    KSIZE: tl.constexpr,
    UP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_TEMB: tl.constexpr,
    HAS_RES: tl.constexpr,
    ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped program order: GROUP_M row blocks share the weight columns in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(Cout, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    group_id = pid // pids_per_group
    first_pid_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % pids_per_group) % group_size
    pid_n = (pid % pids_per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < Cout
    ow = offs_m % Wo
    oh = (offs_m // Wo) % Ho
    n_idx = offs_m // (Wo * Ho)
    ih0 = oh * STRIDE - PAD
    iw0 = ow * STRIDE - PAD
    x_rows = x_ptr + n_idx.to(tl.int64) * stride_xn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_chunks = tl.cdiv(Cin, BLOCK_K)
    # One flat loop over (tap, cin chunk) so the compiler pipelines all KSIZE*KSIZE*k_chunks steps together.
    for step in range(0, KSIZE * KSIZE * k_chunks):
        tap = step // k_chunks
        c0 = (step - tap * k_chunks) * BLOCK_K
        ih = ih0 + tap // KSIZE
        iw = iw0 + tap % KSIZE
        row_ok = m_mask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        offs_k = c0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < Cin
        # H, W are the (virtually) upsampled sizes: pixel (ih, iw) is stored at (ih // UP, iw // UP).
        a_ptrs = (x_rows + (ih // UP) * stride_xh + (iw // UP) * stride_xw)[:, None] + offs_k[None, :] * stride_xc
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_mask[None, :], other=0.0)
        b_ptrs = w_ptr + (tap * Cin + offs_k)[:, None] * Cout + offs_n[None, :]
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc)

    res_rows = res_ptr + n_idx.to(tl.int64) * stride_rn + oh * stride_rh + ow * stride_rw
    acc = fused_epilogue(
        acc, n_idx, offs_n, m_mask, n_mask, bias_ptr, temb_ptr, stride_tn, stride_tc, res_rows, stride_rc,
        out_scale, HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip
    out_rows = out_ptr + n_idx.to(tl.int64) * stride_on + oh * stride_oh + ow * stride_ow
    out_ptrs = out_rows[:, None] + offs_n[None, :] * stride_oc
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _pow2_at_least(value: int, low: int, high: int) -> int:
    return max(low, min(high, triton.next_power_of_2(max(value, 1))))


def _gemm_blocks(
    rows: int, cols: int, red: int, dtype: torch.dtype, device: torch.device
) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for a [rows x red] @ [red x cols] tile loop.

    Largest tiles (128x128x64) for the big GEMMs; rows blocks halve until there are about two programs per SM,
    so the batch-1 shapes (a few hundred rows) still spread over the chip. ``red`` is the per-step reduction
    extent (Cin), so BLOCK_K never exceeds it by more than the tl.dot minimum of 16.
    """
    block_n = _pow2_at_least(cols, 16, 128)
    block_k = 64 if red >= 64 else 32 if red >= 32 else 16
    block_m = 128
    target = 2 * num_sms(device)
    while block_m > 16 and triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n) < target:
        block_m //= 2
    if block_m == 16 and block_n > 32 and triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n) < target:
        block_n = 32
    num_warps = 8 if block_m * block_n >= 128 * 128 else 4
    num_stages = 3 if dtype.itemsize <= 2 else 2  # fp32 tiles are twice the shared memory per stage
    return block_m, block_n, block_k, num_warps, num_stages


def check_epilogue_args(
    n: int,
    cout: int,
    out_hw: tuple[int, int],
    device: torch.device,
    bias: torch.Tensor | None,
    time_emb: torch.Tensor | None,
    residual: torch.Tensor | None,
    activation: str | None,
    out: torch.Tensor | None,
) -> None:
    """Raise FastdiffError for epilogue operands whose shape or device does not fit [n, cout, *out_hw]."""
    check_activation(activation)
    expected = {
        "bias": (cout,),
        "time_emb": (n, cout),
        "residual": (n, cout, *out_hw),
        "out": (n, cout, *out_hw),
    }
    for name, tensor in (("bias", bias), ("time_emb", time_emb), ("residual", residual), ("out", out)):
        if tensor is None:
            continue
        if tuple(tensor.shape) != expected[name]:
            raise FastdiffError(f"{name} must have shape {expected[name]}, got {tuple(tensor.shape)}")
        if tensor.device != device:
            raise FastdiffError(f"{name} is on {tensor.device} but the input is on {device}")
    if bias is not None and not bias.is_contiguous():
        raise FastdiffError("bias must be contiguous")


def conv2d(
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
) -> torch.Tensor:
    """Fused conv2d: ``((act(conv(x, w) + bias + time_emb[:, :, None, None]) + residual) * out_scale``.

    ``x`` is a logical ``[N, Cin, H, W]`` tensor, channels-last in memory for speed. ``weight`` is either raw
    ``[Cout, Cin, K, K]`` or packed ``[K*K*Cin, Cout]`` (:func:`pack_conv_weight`; pack once at load). Square
    kernels of any size, any stride and padding. ``out`` (optional) receives the result; otherwise a new
    channels-last ``[N, Cout, Ho, Wo]`` tensor is returned. Accumulation is fp32 (a tf32 dot for fp32
    inputs on the GPU). ``upsample=k`` convolves the nearest-neighbour x``k`` upsampling of ``x`` without
    materialising it (the U-Net's Upsample2D: interpolate then conv, in one launch).
    """
    if x.dim() != 4:
        raise FastdiffError(f"conv2d input must be 4-D [N, C, H, W], got shape {tuple(x.shape)}")
    n, cin, h, w = x.shape
    if weight.dim() == 4:
        if weight.shape[1] != cin or weight.shape[2] != weight.shape[3]:
            raise FastdiffError(f"conv weight shape {tuple(weight.shape)} does not fit input channels {cin}")
        weight = pack_conv_weight(weight)
    ksize = _packed_kernel_size(weight, cin)
    if not weight.is_contiguous():
        weight = weight.contiguous()
    if stride < 1 or padding < 0:
        raise FastdiffError(f"bad conv stride {stride} / padding {padding}")
    if isinstance(upsample, bool) or not isinstance(upsample, int) or upsample < 1:
        raise FastdiffError(f"upsample must be a positive int, got {upsample!r}")
    cout = weight.shape[1]
    h, w = h * upsample, w * upsample
    ho = (h + 2 * padding - ksize) // stride + 1
    wo = (w + 2 * padding - ksize) // stride + 1
    if ho < 1 or wo < 1:
        raise FastdiffError(f"conv output would be empty for input {h}x{w}, kernel {ksize}, padding {padding}")
    if weight.device != x.device or weight.dtype != x.dtype:
        raise FastdiffError(f"weight ({weight.dtype}, {weight.device}) must match input ({x.dtype}, {x.device})")
    check_epilogue_args(n, cout, (ho, wo), x.device, bias, time_emb, residual, activation, out)
    if out is None:
        out = torch.empty((n, cout, ho, wo), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    rows = n * ho * wo
    block_m, block_n, block_k, num_warps, num_stages = _gemm_blocks(rows, cout, cin, x.dtype, x.device)
    temb = time_emb if time_emb is not None else out
    res = residual if residual is not None else out
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(cout, block_n),)
    temb_strides = time_emb.stride() if time_emb is not None else (0, 0)
    _conv2d_kernel[grid](
        x, weight, bias if bias is not None else out, temb, res, out,
        rows, h, w, cin, ho, wo, cout,
        *x.stride(), *temb_strides, *res.stride(), *out.stride(),
        1.0 if out_scale is None else float(out_scale),
        STRIDE=stride, PAD=padding, KSIZE=ksize, UP=upsample,
        HAS_BIAS=bias is not None, HAS_TEMB=time_emb is not None, HAS_RES=residual is not None,
        ACT=ACTIVATIONS[activation], HAS_SCALE=out_scale is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


CONV_SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "small": (2, 12, 20, 7, 9),
    "cifar10-b1": (1, 128, 128, 32, 32),
    "cifar10-b256": (256, 128, 128, 32, 32),
    "large": (256, 128, 128, 32, 32),
    "sd15-b2": (2, 320, 320, 64, 64),
}
"""size -> (N, Cin, Cout, H, W) of a ResnetBlock2D 3x3 conv at the model's largest resolution."""


def conv_shape(size: str) -> tuple[int, int, int, int, int]:
    """(N, Cin, Cout, H, W) for an example-input size name."""
    if size not in CONV_SHAPES:
        raise FastdiffError(f"unknown example size {size!r}; expected one of {', '.join(CONV_SHAPES)}")
    return CONV_SHAPES[size]


def conv2d_example_inputs(
    size: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """conv1 of a ResnetBlock2D: 3x3 pad 1, packed weights, + bias + time embedding."""
    n, cin, cout, h, w = conv_shape(size)
    gen = torch.Generator().manual_seed(seed)
    x = channels_last_randn((n, cin, h, w), dtype, device, gen)
    weight = torch.randn((cout, cin, 3, 3), generator=gen) / (9 * cin) ** 0.5
    bias = torch.randn(cout, generator=gen)
    time_emb = torch.randn((n, cout), generator=gen)
    packed = pack_conv_weight(weight).to(device=device, dtype=dtype)
    kwargs = {"padding": 1, "time_emb": time_emb.to(device=device, dtype=dtype)}
    return (x, packed, bias.to(device=device, dtype=dtype)), kwargs


def conv2d_cost(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float]:
    """(FLOPs, bytes) of one call by :func:`fastdiff.kernels.cost_model.conv2d_cost`: the input read at its stored
    resolution, the output at the (upsampled) conv's, the epilogue operands that are given."""
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    n, cin, h, w = x.shape
    taps = weight.shape[0] // cin if weight.dim() == 2 else weight.shape[2] * weight.shape[3]
    cout = weight.shape[1] if weight.dim() == 2 else weight.shape[0]
    ksize = round(taps**0.5)
    stride, padding, upsample = kwargs.get("stride", 1), kwargs.get("padding", 0), kwargs.get("upsample", 1)
    ho = (h * upsample + 2 * padding - ksize) // stride + 1
    wo = (w * upsample + 2 * padding - ksize) // stride + 1
    cost = cost_model.conv2d_cost(
        n, cin, cout, ho, wo, ksize, 1, x.element_size(), h, w, bias=bias is not None,
        residual=kwargs.get("residual") is not None, temb=kwargs.get("time_emb") is not None,
        act=kwargs.get("activation"), scale=kwargs.get("out_scale") is not None,
    )  # fmt: skip
    return cost.flops, cost.bytes


OP = KernelOp(
    name="conv2d",
    triton=conv2d,
    ref=conv2d_ref,
    example_inputs=conv2d_example_inputs,
    cost=conv2d_cost,
)
