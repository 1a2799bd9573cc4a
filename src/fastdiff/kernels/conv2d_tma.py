"""Stride-1 convolution on Hopper's tensor-memory accelerator (TMA): the implicit GEMM of :mod:`conv2d` with its
A and B tiles brought in by bulk tensor copies instead of per-thread gathers.

Same op, same definition (:func:`fastdiff.kernels.conv2d.conv2d_ref`), same packed weights ``[K*K*Cin, Cout]``
and the same fused epilogue (bias, time embedding, activation, residual, scale) as :func:`conv2d`; a narrower
domain: stride 1, no upsampling except the U-Net's Upsample2D (below), no GroupNorm in the epilogue, and the layout
constraints of a TMA descriptor (16-byte aligned base and strides, unit channel stride).
:func:`tma_conv_unsupported` says why a call is out of it, and the engine then keeps the gather kernel or cuDNN.

The input is a 4-D descriptor over NHWC ``[N, H, W, Cin]`` (any pixel stride: a channel slice of a concat
buffer works); an output tile is a box of ``TN`` images x ``TH`` rows x ``TW`` columns (``BLOCK_M = TN*TH*TW``,
:func:`box_tile`), and tap ``(kh, kw)`` loads the box shifted by ``(kh - pad, kw - pad)``, one bulk copy per
(tap, channel chunk). The copy engine fills coordinates outside the tensor with zeros, which is exactly the
conv's zero padding, so the tile goes to the tensor cores untouched. Channels past ``Cin`` in the last chunk of
a tap are outside the descriptor too, so they load as zeros and the weight rows they meet (the next tap's) add
nothing. Accumulation is fp32.

Upsample2D (nearest x2, then a 3x3 conv with padding 1) runs as four 2x2 convs on the low-resolution input, one
per output phase ``(py, px)``: output pixel ``(2i + py, 2j + px)`` reads input rows ``i - 1, i`` (``py = 0``,
weights ``w[0]`` and ``w[1] + w[2]``) or ``i, i + 1`` (``py = 1``: ``w[0] + w[1]`` and ``w[2]``), and the same
for columns (:func:`pack_upsample2_weight`). That is 4/9 of the upsampled conv's multiply-adds and no
upsampled tensor; each phase is a program column of the grid, storing every other output row and column.

Measured on the H100 (``benchmarks/sweep_conv.py``, ddpm-cifar10 at batch 256, fp16): the 3x3 convs run at
57-80% of the bf16 matmul ceiling against 35-60% for the gather kernel, 1.2-1.8x faster than it or cuDNN. At
batch 1 the gather kernel's small tiles stay faster, and the engine's autotune keeps it. A second layout
(a 2-D descriptor over the pixel rows, wrapped rows zeroed in registers) was slower everywhere and was dropped.

Split-K (``split_k``): the gather kernel's in-launch fix-up (:func:`fastdiff.kernels.conv2d._split_k_reduce`) over
contiguous ranges of the reduction steps. The engine offers it to the fp8 convs, which have no other kernel, where
the grid leaves SMs idle (batch 1); docs/engine/fp8.md has the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fastdiff.errors import FastdiffError
from fastdiff.kernels.common import ACTIVATIONS, SplitWorkspace, grid_dependency_sync, num_sms, pdl_launch
from fastdiff.kernels.conv2d import (
    SPLIT_K_CHOICES,
    _packed_kernel_size,
    _split_k_reduce,
    check_epilogue_args,
    conv2d_cost,
    conv2d_example_inputs,
    conv2d_ref,
    fills_with_128_rows,
    fused_epilogue,
    pack_conv_weight,
    unpack_conv_weight,
)
from fastdiff.kernels.fp8 import E4M3_MAX, FP8_DTYPE, quantize_e4m3_ref
from fastdiff.kernels.registry import KernelOp


@dataclass(frozen=True)
class TmaConfig:
    """Tile shape and launch parameters of one :func:`conv2d_tma` call."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4


