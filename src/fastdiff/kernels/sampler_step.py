"""One fused elementwise kernel for the generic sampler update (DDPM, DDIM, DPM-Solver++(2M)).

With ``(A, B, C, D, E, F) = coefs[i]`` read from the per-step device table ``coefs [N, 6]`` (float32)::

    x0     = A·x + B·model_output      (then clamped to [-clip_range, clip_range] when clip_range is given)
    x_next = C·x + D·x0 + E·x0_prev + F·noise

``i`` may be a Python int or a 0-d integer device tensor (read by the kernel: no host sync, so a CUDA graph
can replay the step with a new ``i``). ``x0_prev`` / ``noise`` may be None: their terms are left out at
compile time and nothing is read. Math is fp32; both outputs have ``x``'s dtype and memory layout. Any
layout works: the kernel runs over ``x``'s dense storage (contiguous or channels-last), other inputs are
copied to that layout when their strides differ.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels.registry import KernelOp

log = logging.getLogger(__name__)

BLOCK = 2048
"""Elements per program (8 warps x 8 elements per thread: 16-byte fp16 accesses)."""


def sampler_step_ref(
    x: torch.Tensor,
    model_output: torch.Tensor,
    x0_prev: torch.Tensor | None,
    noise: torch.Tensor | None,
    coefs: torch.Tensor,
    i: int | torch.Tensor,
    clip_range: float | None,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch definition in fp32 (float64 for float64 x), coefs indexed on the device; x's dtype out."""
    compute = torch.promote_types(x.dtype, torch.float32)
    a, b, c, d, e, f = coefs[i].to(compute).unbind(-1)
    x32 = x.to(compute)
    x0 = a * x32 + b * model_output.to(compute)
    if clip_range is not None:
        x0 = x0.clamp(-clip_range, clip_range)
    x_next = c * x32 + d * x0
    if x0_prev is not None:
        x_next = x_next + e * x0_prev.to(compute)
    if noise is not None:
        x_next = x_next + f * noise.to(compute)
    if out is not None:
        return out[0].copy_(x_next), out[1].copy_(x0)
    return x_next.to(x.dtype), x0.to(x.dtype)


