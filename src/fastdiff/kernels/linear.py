"""Linear layer on token matrices (a GEMM on the tensor cores) with a fused epilogue: bias, GEGLU, activation,
residual add and scale, for the transformer blocks' projections and feed-forward.

Layout: ``x`` is a 2-D token matrix ``[M, K]`` with unit column stride and any row stride (a channels-last
``[B, K, H, W]`` activation viewed as ``[B*H*W, K]``, or a channel slice of a wider one); ``residual`` and
``out`` are ``[M, N]`` with unit column stride and their own row strides (``out`` is allocated contiguous when
not given; it may be ``residual`` itself, an in-place residual add, but must not overlap ``x``).

Weights: nn.Linear's ``[N_w, K]`` is packed once into a contiguous ``[K, N_w]`` matrix (``W^T``, columns in
nn.Linear's output order; :func:`pack_linear_weight`). With ``geglu`` (diffusers' GEGLU:
``value, gate = proj(x).chunk(2, -1)``) ``N_w = 2N``: packed columns ``0..N-1`` are the value projection and
``N..2N-1`` the gate projection, so the packed layout is the same with and without GEGLU. ``bias`` is always
nn.Linear's own ``[N_w]`` vector (value biases, then gate biases). ``linear(..., packed=True)`` takes the packed
matrix, ``packed=False`` (the default) the raw weight, packed on every call.

Each program owns a BLOCK_M x BLOCK_N output tile and loops over K in BLOCK_K steps with fp32 accumulators
(a tf32 dot for fp32 inputs on the GPU, like conv2d; exact fp32 in the interpreter). With GEGLU it keeps two
accumulators, the value and the gate columns of the same output columns, so the 2N-wide intermediate never
reaches memory. Epilogue, in fp32, per output element ``(m, n)``::

    y = acc[m, n] + bias[n]                                            # without GEGLU
    y = (acc_v[m, n] + bias[n]) * gelu(acc_g[m, n] + bias[N + n])      # with GEGLU (exact, erf GELU)
    y = activation(y)                  # None | "silu" | "gelu" | "relu"
    y = y + residual[m, n]             # optional
    y = y * out_scale                  # optional

Few output tiles over a deep K (the mid block's 128-row feed-forward output, K = 5120) split K: each split's
programs write fp32 partial sums to a ``[split, M, N_w]`` workspace and a second launch adds them up and runs the
epilogue (:func:`_split_k` picks the count). The tile (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) is an argument:
:func:`linear_tiles` lists those worth timing, the engine's autotune times them and a kernel plan pins its pick (a
tile timed in each process could differ between processes, and with it the order of the K sums); the interpreter
runs one small fixed tile. On the H100 (fp16, CUDA-graph timings) the SD1.5
shapes took 0.8-1.5x the time of cuBLAS's bare GEMM (F.linear); the GEGLU projections ran 1.2-2.2x faster than
F.linear + torch's GEGLU (8192 x 320 -> 2 x 1280: 46 us; 34 us bare, 101 us with it); with a residual add they
took 0.6-1.15x the time of F.linear + add.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fastdiff.errors import FastdiffError
from fastdiff.kernels import cost_model
from fastdiff.kernels.common import (
    ACTIVATIONS,
    activation_ref,
    apply_activation,
    check_activation,
    grid_dependency_sync,
    num_sms,
    pdl_launch,
)
from fastdiff.kernels.conv2d import fused_epilogue
from fastdiff.kernels.fp8 import E4M3_MAX, FP8_DTYPE, quantize_e4m3_ref
from fastdiff.kernels.registry import KernelOp


def pack_linear_weight(weight: torch.Tensor, geglu: bool = False) -> torch.Tensor:
    """nn.Linear weight ``[N_w, K]`` -> contiguous ``[K, N_w]`` (``W^T``). The layout is the same with ``geglu``
    (value columns ``0..N-1``, then gate columns ``N..2N-1``); ``geglu`` only checks that N_w is even."""
    if weight.dim() != 2:
        raise FastdiffError(f"linear weight must be 2-D [N_out, K], got shape {tuple(weight.shape)}")
    if geglu and weight.shape[0] % 2:
        raise FastdiffError(f"a GEGLU weight needs an even number of rows (value, gate), got {weight.shape[0]}")
    return weight.t().contiguous()


def pack_linear_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nn.Linear weight ``[N_w, K]`` -> (e4m3 ``[N_w, K]`` contiguous, K-contiguous rows as fp8 wgmma reads them;
    fp32 per-row scales ``[N_w]``: ``max|W[n]| / 448``, 1 for an all-zero row). GEGLU's value and gate rows keep
    their order, as in :func:`pack_linear_weight`."""
    if weight.dim() != 2:
        raise FastdiffError(f"linear weight must be 2-D [N_out, K], got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    # a tensor divisor (filled where amax is: no host copy): CUDA turns a number divisor into a multiply by its
    # reciprocal, which may round otherwise than the CPU's division, and the engine packs on the device
    scale = torch.where(amax > 0, amax / amax.new_full((), E4M3_MAX), torch.ones_like(amax))
    return quantize_e4m3_ref(w, scale[:, None]).contiguous(), scale


def linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    geglu: bool = False,
    out_scale: float | None = None,
    out: torch.Tensor | None = None,
    packed: bool = False,
    split_k: int | None = None,
    tile: tuple[int, int, int, int, int] | None = None,
) -> torch.Tensor:
    """Plain torch definition of :func:`linear`, in fp32 (float64 stays float64), cast to ``x.dtype``: ``x @ W^T
    + bias``, GEGLU ``value * gelu(gate)`` of its two halves, activation, + residual, * out_scale (``split_k``
    is ignored)."""
    compute = torch.promote_types(x.dtype, torch.float32)
    w = weight.t() if packed else weight
    y = F.linear(x.to(compute), w.to(compute), None if bias is None else bias.to(compute))
    if geglu:
        value, gate = y.chunk(2, dim=-1)
        y = value * F.gelu(gate)
    y = activation_ref(y, activation)
    if residual is not None:
        y = y + residual.to(compute)
    if out_scale is not None:
        y = y * out_scale
    y = y.to(x.dtype)
    if out is not None:
        return out.copy_(y)
    return y


