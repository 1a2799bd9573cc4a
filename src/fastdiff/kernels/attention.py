"""Flash-style fused attention ``softmax(q @ k^T * scale) @ v``: the score matrix never reaches memory.

Layout: ``q`` is ``[B, heads, Lq, head_dim]``, ``k`` and ``v`` are ``[B, heads, Lk, head_dim]`` (Lk may
differ from Lq: cross-attention); any strides (e.g. the ``[B, L, heads, head_dim].transpose(1, 2)`` view of a
projection) are read in place, a unit stride on head_dim gives vector loads. The output is a contiguous
``[B, heads, Lq, head_dim]`` tensor (or ``out``, any strides). Head dims that are not powers of two (40, 80,
160) are padded to the next power of two with masked loads; 1..512 work.

Each program owns BLOCK_M query rows of one (batch, head) and streams K/V in BLOCK_N blocks with the online
softmax in fp32 (running max and sum, base-2 exponentials); 16-bit inputs run both products on the tensor cores with
fp32 accumulators; fp32 inputs use exact-fp32 products (``input_precision="ieee"``, FMA units), so fp32 means
fp32. The tile (BLOCK_M, BLOCK_N, warps, stages) is an argument: :func:`attention_tiles` lists those worth timing,
the engine's autotune times them and a kernel plan pins its pick, so a process never times tiles of its own (which
made images differ between processes) and the same tile gives the same bytes.

A second schedule for few keys (``schedule="rows"``, Lk <= :data:`ROWS_MAX_KEYS`): each program holds whole score
rows, the q k^T of BLOCK_M queries against every key, takes their exact softmax and multiplies it by one
BLOCK_DV-wide column slice of v; the value columns split over programs instead of the keys, so nothing is merged
afterwards. Every slice recomputes its rows' scores (cheap next to reading K). It is the batch-1 shape's answer:
DDPM's 16x16 single-head attention (256 queries and keys of 256 channels) gives the streaming schedule 4 query
blocks, and splitting its keys costs a merge of fp32 partials 256 channels wide.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels import cost_model
from fastdiff.kernels.common import (
    SplitWorkspace,
    finish_arrival,
    grid_dependency_sync,
    num_sms,
    pdl_launch,
    reset_arrivals,
)
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
    DOT_PRECISION: tl.constexpr,
):
    """One K/V block of the online softmax: returns the updated (running max, running sum, accumulator)."""
    if MASK_N:
        n_mask = cols < Lk
        k = tl.load(k_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    elif MASK_D:
        k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
    else:
        k = tl.load(k_ptrs)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASK_N:
        s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASK_N:
        v = tl.load(v_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    elif MASK_D:
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _aligned(stride, ALIGN: tl.constexpr):
    """``stride`` rewritten as a visible multiple of ALIGN (the wrapper checked it is one): row starts then
    prove 16-byte aligned, so loads vectorise and pipeline (e.g. the h * 40 head offset of d=40 heads)."""
    if ALIGN > 1:
        stride = (stride // ALIGN) * ALIGN
    return stride


@triton.jit
def _row_pointers(ptr, b, h, rows, stride_b, stride_h, stride_row, ALIGN: tl.constexpr):
    """``[rows, 1]`` pointers to the first element of each row of head ``h`` of batch entry ``b``, the strides
    rewritten as visible multiples of ALIGN (:func:`_aligned`)."""
    base = b * _aligned(stride_b, ALIGN) + h * _aligned(stride_h, ALIGN)
    return ptr + base + rows[:, None] * _aligned(stride_row, ALIGN)


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
    ws_ptr,
    count_ptr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, head) over all keys, or (SPLIT_KV > 1) over the keys of
    split ``program_id(2)``: see :func:`_merge_kv_splits`."""
    grid_dependency_sync(PDL)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < Lq

    q_ptrs = _row_pointers(q_ptr, b, h, offs_m, stride_qb, stride_qh, stride_qm, ALIGN) + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    k_ptrs = _row_pointers(k_ptr, b, h, offs_n, stride_kb, stride_kh, stride_kn, ALIGN) + offs_d[None, :] * stride_kd
    v_ptrs = _row_pointers(v_ptr, b, h, offs_n, stride_vb, stride_vh, stride_vn, ALIGN) + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo = 0
    hi = Lk
    if SPLIT_KV > 1:  # this split's keys: whole BLOCK_N blocks, the ragged end in the last split
        per_split = tl.cdiv(tl.cdiv(Lk, SPLIT_KV), BLOCK_N) * BLOCK_N
        lo = tl.program_id(2) * per_split
        hi = tl.minimum(lo + per_split, Lk)
        k_ptrs += lo * stride_kn
        v_ptrs += lo * stride_vn
    n_full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, n_full, BLOCK_N):
        m_i, l_i, acc = _attention_block(
            q, m_i, l_i, acc, k_ptrs, v_ptrs, start_n + offs_n, hi, d_mask, qk_scale,
            MASK_N=False, MASK_D=BLOCK_D != HEAD_DIM, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    if n_full < hi:
        m_i, l_i, acc = _attention_block(
            q, m_i, l_i, acc, k_ptrs, v_ptrs, n_full + offs_n, hi, d_mask, qk_scale,
            MASK_N=True, MASK_D=BLOCK_D != HEAD_DIM, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    is_last = True
    if SPLIT_KV > 1:
        tile = bh * tl.num_programs(0) + pid_m
        acc, l_i, is_last = _merge_kv_splits(acc, m_i, l_i, ws_ptr, count_ptr, tile,
                                             tl.num_programs(0) * tl.num_programs(1), SPLIT_KV, BLOCK_M,
                                             BLOCK_D)  # fmt: skip
    if is_last:
        acc = acc * (1.0 / l_i)[:, None]
        o_rows = _row_pointers(o_ptr, b, h, offs_m, stride_ob, stride_oh, stride_om, ALIGN)
        o_ptrs = o_rows + offs_d[None, :] * stride_od
        tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _merge_kv_splits(
    acc, m_i, l_i, ws_ptr, count_ptr, tile, num_tiles,
    SPLIT_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Split-KV fix-up in the same launch (flash-decoding's combine): each split stores its unnormalised
    accumulator, running max and sum; the last of a tile's splits to arrive rescales every split to the common
    max and sums them in split order (bit-reproducible), then resets the tile's counter. Returns (acc, l, is_last).
    A split with no keys has max -inf and sum 0: it adds nothing."""
    split = tl.program_id(2)
    rows = tl.arange(0, BLOCK_M)
    offs = rows[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    acc_stride = num_tiles.to(tl.int64) * (BLOCK_M * BLOCK_D)
    ml_base = ws_ptr + SPLIT_KV * acc_stride  # then (max, sum) rows: [SPLIT_KV, tiles, 2, BLOCK_M]
    ml_stride = num_tiles.to(tl.int64) * (2 * BLOCK_M)
    tile64 = tile.to(tl.int64)
    tl.store(ws_ptr + split * acc_stride + tile64 * (BLOCK_M * BLOCK_D) + offs, acc)
    tl.store(ml_base + split * ml_stride + tile64 * (2 * BLOCK_M) + rows, m_i)
    tl.store(ml_base + split * ml_stride + tile64 * (2 * BLOCK_M) + BLOCK_M + rows, l_i)
    is_last = finish_arrival(count_ptr, tile, SPLIT_KV)
    if is_last:
        m_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        for s in tl.static_range(SPLIT_KV):
            m_max = tl.maximum(m_max, tl.load(ml_base + s * ml_stride + tile64 * (2 * BLOCK_M) + rows,
                                              cache_modifier=".cg"))  # fmt: skip
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        for s in tl.static_range(SPLIT_KV):
            ml = ml_base + s * ml_stride + tile64 * (2 * BLOCK_M)
            m_s = tl.load(ml + rows, cache_modifier=".cg")
            weight = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m_max))
            l_i += weight * tl.load(ml + BLOCK_M + rows, cache_modifier=".cg")
            part = tl.load(ws_ptr + s * acc_stride + tile64 * (BLOCK_M * BLOCK_D) + offs, cache_modifier=".cg")
            acc += weight[:, None] * part
        reset_arrivals(count_ptr, tile)
    return acc, l_i, is_last


@triton.jit
def _attention_rows_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, qk_scale, H, Lq, Lk,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KD: tl.constexpr, BLOCK_DV: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_M query rows of one (batch, head) against all Lk <= BLOCK_N keys, output columns
    ``[program_id(1) * BLOCK_DV, +BLOCK_DV)``. Stages: (1) scores s = q k^T over head-dim chunks of BLOCK_KD;
    (2) exact softmax of each whole row (max, base-2 exponentials, sum; padded keys score -inf); (3) p @ v of
    this program's value columns, divided by the row sums."""
    grid_dependency_sync(PDL)
    pid_m = tl.program_id(0)
    pid_dv = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < Lq
    n_mask = offs_n < Lk
    q_rows = _row_pointers(q_ptr, b, h, offs_m, stride_qb, stride_qh, stride_qm, ALIGN)
    k_rows = _row_pointers(k_ptr, b, h, offs_n, stride_kb, stride_kh, stride_kn, ALIGN)

    # (1) scores of every key, head-dim chunk by chunk (the loop pipelines the K loads)
    s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for d0 in tl.range(0, BLOCK_D, BLOCK_KD):
        offs_kd = d0 + tl.arange(0, BLOCK_KD)
        kd_mask = offs_kd < HEAD_DIM
        q = tl.load(q_rows + offs_kd[None, :] * stride_qd, mask=m_mask[:, None] & kd_mask[None, :], other=0.0)
        k = tl.load(k_rows + offs_kd[None, :] * stride_kd, mask=n_mask[:, None] & kd_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), s, input_precision=DOT_PRECISION)

    # (2) exact softmax of whole rows (unnormalised here; the sums divide the output)
    s = tl.where(n_mask[None, :], s * qk_scale, float("-inf"))
    p = tl.exp2(s - tl.max(s, axis=1)[:, None])
    row_sum = tl.sum(p, axis=1)

    # (3) this program's value columns
    offs_dv = pid_dv * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < HEAD_DIM
    v_rows = _row_pointers(v_ptr, b, h, offs_n, stride_vb, stride_vh, stride_vn, ALIGN)
    v_ptrs = v_rows + offs_dv[None, :] * stride_vd
    v = tl.load(v_ptrs, mask=n_mask[:, None] & dv_mask[None, :], other=0.0)
    acc = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION) * (1.0 / row_sum)[:, None]
    o_rows = _row_pointers(o_ptr, b, h, offs_m, stride_ob, stride_oh, stride_om, ALIGN)
    o_ptrs = o_rows + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & dv_mask[None, :])


TUNING_CONFIGS: dict[int, list[tuple[int, int, int, int]]] = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 4, 4), (128, 128, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2)],
    128: [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)],
    256: [(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 8, 3), (32, 64, 4, 2),
          (16, 64, 4, 2)],
    512: [(32, 32, 8, 1), (64, 32, 8, 1), (32, 32, 4, 1), (16, 32, 4, 1)],
}  # fmt: skip
"""16-bit inputs on CUDA: (BLOCK_M, BLOCK_N, num_warps, num_stages) tiles per padded head dim (<= key), the first
the default; :func:`attention_tiles` offers them to a caller that times them (the engine's autotune, whose choice a
kernel plan pins). Nothing times them at run time: a tile picked by timing in each process (Triton's autotuner, as
here until git b3ad124) can differ between processes, and with it the order of the online softmax's sums, so the
images did (242 of 256 at ddpm-cifar10 batch 256 on the H200, one kernel plan, four processes)."""