@triton.jit(do_not_specialize=["step"])
def _sampler_step_kernel(
    x_ptr,
    model_ptr,
    x0_prev_ptr,
    noise_ptr,
    coefs_ptr,
    step_ptr,
    step,
    stride_coef_row,
    stride_coef_col,
    clip,
    x_next_ptr,
    x0_ptr,
    numel,
    STEP_IN_MEMORY: tl.constexpr,
    HAS_X0_PREV: tl.constexpr,
    HAS_NOISE: tl.constexpr,
    HAS_CLIP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    if STEP_IN_MEMORY:
        row = tl.load(step_ptr).to(tl.int64)
    else:
        row = step.to(tl.int64)
    coef = coefs_ptr + row * stride_coef_row
    a = tl.load(coef).to(tl.float32)
    b = tl.load(coef + stride_coef_col).to(tl.float32)
    c = tl.load(coef + 2 * stride_coef_col).to(tl.float32)
    d = tl.load(coef + 3 * stride_coef_col).to(tl.float32)

    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    model_out = tl.load(model_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x0 = a * x + b * model_out
    if HAS_CLIP:
        x0 = tl.minimum(tl.maximum(x0, -clip), clip)
    x_next = c * x + d * x0
    if HAS_X0_PREV:
        e = tl.load(coef + 4 * stride_coef_col).to(tl.float32)
        x_next += e * tl.load(x0_prev_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NOISE:
        f = tl.load(coef + 5 * stride_coef_col).to(tl.float32)
        x_next += f * tl.load(noise_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_next_ptr + offs, x_next.to(x_next_ptr.dtype.element_ty), mask=mask)
    tl.store(x0_ptr + offs, x0.to(x0_ptr.dtype.element_ty), mask=mask)


def _is_dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _like(name: str, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``t`` with ``x``'s shape, device and strides (copied only when the strides differ)."""
    if tuple(t.shape) != tuple(x.shape) or t.device != x.device:
        raise FastdiffError(
            f"{name} must have shape {tuple(x.shape)} on {x.device}, got {tuple(t.shape)} on {t.device}"
        )
    if t.stride() != x.stride():
        t = torch.empty_like(x, dtype=t.dtype).copy_(t)
    return t


def sampler_step(
    x: torch.Tensor,
    model_output: torch.Tensor,
    x0_prev: torch.Tensor | None,
    noise: torch.Tensor | None,
    coefs: torch.Tensor,
    i: int | torch.Tensor,
    clip_range: float | None,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused sampler step; returns ``(x_next, x0)`` (see the module docstring).

    ``out=(x_next, x0)`` writes into given tensors laid out like ``x``; they may alias ``x`` and ``x0_prev``
    (every element is read before it is written, by the same thread).
    """
    if coefs.dim() != 2 or coefs.shape[1] != 6 or coefs.device != x.device:
        raise FastdiffError(f"coefs must be a [N, 6] table on {x.device}, got {tuple(coefs.shape)} on {coefs.device}")
    if isinstance(i, torch.Tensor):
        if i.numel() != 1 or i.dtype.is_floating_point or i.device != x.device:
            raise FastdiffError(f"step index must be an int or a one-element integer tensor on {x.device}")
    elif not 0 <= int(i) < coefs.shape[0]:
        raise FastdiffError(f"step index {i} is outside the {coefs.shape[0]}-row coefficient table")
    if clip_range is not None and not clip_range > 0:
        raise FastdiffError(f"clip_range must be positive or None, got {clip_range}")
    if not _is_dense(x):
        x = x.contiguous()
    model_output = _like("model_output", model_output, x)
    if x0_prev is not None:
        x0_prev = _like("x0_prev", x0_prev, x)
    if noise is not None:
        noise = _like("noise", noise, x)
    if out is None:
        out = (torch.empty_like(x), torch.empty_like(x))
    elif any(t.shape != x.shape or t.stride() != x.stride() or t.dtype != x.dtype for t in out):
        raise FastdiffError(f"out must be two {x.dtype} tensors of shape {tuple(x.shape)} laid out like x")
    step_in_memory = isinstance(i, torch.Tensor)
    numel = x.numel()
    _sampler_step_kernel[(triton.cdiv(numel, BLOCK),)](
        x, model_output, x0_prev if x0_prev is not None else x, noise if noise is not None else x,
        coefs, i if step_in_memory else coefs, 0 if step_in_memory else int(i), *coefs.stride(),
        0.0 if clip_range is None else float(clip_range), out[0], out[1], numel,
        STEP_IN_MEMORY=step_in_memory, HAS_X0_PREV=x0_prev is not None, HAS_NOISE=noise is not None,
        HAS_CLIP=clip_range is not None, BLOCK=BLOCK, num_warps=8,
    )  # fmt: skip
    return out[0], out[1]


SAMPLE_SHAPES: dict[str, tuple[tuple[int, ...], float | None]] = {
    "small": ((2, 3, 7, 9), 1.0),
    "cifar10-b1": ((1, 3, 32, 32), 1.0),
    "cifar10-b256": ((256, 3, 32, 32), 1.0),
    "large": ((256, 3, 32, 32), 1.0),
    "sd15-b2": ((2, 4, 64, 64), None),
}
"""size -> (sample shape, clip_range): CIFAR-10 pixels (DDPM/DDIM clip to [-1, 1]), SD1.5 latents."""


def sampler_step_example_inputs(
    size: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A second-order step (x0_prev and noise both used) with the step index as a 0-d device tensor."""
    if size not in SAMPLE_SHAPES:
        raise FastdiffError(f"unknown example size {size!r}; expected one of {', '.join(SAMPLE_SHAPES)}")
    shape, clip_range = SAMPLE_SHAPES[size]
    gen = torch.Generator().manual_seed(seed)

    def draw(scale: float) -> torch.Tensor:
        t = (scale * torch.randn(shape, generator=gen)).to(device=device, dtype=dtype)
        return t.contiguous(memory_format=torch.channels_last)

    x, model_output, x0_prev, noise = draw(1.5), draw(1.0), draw(0.8), draw(1.0)
    coefs = (torch.rand((10, 6), generator=gen) * 2 - 1).to(device)
    step = torch.tensor(3, device=device)
    return (x, model_output, x0_prev, noise, coefs, step, clip_range), {}


def sampler_step_cost(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float]:
    """(3 + 3 + 2 per present term FLOPs per element; inputs read once, x_next and x0 written once)."""
    x, model_output, x0_prev, noise = args[:4]
    extra = [t for t in (x0_prev, noise) if t is not None]
    flops = (6.0 + 2.0 * len(extra)) * x.numel()
    moved = sum(t.numel() * t.element_size() for t in (x, model_output, *extra, x, x)) + 24
    return flops, float(moved)


OP = KernelOp(
    name="sampler_step",
    triton=sampler_step,
    ref=sampler_step_ref,
    example_inputs=sampler_step_example_inputs,
    cost=sampler_step_cost,
)

__all__ = ["OP", "SAMPLE_SHAPES", "sampler_step", "sampler_step_ref"]
