"""Counter-based Gaussian noise: the value of every element is a pure function of (seed, counter, index).

Image b's noise for draw ``counter`` (0 = x_T, i + 1 = the noise of sampler step i, see
``fastdiff.samplers.noise``) at logical element j (the NCHW index inside the image, whatever the memory layout) is

    r0, r1, r2, r3 = Philox4x32-10(key = seeds[b], counter = (j // 4, counter, 0, 0))
    (r0, r1) -> Box-Muller -> elements 4g, 4g + 1;  (r2, r3) -> Box-Muller -> elements 4g + 2, 4g + 3

with ``u1 = ((r >> 8) + 1) / 2^24`` in (0, 1], ``u2 = (r >> 8) / 2^24`` in [0, 1) (both exact in fp32) and
``sqrt(-2 ln u1) * (cos, sin)(2 pi u2)``. Nothing is stored between draws, so noise costs no memory however many
steps a sampler takes, and image b depends on ``seeds[b]`` only (any batch size or split across GPUs).

Philox is Triton's ``tl.philox`` (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3");
``philox4x32_ref`` is the same function in int64 torch arithmetic, so the integers are identical everywhere. The
normals go through fp32 ``log``/``cos``/``sin``/``sqrt``, whose last-bit rounding differs between the CPU and GPU
maths libraries: CPU and GPU noise agree to a few float32 ulps, not bit for bit. On one device a run is
reproducible bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels.common import grid_dependency_sync, pdl_launch
from fastdiff.kernels.registry import KernelOp

BLOCK = 1024
"""Elements per program of ``gaussian_noise``."""

_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_MASK32 = 0xFFFFFFFF
_TWO_PI = 6.283185307179586
_INV_2_24 = 1.0 / (1 << 24)


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of the 64-bit product of the constant ``a`` and uint32 values in int64 ``b``,
    computed in 16-bit limbs so no intermediate leaves int64's range."""
    low_limb = a * (b & 0xFFFF)  # < 2^48
    high_limb = a * (b >> 16)  # < 2^48
    low = (((high_limb & 0xFFFF) << 16) + low_limb) & _MASK32
    high = (high_limb + (low_limb >> 16)) >> 16
    return high, low