def _fixed_config(block_d: int, lq: int, fp32: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) when no tile is given: fp32 inputs (whose exact-fp32 dots run on
    the FMA units, so smaller tiles), else the first of :func:`attention_tiles`."""
    if not fp32:
        return attention_tiles(block_d, lq)[0]
    block_m, block_n, warps, stages = (64, 32, 4, 2) if block_d <= 64 else (32, 32, 4, 1)
    if block_d > 256:
        block_m, block_n, warps = 16, 16, 8
    return max(16, min(block_m, triton.next_power_of_2(lq))), block_n, warps, stages


ROWS_MAX_KEYS = 512
"""The most keys ``schedule="rows"`` takes: a program holds BLOCK_M x next_pow2(Lk) fp32 scores in registers."""

ROWS_TUNING_CONFIGS: list[tuple[int, int, int, int]] = [
    (16, 64, 4, 2), (16, 128, 4, 2), (16, 256, 8, 2), (32, 64, 4, 2), (32, 128, 8, 2), (64, 64, 4, 2),
    (64, 128, 8, 2), (16, 32, 4, 2), (32, 32, 4, 2),
]  # fmt: skip
"""``schedule="rows"`` on CUDA, 16-bit: (BLOCK_M, BLOCK_DV, num_warps, num_stages) tiles, the first the default;
BLOCK_DV is capped at the padded head dim (:func:`attention_tiles`)."""


def attention_tiles(head_dim: int, lq: int, schedule: str = "stream") -> tuple[tuple[int, int, int, int], ...]:
    """The tiles of 16-bit ``attention`` for this head dim and query count, the default first: (BLOCK_M, BLOCK_N,
    num_warps, num_stages) for ``schedule="stream"``, (BLOCK_M, BLOCK_DV, ...) for ``"rows"``; BLOCK_M capped at the
    padded query count (and BLOCK_DV at the padded head dim), duplicates dropped. Pass one as ``tile=``."""
    if schedule not in SCHEDULES:
        raise FastdiffError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    block_d = max(16, triton.next_power_of_2(head_dim))
    rows_cap = max(16, triton.next_power_of_2(lq))
    if schedule == "rows":
        shapes = ((m, min(dv, block_d), w, st) for m, dv, w, st in ROWS_TUNING_CONFIGS)
    else:
        shapes = iter(TUNING_CONFIGS[max(64, block_d)])
    return tuple(dict.fromkeys((min(m, rows_cap), n, w, st) for m, n, w, st in shapes))


def _check_tile(tile: object) -> tuple[int, int, int, int]:
    if (
        not isinstance(tile, tuple)
        or len(tile) != 4
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in tile)
        or any(x & (x - 1) for x in tile[:3])
        or not 16 <= tile[0] <= 128
    ):
        raise FastdiffError(
            f"tile must be (BLOCK_M, BLOCK_N, num_warps, num_stages): positive ints, the first three powers of 2, "
            f"BLOCK_M 16 to 128 (the split-KV workspace holds 128-row blocks); got {tile!r}"
        )
    return tile


SCHEDULES = ("stream", "rows")
"""``attention``'s schedules: online softmax over key blocks (any Lk, optional split-KV), or whole score rows with
the value columns split (Lk <= :data:`ROWS_MAX_KEYS`); see the module docstring."""


SPLIT_KV_CHOICES = (2,)
"""The ``split_kv`` values offered to a caller that times them (:func:`split_kv_choices`). 4 and 8 were offered
too until git 9823897 and never won in a committed kernel plan (H100: ddpm-cifar10, fashion-mnist, fashion-mnist-t2i
and sd15 at their shipped batch sizes; H200: ddpm-cifar10); 2 won once. ``split_kv`` itself takes any count."""


def split_kv_choices(batch: int, heads: int, lq: int, lk: int, device: torch.device) -> tuple[int, ...]:
    """The ``split_kv`` values worth timing: none when the query blocks (of 64 rows) already number the SMs;
    otherwise those of :data:`SPLIT_KV_CHOICES` that leave every split at least 32 keys."""
    if batch * heads * triton.cdiv(lq, 64) >= num_sms(device):
        return ()
    return tuple(split for split in SPLIT_KV_CHOICES if lk >= 32 * split)


def _row_alignment(*tensors: torch.Tensor) -> int:
    """Elements per 16 bytes if every tensor starts 16-byte aligned and all its strides but the unit one are
    multiples of that, else 1 (no alignment hint)."""
    align = 16 // tensors[0].element_size()
    for t in tensors:
        if t.stride(3) != 1 or t.data_ptr() % 16 or any(s % align for s in t.stride()[:3]):
            return 1
    return align


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    split_kv: int = 1,
    workspace: SplitWorkspace | None = None,
    schedule: str = "stream",
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Fused ``softmax(q @ k^T * scale) @ v`` on ``[B, heads, L, head_dim]`` tensors; scale: 1/sqrt(d).

    Split-KV (``split_kv > 1``, flash-decoding): the keys of each query block are divided among ``split_kv``
    programs, so a call with few query blocks (batch 1: DDPM's 16x16 single-head attention has 256 queries) still
    spreads over the GPU; the last split of a block to finish merges the others' partial results from
    ``workspace`` (:class:`fastdiff.kernels.common.SplitWorkspace`; a new one per call when None), in the same
    launch. ``schedule="rows"`` (Lk <= :data:`ROWS_MAX_KEYS`, no split-KV): whole score rows per program and the
    value columns split instead (module docstring). ``tile``: one of :func:`attention_tiles` for the schedule (None:
    the default, the first; fp32 inputs: a smaller fixed tile); the same tile gives the same bytes."""
    if schedule not in SCHEDULES:
        raise FastdiffError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if isinstance(split_kv, bool) or not isinstance(split_kv, int) or split_kv < 1:
        raise FastdiffError(f"split_kv must be a positive int, got {split_kv!r}")
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
        raise FastdiffError(f"attention needs 1 <= head_dim <= 512 and Lk >= 1, got head_dim={head_dim}, Lk={lk}")
    if schedule == "rows" and (lk > ROWS_MAX_KEYS or split_kv != 1):
        raise FastdiffError(
            f'schedule="rows" takes at most {ROWS_MAX_KEYS} keys and no split_kv, got Lk={lk}, split_kv={split_kv}'
        )
    if k.dtype != q.dtype or v.dtype != q.dtype or k.device != q.device or v.device != q.device:
        raise FastdiffError("q, k and v must share one dtype and device")
    if tile is not None:
        _check_tile(tile)
    if out is None:
        out = torch.empty((batch, heads, lq, head_dim), device=q.device, dtype=q.dtype)
    elif tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype or out.device != q.device:
        raise FastdiffError(f"out must be a {q.dtype} tensor of shape {tuple(q.shape)} on {q.device}")
    scale = head_dim**-0.5 if scale is None else scale
    block_d = max(16, triton.next_power_of_2(head_dim))
    sixteen_bit = q.dtype in (torch.float16, torch.bfloat16)
    if schedule == "rows":
        _attention_rows(q, k, v, out, scale, block_d, sixteen_bit, tile)
        return out
    split_kv = min(split_kv, lk)
    ws = counters = out
    if split_kv > 1:  # room for every config's query blocks (BLOCK_M divides 128; the smallest is 16)
        workspace = workspace if workspace is not None else SplitWorkspace()
        rows = batch * heads * triton.cdiv(lq, 128) * 128
        ws, counters = workspace.reserve(split_kv * rows * (block_d + 2), batch * heads * triton.cdiv(lq, 16), q.device)
    args = (
        q, k, v, out, scale * LOG2_E, heads, lq, lk, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        ws, counters,
    )  # fmt: skip
    meta = {
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "ALIGN": _row_alignment(q, k, v, out),
        # fp32 means fp32: exact-fp32 products (tf32 would cost ~1e-3 relative error); 16-bit inputs: tensor cores.
        "DOT_PRECISION": "tf32" if sixteen_bit else "ieee",
        "SPLIT_KV": split_kv,
    }
    block_m, block_n, num_warps, num_stages = tile or _fixed_config(block_d, lq, not sixteen_bit)
    _attention_kernel[(triton.cdiv(lq, block_m), batch * heads, split_kv)](
        *args,
        **meta,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(q.device),
    )
    return out


