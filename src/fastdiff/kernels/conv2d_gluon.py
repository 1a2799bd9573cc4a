"""Stride-1 convolution in Gluon (Triton's explicit-layout dialect) on Hopper: the TMA conv of :mod:`conv2d_tma`
with the A tile fed to the tensor cores from shared memory.

Same op and definition as :func:`fastdiff.kernels.conv2d.conv2d_ref`, the same packed weights ``[K*K*Cin, Cout]``, the
same output boxes (:func:`fastdiff.kernels.conv2d_tma.box_tile`), the same order of fp32 accumulation (tap, then
channel chunk, 16 deep per instruction), so its results equal :func:`conv2d_tma`'s bit for bit. What differs is the
code around the tensor cores:

* Triton's ``tl.dot`` of the TMA conv reshapes the 4-D input box ``[TN, TH, TW, BLOCK_K]`` into the 2-D A operand in
  registers (the reshape is a register-layout change to Triton), so every step copies A from shared memory into
  registers before its wgmma. Here the box's shared memory is reinterpreted as the ``[BLOCK_M, BLOCK_K]`` operand
  (the 128-byte swizzle of a box is that of its rows stacked), and both operands go to wgmma from shared memory.
* The pipeline is written out: ``STAGES`` buffers, one mbarrier each, the TMA loads of step ``k + STAGES - 1``
  issued once the wgmma of step ``k - 1`` has retired (``warpgroup_mma_wait(1)``).
* ``persistent``: ``programs_per_sm`` programs per SM loop over the tiles, the loads of a tile's first steps issued
  while the previous tile's epilogue runs.
* ``shortcut``: a ResnetBlock2D's 1x1 conv_shortcut summed in, its channel chunks further steps of the same
  pipeline after the taps (the shortcut's output is never written nor read back as the residual). Triton's
  ``conv2d_tma`` cannot do this safely: a second pipelined loop into the same accumulator raced on Triton 3.6
  (CONTRIBUTING); here one hand-written pipeline runs both.

The epilogue is bias, time embedding, residual and scale (``(acc + bias + temb + residual) * out_scale``, the order of
:func:`fastdiff.kernels.conv2d.fused_epilogue` without an activation); convs with an activation, Upsample2D, fp32 and
fp8 stay with the other kernels (:func:`gluon_conv_unsupported`). Gluon kernels do not run in Triton's CPU
interpreter: the tests of this module run on the GPU. Unlike the package's Triton kernels it has no
``grid_dependency_sync``, so it launches in plain stream order (no programmatic dependent launch): it waits for every
kernel before it, and the next kernel's sync waits for it to finish. Measured against the TMA conv on the H100 at
ddpm-cifar10 batch 256: see docs/engine/gluon-conv.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from fastdiff.errors import FastdiffError
from fastdiff.kernels.common import num_sms
from fastdiff.kernels.conv2d import _check_shortcut, _packed_kernel_size, check_epilogue_args, pack_conv_weight
from fastdiff.kernels.conv2d_tma import box_tile, tma_conv_unsupported


@dataclass(frozen=True)
class GluonConfig:
    """Tile and pipeline of one :func:`conv2d_gluon` call; ``programs_per_sm`` > 0 makes the grid persistent."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 3
    num_warps: int = 4
    programs_per_sm: int = 0


