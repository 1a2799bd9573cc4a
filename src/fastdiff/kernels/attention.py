"""Flash-style fused attention ``softmax(q @ k^T * scale) @ v``: the score matrix never reaches memory.

Layout: ``q`` is ``[B, heads, Lq, head_dim]``, ``k`` and ``v`` are ``[B, heads, Lk, head_dim]`` (Lk may
differ from Lq: cross-attention); any strides (e.g. the ``[B, L, heads, head_dim].transpose(1, 2)`` view of a
projection) are read in place, a unit stride on head_dim gives vector loads. The output is a contiguous
``[B, heads, Lq, head_dim]`` tensor (or ``out``, any strides). Head dims that are not powers of two (40, 80,
160) are padded to the next power of two with masked loads; 1..512 work.

Each program owns BLOCK_M query rows of one (batch, head) and streams K/V in BLOCK_N blocks with the online
softmax in fp32 (running max and sum, base-2 exponentials); both products run on the tensor cores with fp32
accumulators (fp32 inputs use tf32 there, relative error ~3e-4).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels.conv2d import num_sms
from fastdiff.kernels.registry import KernelOp

log = logging.getLogger(__name__)

LOG2_E = 1.4426950408889634


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Explicit ``softmax(q @ k^T * scale) @ v`` in fp32 (float64 for float64 inputs), cast to ``q.dtype``.

    ``scale`` defaults to 1/sqrt(head_dim).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    q32, k32, v32 = (t.to(compute) for t in (q, k, v))
    probs = torch.softmax((q32 @ k32.transpose(-1, -2)) * scale, dim=-1)
    o = (probs @ v32).to(q.dtype)
    if out is not None:
        return out.copy_(o)
    return o


@triton.jit
def _attention_block(
    q,
    m_i,
    l_i,
    acc,
    k_ptrs,
    v_ptrs,
    cols,
    Lk,
    d_mask,
    qk_scale,
    MASK_N: tl.constexpr,
    MASK_D: tl.constexpr,
):
    """One K/V block of the online softmax: returns the updated (running max, running sum, accumulator)."""
    if MASK_N:
        n_mask = cols < Lk
        k = tl.load(k_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    elif MASK_D:
        k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASK_N:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    qk_scale,
    H,
    Lq,
    Lk,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_om,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < Lq

    q_ptrs = q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    k_ptrs = k_ptr + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_ptr + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n_full = (Lk // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        m_i, l_i, acc = _attention_block(
            q, m_i, l_i, acc, k_ptrs, v_ptrs, start_n + offs_n, Lk, d_mask, qk_scale,
            MASK_N=False, MASK_D=BLOCK_D != HEAD_DIM,
        )  # fmt: skip
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    if n_full < Lk:
        m_i, l_i, acc = _attention_block(
            q, m_i, l_i, acc, k_ptrs, v_ptrs, n_full + offs_n, Lk, d_mask, qk_scale,
            MASK_N=True, MASK_D=BLOCK_D != HEAD_DIM,
        )  # fmt: skip
    acc = acc / l_i[:, None]
    o_ptrs = o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _attention_blocks(
    batch_heads: int, lq: int, block_d: int, device: torch.device
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): 128x64 tiles up to head_dim 128, smaller for wider heads."""
    if block_d <= 64:
        block_m, block_n, warps, stages = 128, 64, 4, 3
    elif block_d <= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    elif block_d <= 256:
        block_m, block_n, warps, stages = 64, 32, 8, 2
    else:
        block_m, block_n, warps, stages = 32, 32, 8, 1
    block_m = max(16, min(block_m, triton.next_power_of_2(lq)))
    while block_m > 32 and batch_heads * triton.cdiv(lq, block_m) < num_sms(device):
        block_m //= 2
    return block_m, block_n, warps, stages


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused ``softmax(q @ k^T * scale) @ v`` on ``[B, heads, L, head_dim]`` tensors; scale: 1/sqrt(d)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise FastdiffError(
            f"attention inputs must be 4-D [B, heads, L, head_dim], got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    batch, heads, lq, head_dim = q.shape
    lk = k.shape[2]
    if tuple(k.shape) != (batch, heads, lk, head_dim) or tuple(v.shape) != tuple(k.shape):
        raise FastdiffError(
            f"k and v must both be [B={batch}, heads={heads}, Lk, head_dim={head_dim}], got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if not 1 <= head_dim <= 512 or lk < 1:
        raise FastdiffError(
            f"attention needs 1 <= head_dim <= 512 and Lk >= 1, got head_dim={head_dim}, Lk={lk}"
        )
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise FastdiffError("q, k and v must share one dtype and device")
    if out is None:
        out = torch.empty((batch, heads, lq, head_dim), device=q.device, dtype=q.dtype)
    elif tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or out.device != q.device:
        raise FastdiffError(f"out must be a {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}")
    scale = head_dim**-0.5 if scale is None else scale
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps, num_stages = _attention_blocks(batch * heads, lq, block_d, q.device)
    grid = (triton.cdiv(lq, block_m), batch * heads)
    _attention_kernel[grid](
        q, k, v, out, scale * LOG2_E, heads, lq, lk,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


ATTENTION_SHAPES: dict[str, tuple[int, int, int, int, int]] = {
    "small": (2, 2, 19, 19, 40),
    "cifar10-b1": (1, 1, 256, 256, 256),
    "cifar10-b256": (256, 1, 256, 256, 256),
    "large": (256, 1, 256, 256, 256),
    "sd15-b2": (2, 8, 4096, 4096, 40),
}
"""size -> (B, heads, Lq, Lk, head_dim): DDPM-CIFAR10's 16x16 single-head attention over 256 channels, and
SD1.5's first self-attention (64x64 latent, 8 heads of 40)."""


def attention_example_inputs(
    size: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """q, k, v as ``[B, L, heads, d].transpose(1, 2)`` views, the layout a fused projection produces."""
    if size not in ATTENTION_SHAPES:
        raise FastdiffError(f"unknown example size {size!r}; expected one of {', '.join(ATTENTION_SHAPES)}")
    batch, heads, lq, lk, head_dim = ATTENTION_SHAPES[size]
    gen = torch.Generator().manual_seed(seed)

    def draw(length: int) -> torch.Tensor:
        t = torch.randn((batch, length, heads, head_dim), generator=gen)
        return t.to(device=device, dtype=dtype).transpose(1, 2)

    return (draw(lq), draw(lk), draw(lk)), {}


def attention_cost(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float]:
    """(4 * B * heads * Lq * Lk * d for the two products, q + k + v read once + o written once)."""
    q, k, v = args[:3]
    batch, heads, lq, head_dim = q.shape
    flops = 4.0 * batch * heads * lq * k.shape[2] * head_dim
    moved = sum(t.numel() * t.element_size() for t in (q, k, v, q))
    return flops, float(moved)


OP = KernelOp(
    name="attention",
    triton=attention,
    ref=attention_ref,
    example_inputs=attention_example_inputs,
    cost=attention_cost,
)

__all__ = ["ATTENTION_SHAPES", "OP", "attention", "attention_ref"]
