"""GroupNorm over NHWC activations with fused affine, activation and residual add.

Layout: ``x`` is a logical ``[N, C, H, W]`` torch tensor in channels-last memory (NHWC: ``x.is_contiguous(
memory_format=torch.channels_last)``); a tensor in another layout is copied to channels-last first. The
output is channels-last. Any group count that divides C works; ``num_groups=1`` is a LayerNorm over
C x H x W per sample.

Order, per element, with fp32 statistics (Chan's parallel merge of per-tile two-pass mean / M2, so no
sum-of-squares cancellation)::

    y = (x - mean[n, g]) * rsqrt(var[n, g] + eps) * weight[c] + bias[c]
    y = activation(y)                  # None | "silu" | "gelu" (exact, erf) | "relu"
    y = y + residual[n, c, h, w]       # optional

Two designs, chosen by size:

* single pass: one program per (block of whole groups, sample), the blocks of one sample launched together. When
  the block (H*W rows x its channels) fits in registers it is loaded once, reduced and normalised from registers
  (x read once, y written once); otherwise the program streams it twice (statistics, then apply; the second read
  mostly hits L2).
* two phase, for large groups with too few (sample, group) pairs to fill the GPU (batch 1, SD1.5 at 64x64):
  a split-reduction kernel writes per-split (count, mean, M2) partials, an apply kernel merges them and
  writes y.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels import cost_model
from fastdiff.kernels.common import (
    ACTIVATIONS,
    GroupNormPartials,
    activation_ref,
    apply_activation,
    channels_last_randn,
    check_activation,
    grid_dependency_sync,
    num_sms,
    pdl_launch,
)
from fastdiff.kernels.fp8 import FP8_DTYPE, quantize_e4m3_ref, to_e4m3
from fastdiff.kernels.registry import KernelOp

log = logging.getLogger(__name__)

MAX_REGISTER_TILE = 16384
"""Most elements one single-pass program keeps in registers (32 KB of fp16 over 8 warps)."""
WIDE_REGISTER_TILE = 32768
"""The register tile of the wide plan (32-lane rows) used when there are programs enough to fill the GPU."""
WIDE_LANES = 32
"""Fewest channel lanes of the wide plan: 64-byte fp16 row segments. On the H100 at DDPM-CIFAR10 batch 256 this
ran 1.2-1.8x faster than 16 lanes (e.g. 384 channels at 32x32: 620 vs 914 us; 256 at 32x32: 166 vs 298 us)."""
STREAM_TILE = 4096
"""Elements per loop step when a program streams its block."""
LANE_CHOICES = (4, 8, 16, 32, 64)
"""The ``lanes`` a caller may force (the engine times them per shape): no one width wins every shape. On the H100
at DDPM-CIFAR10 batch 256: 384 channels at 32x32 ran 455 us at 64 lanes vs 620 at 32; 512 at 8x8 17.8 vs 19.9 us
at 16 vs 32; an e4m3 output at 384 x 16x16 61 vs 82 us at 64 vs 32 (``benchmarks/sweep_group_norm.py``). The
narrow widths (4, 8: a group or two of 4 channels per program) are for batch 1, where a 32x32 norm of 128 channels
in 16-lane blocks runs on only 8 programs."""
LANES_REGISTER_TILE = 32768
"""The register tile allowed to a forced ``lanes`` plan; a larger block is streamed at 4 warps. On the H100 at
DDPM-CIFAR10 batch 256 the 384-channel 32x32 norm (12-channel groups) ran 447 us streamed at 64 lanes and 4 warps,
against 618 for the size-based plan and over 570 for 64 lanes in registers (``benchmarks/sweep_group_norm.py``, in
the launch order before ``_gn_single_pass_kernel``'s)."""
STREAM_WARPS = 4
"""Warps of a forced ``lanes`` plan that streams its block (4 beat 8 on every streamed shape of that sweep)."""
MAX_SPLIT = 64
"""Most row splits per group in the two-phase design (the apply kernel merges them all in registers)."""
REGISTER_WARPS = 16
"""Warps of a single-pass program whose register tile is larger than ``MAX_REGISTER_TILE`` (the 32K-element tiles
of the wide and forced-lanes plans). In the launch-order sweep (``_gn_single_pass_kernel``) 16 ran the 32-lane tiles
of the four 32x32 norms 1.08-1.13x as fast as 8, and the 128-lane tiles of the 16x16 norms (never the fastest plan
there) at 0.89-1.0x."""

E4M3_STORE_RUN: tl.constexpr = tl.constexpr(8)
"""Contiguous channels per e4m3 store (:func:`_finish_tile`). Against the 16-channel runs Triton picks by itself the
fp8 norms of a ddpm-cifar10 batch-256 step went 1.96 -> 1.78 ms on the H100 (the op tables of the git 4c2ae52 and
269b3a5 bench runs; docs/engine/tap-sum-conv-and-e4m3-stores.md)."""

Design = Literal["auto", "single_pass", "two_phase"]


def group_norm_act_ref(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    design: Design = "auto",
    fp8_scale: float | None = None,
    lanes: int | None = None,
) -> torch.Tensor:
    """Plain torch definition: ``F.group_norm`` -> activation -> + residual (``design``, ``lanes`` ignored), then
    with ``fp8_scale`` e4m3 of ``y / fp8_scale``."""
    y = activation_ref(F.group_norm(x, num_groups, weight, bias, eps), activation)
    if residual is not None:
        y = y + residual
    if fp8_scale is not None:
        y = quantize_e4m3_ref(y, fp8_scale)
    if out is not None:
        return out.copy_(y)
    return y


@triton.jit
def merge_stats(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    """Chan's merge of two (count, mean, M2) summaries; ``n_a + n_b`` > 0. Also merges conv2d's GroupNorm partials
    (``stats=``)."""
    n = n_a + n_b
    delta = mean_b - mean_a
    frac = n_b / n
    return n, mean_a + delta * frac, m2_a + m2_b + delta * delta * n_a * frac


@triton.jit
def _channels_to_groups(cnt, ch_mean, ch_m2, local_c, c_mask, CG: tl.constexpr, ONE_GROUP: tl.constexpr):
    """Per-channel (row count, mean, M2) -> per-lane stats of the lane's group; masked lanes join group 0.

    Several groups per block merge through a [BLOCK_C, BLOCK_C] same-group mask (BLOCK_C <= 128 then);
    a single group is a plain reduction over the valid lanes.
    """
    if ONE_GROUP:
        k = tl.sum(c_mask.to(tl.float32), axis=0)
        mean1 = tl.sum(tl.where(c_mask, ch_mean, 0.0), axis=0) / k
        dev1 = ch_mean - mean1
        m2_1 = tl.sum(tl.where(c_mask, ch_m2 + cnt * dev1 * dev1, 0.0), axis=0)
        g_n = k * cnt
        g_mean = tl.zeros_like(ch_mean) + mean1
        g_m2 = tl.zeros_like(ch_mean) + m2_1
    else:
        grp = tl.where(c_mask, local_c // CG, 0)
        same = (grp[:, None] == grp[None, :]) & c_mask[None, :]
        k = tl.sum(same.to(tl.float32), axis=1)
        g_mean = tl.sum(tl.where(same, ch_mean[None, :], 0.0), axis=1) / k
        dev = ch_mean[None, :] - g_mean[:, None]
        g_m2 = tl.sum(tl.where(same, ch_m2[None, :] + cnt[None, :] * dev * dev, 0.0), axis=1)
        g_n = k * cnt
    return g_n, g_mean, g_m2


@triton.jit
def _block_group_stats(
    x_ptr,
    base,
    stride_xp,
    hw_start,
    hw_end,
    c_begin,
    C,
    CG: tl.constexpr,
    GPB: tl.constexpr,
    BLOCK_HW: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Stats of the GPB groups from channel c_begin (those below C) over rows [hw_start, hw_end), in tiles.

    Returns per-lane (count, mean, M2) of the lane's group; a group wider than BLOCK_C (then GPB == 1) is
    merged over its channel chunks, so every lane ends with the same values.
    """
    lane = tl.arange(0, BLOCK_C)
    run_n = tl.zeros([BLOCK_C], dtype=tl.float32)
    run_mean = tl.zeros([BLOCK_C], dtype=tl.float32)
    run_m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    for cc in range(0, GPB * CG, BLOCK_C):
        local_c = cc + lane
        offs_c = c_begin + local_c
        c_mask = (local_c < GPB * CG) & (offs_c < C)
        cnt = tl.zeros([BLOCK_C], dtype=tl.float32)
        ch_mean = tl.zeros([BLOCK_C], dtype=tl.float32)
        ch_m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
        for h0 in range(hw_start, hw_end, BLOCK_HW):
            rows = h0 + tl.arange(0, BLOCK_HW)
            mask = (rows < hw_end)[:, None] & c_mask[None, :]
            ptrs = x_ptr + base + rows.to(tl.int64)[:, None] * stride_xp + offs_c[None, :]
            tile = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            nb = tl.minimum(hw_end - h0, BLOCK_HW).to(tl.float32)
            t_mean = tl.sum(tile, axis=0) / nb
            dev = tl.where(mask, tile - t_mean[None, :], 0.0)
            cnt, ch_mean, ch_m2 = merge_stats(cnt, ch_mean, ch_m2, nb, t_mean, tl.sum(dev * dev, axis=0))
        g_n, g_mean, g_m2 = _channels_to_groups(cnt, ch_mean, ch_m2, local_c, c_mask, CG, GPB == 1)
        run_n, run_mean, run_m2 = merge_stats(run_n, run_mean, run_m2, g_n, g_mean, g_m2)
    return run_n, run_mean, run_m2


@triton.jit
def _scale_shift(w_ptr, b_ptr, offs_c, c_mask, mean, rstd, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """Per-channel (scale, shift) so that y = x * scale + shift is the normalised, affine output."""
    scale = rstd
    if HAS_W:
        scale = scale * tl.load(w_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    shift = -mean * scale
    if HAS_B:
        shift += tl.load(b_ptr + offs_c, mask=c_mask, other=0.0).to(tl.float32)
    return scale, shift


@triton.jit
def _finish_tile(tile, scale, shift, y_ptr, r_ptr, offs, mask, fp8_inv_scale, ACT: tl.constexpr, HAS_RES: tl.constexpr):
    """y = act(tile * scale + shift) (+ residual), stored at ``offs`` (an e4m3 ``y_ptr``: y * fp8_inv_scale).

    The e4m3 store's offsets are written ``(offs // 8) * 8 + offs % 8`` (the same numbers): that caps the
    contiguity Triton infers at 8 elements, so the store keeps the 8-channels-per-thread layout of the fp16 load
    (8-byte stores) instead of laying the whole tile out at 16 channels per thread for 16-byte stores, which
    doubled the shuffles of the tile's reductions (``E4M3_STORE_RUN``)."""
    y = apply_activation(tile.to(tl.float32) * scale[None, :] + shift[None, :], ACT)
    if HAS_RES:
        y += tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if y_ptr.dtype.element_ty == tl.float8e4nv:
        runs = (offs // E4M3_STORE_RUN) * E4M3_STORE_RUN + offs % E4M3_STORE_RUN
        tl.store(y_ptr + runs, to_e4m3(y * fp8_inv_scale), mask=mask)
    else:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gn_single_pass_kernel(
    x_ptr,
    y_ptr,
    w_ptr,
    b_ptr,
    r_ptr,
    HW,
    C,
    stride_xn,
    stride_xp,
    eps,
    fp8_inv_scale,
    CG: tl.constexpr,
    GPB: tl.constexpr,
    BLOCK_HW: tl.constexpr,
    BLOCK_C: tl.constexpr,
    IN_REGISTERS: tl.constexpr,
    ACT: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (block of GPB whole groups, sample); x rows are ``stride_xp`` apart (y rows: C).

    The channel blocks of one image are neighbours in the launch order, so the programs that run together read
    whole pixel rows between them rather than one channel strip of many images. On the H100 at DDPM-CIFAR10 batch
    256 that ran each swept norm (the 16x16 and 32x32 shapes) 1.08-1.6x faster than the (sample, block) order,
    each order at its best plan (384 channels at 32x32: 276 against 442 us; 128 at 32x32: 65 against 81;
    ``benchmarks/results/sweep-group-norm-order-ddpm-cifar10-b256-h100-2026-11-25.json``, git 860f761, rows
    ``*-bf``); a few plans far from the best ran slower in this order (64 lanes and 16 warps at 512 channels,
    16x16: 73.6 against 67.7 us), and at 8x8 and 4x4 the best plans ran 2-4% slower on three of four norms and 0.6%
    faster on one (``sweep-group-norm-order-small-ddpm-cifar10-b256-h100-2026-11-25.json``: 2.5 us of a step)."""
    grid_dependency_sync(PDL)
    n = tl.program_id(1)
    c_begin = tl.program_id(0) * (GPB * CG)
    base = n.to(tl.int64) * HW * C
    x_base = n.to(tl.int64) * stride_xn
    lane = tl.arange(0, BLOCK_C)
    if IN_REGISTERS:
        # The whole block is one tile: load once, reduce, normalise from registers.
        rows = tl.arange(0, BLOCK_HW)
        offs_c = c_begin + lane
        c_mask = (lane < GPB * CG) & (offs_c < C)
        mask = (rows < HW)[:, None] & c_mask[None, :]
        offs = base + rows.to(tl.int64)[:, None] * C + offs_c[None, :]
        x_offs = x_base + rows.to(tl.int64)[:, None] * stride_xp + offs_c[None, :]
        tile = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
        tile32 = tile.to(tl.float32)
        cnt = tl.zeros([BLOCK_C], dtype=tl.float32) + HW
        ch_mean = tl.sum(tile32, axis=0) / cnt
        dev = tl.where(mask, tile32 - ch_mean[None, :], 0.0)
        ch_m2 = tl.sum(dev * dev, axis=0)
        g_n, g_mean, g_m2 = _channels_to_groups(cnt, ch_mean, ch_m2, lane, c_mask, CG, GPB == 1)
        rstd = tl.math.rsqrt(g_m2 / g_n + eps)
        scale, shift = _scale_shift(w_ptr, b_ptr, offs_c, c_mask, g_mean, rstd, HAS_W, HAS_B)
        _finish_tile(tile, scale, shift, y_ptr, r_ptr, offs, mask, fp8_inv_scale, ACT, HAS_RES)
    else:
        g_n, g_mean, g_m2 = _block_group_stats(x_ptr, x_base, stride_xp, 0, HW, c_begin, C, CG, GPB, BLOCK_HW, BLOCK_C)
        rstd = tl.math.rsqrt(g_m2 / g_n + eps)
        for cc in range(0, GPB * CG, BLOCK_C):
            offs_c = c_begin + cc + lane
            c_mask = (cc + lane < GPB * CG) & (offs_c < C)
            scale, shift = _scale_shift(w_ptr, b_ptr, offs_c, c_mask, g_mean, rstd, HAS_W, HAS_B)
            for h0 in range(0, HW, BLOCK_HW):
                rows = h0 + tl.arange(0, BLOCK_HW)
                mask = (rows < HW)[:, None] & c_mask[None, :]
                offs = base + rows.to(tl.int64)[:, None] * C + offs_c[None, :]
                x_offs = x_base + rows.to(tl.int64)[:, None] * stride_xp + offs_c[None, :]
                tile = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
                _finish_tile(tile, scale, shift, y_ptr, r_ptr, offs, mask, fp8_inv_scale, ACT, HAS_RES)


@triton.jit
def _gn_partial_stats_kernel(
    x_ptr,
    part_ptr,
    HW,
    C,
    stride_xn,
    stride_xp,
    G,
    HW_PER_SPLIT,
    SPLIT,
    CG: tl.constexpr,
    GPB: tl.constexpr,
    BLOCK_HW: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """Phase 1: (count, mean, M2) of each group of a (sample, group block) over one split of the rows."""
    grid_dependency_sync(PDL)
    n = tl.program_id(0)
    block = tl.program_id(1)
    split = tl.program_id(2)
    c_begin = block * (GPB * CG)
    hw_start = split * HW_PER_SPLIT
    hw_end = tl.minimum(hw_start + HW_PER_SPLIT, HW)
    g_n, g_mean, g_m2 = _block_group_stats(
        x_ptr, n.to(tl.int64) * stride_xn, stride_xp, hw_start, hw_end, c_begin, C, CG, GPB, BLOCK_HW, BLOCK_C
    )
    lane = tl.arange(0, BLOCK_C)
    first_of_group = (lane % CG == 0) & (lane < GPB * CG) & (c_begin + lane < C)
    slot = part_ptr + ((n * G + block * GPB + lane // CG) * SPLIT + split) * 3
    tl.store(slot, g_n, mask=first_of_group)
    tl.store(slot + 1, g_mean, mask=first_of_group)
    tl.store(slot + 2, g_m2, mask=first_of_group)


@triton.jit
def _gn_apply_kernel(
    x_ptr,
    y_ptr,
    w_ptr,
    b_ptr,
    r_ptr,
    part_ptr,
    HW,
    C,
    stride_xn,
    stride_xp,
    G,
    SPLIT,
    HW_PER_PROGRAM,
    eps,
    fp8_inv_scale,
    TILE_M,
    TILE_N,
    PARTS,
    CG: tl.constexpr,
    BLOCK_HW: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CONV_TILES: tl.constexpr,
    ACT: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    PDL: tl.constexpr,
):
    """Phase 2: merge the partials of each channel's group, then normalise rows x BLOCK_C channels.

    The partials are ``[N, G, SPLIT, (count, mean, M2)]``: SPLIT row splits of :func:`_gn_partial_stats_kernel`,
    or (``CONV_TILES``) the ``[slots, PARTS]`` entries a conv's epilogue wrote for its TILE_M x TILE_N output tiles
    (``conv2d(..., stats=)``; SPLIT = slots * PARTS), of which an image uses the row tiles its pixels span and a
    group the channel tiles its channels span (the other entries are never written). They are merged BLOCK_S (at
    most 64) at a time, so a large image's many row tiles cost a loop, not registers."""
    grid_dependency_sync(PDL)
    n = tl.program_id(0)
    hw_start = tl.program_id(1) * HW_PER_PROGRAM
    hw_end = tl.minimum(hw_start + HW_PER_PROGRAM, HW)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = offs_c < C
    grp = tl.where(c_mask, offs_c // CG, 0)
    slots = ((n + 1) * HW - 1) // TILE_M - (n * HW) // TILE_M + 1
    parts = ((grp + 1) * CG - 1) // TILE_N - (grp * CG) // TILE_N + 1
    total = tl.zeros([BLOCK_C], dtype=tl.float32)
    mean = tl.zeros([BLOCK_C], dtype=tl.float32)
    m2 = tl.zeros([BLOCK_C], dtype=tl.float32)
    for s0 in range(0, SPLIT, BLOCK_S):  # BLOCK_S entries a step, merged into the running summary (Chan)
        offs_s = s0 + tl.arange(0, BLOCK_S)
        p_mask = c_mask[:, None] & (offs_s < SPLIT)[None, :]
        if CONV_TILES:
            p_mask &= ((offs_s // PARTS) < slots)[None, :] & ((offs_s % PARTS)[None, :] < parts[:, None])
        slot = part_ptr + ((n * G + grp)[:, None] * SPLIT + offs_s[None, :]) * 3
        cnt = tl.load(slot, mask=p_mask, other=0.0)
        means = tl.load(slot + 1, mask=p_mask, other=0.0)
        m2s = tl.load(slot + 2, mask=p_mask, other=0.0)
        c_n = tl.sum(cnt, axis=1)
        c_mean = tl.sum(cnt * means, axis=1) / tl.maximum(c_n, 1.0)
        dev = means - c_mean[:, None]
        c_m2 = tl.sum(m2s + cnt * dev * dev, axis=1)
        both = total + c_n
        delta = c_mean - mean
        frac = c_n / tl.maximum(both, 1.0)  # 0 for a step without entries (and for masked lanes)
        m2 = m2 + c_m2 + delta * delta * total * frac
        mean = mean + delta * frac
        total = both
    rstd = tl.math.rsqrt(m2 / tl.maximum(total, 1.0) + eps)
    scale, shift = _scale_shift(w_ptr, b_ptr, offs_c, c_mask, mean, rstd, HAS_W, HAS_B)
    base = n.to(tl.int64) * HW * C
    x_base = n.to(tl.int64) * stride_xn
    for h0 in range(hw_start, hw_end, BLOCK_HW):
        rows = h0 + tl.arange(0, BLOCK_HW)
        mask = (rows < hw_end)[:, None] & c_mask[None, :]
        offs = base + rows.to(tl.int64)[:, None] * C + offs_c[None, :]
        x_offs = x_base + rows.to(tl.int64)[:, None] * stride_xp + offs_c[None, :]
        tile = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
        _finish_tile(tile, scale, shift, y_ptr, r_ptr, offs, mask, fp8_inv_scale, ACT, HAS_RES)


@dataclass(frozen=True)
class _Plan:
    """How one call runs: design, channel block, groups per block, row tile (and warps per single-pass program:
    0 for one warp per 512 tile elements, at most 8, or ``REGISTER_WARPS`` above ``MAX_REGISTER_TILE``)."""

    design: str
    block_c: int
    groups_per_block: int
    block_hw: int
    in_registers: bool
    num_warps: int = 0


def _channel_block(group_size: int, channels: int, min_lanes: int = 16) -> int:
    """Power-of-two lane count holding whole groups (rows >= 2 * ``min_lanes`` bytes in fp16).

    Several groups share a block (of at most 128 lanes) when that uses >= 75% of the lanes; else one group.
    """
    first = triton.next_power_of_2(max(group_size, min(min_lanes, channels)))
    for block in (first, 2 * first, 4 * first):
        if block > 128:
            break
        if (block // group_size) * group_size >= 0.75 * block:
            return block
    return first


def _plan(
    n: int, channels: int, hw: int, groups: int, device: torch.device, design: Design, lanes: int | None = None
) -> _Plan:
    group_size = channels // groups
    hw_pad = triton.next_power_of_2(hw)
    if lanes is not None and design != "two_phase":  # whole groups of a forced width, in registers if they fit
        groups_per_block = min(groups, lanes // group_size)
        if hw_pad * lanes <= LANES_REGISTER_TILE:
            return _Plan("single_pass", lanes, groups_per_block, hw_pad, True)
        block_hw = min(hw_pad, max(1, STREAM_TILE // lanes))
        return _Plan("single_pass", lanes, groups_per_block, block_hw, False, STREAM_WARPS)
    block_c = _channel_block(group_size, channels, WIDE_LANES)
    groups_per_block = min(groups, block_c // group_size)
    if (
        design != "two_phase" and group_size <= block_c and hw_pad * block_c <= WIDE_REGISTER_TILE
        and n * triton.cdiv(groups, groups_per_block) >= num_sms(device)
    ):  # fmt: skip
        return _Plan("single_pass", block_c, groups_per_block, hw_pad, True)  # wide rows, GPU full
    block_c = _channel_block(group_size, channels)
    if group_size <= block_c and hw_pad * block_c <= MAX_REGISTER_TILE and design != "two_phase":
        return _Plan("single_pass", block_c, min(groups, block_c // group_size), hw_pad, True)
    block_c = min(block_c, 64)
    groups_per_block = max(1, min(groups, block_c // group_size))
    block_hw = min(hw_pad, max(1, STREAM_TILE // block_c))
    blocks = triton.cdiv(groups, groups_per_block)
    if design == "single_pass" or (design == "auto" and n * blocks >= num_sms(device)):
        return _Plan("single_pass", block_c, groups_per_block, block_hw, False)
    return _Plan("two_phase", block_c, groups_per_block, block_hw, False)


def _is_nhwc_rows(t: torch.Tensor) -> bool:
    """Whether ``t`` [N, C, H, W] has unit channel stride and pixel rows ``t.stride(3)`` apart in order (dense
    channels-last, or a channel slice of a wider channels-last tensor): the kernels read such x in place."""
    _, channels, _, w = t.shape
    return t.stride(1) == 1 and t.stride(3) >= channels and t.stride(2) == w * t.stride(3)


def _as_channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def _check_inputs(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str | None,
    residual: torch.Tensor | None,
    out: torch.Tensor | None,
    design: str,
    fp8_scale: float | None = None,
    lanes: int | None = None,
) -> None:
    if x.dim() != 4:
        raise FastdiffError(f"group_norm_act input must be 4-D [N, C, H, W], got shape {tuple(x.shape)}")
    channels = x.shape[1]
    if num_groups < 1 or channels % num_groups != 0:
        raise FastdiffError(f"num_groups={num_groups} must be >= 1 and divide the {channels} channels")
    check_activation(activation)
    if design not in ("auto", "single_pass", "two_phase"):
        raise FastdiffError(f"unknown group_norm_act design {design!r}; expected auto, single_pass or two_phase")
    for name, tensor, shape in (
        ("weight", weight, (channels,)),
        ("bias", bias, (channels,)),
        ("residual", residual, tuple(x.shape)),
        ("out", out, tuple(x.shape)),
    ):
        if tensor is not None and (tuple(tensor.shape) != shape or tensor.device != x.device):
            raise FastdiffError(f"{name} must have shape {shape} on {x.device}, got {tuple(tensor.shape)}")
    out_dtype = FP8_DTYPE if fp8_scale is not None else x.dtype
    if out is not None and (out.dtype != out_dtype or not out.is_contiguous(memory_format=torch.channels_last)):
        raise FastdiffError(f"out must be a channels-last {out_dtype} tensor")
    if fp8_scale is not None and not fp8_scale > 0:
        raise FastdiffError(f"fp8_scale must be > 0, got {fp8_scale}")
    if lanes is not None and (lanes not in LANE_CHOICES or lanes < channels // num_groups):
        raise FastdiffError(
            f"lanes={lanes} must be one of {LANE_CHOICES} and hold a whole group of {channels // num_groups} channels"
        )


def _check_conv_stats(stats: Any, x: torch.Tensor, num_groups: int, design: str, lanes: int | None) -> None:
    n, channels, h, w = x.shape
    if design != "auto" or lanes is not None:
        raise FastdiffError("stats= takes the conv's statistics: design and lanes do not apply")
    if not isinstance(stats, GroupNormPartials) or stats.partials is None or stats.tiles is None:
        raise FastdiffError("stats= needs the GroupNormPartials a conv wrote (conv2d(..., stats=))")
    if stats.groups != num_groups or stats.partials.device != x.device:
        raise FastdiffError(f"stats: {stats.groups} groups on {stats.partials.device}, the norm has {num_groups} on "
                            f"{x.device}")  # fmt: skip
    if stats.tiles[2:] != (h * w, channels) or stats.partials.shape[0] != n:
        raise FastdiffError(
            f"stats are of {stats.partials.shape[0]} samples x {stats.tiles[3]} channels x {stats.tiles[2]} pixels, "
            f"x is {n} x {channels} x {h * w}"
        )


def group_norm_act(
    x: torch.Tensor,
    num_groups: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float = 1e-5,
    *,
    activation: str | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    design: Design = "auto",
    fp8_scale: float | None = None,
    lanes: int | None = None,
    stats: GroupNormPartials | None = None,
) -> torch.Tensor:
    """``activation(group_norm(x) * weight + bias) + residual`` in one (or two) launches, fp32 statistics.
    With ``fp8_scale`` the output is e4m3 ``y / fp8_scale`` (round to nearest even, saturating at 448): the
    input of an fp8 conv (:mod:`fastdiff.kernels.fp8`).

    ``x``: logical ``[N, C, H, W]``, channels-last memory; a channel slice of a wider channels-last tensor
    (``big[:, c0:c1]``, e.g. one part of a zero-copy concat) is read in place; other layouts are copied first.
    ``out``
    (optional) is a channels-last tensor like ``x``. ``design`` forces a design ("auto" picks by size; tests
    use the others). ``lanes`` (one of ``LANE_CHOICES``, at least a group wide) forces the channels one program
    covers, whole groups at a time; None: the size-based plan.

    ``stats`` (a :class:`fastdiff.kernels.common.GroupNormPartials`) takes the statistics
    from the partials that the conv producing ``x`` wrote in its epilogue (``conv2d(..., out=x, stats=stats)``):
    one launch that makes one pass over x, each program first merging its channels' partials (one per row tile of
    the image and channel tile of the group: their number grows with the image). ``design`` and ``lanes`` do not
    apply then.
    """
    _check_inputs(x, num_groups, weight, bias, activation, residual, out, design, fp8_scale, lanes)
    if stats is not None:
        _check_conv_stats(stats, x, num_groups, design, lanes)
    n, channels, h, w = x.shape
    hw = h * w
    if not _is_nhwc_rows(x):
        x = _as_channels_last(x)
    stride_xn, stride_xp = x.stride(0), x.stride(3)
    if residual is not None:
        residual = _as_channels_last(residual)
    if out is None:
        out_dtype = FP8_DTYPE if fp8_scale is not None else x.dtype
        out = torch.empty_like(x, dtype=out_dtype, memory_format=torch.channels_last)
    fp8_inv_scale = 1.0 if fp8_scale is None else 1.0 / fp8_scale
    plan = _plan(n, channels, hw, num_groups, x.device, design, lanes)
    group_size = channels // num_groups
    flags = {
        "ACT": ACTIVATIONS[activation],
        "HAS_RES": residual is not None,
        "HAS_W": weight is not None,
        "HAS_B": bias is not None,
    }
    w_arg = weight if weight is not None else x
    b_arg = bias if bias is not None else x
    r_arg = residual if residual is not None else x
    if stats is not None:
        _apply(x, out, (w_arg, b_arg, r_arg), stats.partials, num_groups, eps, fp8_inv_scale, flags, stats.tiles[:2])
        return out
    blocks = triton.cdiv(num_groups, plan.groups_per_block)
    if plan.design == "single_pass":
        tile = plan.block_hw * plan.block_c
        warps = max(1, min(8, tile // 512)) if tile <= MAX_REGISTER_TILE else REGISTER_WARPS
        _gn_single_pass_kernel[(blocks, n)](
            x, out, w_arg, b_arg, r_arg, hw, channels, stride_xn, stride_xp, eps, fp8_inv_scale,
            CG=group_size, GPB=plan.groups_per_block, BLOCK_HW=plan.block_hw, BLOCK_C=plan.block_c,
            IN_REGISTERS=plan.in_registers, num_warps=plan.num_warps or warps, **flags, **pdl_launch(x.device),
        )  # fmt: skip
        return out
    target = 2 * num_sms(x.device)
    split = min(triton.cdiv(hw, plan.block_hw), triton.cdiv(target, n * blocks), MAX_SPLIT)
    hw_per_split = triton.cdiv(triton.cdiv(hw, split), plan.block_hw) * plan.block_hw
    split = triton.cdiv(hw, hw_per_split)
    partials = torch.empty((n, num_groups, split, 3), device=x.device, dtype=torch.float32)
    _gn_partial_stats_kernel[(n, blocks, split)](
        x, partials, hw, channels, stride_xn, stride_xp, num_groups, hw_per_split, split,
        CG=group_size, GPB=plan.groups_per_block, BLOCK_HW=plan.block_hw, BLOCK_C=plan.block_c, num_warps=4,
        **pdl_launch(x.device),
    )  # fmt: skip
    _apply(x, out, (w_arg, b_arg, r_arg), partials, num_groups, eps, fp8_inv_scale, flags)
    return out


def _apply(
    x: torch.Tensor,
    out: torch.Tensor,
    operands: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    partials: torch.Tensor,
    num_groups: int,
    eps: float,
    fp8_inv_scale: float,
    flags: dict[str, Any],
    conv_tiles: tuple[int, int] | None = None,
) -> None:
    """Launches :func:`_gn_apply_kernel` over ``x`` with ``partials`` [N, G, SPLIT, 3] (``conv_tiles``: the
    (BLOCK_M, BLOCK_N) of the conv that wrote them as [N, G, slots, parts, 3]).

    After the two-phase statistics: tiles of 64 channels, about four programs per SM, each looping over its rows.
    After a conv's: one tile per program, of 1/64 of the tensor (512 to ``STREAM_TILE`` elements), 32 channels
    wide up to 128 channels (64 above), 128 for the largest tiles (fewer, larger programs were slower on the
    H100 at batch 1)."""
    n, channels, h, w = x.shape
    hw = h * w
    split = math.prod(partials.shape[2:-1])
    if conv_tiles is None:
        apply_c = min(64, triton.next_power_of_2(channels))
        apply_hw = max(1, min(triton.next_power_of_2(hw), STREAM_TILE // apply_c))
        programs = triton.cdiv(4 * num_sms(x.device), n * triton.cdiv(channels, apply_c))
    else:
        tile = max(512, min(STREAM_TILE, triton.next_power_of_2(n * hw * channels // 64)))
        wide = 128 if tile == STREAM_TILE else 32 if channels <= 128 else 64
        apply_c = min(wide, triton.next_power_of_2(channels))
        apply_hw = max(1, min(triton.next_power_of_2(hw), tile // apply_c))
        programs = triton.cdiv(hw, apply_hw)
    c_blocks = triton.cdiv(channels, apply_c)
    programs_hw = max(1, min(triton.cdiv(hw, apply_hw), programs))
    hw_per_program = triton.cdiv(triton.cdiv(hw, programs_hw), apply_hw) * apply_hw
    tile_m, tile_n = conv_tiles if conv_tiles is not None else (1, 1)
    _gn_apply_kernel[(n, triton.cdiv(hw, hw_per_program), c_blocks)](
        x, out, *operands, partials, hw, channels, x.stride(0), x.stride(3), num_groups, split, hw_per_program,
        eps, fp8_inv_scale, tile_m, tile_n, partials.shape[-2] if conv_tiles is not None else 1,
        CG=channels // num_groups, BLOCK_HW=apply_hw, BLOCK_C=apply_c, BLOCK_S=min(triton.next_power_of_2(split), 64),
        CONV_TILES=conv_tiles is not None, num_warps=4, **flags, **pdl_launch(x.device),
    )  # fmt: skip


GN_SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "small": (2, 33, 3, 7, 9),
    "cifar10-b1": (1, 128, 32, 32, 32),
    "cifar10-b256": (256, 128, 32, 32, 32),
    "large": (256, 128, 32, 32, 32),
    "sd15-b2": (2, 320, 32, 64, 64),
}
"""size -> (N, C, groups, H, W): a ResnetBlock2D's norm1 + SiLU at the model's largest resolution."""


def group_norm_act_example_inputs(
    size: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """GroupNorm(32) + SiLU of a ResnetBlock2D (small: 33 channels in 3 groups, 7x9), non-trivial affine."""
    if size not in GN_SHAPES:
        raise FastdiffError(f"unknown example size {size!r}; expected one of {', '.join(GN_SHAPES)}")
    n, channels, groups, h, w = GN_SHAPES[size]
    gen = torch.Generator().manual_seed(seed)
    x = channels_last_randn((n, channels, h, w), dtype, device, gen)
    weight = (1.0 + 0.1 * torch.randn(channels, generator=gen)).to(device=device, dtype=dtype)
    bias = (0.1 * torch.randn(channels, generator=gen)).to(device=device, dtype=dtype)
    return (x, groups, weight, bias, 1e-6), {"activation": "silu"}


def group_norm_act_cost(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float]:
    """(FLOPs, bytes) of one call by :func:`fastdiff.kernels.cost_model.group_norm_cost`."""
    x, weight, bias = args[0], args[2], args[3]
    n, channels, h, w = x.shape
    cost = cost_model.group_norm_cost(
        n, channels, h * w, x.element_size(), act=kwargs.get("activation"),
        residual=kwargs.get("residual") is not None, affine=weight is not None or bias is not None,
    )  # fmt: skip
    return cost.flops, cost.bytes


OP = KernelOp(
    name="group_norm_act",
    triton=group_norm_act,
    ref=group_norm_act_ref,
    example_inputs=group_norm_act_example_inputs,
    cost=group_norm_act_cost,
)

__all__ = ["GN_SHAPES", "OP", "group_norm_act", "group_norm_act_ref"]