@gluon.jit
def _tile_origin(t, num_pid_n, tiles_w, tiles_h, TN: gl.constexpr, TH: gl.constexpr, TW: gl.constexpr,
                 BLOCK_N: gl.constexpr):  # fmt: skip
    """(n0, h0, w0, first output channel) of tile ``t``; output-channel tiles vary fastest (A reuse in L2)."""
    pid_n = t % num_pid_n
    box = t // num_pid_n
    n0 = (box // (tiles_w * tiles_h)) * TN
    h0 = ((box // tiles_w) % tiles_h) * TH
    w0 = (box % tiles_w) * TW
    return n0, h0, w0, pid_n * BLOCK_N


@gluon.jit
def _load_tap(x_desc, w_desc, a_buf, b_buf, bar, step, n0, h0, w0, off_n, Cin, k_chunks,
              KSIZE: gl.constexpr, PAD: gl.constexpr, BLOCK_K: gl.constexpr):  # fmt: skip
    tap = step // k_chunks
    c0 = (step - tap * k_chunks) * BLOCK_K
    tma.async_copy_global_to_shared(x_desc, [n0, h0 + tap // KSIZE - PAD, w0 + tap % KSIZE - PAD, c0], bar, a_buf)
    tma.async_copy_global_to_shared(w_desc, [tap * Cin + c0, off_n], bar, b_buf)


@gluon.jit
def _load_step(x_desc, w_desc, sc_desc, wsc_desc, a_buf, b_buf, bar, step, n0, h0, w0, off_n, Cin, k_chunks,
               tap_steps, KSIZE: gl.constexpr, PAD: gl.constexpr, BLOCK_K: gl.constexpr,
               HAS_SC: gl.constexpr):  # fmt: skip
    """TMA loads of reduction step ``step`` into one stage: a (tap, channel chunk) of the conv, out-of-image taps
    loading zeros; with HAS_SC, steps from ``tap_steps`` on are channel chunks of the 1x1 shortcut, whose input box
    is the output tile itself (same box and block shapes: the same stage buffers and byte count)."""
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    if HAS_SC:
        if step < tap_steps:
            _load_tap(x_desc, w_desc, a_buf, b_buf, bar, step, n0, h0, w0, off_n, Cin, k_chunks, KSIZE, PAD,
                      BLOCK_K)  # fmt: skip
        else:
            c0 = (step - tap_steps) * BLOCK_K
            tma.async_copy_global_to_shared(sc_desc, [n0, h0, w0, c0], bar, a_buf)
            tma.async_copy_global_to_shared(wsc_desc, [c0, off_n], bar, b_buf)
    else:
        _load_tap(x_desc, w_desc, a_buf, b_buf, bar, step, n0, h0, w0, off_n, Cin, k_chunks, KSIZE, PAD, BLOCK_K)


@gluon.jit
def _epilogue(acc, n0, h0, w0, off_n, bias_ptr, temb_ptr, res_ptr, out_ptr, N, Ho, Wo, Cout,
              stride_tn, stride_tc, stride_rn, stride_rc, stride_rh, stride_rw, stride_on, stride_oc, stride_oh,
              stride_ow, out_scale,
              HAS_BIAS: gl.constexpr, HAS_TEMB: gl.constexpr, HAS_RES: gl.constexpr, HAS_SCALE: gl.constexpr,
              TH: gl.constexpr, TW: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              num_warps: gl.constexpr):  # fmt: skip
    """(acc + bias + temb + residual) * out_scale, stored in 16-byte runs of output channels."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    y = gl.convert_layout(acc, layout)
    r = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    n_idx = n0 + r // (TH * TW)
    oh = h0 + (r // TW) % TH
    ow = w0 + r % TW
    c_mask = cols < Cout
    mask = ((n_idx < N) & (oh < Ho) & (ow < Wo))[:, None] & c_mask[None, :]
    n64 = n_idx.to(gl.int64)
    if HAS_BIAS:
        y = y + gl.load(bias_ptr + cols, mask=c_mask, other=0.0).to(gl.float32)[None, :]
    if HAS_TEMB:
        temb = temb_ptr + n64[:, None] * stride_tn + cols[None, :] * stride_tc
        y = y + gl.load(temb, mask=mask, other=0.0).to(gl.float32)
    if HAS_RES:
        rows = n64 * stride_rn + oh * stride_rh + ow * stride_rw
        y = y + gl.load(res_ptr + rows[:, None] + cols[None, :] * stride_rc, mask=mask, other=0.0).to(gl.float32)
    if HAS_SCALE:
        y = y * out_scale
    rows = n64 * stride_on + oh * stride_oh + ow * stride_ow
    gl.store(out_ptr + rows[:, None] + cols[None, :] * stride_oc, y.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _conv2d_gluon_kernel(
    x_desc, w_desc, sc_desc, wsc_desc, bias_ptr, temb_ptr, res_ptr, out_ptr,
    N, Cin, Cin_sc, Ho, Wo, Cout,
    stride_tn, stride_tc, stride_rn, stride_rc, stride_rh, stride_rw, stride_on, stride_oc, stride_oh, stride_ow,
    out_scale,
    PAD: gl.constexpr, KSIZE: gl.constexpr,
    HAS_BIAS: gl.constexpr, HAS_TEMB: gl.constexpr, HAS_RES: gl.constexpr, HAS_SCALE: gl.constexpr,
    HAS_SC: gl.constexpr, TN: gl.constexpr, TH: gl.constexpr, TW: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr, PERSISTENT: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    """Program ``pid`` runs tiles ``pid, pid + programs, ...`` (one tile without PERSISTENT); the reduction steps
    of all its tiles form one pipeline, numbered ``g`` (tile ``g // steps``, step ``g % steps``)."""
    BLOCK_M: gl.constexpr = TN * TH * TW
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    num_pid_n = gl.cdiv(Cout, BLOCK_N)
    tiles_w = gl.cdiv(Wo, TW)
    tiles_h = gl.cdiv(Ho, TH)
    my_tiles = 1
    if PERSISTENT:
        my_tiles = gl.cdiv(gl.cdiv(N, TN) * tiles_h * tiles_w * num_pid_n - pid, programs)
    k_chunks = gl.cdiv(Cin, BLOCK_K)
    tap_steps = KSIZE * KSIZE * k_chunks
    steps = tap_steps
    if HAS_SC:  # the reduction runs on over the shortcut's channel chunks
        steps += gl.cdiv(Cin_sc, BLOCK_K)
    total = my_tiles * steps

    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, TN, TH, TW, BLOCK_K], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_K, BLOCK_N], w_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    for i in gl.static_range(STAGES - 1):  # the pipeline's first loads
        if i < total:
            n0, h0, w0, off_n = _tile_origin(pid + (i // steps) * programs, num_pid_n, tiles_w, tiles_h, TN, TH, TW,
                                             BLOCK_N)  # fmt: skip
            _load_step(x_desc, w_desc, sc_desc, wsc_desc, a_bufs.index(i), b_bufs.index(i), bars.index(i), i % steps,
                       n0, h0, w0, off_n, Cin, k_chunks, tap_steps, KSIZE, PAD, BLOCK_K, HAS_SC)  # fmt: skip

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BLOCK_N, 16])  # fmt: skip
    a_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=mma)
    for g in range(total):
        k = g % steps
        s = g % STAGES
        mbarrier.wait(bars.index(s), (g // STAGES) & 1)
        a = a_bufs.index(s)._reinterpret(x_desc.dtype, [BLOCK_M, BLOCK_K], a_layout)  # the box's rows, stacked
        acc = warpgroup_mma(a, b_bufs.index(s), acc, use_acc=k != 0, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # step g - 1 retired: its stage is free
        ahead = g + STAGES - 1
        if ahead < total:
            n1, h1, w1, off1 = _tile_origin(pid + (ahead // steps) * programs, num_pid_n, tiles_w, tiles_h, TN, TH,
                                            TW, BLOCK_N)  # fmt: skip
            _load_step(x_desc, w_desc, sc_desc, wsc_desc, a_bufs.index(ahead % STAGES), b_bufs.index(ahead % STAGES),
                       bars.index(ahead % STAGES), ahead % steps, n1, h1, w1, off1, Cin, k_chunks, tap_steps, KSIZE,
                       PAD, BLOCK_K, HAS_SC)  # fmt: skip
        if k == steps - 1:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            n0, h0, w0, off_n = _tile_origin(pid + (g // steps) * programs, num_pid_n, tiles_w, tiles_h, TN, TH, TW,
                                             BLOCK_N)  # fmt: skip
            _epilogue(acc, n0, h0, w0, off_n, bias_ptr, temb_ptr, res_ptr, out_ptr, N, Ho, Wo, Cout,
                      stride_tn, stride_tc, stride_rn, stride_rc, stride_rh, stride_rw, stride_on, stride_oc,
                      stride_oh, stride_ow, out_scale,
                      HAS_BIAS, HAS_TEMB, HAS_RES, HAS_SCALE, TH, TW, BLOCK_M, BLOCK_N, num_warps)  # fmt: skip
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))


def gluon_conv_unsupported(
    x: torch.Tensor, cout: int, ksize: int, *, stride: int = 1, padding: int = 0, activation: str | None = None
) -> str | None:
    """Why :func:`conv2d_gluon` cannot run this conv, or None (the TMA conv's domain, fp16/bf16, no activation,
    no upsampling)."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {x.dtype}: the Gluon conv is fp16/bf16"
    if activation is not None:
        return "no activation in the Gluon conv's epilogue"
    return tma_conv_unsupported(x, cout, ksize, stride=stride, padding=padding)


def default_gluon_config(n: int, ho: int, wo: int, cout: int, device: torch.device) -> GluonConfig:
    """128 x 128 tiles, three stages (96 KB of shared memory: two programs fit an SM), down to 64 rows and 64
    channels where the grid would leave SMs idle (the 4x4 level at batch 256). Never narrower than 64 channels: the
    tiles' 128-byte swizzle needs 128-byte rows (Triton 3.6 aborts the compile otherwise); a narrower output is a
    zero-filled part of the box."""
    block_n = min(128, max(64, triton.next_power_of_2(cout)))
    if triton.cdiv(n * ho * wo, 128) * triton.cdiv(cout, block_n) >= num_sms(device):
        return GluonConfig(128, block_n)
    return GluonConfig(64, min(block_n, 64))


def conv2d_gluon(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    padding: int = 0,
    time_emb: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    out_scale: float | None = None,
    out: torch.Tensor | None = None,
    config: GluonConfig | None = None,
    shortcut: torch.Tensor | None = None,
    shortcut_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fastdiff.kernels.conv2d.conv2d` for stride-1 fp16/bf16 convs without an activation (module docstring).

    ``weight``: packed ``[K*K*Cin, Cout]`` (:func:`pack_conv_weight`) or raw ``[Cout, Cin, K, K]``. ``config``
    (default :func:`default_gluon_config`) picks the tiles, stages and grid. ``shortcut`` ([N, Cin_sc, Ho, Wo]) with
    ``shortcut_weight`` (raw [Cout, Cin_sc, 1, 1] or packed [Cin_sc, Cout]) adds the 1x1 conv of ``shortcut``, as
    :func:`fastdiff.kernels.conv2d.conv2d` does: its channel chunks are further steps of the same pipeline (a
    ResnetBlock2D's ``conv2(h) + conv_shortcut(x)`` in one launch; the caller sums the two biases into ``bias``)."""
    if x.dim() != 4:
        raise FastdiffError(f"conv2d input must be 4-D [N, C, H, W], got shape {tuple(x.shape)}")
    n, cin, h, w = x.shape
    if weight.dim() == 4:
        weight = pack_conv_weight(weight)
    cout = weight.shape[1]
    ksize = _packed_kernel_size(weight, cin)
    reason = gluon_conv_unsupported(x, cout, ksize, padding=padding)
    if reason is not None:
        raise FastdiffError(f"conv2d_gluon: {reason}")
    if weight.dtype != x.dtype or weight.device != x.device:
        raise FastdiffError(f"weight ({weight.dtype}, {weight.device}) must match input ({x.dtype}, {x.device})")
    ho, wo = h + 2 * padding - ksize + 1, w + 2 * padding - ksize + 1
    if padding < 0 or ho < 1 or wo < 1:
        raise FastdiffError(f"conv output would be empty for input {h}x{w}, kernel {ksize}, padding {padding}")
    check_epilogue_args(n, cout, (ho, wo), x.device, bias, time_emb, residual, None, out)
    if shortcut is not None or shortcut_weight is not None:
        shortcut_weight = _check_shortcut(shortcut, shortcut_weight, x, n, cout, (ho, wo))
        reason = tma_conv_unsupported(shortcut, cout, 1)
        if reason is not None:
            raise FastdiffError(f"conv2d_gluon: shortcut: {reason}")
    if out is None:
        out = torch.empty((n, cout, ho, wo), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    config = config or default_gluon_config(n, ho, wo, cout, x.device)
    if config.block_n < 64 or config.block_k * x.element_size() != 128:
        raise FastdiffError(
            f"conv2d_gluon: tiles of {config.block_n} channels and {config.block_k}-deep steps; the 128-byte swizzle "
            "needs at least 64 channels and 128-byte steps (64 deep in fp16/bf16)"
        )
    _launch(x, weight.contiguous(), bias, time_emb, residual, out, out_scale, padding, ksize, config, shortcut,
            shortcut_weight)  # fmt: skip
    return out


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    time_emb: torch.Tensor | None,
    residual: torch.Tensor | None,
    out: torch.Tensor,
    out_scale: float | None,
    padding: int,
    ksize: int,
    config: GluonConfig,
    shortcut: torch.Tensor | None,
    shortcut_weight: torch.Tensor | None,
) -> None:
    n, cin, h, w = x.shape
    cout = weight.shape[1]
    ho, wo = out.shape[2:]
    tn, th, tw = box_tile(config.block_m, n, ho, wo)
    x_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    w_layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    x_desc = TensorDescriptor(x, [n, h, w, cin], [x.stride(0), x.stride(2), x.stride(3), 1],
                              [tn, th, tw, config.block_k], x_layout)  # fmt: skip
    w_desc = TensorDescriptor(weight, list(weight.shape), [cout, 1], [config.block_k, config.block_n], w_layout)
    sc_desc, wsc_desc, cin_sc = x_desc, w_desc, 0
    if shortcut is not None:
        cin_sc = shortcut.shape[1]
        sc_strides = [shortcut.stride(0), shortcut.stride(2), shortcut.stride(3), 1]
        sc_desc = TensorDescriptor(shortcut, [n, ho, wo, cin_sc], sc_strides, [tn, th, tw, config.block_k], x_layout)
        wsc_desc = TensorDescriptor(shortcut_weight, [cin_sc, cout], [cout, 1], [config.block_k, config.block_n],
                                    w_layout)  # fmt: skip
    tiles = triton.cdiv(n, tn) * triton.cdiv(ho, th) * triton.cdiv(wo, tw) * triton.cdiv(cout, config.block_n)
    programs = tiles if not config.programs_per_sm else min(tiles, config.programs_per_sm * num_sms(x.device))
    res = residual if residual is not None else out
    temb = time_emb if time_emb is not None else out
    _conv2d_gluon_kernel[(programs,)](
        x_desc, w_desc, sc_desc, wsc_desc, bias if bias is not None else out, temb, res, out, n, cin, cin_sc, ho, wo,
        cout,
        *(temb.stride() if time_emb is not None else (0, 0)), res.stride(0), res.stride(1), res.stride(2),
        res.stride(3), *out.stride(),
        1.0 if out_scale is None else float(out_scale),
        PAD=padding, KSIZE=ksize, HAS_BIAS=bias is not None, HAS_TEMB=time_emb is not None,
        HAS_RES=residual is not None, HAS_SCALE=out_scale is not None, HAS_SC=shortcut is not None, TN=tn, TH=th, TW=tw,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, STAGES=config.stages,
        PERSISTENT=config.programs_per_sm > 0, num_warps=config.num_warps,
    )  # fmt: skip


__all__ = ["GluonConfig", "conv2d_gluon", "default_gluon_config", "gluon_conv_unsupported"]