def _attention_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float, block_d: int,
    sixteen_bit: bool, tile: tuple[int, int, int, int] | None,
) -> None:  # fmt: skip
    """Launches :func:`_attention_rows_kernel` (checked arguments) on ``tile`` (BLOCK_M, BLOCK_DV, warps, stages);
    without one: the first of :func:`attention_tiles` for 16-bit inputs on CUDA, else a small fixed tile."""
    batch, heads, lq, head_dim = q.shape
    lk = k.shape[2]
    block_n = max(16, triton.next_power_of_2(lk))
    args = (
        q, k, v, out, scale * LOG2_E, heads, lq, lk, *q.stride(), *k.stride(), *v.stride(), *out.stride(),
    )  # fmt: skip
    meta = {
        "HEAD_DIM": head_dim,
        "BLOCK_D": block_d,
        "BLOCK_N": block_n,
        "ALIGN": _row_alignment(q, k, v, out),
        "DOT_PRECISION": "tf32" if sixteen_bit else "ieee",
        "BLOCK_KD": min(block_d, 64 if block_n <= 256 else 32),
    }

    def grid(m: dict[str, Any]) -> tuple[int, int, int]:
        return triton.cdiv(lq, m["BLOCK_M"]), triton.cdiv(head_dim, m["BLOCK_DV"]), batch * heads

    if tile is None and q.is_cuda and sixteen_bit:
        tile = attention_tiles(head_dim, lq, "rows")[0]
    if tile is not None:
        block_m, block_dv, warps, stages = tile
        chosen = {"BLOCK_M": block_m, "BLOCK_DV": block_dv}
        _attention_rows_kernel[grid(chosen)](*args, **meta, **chosen, num_warps=warps, num_stages=stages,
                                             **pdl_launch(q.device))  # fmt: skip
        return
    # the interpreter and fp32 (exact-fp32 products on the FMA units): one fixed, small tile whose fp32 K chunk and
    # V slice (BLOCK_N x 32, or x 16 past 256 keys) fit the shared memory of any CUDA GPU
    block_m = max(16, min(32 if block_n <= 256 else 16, triton.next_power_of_2(lq)))
    width = 32 if block_n <= 256 else 16
    fixed = {"BLOCK_M": block_m, "BLOCK_DV": min(block_d, width)}
    meta["BLOCK_KD"] = min(block_d, width)
    _attention_rows_kernel[grid(fixed)](*args, **meta, **fixed, num_warps=4, num_stages=1, **pdl_launch(q.device))


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
    """(FLOPs, bytes) of one call by :func:`fastdiff.kernels.cost_model.attention_cost`."""
    q, k = args[:2]
    batch, heads, lq, head_dim = q.shape
    cost = cost_model.attention_cost(batch, heads, lq, k.shape[2], head_dim, q.element_size())
    return cost.flops, cost.bytes


OP = KernelOp(
    name="attention",
    triton=attention,
    ref=attention_ref,
    example_inputs=attention_example_inputs,
    cost=attention_cost,
)

__all__ = ["ATTENTION_SHAPES", "OP", "ROWS_MAX_KEYS", "SCHEDULES", "attention", "attention_ref", "split_kv_choices"]
