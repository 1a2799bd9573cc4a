"""2-D convolution as an implicit GEMM on the tensor cores, with a fused ResnetBlock epilogue.

Layout: activations are logical ``[N, C, H, W]`` torch tensors; the kernel is written for channels-last
memory (``x.is_contiguous(memory_format=torch.channels_last)``, i.e. NHWC in memory) and reads every tensor
through its strides, so other layouts still give the right answer, only slower. The output is always allocated
channels-last.

GEMM view: rows ``M = N*Ho*Wo`` (one per output pixel), columns ``Cout``, reduction ``K = KH*KW*Cin``
ordered ``(kh, kw, cin)``. Weights are packed once into ``[KH*KW*Cin, Cout]`` (:func:`pack_conv_weight`); the
A operand is gathered straight from the activation (no im2col buffer), padding taps load zeros. A reduction step
is one tap's chunk of input channels; below :data:`FLAT_K_MAX_CIN` channels (a U-Net's first conv) a step is a
chunk of the ``K`` rows themselves, each row its own (tap, channel), so 3 channels x 9 taps take one 32-deep step.

Epilogue order, in fp32, per output element ``(n, c, h, w)``::

    y = acc + bias[c] + time_emb[n, c]   # conv1 of a ResnetBlock2D: conv output + time embedding (pre-norm)
    y = activation(y)                     # None | "silu" | "gelu" (exact, erf) | "relu"
    y = y + residual[n, c, h, w]          # conv2: hidden + shortcut ...
    y = y * out_scale                     # ... then x 1/output_scale_factor

GroupNorm statistics of the output (``stats=``, a :class:`fastdiff.kernels.common.GroupNormPartials`): after the
epilogue, per (row tile, image, group) the (count, mean, M2) of the values *as stored* (rounded to the output dtype:
exactly the tensor the norm reads): a corrected two-pass mean / M2 per channel over the tile's rows of each image (a
row tile may hold rows of several images), then Chan's combination over the group's channels in the tile (a group
may be narrower than the channel tile, or wider: then its channel tiles each write a part). No atomics, no sum of
squares: robust when ``|mean| >> std``. ``group_norm_act(y, ..., stats=)`` merges the partials per program and
makes one pass over y (the engine's ``-st`` convs, ``engine/epilogue_norm.py``).

GroupNorm of the output in the epilogue (:class:`OutputGroupNorm`, ``norm_out=``): where every output tile holds
whole images (``Ho*Wo`` a power of two, at most :data:`NORM_OUT_MAX_PIXELS`; the row tile grows to it) and whole
groups (a power-of-two group width), the tile's (image, group) statistics are complete in registers: the epilogue
stores ``y`` and also ``act(group_norm(y) * gamma + beta)`` (two-pass mean and variance of the values as stored),
so the norm costs no launch and no pass over memory and its consumer reads a plain tensor. It is the small levels'
answer at batch 1 (4x4 to 16x16 images), where a standalone GroupNorm is a 2-3 us launch of a few KB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels import cost_model
from fastdiff.kernels.common import (
    ACTIVATIONS,
    GroupNormPartials,
    SplitWorkspace,
    activation_ref,
    apply_activation,
    channels_last_randn,
    check_activation,
    finish_arrival,
    grid_dependency_sync,
    num_sms,
    pdl_launch,
    reset_arrivals,
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


NORM_OUT_MAX_PIXELS = 256
"""The largest image (Ho*Wo) whose GroupNorm a conv's epilogue takes: the row tile holds whole images."""


@dataclass(frozen=True)
class OutputGroupNorm:
    """``act(group_norm(y, groups) * weight + bias)`` of a conv's output ``y``, written to ``out`` by the conv's
    epilogue (``y`` itself still goes to the conv's ``out``): ``conv2d(..., norm_out=OutputGroupNorm(...))``.
    ``weight``/``bias``: [Cout] (both or neither, contiguous; read as fp32). See :func:`norm_out_unsupported`."""

    groups: int
    out: torch.Tensor
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    eps: float = 1e-5
    activation: str | None = None


def norm_out_unsupported(n: int, cout: int, out_hw: tuple[int, int], groups: int) -> str | None:
    """Why the epilogue cannot take the GroupNorm (``groups``) of an [n, cout, *out_hw] conv output, or None."""
    hw = out_hw[0] * out_hw[1]
    if hw & (hw - 1) or hw > NORM_OUT_MAX_PIXELS:
        return f"Ho*Wo = {hw} is not a power of two <= {NORM_OUT_MAX_PIXELS} (the row tile holds whole images)"
    if groups < 1 or cout % groups:
        return f"{groups} groups do not divide {cout} channels"
    width = cout // groups
    if width & (width - 1) or width > 128:
        return f"the group width {width} is not a power of two <= 128 (the channel tile holds whole groups)"
    return None


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


def padding_pair(padding: int | tuple[int, int]) -> tuple[int, int]:
    """(before, after) zero padding of each spatial axis: an int pads both sides alike; a pair pads the top and left
    by the first and the bottom and right by the second (diffusers' Downsample2D with ``padding=0`` pads (0, 1))."""
    if isinstance(padding, int) and not isinstance(padding, bool):
        return padding, padding
    if isinstance(padding, tuple) and len(padding) == 2 and all(isinstance(p, int) for p in padding):
        return padding
    raise FastdiffError(f"padding must be an int or a (before, after) pair of ints, got {padding!r}")


