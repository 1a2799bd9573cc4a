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

GroupNorm folded into the convs (:class:`FoldedGroupNorm`; a ResnetBlock2D's ``GroupNorm -> SiLU -> conv`` without
the standalone norm pass)::

    conv2d(x, w1, ..., stats=fold)   # producer: after the epilogue, partial statistics of the output
    conv2d(h, w2, ..., norm=fold)    # consumer: conv(act(group_norm(h) * gamma + beta)), normalised on load

* Statistics (producer): per (row tile, image, group) the (count, mean, M2) of the values *as stored* (rounded to
  the output dtype: exactly the tensor the consumer normalises): a corrected two-pass mean / M2 per channel over
  the tile's rows of each image (a row tile may hold rows of several images), then Chan's combination over the
  group's channels in the tile (a group may be narrower than the channel tile, or wider: then its channel tiles
  each write a part). No atomics, no sum of squares: robust when ``|mean| >> std``.
* Finalize (producer, same launch): each tile counts itself in on its images' arrival counters; the last tile of
  an image to arrive merges that image's partials of every group (Chan, in slot order: the result does not depend
  on which tile came last) into ``mean_rstd`` [N, G, 2] fp32 and resets the counter. The consumer reads
  ``mean_rstd`` as it is: a fold costs no launch of its own. With ``FoldedGroupNorm(finish=False)`` there is no
  finalize: the partials are left for ``group_norm_act(y, ..., stats=fold)``, a standalone norm that merges them
  per program and makes one pass over y (the engine's ``-st`` convs, ``engine/epilogue_norm.py``).
* Prologue (consumer): each A element is ``act((x - mean[n, g]) * rstd[n, g] * gamma[c] + beta[c])`` in fp32,
  rounded to the input dtype for the dot; padding taps stay exactly 0 (the reference pads the normalised tensor);
  with ``upsample`` the low-resolution pixel is normalised (nearest upsampling keeps the group statistics).

GroupNorm of the output in the epilogue (:class:`OutputGroupNorm`, ``norm_out=``): where every output tile holds
whole images (``Ho*Wo`` a power of two, at most :data:`NORM_OUT_MAX_PIXELS`; the row tile grows to it) and whole
groups (a power-of-two group width), the tile's (image, group) statistics are complete in registers: the epilogue
stores ``y`` and also ``act(group_norm(y) * gamma + beta)`` (two-pass mean and variance of the values as stored),
so the norm costs no launch and no pass over memory and its consumer reads a plain tensor. It is the small levels'
answer at batch 1 (4x4 to 16x16 images), where a standalone GroupNorm is a 2-3 us launch of a few KB.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels import cost_model
from fastdiff.kernels.common import (
    ACTIVATIONS,
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
from fastdiff.kernels.group_norm_act import merge_stats
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


@dataclass(eq=False)
class FoldedGroupNorm:
    """A GroupNorm (+ activation) folded into the conv that produces its input and the conv that consumes it.

    ``groups``, ``eps``, ``activation`` and the affine ``weight``/``bias`` ([C], both or neither, contiguous, on
    the conv's device; read as fp32) are the norm's. ``conv2d(..., stats=fold)`` fills ``partials`` (fp32 [N, G,
    row-tile slots, channel-tile parts, (count, mean, M2)], laid out by that call's tiles, kept in ``tiles``);
    and, in the same launch, merges them into ``mean_rstd`` (fp32 [N, G, (mean, 1/sqrt(var + eps))]; ``arrivals``
    int32 [N] counts the finished tiles of each image, 0 between calls); ``conv2d(..., norm=fold)`` normalises its
    input with ``mean_rstd``. The buffers are allocated on the first call and reused while the shapes stay the same
    (CUDA-graph safe). :func:`conv2d_ref` with ``stats=fold`` sets ``mean_rstd`` directly (``partials``
    None); so may any other source of the input's statistics.
    """

    groups: int
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    eps: float = 1e-5
    activation: str | None = None
    partials: torch.Tensor | None = field(default=None, init=False, repr=False)
    mean_rstd: torch.Tensor | None = field(default=None, init=False, repr=False)
    arrivals: torch.Tensor | None = field(default=None, init=False, repr=False)
    finish: bool = True
    """Whether the producing conv also merges its partials into ``mean_rstd`` (for a ``norm=fold`` consumer). False:
    it only writes ``partials``, which :func:`fastdiff.kernels.group_norm_act.group_norm_act` (``stats=fold``)
    merges per program while it normalises (the GroupNorm then costs its output pass only, and the conv no serial
    finish on its last tile)."""
    tiles: tuple[int, int, int, int] | None = field(default=None, init=False, repr=False)
    """(BLOCK_M, BLOCK_N, Ho*Wo, Cout) of the conv that wrote ``partials``."""

    def __post_init__(self) -> None:
        check_activation(self.activation)
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise FastdiffError(f"GroupNorm groups must be a positive int, got {self.groups!r}")
        if (self.weight is None) != (self.bias is None):
            raise FastdiffError("GroupNorm weight and bias must be given together (or neither)")
        if self.eps < 0:
            raise FastdiffError(f"GroupNorm eps must be >= 0, got {self.eps}")

    def check_channels(self, channels: int, role: str) -> None:
        """FastdiffError unless the norm fits a tensor of ``channels`` channels (``role``: 'stats' or 'norm')."""
        if channels % self.groups:
            raise FastdiffError(f"{role}: {self.groups} GroupNorm groups do not divide {channels} channels")
        if self.weight is not None and (self.weight.shape != (channels,) or self.bias.shape != (channels,)):
            raise FastdiffError(
                f"{role}: GroupNorm weight/bias shapes {tuple(self.weight.shape)}/{tuple(self.bias.shape)} do not "
                f"fit {channels} channels"
            )


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


def group_stats_ref(y: torch.Tensor, groups: int, eps: float) -> torch.Tensor:
    """``[N, G, 2]``: each (image, group)'s mean and ``1/sqrt(var + eps)`` (biased variance) of ``y`` [N, C, H, W],
    in ``y``'s dtype: what ``F.group_norm`` normalises with."""
    yg = y.reshape(y.shape[0], groups, -1)
    var, mean = torch.var_mean(yg, dim=-1, unbiased=False)
    return torch.stack([mean, torch.rsqrt(var + eps)], dim=-1)


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
    norm: FoldedGroupNorm | None = None,
    stats: FoldedGroupNorm | None = None,
    shortcut: torch.Tensor | None = None,
    shortcut_weight: torch.Tensor | None = None,
    norm_out: OutputGroupNorm | None = None,
) -> torch.Tensor:
    """Plain torch definition of :func:`conv2d`: (``F.group_norm`` + activation of the input,) (nearest
    upsampling,) ``F.conv2d`` (+ the 1x1 ``F.conv2d`` of ``shortcut``), then the epilogue; raw or packed weights.
    With ``stats``, sets ``stats.mean_rstd`` to :func:`group_stats_ref` of the result as stored (in ``out``'s dtype
    when given); with ``norm_out``, writes ``F.group_norm`` + activation of the result as stored to
    ``norm_out.out``."""
    if weight.dim() == 2:
        weight = unpack_conv_weight(weight, x.shape[1])
    conv_sc = None
    if shortcut is not None:
        w_sc = unpack_conv_weight(shortcut_weight, shortcut.shape[1]) if shortcut_weight.dim() == 2 else shortcut_weight
        conv_sc = F.conv2d(shortcut, w_sc)
    if norm is not None:
        affine = [None if t is None else t.to(x.dtype) for t in (norm.weight, norm.bias)]
        x = activation_ref(F.group_norm(x, norm.groups, *affine, norm.eps), norm.activation)
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
    if stats is not None:
        stats.partials, stats.tiles = None, None
        stats.mean_rstd = group_stats_ref(y, stats.groups, stats.eps)
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
def _group_norm_tile(
    a, mask, n_idx, n_first, n_last, offs_k, k_mask, mr_ptr, nw_ptr, nb_ptr, G,
    CG: tl.constexpr, NPT: tl.constexpr, ACT: tl.constexpr, AFFINE: tl.constexpr,
):  # fmt: skip
    """A-tile prologue: input tile ``a`` [rows, channels] -> ``act((a - mean) * rstd * gamma + beta)`` in ``a``'s
    dtype, with the statistics ``mr_ptr[n, c // CG]`` of each row's sample; masked elements (padding) are 0.

    The tile's rows belong to at most NPT samples from ``n_first`` (clamped to ``n_last``): their statistics are
    loaded as channel vectors and selected per row (a 2-D gather would be staged through shared memory).
    """
    g_k = offs_k // CG
    mean = tl.load(mr_ptr + (n_first * G + g_k) * 2, mask=k_mask, other=0.0)[None, :]
    scale = tl.load(mr_ptr + (n_first * G + g_k) * 2 + 1, mask=k_mask, other=0.0)[None, :]
    for s in tl.static_range(1, NPT):
        n_s = tl.minimum(n_first + s, n_last)
        here = (n_idx == n_s)[:, None]
        mean = tl.where(here, tl.load(mr_ptr + (n_s * G + g_k) * 2, mask=k_mask, other=0.0)[None, :], mean)
        scale = tl.where(here, tl.load(mr_ptr + (n_s * G + g_k) * 2 + 1, mask=k_mask, other=0.0)[None, :], scale)
    if AFFINE:
        scale = scale * tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
    y = (a.to(tl.float32) - mean) * scale
    if AFFINE:
        y += tl.load(nb_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)[None, :]
    return apply_activation(tl.where(mask, y, 0.0), ACT).to(a.dtype)  # every activation keeps 0 at 0


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
def _finish_group_stats(
    part_ptr, mr_ptr, arrive_ptr, pid_m, num_pid_n, M, HWo, G, S, P, eps,
    CG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_P2: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """After a tile stored its partials: count it in on each of its images' arrival counters; for an image whose
    last tile this is, merge the image's partials of every group (Chan, in slot order) into ``mr_ptr[n, g]`` =
    (mean, 1/sqrt(var + eps)) and reset the image's counter."""
    row0 = pid_m * BLOCK_M
    n_first = row0 // HWo
    n_last = (tl.minimum(row0 + BLOCK_M, M) - 1) // HWo
    g = tl.arange(0, GROUPS_P2)
    g_ok = g < G
    parts = ((g + 1) * CG - 1) // BLOCK_N - (g * CG) // BLOCK_N + 1  # channel tiles that hold group g
    for n in range(n_first, n_last + 1):
        slots = ((n + 1) * HWo - 1) // BLOCK_M - (n * HWo) // BLOCK_M + 1  # row tiles that hold image n
        if finish_arrival(arrive_ptr, n, slots * num_pid_n):
            run_n = tl.zeros([GROUPS_P2], dtype=tl.float32)
            run_mean = tl.zeros([GROUPS_P2], dtype=tl.float32)
            run_m2 = tl.zeros([GROUPS_P2], dtype=tl.float32)
            base = part_ptr + (n * G + g).to(tl.int64)[:, None] * (S * P * 3)
            for i0 in range(0, slots * P, CHUNK):
                offs = i0 + tl.arange(0, CHUNK)
                ok = g_ok[:, None] & (offs < slots * P)[None, :] & ((offs % P)[None, :] < parts[:, None])
                ptrs = base + offs[None, :] * 3
                cnt = tl.load(ptrs, mask=ok, other=0.0, cache_modifier=".cg")
                means = tl.load(ptrs + 1, mask=ok, other=0.0, cache_modifier=".cg")
                m2s = tl.load(ptrs + 2, mask=ok, other=0.0, cache_modifier=".cg")
                c_n = tl.where(g_ok, tl.sum(cnt, axis=1), 1.0)  # lanes past G: a dummy count, never stored
                c_mean = tl.sum(cnt * means, axis=1) / c_n
                dev = means - c_mean[:, None]
                c_m2 = tl.sum(m2s + cnt * dev * dev, axis=1)
                run_n, run_mean, run_m2 = merge_stats(run_n, run_mean, run_m2, c_n, c_mean, c_m2)
            out = mr_ptr + (n * G + g) * 2
            tl.store(out, run_mean, mask=g_ok)
            tl.store(out + 1, tl.math.rsqrt(run_m2 / run_n + eps), mask=g_ok)
            reset_arrivals(arrive_ptr, n)


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
    mr_ptr,
    nw_ptr,
    nb_ptr,
    part_ptr,
    stats_mr_ptr,
    arrive_ptr,
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
    NORM_G,
    STATS_G,
    STATS_S,
    STATS_P,
    stats_eps,
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
    HAS_NORM: tl.constexpr,
    NORM_CG: tl.constexpr,
    NORM_NPT: tl.constexpr,
    NORM_ACT: tl.constexpr,
    NORM_AFFINE: tl.constexpr,
    HAS_STATS: tl.constexpr,
    STATS_CG: tl.constexpr,
    STATS_GPT: tl.constexpr,
    STATS_GP2: tl.constexpr,
    STATS_CHUNK: tl.constexpr,
    STATS_FINISH: tl.constexpr,
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
    n_first = (pid_m * BLOCK_M) // (Ho * Wo)  # the samples of this row tile: n_first .. at most n_last
    n_last = (M - 1) // (Ho * Wo)

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
        if FLAT_K:  # this step's BLOCK_K weight rows, each its own (tap, channel); no folded norm here
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
            if HAS_NORM:
                a = _group_norm_tile(
                    a, a_mask, n_idx, n_first, n_last, offs_k, k_mask, mr_ptr, nw_ptr, nb_ptr, NORM_G,
                    NORM_CG, NORM_NPT, NORM_ACT, NORM_AFFINE,
                )  # fmt: skip
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
            acc, out_ptr, bias_ptr, temb_ptr, res_ptr, part_ptr, stats_mr_ptr, arrive_ptr, n_idx, oh, ow, offs_n,
            m_mask, n_mask, pid_m, pid_n, num_pid_n, M, Ho, Wo, stride_tn, stride_tc, stride_rn, stride_rc, stride_rh,
            stride_rw, stride_on, stride_oc, stride_oh, stride_ow, out_scale, STATS_G, STATS_S, STATS_P, stats_eps,
            HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE, HAS_STATS, STATS_CG, STATS_GPT, STATS_GP2, STATS_CHUNK,
            STATS_FINISH, BLOCK_M, BLOCK_N,
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
    acc, out_ptr, bias_ptr, temb_ptr, res_ptr, part_ptr, stats_mr_ptr, arrive_ptr, n_idx, oh, ow, offs_n, m_mask,
    n_mask, pid_m, pid_n, num_pid_n, M, Ho, Wo, stride_tn, stride_tc, stride_rn, stride_rc, stride_rh, stride_rw,
    stride_on, stride_oc, stride_oh, stride_ow, out_scale, STATS_G, STATS_S, STATS_P, stats_eps,
    HAS_BIAS: tl.constexpr, HAS_TEMB: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_STATS: tl.constexpr, STATS_CG: tl.constexpr, STATS_GPT: tl.constexpr,
    STATS_GP2: tl.constexpr, STATS_CHUNK: tl.constexpr, STATS_FINISH: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The fused epilogue of a finished accumulator tile, its store and (``HAS_STATS``) its GroupNorm partials,
    (``STATS_FINISH``) merged into the statistics by the last tile of each image; returns the tile as stored (in the
    output dtype)."""
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
        if STATS_FINISH:
            _finish_group_stats(
                part_ptr, stats_mr_ptr, arrive_ptr, pid_m, num_pid_n, M, Ho * Wo, STATS_G, STATS_S, STATS_P,
                stats_eps, STATS_CG, BLOCK_M, BLOCK_N, STATS_GP2, STATS_CHUNK,
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
"""Below this many input channels (and without a folded GroupNorm) the reduction runs over the (tap, channel) rows
of the packed weight in BLOCK_K steps instead of one step per tap: a U-Net's first conv (3 channels, 3x3) takes one
32-deep step instead of nine 16-deep ones of which 13 of 16 columns are padding."""

SPLIT_K_CHOICES = (2, 4, 8, 16)
"""The split-K factors offered to a caller that times them (``split_k_choices``)."""


def split_k_choices(
    n: int,
    cin: int,
    cout: int,
    out_hw: tuple[int, int],
    ksize: int,
    dtype: torch.dtype,
    device: torch.device,
    folded_norm: bool = False,
) -> tuple[int, ...]:
    """The ``split_k`` values worth timing for a conv of this shape: none when its unsplit grid already has two
    programs per SM; otherwise those of :data:`SPLIT_K_CHOICES` that leave every split at least two reduction steps
    and the grid at most eight programs per SM (on the H100 at batch 1 a 32x32 conv of 18 steps in 256 programs
    still gains from 2-4 splits: its time is the latency of the serial reduction, not the SMs' throughput).
    ``folded_norm``: the conv normalises its input on load (``norm=``), which keeps one step per tap."""
    rows = n * out_hw[0] * out_hw[1]
    sms = num_sms(device)
    block_m, block_n, block_k, *_ = _gemm_blocks(rows, cout, cin, dtype, device)
    if triton.cdiv(rows, block_m) * triton.cdiv(cout, block_n) >= 2 * sms:
        return ()
    steps = ksize * ksize * triton.cdiv(cin, block_k)
    if cin < FLAT_K_MAX_CIN and not folded_norm:  # the wrapper's flattened reduction
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


def _reserve_stats(fold: FoldedGroupNorm, partials_shape: tuple[int, ...], device: torch.device) -> None:
    """The producer's buffers of ``fold``: partials of this shape, ``mean_rstd`` [N, G, 2] and zeroed arrival
    counters [N] (kept while the shapes stay: fixed addresses for CUDA graphs)."""
    n, groups = partials_shape[:2]
    if fold.partials is None or fold.partials.shape != partials_shape or fold.partials.device != device:
        fold.partials = torch.empty(partials_shape, device=device, dtype=torch.float32)
    mr = fold.mean_rstd
    if mr is None or mr.shape != (n, groups, 2) or mr.dtype != torch.float32 or mr.device != device:
        fold.mean_rstd = torch.empty((n, groups, 2), device=device, dtype=torch.float32)
    if fold.arrivals is None or fold.arrivals.shape != (n,) or fold.arrivals.device != device:
        fold.arrivals = torch.zeros(n, device=device, dtype=torch.int32)


def _stats_chunk(groups: int, entries: int) -> int:
    """Partials merged per step by the finishing tile: about 4096 (group, entry) pairs a step."""
    return max(1, min(triton.next_power_of_2(entries), 4096 // triton.next_power_of_2(groups)))


def _samples_per_tile(n: int, hw: int, block_m: int) -> int:
    """Most samples the rows of one ``block_m`` row tile can belong to (``hw`` rows per sample)."""
    if hw % block_m == 0:
        return 1
    if block_m % hw == 0:
        return min(n, block_m // hw)
    return min(n, (block_m - 1) // hw + 2)


def _check_fold(fold: Any, role: str, channels: int, device: torch.device) -> None:
    if not isinstance(fold, FoldedGroupNorm):
        raise FastdiffError(f"{role} must be a FoldedGroupNorm, got {type(fold).__name__}")
    fold.check_channels(channels, role)
    if fold.weight is not None and (fold.weight.device != device or fold.bias.device != device):
        raise FastdiffError(f"{role}: GroupNorm weight/bias are on {fold.weight.device} but the input is on {device}")
    if fold.weight is not None and not (fold.weight.is_contiguous() and fold.bias.is_contiguous()):
        raise FastdiffError(f"{role}: GroupNorm weight and bias must be contiguous")


def _check_norm_input(
    norm: FoldedGroupNorm, stats: FoldedGroupNorm | None, n: int, cin: int, device: torch.device
) -> None:
    """FastdiffError unless ``norm`` fits the input and holds statistics of an [n, cin, ...] tensor."""
    _check_fold(norm, "norm", cin, device)
    if norm is stats:
        raise FastdiffError("norm and stats must be different FoldedGroupNorms (the input's and the output's)")
    if norm.mean_rstd is None or not norm.finish:
        raise FastdiffError(
            "norm= needs its input's finished statistics (finish=True): run the conv producing it with stats= first"
        )
    if tuple(norm.mean_rstd.shape[:2]) != (n, norm.groups) or (norm.tiles is not None and norm.tiles[3] != cin):
        channels = norm.tiles[3] if norm.tiles is not None else "?"
        raise FastdiffError(
            f"norm: its statistics are of {norm.mean_rstd.shape[0]} samples x {channels} channels in "
            f"{norm.mean_rstd.shape[1]} groups, the input has {n} x {cin} in {norm.groups}"
        )


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of device memory that ``t``'s elements may occupy."""
    reach = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True) if size > 0)
    return t.data_ptr(), t.data_ptr() + (reach + 1) * t.element_size()


def _check_norm_out(
    norm_out: OutputGroupNorm,
    folded: bool,
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
    if folded:
        raise FastdiffError("norm_out does not combine with a folded GroupNorm (norm= / stats=)")
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
    norm: FoldedGroupNorm | None = None,
    stats: FoldedGroupNorm | None = None,
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

    GroupNorm folding (module docstring): ``norm=fold`` convolves ``act(group_norm(x))`` instead of ``x``, with
    the statistics a ``stats=fold`` conv wrote for ``x``; ``stats=fold`` writes the statistics of this conv's
    output (as stored) for the ``norm=fold`` conv that consumes it, finished in the same launch (or, with
    ``stats.finish`` False, left as partials for ``group_norm_act(..., stats=stats)``). ``norm_out``
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
    if norm is not None:
        _check_norm_input(norm, stats, n, cin, x.device)
    if stats is not None:
        _check_fold(stats, "stats", cout, x.device)
    if norm_out is not None:
        folded = norm is not None or stats is not None
        _check_norm_out(norm_out, folded, n, cout, (ho, wo), x.device, (x, residual, shortcut, out))
    mean_rstd = None
    if norm is not None:
        mean_rstd = norm.mean_rstd.to(device=x.device, dtype=torch.float32).contiguous()
    if out is None:
        out = torch.empty((n, cout, ho, wo), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    rows = n * ho * wo
    block_m, block_n, block_k, num_warps, num_stages = _gemm_blocks(rows, cout, cin, x.dtype, x.device, split_k)
    flat_k = cin < FLAT_K_MAX_CIN and norm is None
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
        workspace.reserve(split_k * tiles * block_m * block_n, tiles, x.device)
    stats_layout = (0, 0, 1)
    if stats is not None:
        stats_layout = _stats_layout(n, ho * wo, cout, stats.groups, block_m, block_n)
        _reserve_stats(stats, (n, stats.groups, *stats_layout[:2], 3), x.device)
        stats.tiles = (block_m, block_n, ho * wo, cout)
    temb = time_emb if time_emb is not None else out
    res = residual if residual is not None else out
    grid = (tiles, split_k)
    temb_strides = time_emb.stride() if time_emb is not None else (0, 0)
    norm_affine = norm is not None and norm.weight is not None
    on = norm_out.out if norm_out is not None else out
    on_affine = norm_out is not None and norm_out.weight is not None
    on_width = cout // norm_out.groups if norm_out is not None else 1
    _conv2d_kernel[grid](
        x, weight, bias if bias is not None else out, temb, res, out,
        mean_rstd if norm is not None else out, norm.weight if norm_affine else out, norm.bias if norm_affine else out,
        *((stats.partials, stats.mean_rstd, stats.arrivals) if stats is not None else (out, out, out)),
        workspace.partials if split_k > 1 else out, workspace.counters if split_k > 1 else out,
        shortcut if shortcut is not None else out, shortcut_weight if shortcut is not None else out,
        on, norm_out.weight if on_affine else out, norm_out.bias if on_affine else out,
        rows, h, w, cin, cin_sc, ho, wo, cout,
        *x.stride(), *temb_strides, *res.stride(), *out.stride(), *(shortcut if shortcut is not None else out).stride(),
        *on.stride(), float(norm_out.eps) if norm_out is not None else 0.0,
        1.0 if out_scale is None else float(out_scale),
        norm.groups if norm is not None else 1, stats.groups if stats is not None else 1, *stats_layout[:2],
        float(stats.eps) if stats is not None else 0.0,
        STRIDE=stride, PAD=pad, KSIZE=ksize, UP=upsample,
        HAS_BIAS=bias is not None, HAS_TEMB=time_emb is not None, HAS_RES=residual is not None,
        ACT=ACTIVATIONS[activation], HAS_SCALE=out_scale is not None, HAS_SHORTCUT=shortcut is not None,
        FLAT_K=flat_k, HAS_NORM=norm is not None, NORM_CG=cin // norm.groups if norm is not None else 1,
        NORM_NPT=_samples_per_tile(n, ho * wo, block_m) if norm is not None else 1,
        NORM_ACT=ACTIVATIONS[norm.activation] if norm is not None else 0, NORM_AFFINE=norm_affine,
        HAS_STATS=stats is not None, STATS_CG=cout // stats.groups if stats is not None else 1,
        STATS_GPT=stats_layout[2], STATS_GP2=triton.next_power_of_2(stats.groups) if stats is not None else 1,
        STATS_CHUNK=_stats_chunk(stats.groups, stats_layout[0] * stats_layout[1]) if stats is not None else 1,
        STATS_FINISH=stats is not None and stats.finish,
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
    resolution, the output at the (upsampled) conv's, the epilogue operands that are given, a folded GroupNorm's
    prologue (``norm``) and statistics (``stats``)."""
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    n, cin, h, w = x.shape
    taps = weight.shape[0] // cin if weight.dim() == 2 else weight.shape[2] * weight.shape[3]
    cout = weight.shape[1] if weight.dim() == 2 else weight.shape[0]
    ksize = round(taps**0.5)
    stride, upsample = kwargs.get("stride", 1), kwargs.get("upsample", 1)
    pads = sum(padding_pair(kwargs.get("padding", 0)))
    norm, stats = kwargs.get("norm"), kwargs.get("stats")
    ho = (h * upsample + pads - ksize) // stride + 1
    wo = (w * upsample + pads - ksize) // stride + 1
    cost = cost_model.conv2d_cost(
        n, cin, cout, ho, wo, ksize, 1, x.element_size(), h, w, bias=bias is not None,
        residual=kwargs.get("residual") is not None, temb=kwargs.get("time_emb") is not None,
        act=kwargs.get("activation"), scale=kwargs.get("out_scale") is not None,
        norm_groups=norm.groups if norm is not None else 0, norm_act=norm.activation if norm is not None else None,
        norm_affine=norm is not None and norm.weight is not None,
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
