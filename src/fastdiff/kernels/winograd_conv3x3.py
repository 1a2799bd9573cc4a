"""Winograd F(4x4, 3x3) convolution: 3x3 kernel, stride 1, padding 1, with the conv2d fused epilogue.

Layout: activations are logical ``[N, C, H, W]`` torch tensors, channels-last in memory (NHWC) for speed; the
kernels read through strides, so other layouts are correct but slower. The output is allocated channels-last.

Each 4x4 output tile reads a 6x6 input tile ``d`` (starting one pixel up-left, zero padded) and computes
``Y = A^T [ (G g G^T) (.) (B^T d B) ] A``. Three Triton launches:

1. input transform: ``V[k, t, cin] = (B^T d_t B)[k]`` for the 36 positions ``k`` of every tile ``t``
   (computed in fp32, stored in ``U``'s dtype, fp16 by default for 16-bit inputs: the GEMM runs on the tensor
   cores);
2. 36 batched GEMMs with ``tl.dot``: ``M[k] = V[k] @ U[k]``, ``[T, Cin] @ [Cin, Cout]``, fp32 accumulate
   and store;
3. output transform ``A^T M A`` plus the epilogue of :mod:`fastdiff.kernels.conv2d`, in the same order:
   ``((act(y + bias[c] + time_emb[n, c]) + residual) * out_scale``.

``U = G g G^T`` (:func:`winograd_transform_weight`, ``[36, Cin, Cout]``) is computed once at load.
The transforms cost accuracy: with 16-bit operands ``V`` and ``U`` are rounded after the transform and the
output transform amplifies the rounding (coefficients up to 8 per axis); :func:`winograd_error_vs_direct`
measures it against the implicit-GEMM conv (CPU emulation, unit-variance data: fp16 about 3e-3 vs 2e-4; bf16
with bf16 operands 2.5e-2, hence fp16 operands for bf16 too, 3.5e-3). ``|V| <= 100 max|x|``, so fp16 ``V``
overflows to inf once activations exceed about 650 in magnitude; use fp32 ``U`` (or the implicit-GEMM conv2d)
for such layers.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels import cost_model
from fastdiff.kernels.common import ACTIVATIONS, channels_last_randn, grid_dependency_sync, pdl_launch
from fastdiff.kernels.conv2d import (
    _gemm_blocks,
    check_epilogue_args,
    conv2d,
    conv2d_ref,
    conv_shape,
    fused_epilogue,
)
from fastdiff.kernels.registry import KernelOp

TILE = 4
"""Output tile edge; the input tile edge is TILE + 2 = 6, giving 36 transform positions."""

G_MATRIX = (
    (1 / 4, 0.0, 0.0),
    (-1 / 6, -1 / 6, -1 / 6),
    (-1 / 6, 1 / 6, -1 / 6),
    (1 / 24, 1 / 12, 1 / 6),
    (1 / 24, -1 / 12, 1 / 6),
    (0.0, 0.0, 1.0),
)
"""The F(4, 3) weight transform G (6x3); B^T and A^T are written out in the kernels below."""


def winograd_gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """Default dtype of ``U`` and ``V`` (the GEMM operands) for activations of ``dtype``.

    fp16 for both 16-bit types: with bf16 operands the transforms' rounding gives a relative error near
    2.5e-2, with fp16 operands about 3.5e-3 (fp16's range then bounds the activations to about 650, see the
    module doc).
    """
    return torch.float16 if dtype == torch.bfloat16 else dtype


def winograd_transform_weight(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch 3x3 conv weight ``[Cout, Cin, 3, 3]`` -> ``U = G g G^T`` as contiguous ``[36, Cin, Cout]``.

    Computed in float64 and rounded once to ``dtype`` (default: :func:`winograd_gemm_dtype` of the weight's
    dtype), which is the dtype the GEMM runs in; do this at model load.
    """
    if weight.dim() != 4 or weight.shape[2:] != (3, 3):
        raise FastdiffError(f"winograd weight must be [Cout, Cin, 3, 3], got shape {tuple(weight.shape)}")
    g_mat = torch.tensor(G_MATRIX, dtype=torch.float64, device=weight.device)
    u = torch.einsum("ai,ocij,bj->abco", g_mat, weight.to(torch.float64), g_mat)
    target = winograd_gemm_dtype(weight.dtype) if dtype is None else dtype
    return u.reshape(36, weight.shape[1], weight.shape[0]).to(target).contiguous()