def pack_upsample2_weight(weight: torch.Tensor) -> torch.Tensor:
    """3x3 conv weight ``[Cout, Cin, 3, 3]`` -> the four phase weights of nearest-x2 + conv (module docstring),
    packed ``[(phase py*2 + px, tap a*2 + b, Cin), Cout]`` = ``[16*Cin, Cout]``, summed in the weight's dtype."""
    if weight.dim() != 4 or weight.shape[2:] != (3, 3):
        raise FastdiffError(f"upsample-conv weight must be [Cout, Cin, 3, 3], got shape {tuple(weight.shape)}")
    rows = [  # phase 0 / 1 of one axis: (weights of input offset -1 or 0, of offset 0 or +1)
        (weight[:, :, 0:1], weight[:, :, 1:3].sum(2, keepdim=True)),
        (weight[:, :, 0:2].sum(2, keepdim=True), weight[:, :, 2:3]),
    ]
    phases = []
    for py in range(2):
        by_rows = torch.cat(rows[py], dim=2)  # [Cout, Cin, 2, 3]
        for px in range(2):
            cols = by_rows[..., 0:1], by_rows[..., 1:3].sum(3, keepdim=True)
            if px:
                cols = by_rows[..., 0:2].sum(3, keepdim=True), by_rows[..., 2:3]
            phases.append(pack_conv_weight(torch.cat(cols, dim=3)))  # [4*Cin, Cout]
    return torch.cat(phases)