@triton.jit
def _epilogue_store(
    acc,
    acc_g,
    offs_m,
    offs_n,
    M,
    N,
    bias_ptr,
    res_ptr,
    out_ptr,
    stride_rm,
    stride_om,
    out_scale,
    GEGLU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
):
    """The fused epilogue of an fp32 output tile (``acc_g``: its gate columns' sums, GEGLU only), stored."""
    m_mask = offs_m < M
    n_mask = offs_n < N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GEGLU:
            acc_g += tl.load(bias_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GEGLU:
        acc = acc * apply_activation(acc_g, 2)  # value * exact GELU(gate)
    # The rest of the epilogue is conv2d's (activation, residual, scale; no bias or time embedding here).
    rows = offs_m.to(tl.int64)
    acc = fused_epilogue(
        acc, offs_m, offs_n, m_mask, n_mask, bias_ptr, bias_ptr, 0, 0, res_ptr + rows * stride_rm, 1, out_scale,
        False, False, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    part_ptr,
    M,
    N,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_wk,
    stride_wn,
    stride_rm,
    stride_om,
    stride_ps,
    stride_pm,
    out_scale,
    GEGLU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    PARTIAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: a BLOCK_M x BLOCK_N tile of the [M, N] output over the K slice of split ``program_id(1)``
    (K_PER_SPLIT long); GEGLU adds the gate columns' accumulator. Without PARTIAL (one split) the epilogue runs
    and ``out`` is written; with it the fp32 sums go to ``part`` [split, M, N_w] (value, then gate columns)."""
    # Grouped program order: GROUP_M row blocks share the weight columns in L2.
    grid_dependency_sync(PDL)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % pids_per_group) % group_size
    pid_n = (pid % pids_per_group) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    k_start = tl.program_id(1) * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    # Edge row tiles load wrapped-around rows (valid memory, never stored): no row mask on the x loads.
    load_m = (offs_m % M).to(tl.int64)
    x_ptrs = x_ptr + load_m[:, None] * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = w_ptr + (k_start + offs_k)[:, None] * stride_wk + offs_n[None, :] * stride_wn
    g_ptrs = w_ptrs + N * stride_wn  # the gate columns of the same outputs (GEGLU only)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            w_mask = n_mask[None, :]
        else:
            k_mask = offs_k < k_end - k0
            a = tl.load(x_ptrs, mask=k_mask[None, :], other=0.0)
            w_mask = k_mask[:, None] & n_mask[None, :]
        acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0), acc)
        if GEGLU:
            acc_g = tl.dot(a, tl.load(g_ptrs, mask=w_mask, other=0.0), acc_g)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
        g_ptrs += BLOCK_K * stride_wk

    if PARTIAL:
        mask = (offs_m < M)[:, None] & n_mask[None, :]
        part = part_ptr + tl.program_id(1) * stride_ps + offs_m.to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
        tl.store(part, acc, mask=mask)
        if GEGLU:
            tl.store(part + N, acc_g, mask=mask)
    else:
        _epilogue_store(
            acc, acc_g, offs_m, offs_n, M, N, bias_ptr, res_ptr, out_ptr, stride_rm, stride_om, out_scale,
            GEGLU, HAS_BIAS, HAS_RES, ACT, HAS_SCALE,
        )  # fmt: skip


@triton.jit
def _split_k_epilogue_kernel(
    part_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    M,
    N,
    SPLIT,
    stride_ps,
    stride_pm,
    stride_rm,
    stride_om,
    out_scale,
    GEGLU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: the SPLIT partial sums of a BLOCK_M x BLOCK_N output tile added up, then the epilogue."""
    grid_dependency_sync(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    ptrs = part_ptr + offs_m.to(tl.int64)[:, None] * stride_pm + offs_n[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for split in range(SPLIT):
        acc += tl.load(ptrs + split * stride_ps, mask=mask, other=0.0)
        if GEGLU:
            acc_g += tl.load(ptrs + split * stride_ps + N, mask=mask, other=0.0)
    _epilogue_store(
        acc, acc_g, offs_m, offs_n, M, N, bias_ptr, res_ptr, out_ptr, stride_rm, stride_om, out_scale,
        GEGLU, HAS_BIAS, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip


@triton.jit
def _linear_tma_kernel(
    x_desc,
    w_desc,
    scale_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_rm,
    stride_om,
    out_scale,
    GEGLU: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    ACT: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
):
    """:func:`_linear_kernel` (one split) with its A and B tiles brought in by TMA bulk copies: the copy engine
    zero-fills rows past M and columns past K, so no masks; a value tile's columns past N read gate columns (or
    zeros past N_w) that only reach outputs the store masks off. FP8: e4m3 operands, the weights ``[N_w, K]``
    (K-contiguous, what fp8 wgmma reads), each accumulator column times ``scale[n]`` before the epilogue."""
    grid_dependency_sync(PDL)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    group_size = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % pids_per_group) % group_size
    pid_n = (pid % pids_per_group) // group_size
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = x_desc.load([m0, k0])
        if FP8:
            acc = tl.dot(a, w_desc.load([n0, k0]).T, acc)
            if GEGLU:
                acc_g = tl.dot(a, w_desc.load([N + n0, k0]).T, acc_g)
        else:
            acc = tl.dot(a, w_desc.load([k0, n0]), acc)
            if GEGLU:
                acc_g = tl.dot(a, w_desc.load([k0, N + n0]), acc_g)
    if FP8:  # back to real units: the activation's scale times each weight column's, folded at load
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = acc * tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if GEGLU:
            acc_g = acc_g * tl.load(scale_ptr + N + offs_n, mask=n_mask, other=0.0)[None, :]
    _epilogue_store(
        acc, acc_g, m0 + tl.arange(0, BLOCK_M), n0 + tl.arange(0, BLOCK_N), M, N, bias_ptr, res_ptr, out_ptr,
        stride_rm, stride_om, out_scale, GEGLU, HAS_BIAS, HAS_RES, ACT, HAS_SCALE,
    )  # fmt: skip


_linear_even_k = triton.heuristics(
    {"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0 and args["K_PER_SPLIT"] % args["BLOCK_K"] == 0}
)(_linear_kernel)

TUNING_CONFIGS: list[tuple[int, int, int, int, int]] = [
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (64, 128, 32, 4, 4),
    (64, 64, 64, 4, 3),
]
"""CUDA: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tiles (:func:`linear_tiles`); the small one is for
few-row GEMMs (cross-attention K/V: 154 rows)."""
FEW_ROWS = 256
"""At most this many rows, the default tile is the small one (the last of :data:`TUNING_CONFIGS`)."""
INTERPRETER_CONFIG = (32, 32, 32, 4, 1)
"""The one tile of the CPU interpreter (small, so the tests' odd shapes cross tile edges)."""
SPLIT_ALIGN = 64
"""K per split is a multiple of this (the largest BLOCK_K), so only the last split can end in a partial step."""
SPLIT_DEPTH = 1024
"""Least K per split when splitting is picked by size."""
MAX_SPLIT = 4
"""Most K splits picked by size."""
EPILOGUE_BLOCK = 64
"""Tile side of the split-K epilogue kernel."""


def linear_tiles(m: int, tma: bool = False) -> tuple[tuple[int, int, int, int, int], ...]:
    """The tiles of ``linear`` on CUDA for a GEMM of ``m`` rows, the default first (the small tile for at most
    :data:`FEW_ROWS` rows, else the first of :data:`TUNING_CONFIGS`). Pass one as ``tile=``. ``tma``: those of the
    TMA form, the 4-warp ones only: Triton 3.6's TMA pipelines gave wrong, run-to-run varying results with 8 warps
    (two consumer warpgroups) on short reduction loops (CONTRIBUTING.md; ``conv2d_tma.default_config``), and a
    token GEMM's loop is 5-80 steps."""
    configs = [t for t in TUNING_CONFIGS if not tma or t[3] == 4]
    default = configs[-1] if m <= FEW_ROWS else configs[0]
    return (default, *(t for t in configs if t != default))


def _check_tile(tile: object) -> tuple[int, int, int, int, int]:
    if (
        not isinstance(tile, tuple)
        or len(tile) != 5
        or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in tile)
        or any(x & (x - 1) for x in tile[:4])
        or tile[2] > SPLIT_ALIGN
    ):
        raise FastdiffError(
            "tile must be (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): positive ints, the first four powers "
            f"of 2, BLOCK_K at most {SPLIT_ALIGN}; got {tile!r}"
        )
    return tile


def _split_k(m: int, n: int, k: int, device: torch.device) -> int:
    """K splits picked by size: 1 unless the 128x128 output tiles fill under a quarter of the SMs and K is deep
    (at least SPLIT_DEPTH per split); then up to MAX_SPLIT, about one program per two SMs.

    On the H100 (fp16, CUDA-graph timings) only the mid block's feed-forward output gained: 128 x 5120 -> 1280
    (10 tiles) ran 17.6 / 14.0 / 12.0 / 15.2 us in 1 / 2 / 4 / 8 splits; with 40 tiles (512 rows) splits gained
    under 10% or lost, and for K <= 1280 (GEGLU 1280 -> 2 x 5120 at 128 rows, 154-row cross-attention K/V)
    every split lost. One SM off CUDA, so the interpreter never splits by itself.
    """
    tiles = triton.cdiv(m, 128) * triton.cdiv(n, 128)
    sms = num_sms(device)
    if 4 * tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(sms, 2 * tiles), k // SPLIT_DEPTH, MAX_SPLIT))


def tma_linear_unsupported(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why ``linear(x, weight, packed=True, tma=True)`` cannot run, or None: a Hopper-class GPU (or Triton's
    interpreter), 16-bit or e4m3 inputs, unit column strides and 16-byte aligned base pointers and row strides (TMA
    descriptors)."""
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] < 9:
        return "TMA needs a Hopper-class GPU (compute capability 9.0 or newer)"
    if x.dtype not in (torch.float16, torch.bfloat16, FP8_DTYPE):
        return f"dtype {x.dtype} is not fp16, bf16 or e4m3"
    if any(t.stride(1) != 1 for t in (x, weight)):
        return "TMA needs unit column strides"
    size = x.element_size()
    if any(t.data_ptr() % 16 or t.stride(0) * size % 16 for t in (x, weight)):
        return "TMA needs 16-byte aligned base pointers and row strides"
    return None


def _check_rows(name: str, t: torch.Tensor, shape: tuple[int, int], device: torch.device) -> None:
    """A FastdiffError unless ``t`` is a 2-D ``shape`` matrix on ``device`` with unit column stride."""
    if tuple(t.shape) != shape or t.device != device:
        raise FastdiffError(f"{name} must have shape {shape} on {device}, got {tuple(t.shape)} on {t.device}")
    if t.stride(1) != 1 and shape[1] > 1:
        raise FastdiffError(f"{name} needs unit column stride, got strides {t.stride()}")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    geglu: bool = False,
    out_scale: float | None = None,
    out: torch.Tensor | None = None,
    packed: bool = False,
    split_k: int | None = None,
    tile: tuple[int, int, int, int, int] | None = None,
    tma: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused ``((act(geglu(x @ W^T + bias)) + residual) * out_scale`` on a token matrix ``x`` [M, K] -> [M, N].

    ``weight``: nn.Linear's ``[N_w, K]`` (``packed=False``) or :func:`pack_linear_weight`'s ``[K, N_w]``
    (``packed=True``; pack once at load); N_w = 2N with ``geglu``, else N. ``bias``: ``[N_w]``. ``x``,
    ``residual`` [M, N] and ``out`` [M, N]: unit column stride, any row stride. Accumulation is fp32.
    ``split_k``: K slices summed by a second launch (fp32 partials) for few-tile, deep-K shapes; None picks by
    size (tests force it). ``tile``: one of :func:`linear_tiles` (None: on CUDA its default for ``M``, the small
    tile for fp32, in the interpreter one small tile); the same tile gives the same bytes. ``tma``: the kernel
    whose tiles arrive by TMA bulk copies (Hopper; one split: ``split_k`` None or 1; :func:`tma_linear_unsupported`
    says when it cannot run; its tiles: :func:`linear_tiles` with ``tma=True``).

    An e4m3 ``x`` (``fastdiff.kernels.fp8``: the output of a LayerNorm or GroupNorm that wrote e4m3) runs on the
    TMA kernel (``tma=True``) with :func:`pack_linear_weight_fp8`'s ``[N_w, K]`` e4m3 weight (``packed=True``) and
    ``weight_scale`` [N_w] fp32: the activation's scale times each weight row's, folded at load. The output (and
    ``residual``) are then fp16 (or ``out``'s dtype, fp16 or bf16).
    """
    if x.dim() != 2:
        raise FastdiffError(f"linear input must be a 2-D token matrix [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    if x.stride(1) != 1 and k > 1:
        raise FastdiffError(f"linear input needs unit column stride, got strides {x.stride()}")
    fp8 = x.dtype == FP8_DTYPE
    if fp8 and not (tma and packed and weight_scale is not None):
        raise FastdiffError("an e4m3 input runs on the TMA kernel: tma=True, packed=True and a weight_scale")
    if weight.dim() != 2 or weight.shape[1 if fp8 or not packed else 0] != k:
        layout = "[N_w, K]" if fp8 or not packed else "packed [K, N_w]"
        raise FastdiffError(f"linear weight {tuple(weight.shape)} is not a {layout} matrix for K={k}")
    if weight.device != x.device or weight.dtype != x.dtype:
        raise FastdiffError(f"weight ({weight.dtype}, {weight.device}) must match input ({x.dtype}, {x.device})")
    if not packed:
        weight = pack_linear_weight(weight, geglu)
    n_w = weight.shape[0 if fp8 else 1]
    if fp8 and (
        weight_scale is None or tuple(weight_scale.shape) != (n_w,) or weight_scale.dtype != torch.float32
        or weight_scale.device != x.device or not weight_scale.is_contiguous()
    ):  # fmt: skip
        raise FastdiffError(f"weight_scale must be a contiguous float32 tensor of shape ({n_w},) on {x.device}")
    if geglu and n_w % 2:
        raise FastdiffError(f"a GEGLU weight needs an even number of output columns (value, gate), got {n_w}")
    n = n_w // 2 if geglu else n_w
    check_activation(activation)
    if split_k is not None and (isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1):
        raise FastdiffError(f"split_k must be None or a positive int, got {split_k!r}")
    if tile is not None:
        _check_tile(tile)
    if bias is not None:
        if tuple(bias.shape) != (n_w,) or bias.device != x.device:
            raise FastdiffError(f"bias must have shape ({n_w},) on {x.device}, got {tuple(bias.shape)}")
        if not bias.is_contiguous():
            raise FastdiffError("bias must be contiguous")
    if residual is not None:
        _check_rows("residual", residual, (m, n), x.device)
    out_dtypes = (torch.float16, torch.bfloat16) if fp8 else (x.dtype,)
    if out is not None:
        _check_rows("out", out, (m, n), x.device)
        if out.dtype not in out_dtypes:
            raise FastdiffError(f"out must be a {' or '.join(map(str, out_dtypes))} tensor, got {out.dtype}")
    else:
        out = torch.empty((m, n), device=x.device, dtype=out_dtypes[0])
    if m == 0 or n == 0:
        return out

    if tma:
        if split_k not in (None, 1):
            raise FastdiffError(f"the TMA linear kernel does not split K (split_k={split_k})")
        reason = tma_linear_unsupported(x, weight)
        if reason is not None:
            raise FastdiffError(f"linear(tma=True): {reason}")
        split_k = 1
    split = _split_k(m, n, k, x.device) if split_k is None else split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split), SPLIT_ALIGN) * SPLIT_ALIGN if split > 1 else k
    split = triton.cdiv(k, k_per_split) if split > 1 else 1
    if split > 1:
        part = torch.empty((split, m, n_w), device=x.device, dtype=torch.float32)
    else:
        part, k_per_split = out, k  # unused: the GEMM writes out itself
    res = residual if residual is not None else out
    bias_arg = bias if bias is not None else out
    scale = 1.0 if out_scale is None else float(out_scale)
    flags = {
        "GEGLU": geglu,
        "HAS_BIAS": bias is not None,
        "HAS_RES": residual is not None,
        "ACT": ACTIVATIONS[activation],
        "HAS_SCALE": out_scale is not None,
    }
    args = (
        x, weight, bias_arg, res, out, part, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), weight.stride(1), res.stride(0), out.stride(0), m * n_w, n_w, scale,
    )  # fmt: skip
    if tile is None:  # fp32 on CUDA: the small tile (the large ones need ~200 KB of shared memory in fp32)
        tile = (
            INTERPRETER_CONFIG
            if not x.is_cuda
            else TUNING_CONFIGS[-1]
            if x.dtype == torch.float32
            else linear_tiles(m, tma)[0]
        )
    block_m, block_n, block_k, num_warps, num_stages = tile
    if tma:
        x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, block_k])
        w_shape, w_block = ([n_w, k], [block_n, block_k]) if fp8 else ([k, n_w], [block_k, block_n])
        w_desc = TensorDescriptor(weight, w_shape, [weight.stride(0), 1], w_block)
        scales = weight_scale if fp8 else out
        _linear_tma_kernel[(triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)](
            x_desc, w_desc, scales, bias_arg, res, out, m, n, k, res.stride(0), out.stride(0), scale, **flags,
            FP8=fp8, GROUP_M=8, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
            num_stages=num_stages, **pdl_launch(x.device),
        )  # fmt: skip
        return out
    _linear_even_k[(triton.cdiv(m, block_m) * triton.cdiv(n, block_n), split)](
        *args, **flags, PARTIAL=split > 1, GROUP_M=8,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        **pdl_launch(x.device),
    )  # fmt: skip
    if split > 1:
        _split_k_epilogue_kernel[(triton.cdiv(m, EPILOGUE_BLOCK), triton.cdiv(n, EPILOGUE_BLOCK))](
            part, bias_arg, res, out, m, n, split, m * n_w, n_w, res.stride(0), out.stride(0), scale,
            **flags, BLOCK_M=EPILOGUE_BLOCK, BLOCK_N=EPILOGUE_BLOCK, num_warps=4, **pdl_launch(x.device),
        )  # fmt: skip
    return out


LINEAR_SHAPES: dict[str, tuple[int, int, int, bool, bool, bool]] = {
    "small": (45, 40, 24, True, True, True),
    "sd15-b2-ff": (2 * 64 * 64, 320, 1280, True, True, False),
    "sd15-b2-proj": (2 * 64 * 64, 320, 320, False, True, True),
    "sd15-b2-kv": (2 * 77, 768, 320, False, False, False),
}
"""size -> (M tokens, K, N, geglu, bias, residual): SD1.5 at batch 2 in the first transformer block (64x64
latent, 320 channels): the feed-forward's GEGLU projection (320 -> 2 x 1280), the attention output projection
+ residual, and a cross-attention K/V projection of the 77 text tokens (768 -> 320, no bias). "small" runs
every epilogue stage."""


def linear_example_inputs(
    size: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Contiguous tokens, packed weights (``packed=True``) scaled by 1/sqrt(K), and the size's epilogue."""
    if size not in LINEAR_SHAPES:
        raise FastdiffError(f"unknown example size {size!r}; expected one of {', '.join(LINEAR_SHAPES)}")
    m, k, n, geglu, has_bias, has_res = LINEAR_SHAPES[size]
    n_w = 2 * n if geglu else n
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)

    x = draw(m, k)
    weight = pack_linear_weight(draw(n_w, k, scale=k**-0.5), geglu)
    bias = draw(n_w, scale=0.1) if has_bias else None
    kwargs: dict[str, Any] = {"geglu": geglu, "packed": True}
    if has_res:
        kwargs["residual"] = draw(m, n)
    return (x, weight, bias), kwargs


def linear_cost(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float]:
    """(FLOPs, bytes) of one call by :func:`fastdiff.kernels.cost_model.linear_cost`."""
    x, weight = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    geglu = kwargs.get("geglu", False)
    n_w = weight.shape[1] if kwargs.get("packed", False) else weight.shape[0]
    m, k = x.shape
    cost = cost_model.linear_cost(
        m, n_w // 2 if geglu else n_w, k, x.element_size(), bias=bias is not None, geglu=geglu,
        residual=kwargs.get("residual") is not None, act=kwargs.get("activation"),
        scale=kwargs.get("out_scale") is not None,
    )  # fmt: skip
    return cost.flops, cost.bytes


OP = KernelOp(
    name="linear",
    triton=linear,
    ref=linear_ref,
    example_inputs=linear_example_inputs,
    cost=linear_cost,
)

__all__ = ["LINEAR_SHAPES", "OP", "linear", "linear_ref", "pack_linear_weight"]