def winograd_restore_weight(weight_transformed: torch.Tensor) -> torch.Tensor:
    """Least-squares inverse of :func:`winograd_transform_weight`: ``[36, Cin, Cout]`` -> float64 g."""
    if weight_transformed.dim() != 3 or weight_transformed.shape[0] != 36:
        raise FastdiffError(
            f"transformed winograd weight must be [36, Cin, Cout], got {tuple(weight_transformed.shape)}"
        )
    g_pinv = torch.linalg.pinv(torch.tensor(G_MATRIX, dtype=torch.float64, device=weight_transformed.device))
    u = weight_transformed.to(torch.float64).reshape(6, 6, *weight_transformed.shape[1:])
    return torch.einsum("ia,abco,jb->ocij", g_pinv, u, g_pinv).contiguous()


def winograd_conv3x3_ref(
    x: torch.Tensor,
    weight_transformed: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    time_emb: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    out_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch definition: the direct 3x3 conv (padding 1) with the weight recovered from ``U``."""
    return conv2d_ref(
        x, winograd_restore_weight(weight_transformed).to(x.dtype), bias, padding=1, time_emb=time_emb,
        residual=residual, activation=activation, out_scale=out_scale, out=out,
    )  # fmt: skip


@triton.jit
def _bt6(d0, d1, d2, d3, d4, d5):
    """B^T @ d for one 6-vector."""
    r0 = 4.0 * d0 - 5.0 * d2 + d4
    r1 = -4.0 * (d1 + d2) + d3 + d4
    r2 = 4.0 * (d1 - d2) - d3 + d4
    r3 = 2.0 * (d3 - d1) - d2 + d4
    r4 = 2.0 * (d1 - d3) - d2 + d4
    r5 = 4.0 * d1 - 5.0 * d3 + d5
    return r0, r1, r2, r3, r4, r5


@triton.jit
def _at6(m0, m1, m2, m3, m4, m5):
    """A^T @ m for one 6-vector (4 results)."""
    sum12 = m1 + m2
    dif12 = m1 - m2
    sum34 = m3 + m4
    dif34 = m3 - m4
    return m0 + sum12 + sum34, dif12 + 2.0 * dif34, sum12 + 4.0 * sum34, dif12 + 8.0 * dif34 + m5


@triton.jit
def _input_row(x_rows, x_cols, tc_mask, ih, iw0, H, W, stride_xh, stride_xw):
    """Load input row ``ih`` of the 6x6 tiles (columns iw0..iw0+5) and transform it along the columns."""
    row_ok = tc_mask & ((ih >= 0) & (ih < H))[:, None]
    row = x_rows + (ih * stride_xh)[:, None] + x_cols
    iw1 = iw0 + 1
    iw2 = iw0 + 2
    iw3 = iw0 + 3
    iw4 = iw0 + 4
    iw5 = iw0 + 5
    d0 = tl.load(row + (iw0 * stride_xw)[:, None], mask=row_ok & ((iw0 >= 0) & (iw0 < W))[:, None], other=0.0)
    d1 = tl.load(row + (iw1 * stride_xw)[:, None], mask=row_ok & ((iw1 >= 0) & (iw1 < W))[:, None], other=0.0)
    d2 = tl.load(row + (iw2 * stride_xw)[:, None], mask=row_ok & ((iw2 >= 0) & (iw2 < W))[:, None], other=0.0)
    d3 = tl.load(row + (iw3 * stride_xw)[:, None], mask=row_ok & ((iw3 >= 0) & (iw3 < W))[:, None], other=0.0)
    d4 = tl.load(row + (iw4 * stride_xw)[:, None], mask=row_ok & ((iw4 >= 0) & (iw4 < W))[:, None], other=0.0)
    d5 = tl.load(row + (iw5 * stride_xw)[:, None], mask=row_ok & ((iw5 >= 0) & (iw5 < W))[:, None], other=0.0)
    return _bt6(
        d0.to(tl.float32), d1.to(tl.float32), d2.to(tl.float32), d3.to(tl.float32), d4.to(tl.float32),
        d5.to(tl.float32),
    )  # fmt: skip


@triton.jit
def _store_column(v_ptrs, plane, mask, COL: tl.constexpr, r0, r1, r2, r3, r4, r5):
    """Transform column COL along the rows and store V[a*6 + COL] for a = 0..5."""
    v0, v1, v2, v3, v4, v5 = _bt6(r0, r1, r2, r3, r4, r5)
    dtype = v_ptrs.dtype.element_ty
    tl.store(v_ptrs + (0 * 6 + COL) * plane, v0.to(dtype), mask=mask)
    tl.store(v_ptrs + (1 * 6 + COL) * plane, v1.to(dtype), mask=mask)
    tl.store(v_ptrs + (2 * 6 + COL) * plane, v2.to(dtype), mask=mask)
    tl.store(v_ptrs + (3 * 6 + COL) * plane, v3.to(dtype), mask=mask)
    tl.store(v_ptrs + (4 * 6 + COL) * plane, v4.to(dtype), mask=mask)
    tl.store(v_ptrs + (5 * 6 + COL) * plane, v5.to(dtype), mask=mask)


@triton.jit
def _winograd_input_kernel(
    x_ptr,
    v_ptr,
    T,
    Cin,
    H,
    W,
    tiles_h,
    tiles_w,
    stride_xn,
    stride_xc,
    stride_xh,
    stride_xw,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_dependency_sync(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_mask = offs_t < T
    tc_mask = t_mask[:, None] & (offs_c < Cin)[None, :]
    tile_w = offs_t % tiles_w
    tile_h = (offs_t // tiles_w) % tiles_h
    n_idx = offs_t // (tiles_w * tiles_h)
    ih0 = tile_h * 4 - 1
    iw0 = tile_w * 4 - 1
    x_rows = x_ptr + (n_idx.to(tl.int64) * stride_xn)[:, None]
    x_cols = offs_c[None, :] * stride_xc

    r00, r01, r02, r03, r04, r05 = _input_row(x_rows, x_cols, tc_mask, ih0, iw0, H, W, stride_xh, stride_xw)
    r10, r11, r12, r13, r14, r15 = _input_row(x_rows, x_cols, tc_mask, ih0 + 1, iw0, H, W, stride_xh, stride_xw)
    r20, r21, r22, r23, r24, r25 = _input_row(x_rows, x_cols, tc_mask, ih0 + 2, iw0, H, W, stride_xh, stride_xw)
    r30, r31, r32, r33, r34, r35 = _input_row(x_rows, x_cols, tc_mask, ih0 + 3, iw0, H, W, stride_xh, stride_xw)
    r40, r41, r42, r43, r44, r45 = _input_row(x_rows, x_cols, tc_mask, ih0 + 4, iw0, H, W, stride_xh, stride_xw)
    r50, r51, r52, r53, r54, r55 = _input_row(x_rows, x_cols, tc_mask, ih0 + 5, iw0, H, W, stride_xh, stride_xw)

    plane = T * Cin
    v_ptrs = v_ptr + offs_t[:, None] * Cin + offs_c[None, :]
    _store_column(v_ptrs, plane, tc_mask, 0, r00, r10, r20, r30, r40, r50)
    _store_column(v_ptrs, plane, tc_mask, 1, r01, r11, r21, r31, r41, r51)
    _store_column(v_ptrs, plane, tc_mask, 2, r02, r12, r22, r32, r42, r52)
    _store_column(v_ptrs, plane, tc_mask, 3, r03, r13, r23, r33, r43, r53)
    _store_column(v_ptrs, plane, tc_mask, 4, r04, r14, r24, r34, r44, r54)
    _store_column(v_ptrs, plane, tc_mask, 5, r05, r15, r25, r35, r45, r55)


@triton.jit
def _winograd_gemm_kernel(
    v_ptr,
    u_ptr,
    m_ptr,
    T,
    Cin,
    Cout,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """M[k] = V[k] @ U[k] for k = program_id(1): [T, Cin] @ [Cin, Cout] -> fp32 [T, Cout]."""
    grid_dependency_sync(PDL)
    pid = tl.program_id(0)
    k = tl.program_id(1)
    num_pid_m = tl.cdiv(T, BLOCK_M)
    num_pid_n = tl.cdiv(Cout, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % pids_per_group) % group_size
    pid_n = (pid % pids_per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < T
    n_mask = offs_n < Cout
    a_base = v_ptr + k * T * Cin + offs_m[:, None] * Cin
    b_base = u_ptr + k * Cin * Cout + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c0 in range(0, Cin, BLOCK_K):
        offs_k = c0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < Cin
        a = tl.load(a_base + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_base + offs_k[:, None] * Cout, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    m_ptrs = m_ptr + k * T * Cout + offs_m[:, None] * Cout + offs_n[None, :]
    tl.store(m_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _output_row(m_ptrs, plane, mask, ROW: tl.constexpr):
    """Load M[ROW*6 + b] for b = 0..5 and transform along b (4 results)."""
    m0 = tl.load(m_ptrs + (ROW * 6 + 0) * plane, mask=mask, other=0.0)
    m1 = tl.load(m_ptrs + (ROW * 6 + 1) * plane, mask=mask, other=0.0)
    m2 = tl.load(m_ptrs + (ROW * 6 + 2) * plane, mask=mask, other=0.0)
    m3 = tl.load(m_ptrs + (ROW * 6 + 3) * plane, mask=mask, other=0.0)
    m4 = tl.load(m_ptrs + (ROW * 6 + 4) * plane, mask=mask, other=0.0)
    m5 = tl.load(m_ptrs + (ROW * 6 + 5) * plane, mask=mask, other=0.0)
    return _at6(m0, m1, m2, m3, m4, m5)


@triton.jit
def _finish_output(
    y, oh, ow, t_mask, n_idx, offs_n, n_mask, H, W,
    bias_ptr, temb_ptr, stride_tn, stride_tc, res_ptr, stride_rn, stride_rc, stride_rh, stride_rw,
    out_ptr, stride_on, stride_oc, stride_oh, stride_ow, out_scale,
    HAS_BIAS: tl.constexpr, HAS_TEMB: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):  # fmt: skip
    """Epilogue and store of one output pixel (oh, ow) per tile row."""
    row_mask = t_mask & (oh < H) & (ow < W)
    n64 = n_idx.to(tl.int64)
    res_rows = res_ptr + n64 * stride_rn + oh * stride_rh + ow * stride_rw
    y = fused_epilogue(
        y, n_idx, offs_n, row_mask, n_mask, bias_ptr, temb_ptr, stride_tn, stride_tc, res_rows, stride_rc,
        out_scale, HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip
    out_ptrs = (out_ptr + n64 * stride_on + oh * stride_oh + ow * stride_ow)[:, None] + offs_n[None, :] * stride_oc
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _finish_column(
    z0, z1, z2, z3, z4, z5, oh0, ow, t_mask, n_idx, offs_n, n_mask, H, W,
    bias_ptr, temb_ptr, stride_tn, stride_tc, res_ptr, stride_rn, stride_rc, stride_rh, stride_rw,
    out_ptr, stride_on, stride_oc, stride_oh, stride_ow, out_scale,
    HAS_BIAS: tl.constexpr, HAS_TEMB: tl.constexpr, HAS_RES: tl.constexpr, ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):  # fmt: skip
    """Transform one column of Z = M A along the rows and finish its 4 output pixels (oh0..oh0+3, ow)."""
    y0, y1, y2, y3 = _at6(z0, z1, z2, z3, z4, z5)
    _finish_output(
        y0, oh0, ow, t_mask, n_idx, offs_n, n_mask, H, W, bias_ptr, temb_ptr, stride_tn, stride_tc, res_ptr,
        stride_rn, stride_rc, stride_rh, stride_rw, out_ptr, stride_on, stride_oc, stride_oh, stride_ow,
        out_scale, HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip
    _finish_output(
        y1, oh0 + 1, ow, t_mask, n_idx, offs_n, n_mask, H, W, bias_ptr, temb_ptr, stride_tn, stride_tc,
        res_ptr, stride_rn, stride_rc, stride_rh, stride_rw, out_ptr, stride_on, stride_oc, stride_oh,
        stride_ow, out_scale, HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip
    _finish_output(
        y2, oh0 + 2, ow, t_mask, n_idx, offs_n, n_mask, H, W, bias_ptr, temb_ptr, stride_tn, stride_tc,
        res_ptr, stride_rn, stride_rc, stride_rh, stride_rw, out_ptr, stride_on, stride_oc, stride_oh,
        stride_ow, out_scale, HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip
    _finish_output(
        y3, oh0 + 3, ow, t_mask, n_idx, offs_n, n_mask, H, W, bias_ptr, temb_ptr, stride_tn, stride_tc,
        res_ptr, stride_rn, stride_rc, stride_rh, stride_rw, out_ptr, stride_on, stride_oc, stride_oh,
        stride_ow, out_scale, HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip


@triton.jit
def _winograd_output_kernel(
    m_ptr,
    bias_ptr,
    temb_ptr,
    res_ptr,
    out_ptr,
    T,
    Cout,
    H,
    W,
    tiles_h,
    tiles_w,
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
    HAS_BIAS: tl.constexpr,
    HAS_TEMB: tl.constexpr,
    HAS_RES: tl.constexpr,
    ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_dependency_sync(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = offs_t < T
    n_mask = offs_n < Cout
    tile_w = offs_t % tiles_w
    tile_h = (offs_t // tiles_w) % tiles_h
    n_idx = offs_t // (tiles_w * tiles_h)
    oh0 = tile_h * 4
    ow0 = tile_w * 4

    plane = T * Cout
    mask = t_mask[:, None] & n_mask[None, :]
    m_ptrs = m_ptr + offs_t[:, None] * Cout + offs_n[None, :]
    z00, z01, z02, z03 = _output_row(m_ptrs, plane, mask, 0)
    z10, z11, z12, z13 = _output_row(m_ptrs, plane, mask, 1)
    z20, z21, z22, z23 = _output_row(m_ptrs, plane, mask, 2)
    z30, z31, z32, z33 = _output_row(m_ptrs, plane, mask, 3)
    z40, z41, z42, z43 = _output_row(m_ptrs, plane, mask, 4)
    z50, z51, z52, z53 = _output_row(m_ptrs, plane, mask, 5)

    _finish_column(
        z00, z10, z20, z30, z40, z50, oh0, ow0 + 0, t_mask, n_idx, offs_n, n_mask, H, W, bias_ptr, temb_ptr,
        stride_tn, stride_tc, res_ptr, stride_rn, stride_rc, stride_rh, stride_rw, out_ptr, stride_on,
        stride_oc, stride_oh, stride_ow, out_scale, HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip
    _finish_column(
        z01, z11, z21, z31, z41, z51, oh0, ow0 + 1, t_mask, n_idx, offs_n, n_mask, H, W, bias_ptr, temb_ptr,
        stride_tn, stride_tc, res_ptr, stride_rn, stride_rc, stride_rh, stride_rw, out_ptr, stride_on,
        stride_oc, stride_oh, stride_ow, out_scale, HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip
    _finish_column(
        z02, z12, z22, z32, z42, z52, oh0, ow0 + 2, t_mask, n_idx, offs_n, n_mask, H, W, bias_ptr, temb_ptr,
        stride_tn, stride_tc, res_ptr, stride_rn, stride_rc, stride_rh, stride_rw, out_ptr, stride_on,
        stride_oc, stride_oh, stride_ow, out_scale, HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip
    _finish_column(
        z03, z13, z23, z33, z43, z53, oh0, ow0 + 3, t_mask, n_idx, offs_n, n_mask, H, W, bias_ptr, temb_ptr,
        stride_tn, stride_tc, res_ptr, stride_rn, stride_rc, stride_rh, stride_rw, out_ptr, stride_on,
        stride_oc, stride_oh, stride_ow, out_scale, HAS_BIAS, HAS_TEMB, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip


def winograd_conv3x3(
    x: torch.Tensor,
    weight_transformed: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    time_emb: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    out_scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """3x3 stride-1 padding-1 conv by Winograd F(4x4, 3x3) with the conv2d epilogue.

    ``x`` is a logical ``[N, Cin, H, W]`` tensor (channels-last memory for speed); ``weight_transformed`` is
    ``[36, Cin, Cout]`` from :func:`winograd_transform_weight`; its dtype is the GEMM dtype (``V`` is stored
    in it; fp32 runs the GEMM in full fp32, not tf32, since the transforms amplify tf32's rounding). Returns a
    channels-last ``[N, Cout, H, W]`` tensor (or writes ``out``):
    ``((act(conv + bias + time_emb[:, :, None, None]) + residual) * out_scale``.
    """
    if x.dim() != 4:
        raise FastdiffError(f"winograd_conv3x3 input must be 4-D [N, C, H, W], got shape {tuple(x.shape)}")
    n, cin, h, w = x.shape
    if weight_transformed.dim() != 3 or weight_transformed.shape[:2] != (36, cin):
        raise FastdiffError(
            f"transformed winograd weight must be [36, {cin}, Cout], got {tuple(weight_transformed.shape)}"
        )
    if weight_transformed.device != x.device:
        raise FastdiffError(f"weight is on {weight_transformed.device} but the input is on {x.device}")
    if weight_transformed.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise FastdiffError(f"transformed winograd weight dtype {weight_transformed.dtype} is not supported")
    cout = weight_transformed.shape[2]
    check_epilogue_args(n, cout, (h, w), x.device, bias, time_emb, residual, activation, out)
    u = weight_transformed.contiguous()
    tiles_h, tiles_w = triton.cdiv(h, TILE), triton.cdiv(w, TILE)
    tiles = n * tiles_h * tiles_w
    if 36 * tiles * max(cin, cout) >= 2**31:
        raise FastdiffError(f"winograd_conv3x3: input {tuple(x.shape)} too large for 32-bit tile indexing")
    v = torch.empty((36, tiles, cin), device=x.device, dtype=u.dtype)
    m = torch.empty((36, tiles, cout), device=x.device, dtype=torch.float32)
    if out is None:
        out = torch.empty((n, cout, h, w), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)

    # 36 live [BLOCK_T, BLOCK_C] fp32 tiles per program: 16 x 32 keeps them in registers on the GPU; the
    # interpreter runs programs one by one, so it gets few, large ones.
    on_gpu = x.device.type == "cuda"
    block_t = 16 if on_gpu else 64
    block_c = max(16, min(32 if on_gpu else 128, triton.next_power_of_2(cin)))
    _winograd_input_kernel[(triton.cdiv(tiles, block_t), triton.cdiv(cin, block_c))](
        x,
        v,
        tiles,
        cin,
        h,
        w,
        tiles_h,
        tiles_w,
        *x.stride(),
        BLOCK_T=block_t,
        BLOCK_C=block_c,
        num_warps=4,
        **pdl_launch(x.device),
    )
    block_m, block_n, block_k, num_warps, num_stages = _gemm_blocks(36 * tiles, cout, cin, u.dtype, x.device)
    gemm_grid = (triton.cdiv(tiles, block_m) * triton.cdiv(cout, block_n), 36)
    _winograd_gemm_kernel[gemm_grid](
        v, u, m, tiles, cin, cout, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        PRECISION="ieee" if u.dtype == torch.float32 else "tf32", num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(x.device),
    )  # fmt: skip
    block_out = max(16, min(32 if on_gpu else 128, triton.next_power_of_2(cout)))
    res = residual if residual is not None else out
    temb_strides = time_emb.stride() if time_emb is not None else (0, 0)
    _winograd_output_kernel[(triton.cdiv(tiles, block_t), triton.cdiv(cout, block_out))](
        m, bias if bias is not None else out, time_emb if time_emb is not None else out, res, out,
        tiles, cout, h, w, tiles_h, tiles_w, *temb_strides, *res.stride(), *out.stride(),
        1.0 if out_scale is None else float(out_scale),
        HAS_BIAS=bias is not None, HAS_TEMB=time_emb is not None, HAS_RES=residual is not None,
        ACT=ACTIVATIONS[activation], HAS_SCALE=out_scale is not None,
        BLOCK_T=block_t, BLOCK_N=block_out, num_warps=4, **pdl_launch(x.device),
    )  # fmt: skip
    return out


def winograd_error_vs_direct(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> dict[str, float]:
    """Relative errors ``||out - ref|| / ||ref||`` of Winograd and of the implicit-GEMM conv2d, same inputs.

    ``ref`` is the float64 direct conv (on the CPU) of the given (already rounded) ``x``, raw 3x3 ``weight``
    and ``bias``; the difference between the two numbers is what the Winograd transforms cost in accuracy.
    """
    ref = conv2d_ref(x.cpu().double(), weight.cpu().double(), None if bias is None else bias.cpu().double(), padding=1)
    winograd = winograd_conv3x3(x, winograd_transform_weight(weight), bias).cpu().double()
    direct = conv2d(x, weight, bias, padding=1).cpu().double()
    scale = ref.norm().item()
    return {
        "winograd": (winograd - ref).norm().item() / scale,
        "implicit_gemm": (direct - ref).norm().item() / scale,
    }


def winograd_conv3x3_example_inputs(
    size: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """conv2 of a ResnetBlock2D: 3x3 pad 1 on transformed weights, + bias, + residual shortcut."""
    n, cin, cout, h, w = conv_shape(size)
    gen = torch.Generator().manual_seed(seed)
    x = channels_last_randn((n, cin, h, w), dtype, device, gen)
    weight = torch.randn((cout, cin, 3, 3), generator=gen) / (9 * cin) ** 0.5
    bias = torch.randn(cout, generator=gen)
    residual = channels_last_randn((n, cout, h, w), dtype, device, gen)
    u = winograd_transform_weight(weight.to(device=device), winograd_gemm_dtype(dtype))
    return (x, u, bias.to(device=device, dtype=dtype)), {"residual": residual}


def winograd_conv3x3_cost(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float]:
    """(FLOPs, bytes) of the op it computes, a 3x3 'same' conv (:func:`fastdiff.kernels.cost_model.conv2d_cost`):
    useful work, not the transform arithmetic, and the raw 3x3 weights, not the 6x6 ``U`` the kernel reads."""
    x, u = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    n, cin, h, w = x.shape
    cost = cost_model.conv2d_cost(
        n, cin, u.shape[2], h, w, 3, 1, x.element_size(), bias=bias is not None,
        residual=kwargs.get("residual") is not None, temb=kwargs.get("time_emb") is not None,
        act=kwargs.get("activation"), scale=kwargs.get("out_scale") is not None,
    )  # fmt: skip
    return cost.flops, cost.bytes


OP = KernelOp(
    name="winograd_conv3x3",
    triton=winograd_conv3x3,
    ref=winograd_conv3x3_ref,
    example_inputs=winograd_conv3x3_example_inputs,
    cost=winograd_conv3x3_cost,
)