def philox4x32_ref(
    seed: torch.Tensor, c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, rounds: int = 10
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton's ``tl.philox`` in int64 torch maths: broadcastable int64 inputs (counters < 2^32), uint32 values out."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c0, c1, c2, c3 = (torch.as_tensor(c) & _MASK32 for c in (c0, c1, c2, c3))
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo32(_ROUND_B, c2)
        hi_a, lo_a = _mulhilo32(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _MASK32, (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def _box_muller_ref(r_u1: torch.Tensor, r_u2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u1 = ((r_u1 >> 8) + 1).to(torch.float32) * _INV_2_24
    theta = (r_u2 >> 8).to(torch.float32) * (_TWO_PI * _INV_2_24)
    radius = torch.sqrt(-2.0 * torch.log(u1))
    return radius * torch.cos(theta), radius * torch.sin(theta)


def gaussian_noise_ref(
    seeds: torch.Tensor,
    counter: int,
    shape: tuple[int, ...],
    *,
    channels_last: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Noise [B, *shape] in fp32 (see the module docstring) on ``seeds``' device, in plain torch."""
    seeds = seeds.to(torch.int64)
    per_image = math.prod(shape)
    groups = (per_image + 3) // 4
    g = torch.arange(groups, dtype=torch.int64, device=seeds.device)
    r0, r1, r2, r3 = philox4x32_ref(seeds[:, None], g[None, :], torch.tensor(counter, device=seeds.device), 0, 0)
    n0, n1 = _box_muller_ref(r0, r1)
    n2, n3 = _box_muller_ref(r2, r3)
    noise = torch.stack((n0, n1, n2, n3), dim=-1).reshape(seeds.shape[0], groups * 4)[:, :per_image]
    noise = noise.reshape(seeds.shape[0], *shape)
    if channels_last:
        noise = noise.contiguous(memory_format=torch.channels_last)
    if out is not None:
        return out.copy_(noise)
    return noise


@triton.jit
def normal_at(seed, counter, logical):
    """fp32 N(0, 1) for int64 per-element ``seed`` / ``logical`` index and a scalar ``counter`` (module docstring)."""
    group = (logical // 4).to(tl.uint32)
    lane = logical % 4
    zero = tl.zeros_like(group)
    r0, r1, r2, r3 = tl.philox(seed, group, zero + counter.to(tl.uint32), zero, zero)
    first_pair = lane < 2
    r_u1 = tl.where(first_pair, r0, r2)
    r_u2 = tl.where(first_pair, r1, r3)
    u1 = ((r_u1 >> 8) + 1).to(tl.float32) * 5.9604644775390625e-08
    theta = (r_u2 >> 8).to(tl.float32) * (6.283185307179586 * 5.9604644775390625e-08)
    radius = tl.sqrt(-2.0 * tl.log(u1))
    return tl.where(lane % 2 == 0, radius * tl.cos(theta), radius * tl.sin(theta))


@triton.jit
def logical_index(offs, per_image, channels, hw, CHANNELS_LAST: tl.constexpr):
    """(image, NCHW index inside the image) of storage offsets ``offs`` of a dense NCHW or NHWC tensor."""
    image = offs // per_image
    inner = offs - image * per_image
    if CHANNELS_LAST:
        inner = (inner % channels) * hw + inner // channels
    return image, inner


@triton.jit(do_not_specialize=["counter"])
def _gaussian_noise_kernel(
    seeds_ptr,
    out_ptr,
    counter,
    numel,
    per_image,
    channels,
    hw,
    CHANNELS_LAST: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_dependency_sync(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    image, logical = logical_index(offs, per_image, channels, hw, CHANNELS_LAST)
    seed = tl.load(seeds_ptr + image, mask=mask, other=0)
    tl.store(out_ptr + offs, normal_at(seed, counter, logical), mask=mask)


def layout_of(x: torch.Tensor) -> tuple[bool, int, int]:
    """(channels_last, C, H·W) of a dense 4-d tensor (any dense tensor of other rank counts as contiguous)."""
    if x.is_contiguous():
        c, hw = (x.shape[1], math.prod(x.shape[2:])) if x.dim() >= 2 else (1, 1)
        return False, c, hw
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
        return True, x.shape[1], x.shape[2] * x.shape[3]
    raise FastdiffError("noise can only be written into a contiguous or channels-last tensor")


def gaussian_noise(
    seeds: torch.Tensor,
    counter: int,
    shape: tuple[int, ...],
    *,
    channels_last: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``gaussian_noise_ref`` as one Triton kernel (on CUDA, or on the CPU under ``TRITON_INTERPRET=1``)."""
    if seeds.dim() != 1 or seeds.dtype != torch.int64:
        raise FastdiffError(f"seeds must be a 1-d int64 tensor, got {seeds.dtype} of shape {tuple(seeds.shape)}")
    full = (seeds.shape[0], *shape)
    if out is None:
        out = torch.empty(full, dtype=torch.float32, device=seeds.device)
        if channels_last:
            out = out.contiguous(memory_format=torch.channels_last)
    elif tuple(out.shape) != full or out.dtype != torch.float32 or out.device != seeds.device:
        raise FastdiffError(f"out must be fp32 {full} on {seeds.device}, got {out.dtype} {tuple(out.shape)}")
    is_cl, c, hw = layout_of(out)
    numel = out.numel()
    if numel:
        _gaussian_noise_kernel[(triton.cdiv(numel, BLOCK),)](
            seeds,
            out,
            int(counter),
            numel,
            math.prod(shape),
            c,
            hw,
            CHANNELS_LAST=is_cl,
            BLOCK=BLOCK,
            num_warps=4,
            **pdl_launch(out.device),
        )
    return out


SHAPES: dict[str, tuple[int, tuple[int, ...]]] = {
    "small": (3, (3, 7, 9)),
    "cifar10-b1": (1, (3, 32, 32)),
    "cifar10-b256": (256, (3, 32, 32)),
    "sd15-b2": (2, (4, 64, 64)),
}
"""size -> (batch, per-image shape)."""


def gaussian_noise_example_inputs(
    size: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Seeds near 2^40 (both key words used) and a mid-run counter."""
    if size not in SHAPES:
        raise FastdiffError(f"unknown example size {size!r}; expected one of {', '.join(SHAPES)}")
    batch, shape = SHAPES[size]
    seeds = torch.arange(batch, dtype=torch.int64, device=device) * 7919 + (1 << 40) + seed
    return (seeds, 17, shape), {}


def gaussian_noise_cost(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float]:
    """(~10 Philox rounds of 6 integer ops + Box-Muller per element; one fp32 write per element)."""
    seeds, _, shape = args
    numel = seeds.shape[0] * math.prod(shape)
    return 70.0 * numel, 4.0 * numel


OP = KernelOp(
    name="gaussian_noise",
    triton=gaussian_noise,
    ref=gaussian_noise_ref,
    example_inputs=gaussian_noise_example_inputs,
    cost=gaussian_noise_cost,
)

__all__ = ["OP", "gaussian_noise", "gaussian_noise_ref", "logical_index", "normal_at", "philox4x32_ref"]