def conv2d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    stride: int = 1,
    padding: int | tuple[int, int] = 0,
    time_emb: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    out_scale: float | None = None,
    out: torch.Tensor | None = None,
    upsample: int = 1,
    stats: GroupNormPartials | None = None,
    shortcut: torch.Tensor | None = None,
    shortcut_weight: torch.Tensor | None = None,
    norm_out: OutputGroupNorm | None = None,
) -> torch.Tensor:
    """Plain torch definition of :func:`conv2d`: (nearest upsampling,) ``F.conv2d`` (+ the 1x1 ``F.conv2d`` of
    ``shortcut``), then the epilogue; raw or packed weights. With ``norm_out``, writes ``F.group_norm`` +
    activation of the result as stored to ``norm_out.out``. ``stats`` is accepted and left as it is (its partials
    are laid out by the kernel's tiles; the norm they serve is ``group_norm_act_ref`` of the result)."""
    if weight.dim() == 2:
        weight = unpack_conv_weight(weight, x.shape[1])
    conv_sc = None
    if shortcut is not None:
        w_sc = unpack_conv_weight(shortcut_weight, shortcut.shape[1]) if shortcut_weight.dim() == 2 else shortcut_weight
        conv_sc = F.conv2d(shortcut, w_sc)
    if upsample > 1:
        x = F.interpolate(x, scale_factor=upsample, mode="nearest")
    before, after = padding_pair(padding)
    y = F.conv2d(F.pad(x, (before, after, before, after)), weight, None, stride=stride)
    y = epilogue_ref(
        y if conv_sc is None else y + conv_sc,
        bias,
        time_emb,
        residual,
        activation,
        out_scale,
    )
    if out is not None:
        y = out.copy_(y)
    if norm_out is not None:
        stored = y.to(norm_out.out.dtype)
        affine = [None if t is None else t.to(stored.dtype) for t in (norm_out.weight, norm_out.bias)]
        normed = F.group_norm(stored, norm_out.groups, *affine, norm_out.eps)
        norm_out.out.copy_(activation_ref(normed, norm_out.activation))
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
def _tile_group_stats(
    y, n_idx, offs_n, m_mask, n_mask, pid_m, pid_n, M, HWo, part_ptr, G, S, P,
    CG: tl.constexpr, GPT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Partial GroupNorm statistics of one output tile ``y`` [BLOCK_M, BLOCK_N] (fp32 of the stored values).

    For each sample among the tile's rows and each group among its channels (at most GPT), stores (count, mean,
    M2) at ``part_ptr[n, g, pid_m - first row tile of n, pid_n - first channel tile of g]``: per channel a
    corrected two-pass mean and M2 over the sample's rows (Chan, Golub & LeVeque 1983: the deviations from the
    rough mean also correct it), then Chan's combination over the group's channels in the tile.
    """
    row0 = pid_m * BLOCK_M
    n_first = row0 // HWo
    n_last = (tl.minimum(row0 + BLOCK_M, M) - 1) // HWo
    g_first = (pid_n * BLOCK_N) // CG
    gi = tl.arange(0, GPT)
    in_group = ((offs_n // CG - g_first)[:, None] == gi[None, :]) & n_mask[:, None]  # [BLOCK_N, GPT]
    width = tl.sum(in_group.to(tl.float32), axis=0)  # the group's channels in this tile
    g_ok = width > 0
    part = pid_n - ((g_first + gi) * CG) // BLOCK_N
    for n in range(n_first, n_last + 1):
        rows = m_mask & (n_idx == n)
        cnt = tl.sum(rows.to(tl.float32), axis=0)
        mask = rows[:, None] & n_mask[None, :]
        rough = tl.sum(tl.where(mask, y, 0.0), axis=0) / cnt
        dev = tl.where(mask, y - rough[None, :], 0.0)
        fix = tl.sum(dev, axis=0)  # corrected two-pass: the rough mean's rounding, removed from mean and M2
        ch_mean = rough + fix / cnt
        ch_m2 = tl.sum(dev * dev, axis=0) - fix * fix / cnt
        g_mean = tl.sum(tl.where(in_group, ch_mean[:, None], 0.0), axis=0) / tl.maximum(width, 1.0)
        spread = ch_mean[:, None] - g_mean[None, :]
        g_m2 = tl.sum(tl.where(in_group, ch_m2[:, None] + cnt * spread * spread, 0.0), axis=0)
        slot = pid_m - (n * HWo) // BLOCK_M
        base = part_ptr + (((n * G + g_first + gi) * S + slot) * P + part) * 3
        tl.store(base, cnt * width, mask=g_ok)
        tl.store(base + 1, g_mean, mask=g_ok)
        tl.store(base + 2, g_m2, mask=g_ok)


@triton.jit
def _group_norm_of_tile(
    y, mask, offs_n, n_mask, out_ptrs, w_ptr, b_ptr, eps,
    IPT: tl.constexpr, HW: tl.constexpr, GPT: tl.constexpr, CG: tl.constexpr, ACT: tl.constexpr,
    AFFINE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Stores ``act(group_norm(y) * gamma + beta)`` of an output tile ``y`` [IPT*HW, BLOCK_N] (fp32 of the stored
    values) that holds IPT whole images of HW pixels and GPT whole groups of CG channels: two-pass mean and
    (biased) variance per (image, group) in registers. Masked rows and channels are whole images and groups of
    zeros: their statistics are never used."""
    y3 = tl.reshape(tl.where(mask, y, 0.0), [IPT, HW, BLOCK_N])
    inv_count = 1.0 / (HW * CG)
    g_mean = tl.sum(tl.reshape(tl.sum(y3, axis=1), [IPT, GPT, CG]), axis=2) * inv_count
    dev = y3 - tl.reshape(tl.broadcast_to(g_mean[:, :, None], [IPT, GPT, CG]), [IPT, BLOCK_N])[:, None, :]
    g_var = tl.sum(tl.reshape(tl.sum(dev * dev, axis=1), [IPT, GPT, CG]), axis=2) * inv_count
    rstd = tl.math.rsqrt(g_var + eps)
    z = dev * tl.reshape(tl.broadcast_to(rstd[:, :, None], [IPT, GPT, CG]), [IPT, BLOCK_N])[:, None, :]
    if AFFINE:
        gamma = tl.load(w_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        beta = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        z = z * gamma[None, None, :] + beta[None, None, :]
    z = apply_activation(tl.reshape(z, [IPT * HW, BLOCK_N]), ACT)
    tl.store(out_ptrs, z.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _conv2d_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    temb_ptr,
    res_ptr,
    out_ptr,
    part_ptr,
    ws_ptr,
    count_ptr,
    sc_ptr,
    sw_ptr,
    on_ptr,
    onw_ptr,
    onb_ptr,
    M,
    H,
    W,
    Cin,
    Cin_sc,
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
    stride_sn,
    stride_sc,
    stride_sh,
    stride_sw,
    stride_onn,
    stride_onc,
    stride_onh,
    stride_onw,
    on_eps,
    out_scale,
    STATS_G,
    STATS_S,
    STATS_P,
    STRIDE: tl.constexpr,
    PAD: tl.constexpr,
    KSIZE: tl.constexpr,
    UP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_TEMB: tl.constexpr,
    HAS_RES: tl.constexpr,
    ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_SHORTCUT: tl.constexpr,
    FLAT_K: tl.constexpr,
    HAS_STATS: tl.constexpr,
    STATS_CG: tl.constexpr,
    STATS_GPT: tl.constexpr,
    HAS_NORM_OUT: tl.constexpr,
    NORM_OUT_IPT: tl.constexpr,
    NORM_OUT_HW: tl.constexpr,
    NORM_OUT_GPT: tl.constexpr,
    NORM_OUT_CG: tl.constexpr,
    NORM_OUT_ACT: tl.constexpr,
    NORM_OUT_AFFINE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_dependency_sync(PDL)
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
    # One flat loop over (tap, cin chunk) so the compiler pipelines all KSIZE*KSIZE*k_chunks steps together, then
    # (HAS_SHORTCUT) the 1x1 shortcut's cin chunks; with SPLIT_K > 1 this program runs its share of all those steps
    # (program_id(1) of SPLIT_K contiguous ranges).
    steps = KSIZE * KSIZE * k_chunks
    if FLAT_K:  # few input channels: the reduction runs over the packed weight's rows, (tap, channel) flattened
        steps = tl.cdiv(KSIZE * KSIZE * Cin, BLOCK_K)
    all_steps = steps
    if HAS_SHORTCUT:
        all_steps += tl.cdiv(Cin_sc, BLOCK_K)
    step_lo = 0
    step_hi = all_steps
    if SPLIT_K > 1:
        per_split = tl.cdiv(all_steps, SPLIT_K)
        step_lo = tl.program_id(1) * per_split
        step_hi = tl.minimum(step_lo + per_split, all_steps)
    for step in range(step_lo, tl.minimum(step_hi, steps)):
        if FLAT_K:  # this step's BLOCK_K weight rows, each its own (tap, channel)
            offs_k = step * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = offs_k < KSIZE * KSIZE * Cin
            tap_k = offs_k // Cin
            ih = ih0[:, None] + (tap_k // KSIZE)[None, :]
            iw = iw0[:, None] + (tap_k % KSIZE)[None, :]
            a_mask = m_mask[:, None] & k_mask[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            a_ptrs = (x_rows[:, None] + (ih // UP) * stride_xh + (iw // UP) * stride_xw
                      + (offs_k - tap_k * Cin)[None, :] * stride_xc)  # fmt: skip
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            b_ptrs = w_ptr + offs_k[:, None] * Cout + offs_n[None, :]
        else:
            tap = step // k_chunks
            c0 = (step - tap * k_chunks) * BLOCK_K
            ih = ih0 + tap // KSIZE
            iw = iw0 + tap % KSIZE
            row_ok = m_mask & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            offs_k = c0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < Cin
            # H, W are the (virtually) upsampled sizes: pixel (ih, iw) is stored at (ih // UP, iw // UP).
            a_ptrs = (x_rows + (ih // UP) * stride_xh + (iw // UP) * stride_xw)[:, None] + offs_k[None, :] * stride_xc
            a_mask = row_ok[:, None] & k_mask[None, :]
            a = tl.load(a_ptrs, mask=a_mask, other=0.0)
            b_ptrs = w_ptr + (tap * Cin + offs_k)[:, None] * Cout + offs_n[None, :]
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc)

    if HAS_SHORTCUT:  # + conv1x1(shortcut) at the output pixels: a ResnetBlock2D's conv_shortcut, summed in fp32
        sc_rows = sc_ptr + n_idx.to(tl.int64) * stride_sn + oh * stride_sh + ow * stride_sw
        for step in range(tl.maximum(step_lo, steps), step_hi):
            offs_k = (step - steps) * BLOCK_K + tl.arange(0, BLOCK_K)
            k_mask = offs_k < Cin_sc
            a = tl.load(sc_rows[:, None] + offs_k[None, :] * stride_sc, mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)  # fmt: skip
            b = tl.load(sw_ptr + offs_k[:, None] * Cout + offs_n[None, :], mask=k_mask[:, None] & n_mask[None, :],
                        other=0.0)  # fmt: skip
            acc = tl.dot(a, b, acc)

    is_last = True
    if SPLIT_K > 1:
        acc, is_last = _split_k_reduce(acc, ws_ptr, count_ptr, pid, tl.program_id(1), num_pid_m * num_pid_n,
                                       SPLIT_K, BLOCK_M, BLOCK_N)  # fmt: skip
    if is_last:
        y = _conv_epilogue(
            acc, out_ptr, bias_ptr, temb_ptr, res_ptr, part_ptr, n_idx, oh, ow, offs_n, m_mask, n_mask, pid_m, pid_n,
            M, Ho, Wo, stride_tn, stride_tc, stride_rn, stride_rc, stride_rh, stride_rw, stride_on, stride_oc,
            stride_oh, stride_ow, out_scale, STATS_G, STATS_S, STATS_P, HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE,
            HAS_STATS, STATS_CG, STATS_GPT, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        if HAS_NORM_OUT:  # the tile holds whole images and groups (the wrapper sized it so)
            on_ptrs = (on_ptr + n_idx.to(tl.int64)[:, None] * stride_onn + (oh * stride_onh + ow * stride_onw)[:, None]
                       + offs_n[None, :] * stride_onc)  # fmt: skip
            _group_norm_of_tile(
                y.to(tl.float32), m_mask[:, None] & n_mask[None, :], offs_n, n_mask, on_ptrs, onw_ptr, onb_ptr, on_eps,
                NORM_OUT_IPT, NORM_OUT_HW, NORM_OUT_GPT, NORM_OUT_CG, NORM_OUT_ACT, NORM_OUT_AFFINE, BLOCK_N,
            )  # fmt: skip


@triton.jit
def _split_k_reduce(
    acc, ws_ptr, count_ptr, tile, split, num_tiles,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Split-K fix-up in the same launch: each program stores its fp32 partial tile in the workspace and counts
    itself in; the last of a tile's SPLIT_K programs (it alone gets ``is_last``) sums all partials in split order
    (the result does not depend on which program finished last: bit-reproducible) and resets the tile's counter to
    0 for the next call (so the counters need zeroing only once)."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tile_base = tile.to(tl.int64) * (BLOCK_M * BLOCK_N)
    split_stride = num_tiles.to(tl.int64) * (BLOCK_M * BLOCK_N)
    tl.store(ws_ptr + split * split_stride + tile_base + offs, acc)
    is_last = finish_arrival(count_ptr, tile, SPLIT_K)
    if is_last:
        acc = tl.load(ws_ptr + tile_base + offs, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(ws_ptr + s * split_stride + tile_base + offs, cache_modifier=".cg")
        reset_arrivals(count_ptr, tile)
    return acc, is_last


@triton.jit
def _conv_epilogue(
    acc, out_ptr, bias_ptr, temb_ptr, res_ptr, part_ptr, n_idx, oh, ow, offs_n, m_mask, n_mask, pid_m, pid_n, M, Ho,
    Wo, stride_tn, stride_tc, stride_rn, stride_rc, stride_rh, stride_rw, stride_on, stride_oc, stride_oh, stride_ow,
    out_scale, STATS_G, STATS_S, STATS_P,
    HAS_BIAS: tl.constexpr, HAS_TEMB: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_STATS: tl.constexpr, STATS_CG: tl.constexpr, STATS_GPT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The fused epilogue of a finished accumulator tile, its store and (``HAS_STATS``) its GroupNorm partials;
    returns the tile as stored (in the output dtype)."""
    res_rows = res_ptr + n_idx.to(tl.int64) * stride_rn + oh * stride_rh + ow * stride_rw
    acc = fused_epilogue(
        acc, n_idx, offs_n, m_mask, n_mask, bias_ptr, temb_ptr, stride_tn, stride_tc, res_rows, stride_rc,
        out_scale, HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip
    out_rows = out_ptr + n_idx.to(tl.int64) * stride_on + oh * stride_oh + ow * stride_ow
    out_ptrs = out_rows[:, None] + offs_n[None, :] * stride_oc
    y = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, y, mask=m_mask[:, None] & n_mask[None, :])
    if HAS_STATS:
        _tile_group_stats(
            y.to(tl.float32), n_idx, offs_n, m_mask, n_mask, pid_m, pid_n, M, Ho * Wo, part_ptr, STATS_G, STATS_S,
            STATS_P, STATS_CG, STATS_GPT, BLOCK_M, BLOCK_N,
        )  # fmt: skip
    return y


def _pow2_at_least(value: int, low: int, high: int) -> int:
    return max(low, min(high, triton.next_power_of_2(max(value, 1))))


@dataclass(frozen=True)
class GemmTiles:
    """A tile plan for :func:`conv2d` (``tiles=``) in place of its own (:func:`_gemm_blocks`): powers of two, each
    block at least 16 (the tl.dot minimum). For sweeps (``benchmarks/sweep_conv.py --gather-tiles``)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        blocks = (self.block_m, self.block_n, self.block_k)
        if any(b < 16 or b & (b - 1) for b in blocks) or self.num_warps not in (1, 2, 4, 8) or self.num_stages < 1:
            raise FastdiffError(f"bad conv tiles {self}: blocks powers of two >= 16, 1-8 warps, >= 1 stage")


LATENCY_BLOCK_K = 128
"""The reduction step of a latency-bound conv (:func:`_gemm_blocks`) whose Cin is at least this wide."""


BIG_TILE_PROGRAMS_PER_SM = 1.5
"""Programs per SM from which a conv takes 128-row tiles (both conv kernels' plans: :func:`_gemm_blocks`,
:func:`fastdiff.kernels.conv2d_tma.default_config`): the 8x8 level of batch 256 (256 programs of 128 x 128 for
132 SMs) ran faster in them than in 64-row tiles (``sweep-conv-small-tiles-ddpm-cifar10-b256-h100-2026-11-26``)."""


def fills_with_128_rows(programs: int, device: torch.device) -> bool:
    """Whether ``programs`` programs of 128-row tiles are at least :data:`BIG_TILE_PROGRAMS_PER_SM` per SM."""
    return programs >= BIG_TILE_PROGRAMS_PER_SM * num_sms(device)


def flat_k_block(ksize: int, cin: int) -> int:
    """The reduction step of the flattened (tap, channel) loop (:data:`FLAT_K_MAX_CIN`): all ``ksize^2 * cin``
    rows in one step where they fit in 64, padded to a power of two of at least 16 (the tl.dot minimum)."""
    return min(64, max(16, triton.next_power_of_2(ksize * ksize * cin)))


def _gemm_blocks(
    rows: int, cols: int, red: int, dtype: torch.dtype, device: torch.device, split_k: int = 1
) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for a [rows x red] @ [red x cols] tile loop.

    ``red`` is the per-step reduction extent (Cin), so BLOCK_K never exceeds it by more than the tl.dot minimum of
    16. Two regimes:

    * throughput: the largest tiles (128 x 128 x 64) when they give at least 1.5 programs per SM (``split_k``
      programs per tile): the batch-256 shapes, down to the 8x8 level's stride-2 conv (256 programs of 128 x 128
      for 132 SMs);
    * latency (fewer tiles than that: batch 1, the 8x8 to 32x32 levels): a program's time is its serial chain of
      reduction steps, so the tiles are 32 channels wide, each step :data:`LATENCY_BLOCK_K` deep where Cin allows
      (half the steps), and the row block the largest of 64, 32, 16 that still gives half a program per SM, split
      programs included (read off a tile sweep of ddpm-cifar10's batch-1 3x3 convs on the H100:
      ``benchmarks/sweep_conv.py --gather-tiles``).
    """
    block_n = _pow2_at_least(cols, 16, 128)
    block_k = 64 if red >= 64 else 32 if red >= 32 else 16
    num_stages = 3 if dtype.itemsize <= 2 else 2  # fp32 tiles are twice the shared memory per stage
    sms = num_sms(device)
    if fills_with_128_rows(triton.cdiv(rows, 128) * triton.cdiv(cols, block_n) * split_k, device):
        return 128, block_n, block_k, 8 if block_n >= 128 else 4, num_stages
    block_n = min(block_n, 32)
    block_k = LATENCY_BLOCK_K if red >= LATENCY_BLOCK_K else block_k
    block_m = 64
    while block_m > 16 and triton.cdiv(rows, block_m) * triton.cdiv(cols, block_n) * split_k < sms // 2:
        block_m //= 2
    return block_m, block_n, block_k, 4, num_stages


FLAT_K_MAX_CIN = 16
"""Below this many input channels the reduction runs over the (tap, channel) rows
of the packed weight in BLOCK_K steps instead of one step per tap: a U-Net's first conv (3 channels, 3x3) takes one
32-deep step instead of nine 16-deep ones of which 13 of 16 columns are padding."""

SPLIT_K_CHOICES = (2, 4, 8)
"""The split-K factors offered to a caller that times them (``split_k_choices``). 16 was offered too until git
9823897 and never won in a committed kernel plan (H100 and H200, every shipped plan); 8 won 50 ops, 4 won 103."""


def split_k_choices(
    n: int,
    cin: int,
    cout: int,
    out_hw: tuple[int, int],
    ksize: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[int, ...]:
    """The ``split_k`` values worth timing for a conv of this shape: none when its unsplit grid already has two
    programs per SM; otherwise those of :data:`SPLIT_K_CHOICES` that leave every split at least two reduction steps
    and the grid at most eight programs per SM (on the H100 at batch 1 a 32x32 conv of 18 steps in 256 programs
    still gains from 2-4 splits: its time is the latency of the serial reduction, not the SMs' throughput)."""
    rows = n * out_hw[0] * out_hw[1]
    sms = num_sms(device)
    block_m, block_n, block_k, *_ = _gemm_blocks(rows, cout, cin, dtype, device)
    if triton.cdiv(rows, block_m) * triton.cdiv(cout, block_n) >= 2 * sms:
        return ()
    steps = ksize * ksize * triton.cdiv(cin, block_k)
    if cin < FLAT_K_MAX_CIN:  # the wrapper's flattened reduction
        steps = triton.cdiv(ksize * ksize * cin, flat_k_block(ksize, cin))
    choices = []
    for split in SPLIT_K_CHOICES:
        block_m, block_n, block_k, *_ = _gemm_blocks(rows, cout, cin, dtype, device, split)
        tiles = triton.cdiv(rows, block_m) * triton.cdiv(cout, block_n)
        if 2 * split <= steps and tiles * split <= 8 * sms:
            choices.append(split)
    return tuple(choices)


def _stats_layout(n: int, hw: int, cout: int, groups: int, block_m: int, block_n: int) -> tuple[int, int, int]:
    """(row-tile slots per sample, channel-tile parts per group, groups per channel tile as a power of two) of
    the partial-statistics buffer of a conv with these tiles: a sample's rows span at most ``slots`` row tiles
    (one more than ``ceil(hw / block_m)`` when samples straddle tiles), a group's channels ``parts`` channel
    tiles."""
    cg = cout // groups
    slots = triton.cdiv(hw, block_m) + (1 if n > 1 and hw % block_m else 0)
    parts = max(((g + 1) * cg - 1) // block_n - g * cg // block_n + 1 for g in range(groups))
    per_tile = max(
        (min((t + 1) * block_n, cout) - 1) // cg - t * block_n // cg + 1 for t in range(triton.cdiv(cout, block_n))
    )
    return slots, parts, triton.next_power_of_2(per_tile)


def _check_stats(stats: Any, channels: int) -> None:
    if not isinstance(stats, GroupNormPartials):
        raise FastdiffError(f"stats must be a GroupNormPartials, got {type(stats).__name__}")
    stats.check_channels(channels)


def _reserve_stats(stats: GroupNormPartials, partials_shape: tuple[int, ...], device: torch.device) -> None:
    """The partials buffer of ``stats`` in this shape (kept while the shape stays: a fixed address for CUDA
    graphs)."""
    if stats.partials is None or stats.partials.shape != partials_shape or stats.partials.device != device:
        stats.partials = torch.empty(partials_shape, device=device, dtype=torch.float32)


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of device memory that ``t``'s elements may occupy."""
    reach = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True) if size > 0)
    return t.data_ptr(), t.data_ptr() + (reach + 1) * t.element_size()


def _check_norm_out(
    norm_out: OutputGroupNorm,
    with_stats: bool,
    n: int,
    cout: int,
    out_hw: tuple[int, int],
    device: torch.device,
    operands: tuple[torch.Tensor | None, ...],
) -> None:
    """FastdiffError unless the epilogue can take ``norm_out`` for an [n, cout, *out_hw] output on ``device``,
    into memory none of the conv's ``operands`` (input, residual, shortcut, output) occupies: a tile storing its
    normalised values there could overwrite what another tile still reads."""
    if not isinstance(norm_out, OutputGroupNorm):
        raise FastdiffError(f"norm_out must be an OutputGroupNorm, got {type(norm_out).__name__}")
    if with_stats:
        raise FastdiffError("norm_out does not combine with stats= (both are the output's GroupNorm)")
    why = norm_out_unsupported(n, cout, out_hw, norm_out.groups)
    if why is not None:
        raise FastdiffError(f"norm_out: {why}")
    check_activation(norm_out.activation)
    if norm_out.eps < 0:
        raise FastdiffError(f"norm_out: GroupNorm eps must be >= 0, got {norm_out.eps}")
    if tuple(norm_out.out.shape) != (n, cout, *out_hw) or norm_out.out.device != device:
        raise FastdiffError(f"norm_out.out must be a [{n}, {cout}, {out_hw[0]}, {out_hw[1]}] tensor on {device}, got "
                            f"{tuple(norm_out.out.shape)} on {norm_out.out.device}")  # fmt: skip
    if (norm_out.weight is None) != (norm_out.bias is None):
        raise FastdiffError("norm_out: GroupNorm weight and bias must be given together (or neither)")
    for t in (norm_out.weight, norm_out.bias):
        if t is not None and (tuple(t.shape) != (cout,) or t.device != device or not t.is_contiguous()):
            raise FastdiffError(f"norm_out: GroupNorm weight and bias must be contiguous [{cout}] tensors on {device}")
    first, end = _byte_span(norm_out.out)
    for t in operands:
        if t is not None and t.numel() and norm_out.out.numel():
            t_first, t_end = _byte_span(t)
            if t_first < end and first < t_end:
                raise FastdiffError("norm_out.out overlaps the conv's input, residual, shortcut or output")


def _check_shortcut(
    shortcut: torch.Tensor | None,
    weight: torch.Tensor | None,
    x: torch.Tensor,
    n: int,
    cout: int,
    out_hw: tuple[int, int],
) -> torch.Tensor:
    """The packed [Cin_sc, Cout] shortcut weight; FastdiffError unless tensor and weight fit the conv's output."""
    if shortcut is None or weight is None:
        raise FastdiffError("shortcut and shortcut_weight must be given together")
    if shortcut.dim() != 4 or (shortcut.shape[0], *shortcut.shape[2:]) != (n, *out_hw):
        raise FastdiffError(f"shortcut must be [{n}, C, {out_hw[0]}, {out_hw[1]}] (the output's size), got "
                            f"{tuple(shortcut.shape)}")  # fmt: skip
    cin_sc = shortcut.shape[1]
    if weight.dim() == 4:
        if tuple(weight.shape) != (cout, cin_sc, 1, 1):
            raise FastdiffError(f"shortcut_weight must be [{cout}, {cin_sc}, 1, 1], got {tuple(weight.shape)}")
        weight = pack_conv_weight(weight)
    if tuple(weight.shape) != (cin_sc, cout):
        raise FastdiffError(f"packed shortcut_weight must be [{cin_sc}, {cout}], got {tuple(weight.shape)}")
    for name, t in (("shortcut", shortcut), ("shortcut_weight", weight)):
        if t.device != x.device or t.dtype != x.dtype:
            raise FastdiffError(f"{name} ({t.dtype}, {t.device}) must match the input ({x.dtype}, {x.device})")
    return weight.contiguous()


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
    padding: int | tuple[int, int] = 0,
    time_emb: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    out_scale: float | None = None,
    out: torch.Tensor | None = None,
    upsample: int = 1,
    stats: GroupNormPartials | None = None,
    split_k: int = 1,
    workspace: SplitWorkspace | None = None,
    shortcut: torch.Tensor | None = None,
    shortcut_weight: torch.Tensor | None = None,
    norm_out: OutputGroupNorm | None = None,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """Fused conv2d: ``((act(conv(x, w) + bias + time_emb[:, :, None, None]) + residual) * out_scale``.

    ``x`` is a logical ``[N, Cin, H, W]`` tensor, channels-last in memory for speed. ``weight`` is either raw
    ``[Cout, Cin, K, K]`` or packed ``[K*K*Cin, Cout]`` (:func:`pack_conv_weight`; pack once at load). Square
    kernels of any size, any stride and padding (an int, or (before, after): :func:`padding_pair`). ``out``
    (optional) receives the result; otherwise a new channels-last ``[N, Cout, Ho, Wo]`` tensor is returned.
    Accumulation is fp32 (a tf32 dot for fp32 inputs on the GPU). ``upsample=k`` convolves the nearest-neighbour
    x``k`` upsampling of ``x`` without materialising it (the U-Net's Upsample2D: interpolate then conv, in one
    launch).

    ``stats`` (:class:`fastdiff.kernels.common.GroupNormPartials`) writes the partial GroupNorm statistics of the
    output (as stored) for ``group_norm_act(..., stats=stats)`` (module docstring). ``norm_out``
    (:class:`OutputGroupNorm`; where :func:`norm_out_unsupported` is None) also writes the output's GroupNorm and
    activation to ``norm_out.out``, from the tile in registers (module docstring).

    ``shortcut`` ([N, Cin_sc, Ho, Wo], at the output's size) with ``shortcut_weight`` (raw [Cout, Cin_sc, 1, 1] or
    packed [Cin_sc, Cout]) adds the 1x1 conv of ``shortcut`` to the accumulator before the epilogue: the reduction
    runs on over its channels (a ResnetBlock2D's ``conv2(h) + conv_shortcut(x)`` in one launch, the two
    biases summed by the caller into ``bias``; no shortcut tensor written or read back).

    Split-K (``split_k > 1``; at most one split per reduction step, ``KSIZE*KSIZE*ceil(Cin/BLOCK_K)``): each output
    tile's reduction is divided among ``split_k`` programs, so a conv with few output tiles (batch 1, the 4x4 and
    8x8 levels) still fills the GPU; the last program of a tile to finish sums the fp32 partials in ``workspace``
    (:class:`fastdiff.kernels.common.SplitWorkspace`; a new one per call when None) and runs the epilogue, in the
    same launch.

    ``tiles`` (:class:`GemmTiles`) replaces the tile plan (the epilogue GroupNorm still grows the tile to whole
    images and groups).
    """
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1:
        raise FastdiffError(f"split_k must be a positive int, got {split_k!r}")
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
    pad, pad_end = padding_pair(padding)
    if stride < 1 or pad < 0 or pad_end < 0:
        raise FastdiffError(f"bad conv stride {stride} / padding {padding}")
    if isinstance(upsample, bool) or not isinstance(upsample, int) or upsample < 1:
        raise FastdiffError(f"upsample must be a positive int, got {upsample!r}")
    cout = weight.shape[1]
    h, w = h * upsample, w * upsample
    ho = (h + pad + pad_end - ksize) // stride + 1
    wo = (w + pad + pad_end - ksize) // stride + 1
    if ho < 1 or wo < 1:
        raise FastdiffError(f"conv output would be empty for input {h}x{w}, kernel {ksize}, padding {padding}")
    if weight.device != x.device or weight.dtype != x.dtype:
        raise FastdiffError(f"weight ({weight.dtype}, {weight.device}) must match input ({x.dtype}, {x.device})")
    check_epilogue_args(n, cout, (ho, wo), x.device, bias, time_emb, residual, activation, out)
    if shortcut is not None or shortcut_weight is not None:
        shortcut_weight = _check_shortcut(shortcut, shortcut_weight, x, n, cout, (ho, wo))
    if stats is not None:
        _check_stats(stats, cout)
    if norm_out is not None:
        _check_norm_out(norm_out, stats is not None, n, cout, (ho, wo), x.device, (x, residual, shortcut, out))
    if out is None:
        out = torch.empty((n, cout, ho, wo), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    rows = n * ho * wo
    block_m, block_n, block_k, num_warps, num_stages = _gemm_blocks(rows, cout, cin, x.dtype, x.device, split_k)
    flat_k = cin < FLAT_K_MAX_CIN
    if flat_k:  # one reduction over all K*K*Cin weight rows (the first conv of a U-Net: 1-4 channels)
        block_k = flat_k_block(ksize, cin)
    if tiles is not None:
        block_m, block_n, block_k, num_warps, num_stages = (
            tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_warps, tiles.num_stages
        )  # fmt: skip
    if norm_out is not None:  # whole images per row tile, whole groups per channel tile
        block_m, block_n = max(block_m, ho * wo), max(block_n, cout // norm_out.groups)
        num_warps = 8 if block_m * block_n >= 128 * 128 else 4
        if block_m * block_n > 64 * 64:  # the grown tile's operands keep 64-deep steps (shared memory)
            block_k = min(block_k, 64)
    tiles = triton.cdiv(rows, block_m) * triton.cdiv(cout, block_n)
    cin_sc = shortcut.shape[1] if shortcut is not None else 0
    steps = triton.cdiv(ksize * ksize * cin, block_k) if flat_k else ksize * ksize * triton.cdiv(cin, block_k)
    split_k = min(split_k, steps + triton.cdiv(cin_sc, block_k))
    if split_k > 1:
        workspace = workspace if workspace is not None else SplitWorkspace()
        partials, counters = workspace.reserve(split_k * tiles * block_m * block_n, tiles, x.device)
    stats_layout = (0, 0, 1)
    if stats is not None:
        stats_layout = _stats_layout(n, ho * wo, cout, stats.groups, block_m, block_n)
        _reserve_stats(stats, (n, stats.groups, *stats_layout[:2], 3), x.device)
        stats.tiles = (block_m, block_n, ho * wo, cout)
    temb = time_emb if time_emb is not None else out
    res = residual if residual is not None else out
    grid = (tiles, split_k)
    temb_strides = time_emb.stride() if time_emb is not None else (0, 0)
    on = norm_out.out if norm_out is not None else out
    on_affine = norm_out is not None and norm_out.weight is not None
    on_width = cout // norm_out.groups if norm_out is not None else 1
    _conv2d_kernel[grid](
        x, weight, bias if bias is not None else out, temb, res, out, stats.partials if stats is not None else out,
        partials if split_k > 1 else out, counters if split_k > 1 else out,
        shortcut if shortcut is not None else out, shortcut_weight if shortcut is not None else out,
        on, norm_out.weight if on_affine else out, norm_out.bias if on_affine else out,
        rows, h, w, cin, cin_sc, ho, wo, cout,
        *x.stride(), *temb_strides, *res.stride(), *out.stride(), *(shortcut if shortcut is not None else out).stride(),
        *on.stride(), float(norm_out.eps) if norm_out is not None else 0.0,
        1.0 if out_scale is None else float(out_scale), stats.groups if stats is not None else 1, *stats_layout[:2],
        STRIDE=stride, PAD=pad, KSIZE=ksize, UP=upsample,
        HAS_BIAS=bias is not None, HAS_TEMB=time_emb is not None, HAS_RES=residual is not None,
        ACT=ACTIVATIONS[activation], HAS_SCALE=out_scale is not None, HAS_SHORTCUT=shortcut is not None,
        FLAT_K=flat_k, HAS_STATS=stats is not None, STATS_CG=cout // stats.groups if stats is not None else 1,
        STATS_GPT=stats_layout[2],
        HAS_NORM_OUT=norm_out is not None, NORM_OUT_IPT=block_m // (ho * wo) if norm_out is not None else 1,
        NORM_OUT_HW=ho * wo if norm_out is not None else 1, NORM_OUT_GPT=block_n // on_width, NORM_OUT_CG=on_width,
        NORM_OUT_ACT=ACTIVATIONS[norm_out.activation] if norm_out is not None else 0, NORM_OUT_AFFINE=on_affine,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, SPLIT_K=split_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(x.device),
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
    resolution, the output at the (upsampled) conv's, the epilogue operands that are given, the GroupNorm statistics
    of the output (``stats``)."""
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    n, cin, h, w = x.shape
    taps = weight.shape[0] // cin if weight.dim() == 2 else weight.shape[2] * weight.shape[3]
    cout = weight.shape[1] if weight.dim() == 2 else weight.shape[0]
    ksize = round(taps**0.5)
    stride, upsample = kwargs.get("stride", 1), kwargs.get("upsample", 1)
    pads = sum(padding_pair(kwargs.get("padding", 0)))
    stats = kwargs.get("stats")
    ho = (h * upsample + pads - ksize) // stride + 1
    wo = (w * upsample + pads - ksize) // stride + 1
    cost = cost_model.conv2d_cost(
        n, cin, cout, ho, wo, ksize, 1, x.element_size(), h, w, bias=bias is not None,
        residual=kwargs.get("residual") is not None, temb=kwargs.get("time_emb") is not None,
        act=kwargs.get("activation"), scale=kwargs.get("out_scale") is not None,
        stats_groups=stats.groups if stats is not None else 0,
    )  # fmt: skip
    return cost.flops, cost.bytes


OP = KernelOp(
    name="conv2d",
    triton=conv2d,
    ref=conv2d_ref,
    example_inputs=conv2d_example_inputs,
    cost=conv2d_cost,
)