def pack_conv_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch conv weight ``[Cout, Cin, K, K]`` -> (e4m3 ``[Cout, K*K*Cin]``, rows as :func:`pack_conv_weight`'s
    columns; fp32 per-output-channel scales ``[Cout]``). An all-zero channel gets scale 1."""
    packed = pack_conv_weight(weight.float()).t()
    amax = packed.abs().amax(dim=1)
    # a tensor divisor (filled where amax is: no host copy): CUDA turns a number divisor into a multiply by its
    # reciprocal, which may round otherwise than the CPU's division, and the engine packs on the device
    scale = torch.where(amax > 0, amax / amax.new_full((), E4M3_MAX), torch.ones_like(amax))
    return quantize_e4m3_ref(packed, scale[:, None]).contiguous(), scale


def unpack_conv_weight_fp8(packed: torch.Tensor, scale: torch.Tensor, cin: int) -> torch.Tensor:
    """The fp32 weight ``[Cout, Cin, K, K]`` that (``packed``, ``scale``) of :func:`pack_conv_weight_fp8` stand for."""
    return unpack_conv_weight((packed.float() * scale[:, None].float()).t(), cin)


@triton.jit
def _conv2d_tma_kernel(
    x_desc, w_desc, scale_ptr, bias_ptr, temb_ptr, res_ptr, out_ptr, ws_ptr, count_ptr,
    N, Cin, Ho, Wo, Cout,
    stride_tn, stride_tc, stride_rn, stride_rc, stride_rh, stride_rw, stride_on, stride_oc, stride_oh, stride_ow,
    out_scale,
    PAD: tl.constexpr, KSIZE: tl.constexpr, UP2: tl.constexpr, FP8: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_TEMB: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    TN: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    grid_dependency_sync(PDL)
    BLOCK_M: tl.constexpr = TN * TH * TW
    # Output-channel tiles vary fastest: the programs that share an input tile run together (L2 reuse).
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(Cout, BLOCK_N)
    pid_n = pid % num_pid_n
    tile = pid // num_pid_n
    tiles_w = tl.cdiv(Wo, TW)
    tiles_h = tl.cdiv(Ho, TH)
    n0 = (tile // (tiles_w * tiles_h)) * TN
    h0 = ((tile // tiles_w) % tiles_h) * TH
    w0 = (tile % tiles_w) * TW
    r = tl.arange(0, BLOCK_M)
    n_idx = n0 + r // (TH * TW)
    oh = h0 + (r // TW) % TH  # with UP2: the low-resolution pixel (i, j) of output (2i + py, 2j + px)
    ow = w0 + r % TW
    m_mask = (n_idx < N) & (oh < Ho) & (ow < Wo)
    phase = tl.program_id(1)  # 0 without UP2
    py = phase // 2
    px = phase % 2

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_chunks = tl.cdiv(Cin, BLOCK_K)
    w_row0 = phase * (KSIZE * KSIZE) * Cin
    steps = KSIZE * KSIZE * k_chunks
    step_lo = 0
    step_hi = steps
    if SPLIT_K > 1:  # this program's contiguous share of the reduction steps (program_id(2) of SPLIT_K)
        per_split = tl.cdiv(steps, SPLIT_K)
        step_lo = tl.program_id(2) * per_split
        step_hi = tl.minimum(step_lo + per_split, steps)
    for step in range(step_lo, step_hi):
        tap = step // k_chunks
        c0 = (step - tap * k_chunks) * BLOCK_K
        ih = h0 + tap // KSIZE + py - PAD
        iw = w0 + tap % KSIZE + px - PAD
        a = x_desc.load([n0, ih, iw, c0]).reshape(BLOCK_M, BLOCK_K)
        if FP8:  # weights [Cout, K]: fp8 wgmma reads both operands K-contiguous
            b = w_desc.load([pid_n * BLOCK_N, w_row0 + tap * Cin + c0])
            acc = tl.dot(a, b.T, acc)
        else:
            b = w_desc.load([w_row0 + tap * Cin + c0, pid_n * BLOCK_N])
            acc = tl.dot(a, b, acc)
    if UP2:
        oh = 2 * oh + py
        ow = 2 * ow + px

    is_last = True
    if SPLIT_K > 1:  # the last of the tile's programs sums the fp32 partials in split order, then runs the epilogue
        unit = pid + phase * tl.num_programs(0)
        acc, is_last = _split_k_reduce(acc, ws_ptr, count_ptr, unit, tl.program_id(2),
                                       tl.num_programs(0) * tl.num_programs(1), SPLIT_K, BLOCK_M, BLOCK_N)  # fmt: skip
    if is_last:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < Cout
        if FP8:  # a_scale * w_scale[n]: the accumulator back to real units before the epilogue
            acc = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
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
) -> str | None:
    """Why :func:`conv2d_tma` cannot run a ``ksize`` x ``ksize`` conv of ``x`` to ``cout`` channels, or None
    when it can (the packed weight is contiguous: its row stride is ``cout``)."""
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
        return "TMA needs a Hopper-class GPU (compute capability 9.0 or newer)"
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32, FP8_DTYPE):
        return f"dtype {x.dtype} is not fp16, bf16, fp32 or fp8 (e4m3)"
    if stride != 1 or upsample not in (1, 2):
        return "stride 1, and upsampling by 2 at most"
    if upsample == 2 and (ksize, padding) != (3, 1):
        return "upsampling by 2 only before a 3x3 conv with padding 1 (Upsample2D)"
    if upsample == 2 and x.dtype == FP8_DTYPE:
        return "no fp8 Upsample2D"
    n, cin, h, w = x.shape
    if x.stride(1) != 1:
        return "the input's channels must be contiguous (channels-last)"
    weight_row = ksize * ksize * cin if x.dtype == FP8_DTYPE else cout * x.element_size()  # bytes
    if not _aligned(x, (x.stride(0), x.stride(2), x.stride(3))) or weight_row % 16:
        return "TMA needs 16-byte aligned base pointers and strides"
    return None


def default_config(n: int, ho: int, wo: int, cin: int, cout: int, dtype: torch.dtype,
                   device: torch.device) -> TmaConfig:  # fmt: skip
    """The tile shape for a conv of this size, from ``benchmarks/sweep_conv.py`` on the H100 (ddpm-cifar10, batch
    256): 128x128 tiles while they give at least 1.5 programs per SM, then 64x128, then 64x64 (batch 256 at 4x4).

    The 8x8 level of batch 256 sits between (256 programs of 128x128 for 132 SMs): there 128-row tiles ran its 3x3
    convs in 35.4-35.6 against 40.6-40.8 us (64x128), the 512-channel conv1 in 64.5 against 74.5, and the
    Upsample2D of the 4x4 level (the same grid) in 18.1 against 21.3; at 4x4 (64 programs) 64x64 stays best (16.9
    against 28.3 us) (``benchmarks/results/sweep-conv-small-tiles-ddpm-cifar10-b256-h100-2026-11-26.json``).

    Always 4 warps. With 8 warps (two consumer warpgroups) the 3x3 convs ran 5-9% faster, but Triton 3.6's
    pipelined TMA loop then returned wrong results on the H100 (0.2-0.9% relative error against exact 4-warp
    results) whenever the loop was short: the 1x1 convs (4-8 steps) and the Upsample2D phases (16 steps).
    """
    rows = n * ho * wo
    block_n = max(16, _pow2_at_most(cout, 128))
    block_k = 64 if cin >= 64 else max(16, triton.next_power_of_2(cin))
    if dtype == FP8_DTYPE:  # 128-byte rows, as for fp16; fp8 wgmma steps K by 32
        block_k = 128 if cin >= 128 else max(32, triton.next_power_of_2(cin))
    stages = 4 if dtype.itemsize <= 2 else 2  # fp32 tiles take twice the shared memory per stage
    if fills_with_128_rows(triton.cdiv(rows, 128) * triton.cdiv(cout, block_n), device):
        return TmaConfig(128, block_n, block_k, 4, stages)
    if triton.cdiv(rows, 64) * triton.cdiv(cout, block_n) >= num_sms(device):
        return TmaConfig(64, block_n, block_k, 4, stages)
    return TmaConfig(64, min(block_n, 64), block_k, 4, stages)


def tma_split_k_choices(
    n: int, ho: int, wo: int, cin: int, cout: int, ksize: int, dtype: torch.dtype, device: torch.device,
    upsample: int = 1,
) -> tuple[int, ...]:  # fmt: skip
    """The split-K factors of :func:`conv2d_tma` worth timing for a conv of this size (its default tiles): none where
    the grid already gives two programs per SM; otherwise those of the gather kernel's ``SPLIT_K_CHOICES`` with at
    least two reduction steps per split on average and the grid at most eight programs per SM. (The kernel gives
    each split ``ceil(steps / split_k)`` steps, so the last splits may get fewer or none: 9 steps split 4 ways run
    as 3 + 3 + 3 + 0.)"""
    config = default_config(n * upsample**2, ho, wo, cin, cout, dtype, device)
    tn, th, tw = box_tile(config.block_m, n, ho, wo)
    programs = triton.cdiv(n, tn) * triton.cdiv(ho, th) * triton.cdiv(wo, tw) * triton.cdiv(cout, config.block_n)
    programs *= upsample**2
    sms = num_sms(device)
    if programs >= 2 * sms:
        return ()
    steps = (4 if upsample == 2 else ksize * ksize) * triton.cdiv(cin, config.block_k)
    return tuple(s for s in SPLIT_K_CHOICES if 2 * s <= steps and programs * s <= 8 * sms)


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
    weight_scale: torch.Tensor | None = None,
    split_k: int = 1,
    workspace: SplitWorkspace | None = None,
) -> torch.Tensor:
    """:func:`fastdiff.kernels.conv2d.conv2d` for stride-1 convs, tiles loaded by TMA (module docstring).

    ``weight`` is packed ``[K*K*Cin, Cout]`` or raw ``[Cout, Cin, K, K]``; with ``upsample=2`` (a 3x3 conv,
    padding 1) packed means :func:`pack_upsample2_weight`'s ``[16*Cin, Cout]``. ``config`` (default
    :func:`default_config`) picks the tile shape. A conv outside the TMA domain raises FastdiffError with
    :func:`tma_conv_unsupported`'s reason.

    fp8: an e4m3 ``x`` takes :func:`pack_conv_weight_fp8`'s e4m3 ``[Cout, K*K*Cin]`` and
    ``weight_scale`` ``[Cout]`` fp32, the product of the input's scale and the weight's per-channel scales (the
    conv sees ``x * a_scale`` and ``W8 * w_scale``); the output (``out``, default fp16) is fp16, bf16 or fp32.

    Split-K (``split_k > 1``, at most one split per reduction step): as :func:`fastdiff.kernels.conv2d.conv2d`, each
    output tile's reduction steps are divided among ``split_k`` programs and the last to finish sums the fp32
    partials in ``workspace`` (:class:`fastdiff.kernels.common.SplitWorkspace`; a new one when None) in split order
    and runs the epilogue, in the same launch: for grids that leave SMs idle (the 4x4 level at batch 256, batch 1).
    """
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1:
        raise FastdiffError(f"split_k must be a positive int, got {split_k!r}")
    if x.dim() != 4:
        raise FastdiffError(f"conv2d input must be 4-D [N, C, H, W], got shape {tuple(x.shape)}")
    n, cin, h, w = x.shape
    up2 = upsample == 2
    fp8 = x.dtype == FP8_DTYPE
    if fp8:
        _check_fp8_weight(weight, weight_scale, cin, x.device)
        if up2:
            raise FastdiffError("conv2d_tma: no fp8 Upsample2D")
        if out is not None and out.dtype == FP8_DTYPE:
            raise FastdiffError("an fp8 conv writes fp16, bf16 or fp32, not fp8")
    elif weight_scale is not None:
        raise FastdiffError("weight_scale is for fp8 inputs only")
    if weight.dim() == 4:
        weight = pack_upsample2_weight(weight) if up2 else pack_conv_weight(weight)
    if up2 and (weight.dim() != 2 or weight.shape[0] != 16 * cin):
        raise FastdiffError(f"upsample=2 needs pack_upsample2_weight's [16*Cin, Cout], got {tuple(weight.shape)}")
    cout = weight.shape[0] if fp8 else weight.shape[1]
    ksize = 3 if up2 else _packed_kernel_size(weight.t() if fp8 else weight, cin)
    reason = tma_conv_unsupported(x, cout, ksize, stride=stride, padding=padding, upsample=upsample)
    if reason is not None:
        raise FastdiffError(f"conv2d_tma: {reason}")
    ho, wo = h + 2 * padding - ksize + 1, w + 2 * padding - ksize + 1  # with upsample=2: the low resolution
    if padding < 0 or ho < 1 or wo < 1:
        raise FastdiffError(f"conv output would be empty for input {h}x{w}, kernel {ksize}, padding {padding}")
    config = config or default_config(n * upsample**2, ho, wo, cin, cout, x.dtype, x.device)
    if weight.dtype != x.dtype or weight.device != x.device:
        raise FastdiffError(f"weight ({weight.dtype}, {weight.device}) must match input ({x.dtype}, {x.device})")
    weight = weight.contiguous()
    out_hw = (ho * upsample, wo * upsample)
    check_epilogue_args(n, cout, out_hw, x.device, bias, time_emb, residual, activation, out)
    if out is None:
        out_dtype = torch.float16 if fp8 else x.dtype
        out = torch.empty((n, cout, *out_hw), device=x.device, dtype=out_dtype, memory_format=torch.channels_last)
    tn, th, tw = box_tile(config.block_m, n, ho, wo)
    x_desc = TensorDescriptor(
        x, [n, h, w, cin], [x.stride(0), x.stride(2), x.stride(3), 1], [tn, th, tw, config.block_k]
    )
    tiles = triton.cdiv(n, tn) * triton.cdiv(ho, th) * triton.cdiv(wo, tw)
    w_block = [config.block_n, config.block_k] if fp8 else [config.block_k, config.block_n]
    w_desc = TensorDescriptor(weight, list(weight.shape), [weight.shape[1], 1], w_block)
    temb = time_emb if time_emb is not None else out
    res = residual if residual is not None else out
    temb_strides = time_emb.stride() if time_emb is not None else (0, 0)
    programs = tiles * triton.cdiv(cout, config.block_n) * (4 if up2 else 1)
    split_k = min(split_k, (4 if up2 else ksize**2) * triton.cdiv(cin, config.block_k))  # a step per split at least
    if split_k > 1:
        workspace = workspace if workspace is not None else SplitWorkspace()
        partials, counters = workspace.reserve(split_k * programs * config.block_m * config.block_n, programs, x.device)
    grid = (tiles * triton.cdiv(cout, config.block_n), 4 if up2 else 1, split_k)
    _conv2d_tma_kernel[grid](
        x_desc, w_desc, weight_scale if fp8 else out, bias if bias is not None else out, temb, res, out,
        partials if split_k > 1 else out, counters if split_k > 1 else out,
        n, cin, ho, wo, cout, *temb_strides, *res.stride(), *out.stride(),
        1.0 if out_scale is None else float(out_scale),
        PAD=padding, KSIZE=2 if up2 else ksize, UP2=up2, FP8=fp8,
        HAS_BIAS=bias is not None, HAS_TEMB=time_emb is not None, HAS_RES=residual is not None,
        ACT=ACTIVATIONS[activation], HAS_SCALE=out_scale is not None,
        TN=tn, TH=th, TW=tw, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(x.device),
    )  # fmt: skip
    return out


def _check_fp8_weight(weight: torch.Tensor, scale: torch.Tensor | None, cin: int, device: torch.device) -> None:
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or weight.shape[1] % cin:
        raise FastdiffError(
            f"an fp8 input needs pack_conv_weight_fp8's e4m3 [Cout, K*K*Cin] weight, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    if scale is None or scale.dtype != torch.float32 or tuple(scale.shape) != (weight.shape[0],) or (
        scale.device != device
    ):  # fmt: skip
        raise FastdiffError(f"an fp8 conv needs weight_scale: fp32 [{weight.shape[0]}] on {device}")


def conv2d_fp8_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, weight_scale: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:  # fmt: skip
    """Plain torch definition of the fp8 :func:`conv2d_tma`: :func:`conv2d_ref` of the e4m3 input and the
    dequantised weight (``W8 * weight_scale``) in fp32 (copied into ``out`` when given)."""
    out = kwargs.pop("out", None)
    w = unpack_conv_weight_fp8(weight, weight_scale, x.shape[1])
    y = conv2d_ref(x.float(), w, None if bias is None else bias.float(), **{
        k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items() if k != "config"
    })  # fmt: skip
    return y if out is None else out.copy_(y)


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
