"""One fused elementwise kernel for every sampler's update (DDPM, DDIM, Euler, Euler ancestral, DPM-Solver++
2M and 2M SDE, UniPC), with classifier-free guidance and the step noise drawn inside.

With the row ``coefs[i]`` of a per-step table (float32 [N, 13], columns ``COLUMNS``; see
``fastdiff.samplers.tables`` for each sampler's values) and ``out`` the model output::

    out    = out_u + g·(out_c - out_u)                  guidance only: model_output holds [uncond; cond], 2B rows;
                                                        g = 1 (the conditional output) at steps whose W is 0
    x0     = A·x + B·out                                then clamped to [-clip_range, clip_range] if given
    xc     = Kx·x + Ka·aux + K0·x0 + K1·h1 + K2·h2      corrector (UniPC) only, else xc = x
    x_next = C·xc + D·x0 + E·h1 + G·out + F·z           z ~ N(0, 1)

``h1`` / ``h2`` are the x0 of the previous two steps and ``aux`` the previous step's corrected sample. The
step returns ``(x_next, x0[, h1][, xc])``: the new history is (x0, h1) and the new aux is xc, so passing
``out=(x, h1, h2, aux)`` updates the whole sampler state in place (every element is read before it is written,
by the same thread). Terms whose tensor is None are left out at compile time and nothing is read for them.

``i`` may be a Python int or a one-element integer device tensor read by the kernel: no host sync, so a CUDA
graph replays the step at any position of the loop. The noise z is either a given tensor or, with ``seeds``
(int64 [B]), drawn in the kernel as ``fastdiff.kernels.philox_noise`` draw ``i + 1`` of image b's seed: no noise
is stored anywhere. ``model_input`` (optional) receives x_next cast to its dtype (both halves when guiding): the
next model call's input, so the loop needs no separate cast kernel. Maths is fp32; outputs have x's dtype and
layout (contiguous or channels-last); other inputs are copied to x's layout when their strides differ.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError
from fastdiff.kernels.common import grid_dependency_sync, num_sms, pdl_launch
from fastdiff.kernels.philox_noise import gaussian_noise_ref, layout_of, logical_index, normal_at
from fastdiff.kernels.registry import KernelOp

log = logging.getLogger(__name__)

COLUMNS = ("A", "B", "Kx", "Ka", "K0", "K1", "K2", "C", "D", "E", "G", "F", "W")
"""The per-step coefficient columns, in table order (see the module docstring). W is the step's guidance switch: 1
where the image's guidance scale applies, 0 where the step takes the conditional output alone (a guidance interval,
``fastdiff.samplers.make_sampler``'s ``guidance_interval``)."""
COL = {name: k for k, name in enumerate(COLUMNS)}

MAX_BLOCK = 1024
"""Elements per program of a large step (4 warps x 8 elements per thread: 16-byte fp16 accesses)."""
MIN_BLOCK = 128
"""Elements per program of a small step (one per thread)."""


def block_size(numel: int, device: torch.device) -> int:
    """Elements per program: enough programs for two per SM, each of MIN_BLOCK..MAX_BLOCK elements. A batch-1
    CIFAR step (3072 elements) then runs 24 programs of 128 instead of 3 of 1024: each thread draws its Philox
    normals one after another, and on the H100 that took 5.4 us per step against 1.8 us."""
    per_program = triton.cdiv(numel, 2 * num_sms(device))
    return max(MIN_BLOCK, min(MAX_BLOCK, triton.next_power_of_2(per_program)))


def _step_row(coefs: torch.Tensor, i: int | torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    row = coefs[i].reshape(-1).to(dtype)
    return {name: row[k] for k, name in enumerate(COLUMNS)}


def sampler_step_ref(
    x: torch.Tensor,
    model_output: torch.Tensor,
    coefs: torch.Tensor,
    i: int | torch.Tensor,
    h1: torch.Tensor | None = None,
    h2: torch.Tensor | None = None,
    aux: torch.Tensor | None = None,
    *,
    noise: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    guidance: torch.Tensor | None = None,
    clip_range: float | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
    model_input: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Plain torch definition in fp32 (float64 for float64 x); returns ``(x_next, x0[, h1][, xc])`` in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    k = _step_row(coefs, i, compute)
    xf = x.to(compute)
    model = model_output.to(compute)
    if guidance is not None:  # 1. classifier-free guidance (Ho & Salimans 2022, eq. 6)
        uncond, cond = model.chunk(2)
        g = guidance.to(compute).view(-1, *([1] * (x.dim() - 1)))
        g = torch.where(k["W"] != 0, g, torch.ones_like(g))
        model = uncond + g * (cond - uncond)
    x0 = k["A"] * xf + k["B"] * model  # 2. data prediction
    if clip_range is not None:
        x0 = x0.clamp(-clip_range, clip_range)
    h1f = None if h1 is None else h1.to(compute, copy=h2 is not None)  # a copy when it is also returned
    xc = xf
    if aux is not None:  # 3. corrector
        xc = k["Kx"] * xf + k["Ka"] * aux.to(compute) + k["K0"] * x0
        if h1f is not None:
            xc = xc + k["K1"] * h1f
        if h2 is not None:
            xc = xc + k["K2"] * h2.to(compute)
    x_next = k["C"] * xc + k["D"] * x0 + k["G"] * model  # 4. update
    if h1f is not None:
        x_next = x_next + k["E"] * h1f
    if seeds is not None:
        noise = gaussian_noise_ref(seeds, int(i) + 1, tuple(x.shape[1:]))
    if noise is not None:
        x_next = x_next + k["F"] * noise.to(compute)
    results = [x_next, x0] + ([h1f] if h2 is not None else []) + ([xc] if aux is not None else [])
    if model_input is not None:
        rows = x_next.to(model_input.dtype)
        model_input.copy_(torch.cat([rows, rows]) if guidance is not None else rows)
    if out is not None:
        return tuple(o.copy_(r) for o, r in zip(out, results, strict=True))
    return tuple(r.to(x.dtype) for r in results)


@triton.jit(do_not_specialize=["step"])
def _sampler_step_kernel(
    x_ptr, model_ptr, h1_ptr, h2_ptr, aux_ptr, noise_ptr, seeds_ptr, guidance_ptr, coefs_ptr, step_ptr, step,
    stride_coef_row, stride_coef_col, clip,
    x_next_ptr, x0_ptr, h2_out_ptr, aux_out_ptr, model_input_ptr,
    numel, per_image, channels, hw,
    STEP_IN_MEMORY: tl.constexpr, HAS_H1: tl.constexpr, HAS_H2: tl.constexpr, HAS_AUX: tl.constexpr,
    NOISE: tl.constexpr, HAS_GUIDANCE: tl.constexpr, HAS_CLIP: tl.constexpr, HAS_MODEL_INPUT: tl.constexpr,
    CHANNELS_LAST: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    grid_dependency_sync(PDL)
    if STEP_IN_MEMORY:
        row = tl.load(step_ptr).to(tl.int64)
    else:
        row = step.to(tl.int64)
    coef = coefs_ptr + row * stride_coef_row

    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = tl.load(model_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    image, logical = logical_index(offs, per_image, channels, hw, CHANNELS_LAST)
    if HAS_GUIDANCE:  # 1. guidance: rows [0, B) unconditional, [B, 2B) conditional
        cond = tl.load(model_ptr + numel + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(guidance_ptr + image, mask=mask, other=0.0)
        g = tl.where(tl.load(coef + 12 * stride_coef_col) != 0, g, 1.0)
        out = out + g * (cond - out)
    # 2. data prediction
    x0 = tl.load(coef).to(tl.float32) * x + tl.load(coef + stride_coef_col).to(tl.float32) * out
    if HAS_CLIP:
        x0 = tl.minimum(tl.maximum(x0, -clip), clip)
    if HAS_H1:
        h1 = tl.load(h1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    xc = x
    if HAS_AUX:  # 3. corrector
        xc = tl.load(coef + 2 * stride_coef_col).to(tl.float32) * x
        xc += tl.load(coef + 3 * stride_coef_col).to(tl.float32) * tl.load(aux_ptr + offs, mask=mask, other=0.0).to(
            tl.float32
        )
        xc += tl.load(coef + 4 * stride_coef_col).to(tl.float32) * x0
        if HAS_H1:
            xc += tl.load(coef + 5 * stride_coef_col).to(tl.float32) * h1
        if HAS_H2:
            h2 = tl.load(h2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            xc += tl.load(coef + 6 * stride_coef_col).to(tl.float32) * h2
    # 4. update
    x_next = tl.load(coef + 7 * stride_coef_col).to(tl.float32) * xc
    x_next += tl.load(coef + 8 * stride_coef_col).to(tl.float32) * x0
    x_next += tl.load(coef + 10 * stride_coef_col).to(tl.float32) * out
    if HAS_H1:
        x_next += tl.load(coef + 9 * stride_coef_col).to(tl.float32) * h1
    if NOISE == 1:
        z = tl.load(noise_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x_next += tl.load(coef + 11 * stride_coef_col).to(tl.float32) * z
    if NOISE == 2:
        seed = tl.load(seeds_ptr + image, mask=mask, other=0)
        x_next += tl.load(coef + 11 * stride_coef_col).to(tl.float32) * normal_at(seed, row + 1, logical)
    tl.store(x_next_ptr + offs, x_next.to(x_next_ptr.dtype.element_ty), mask=mask)
    tl.store(x0_ptr + offs, x0.to(x0_ptr.dtype.element_ty), mask=mask)
    if HAS_H2:
        tl.store(h2_out_ptr + offs, h1.to(h2_out_ptr.dtype.element_ty), mask=mask)
    if HAS_AUX:
        tl.store(aux_out_ptr + offs, xc.to(aux_out_ptr.dtype.element_ty), mask=mask)
    if HAS_MODEL_INPUT:
        cast = x_next.to(model_input_ptr.dtype.element_ty)
        tl.store(model_input_ptr + offs, cast, mask=mask)
        if HAS_GUIDANCE:
            tl.store(model_input_ptr + numel + offs, cast, mask=mask)


def _like(name: str, t: torch.Tensor, x: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """``t`` with ``x``'s shape (``rows`` times its batch), device and layout (copied only when it differs)."""
    shape = (rows * x.shape[0], *x.shape[1:])
    if tuple(t.shape) != shape or t.device != x.device:
        raise FastdiffError(f"{name} must have shape {shape} on {x.device}, got {tuple(t.shape)} on {t.device}")
    channels_last = layout_of(x)[0]
    dense = t.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    if not dense:
        t = t.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return t


def _check_vector(name: str, t: torch.Tensor | None, x: torch.Tensor, dtype: torch.dtype) -> None:
    if t is not None and (tuple(t.shape) != (x.shape[0],) or t.dtype != dtype or t.device != x.device):
        raise FastdiffError(f"{name} must be a {dtype} vector of {x.shape[0]} values on {x.device}")


def sampler_step(
    x: torch.Tensor,
    model_output: torch.Tensor,
    coefs: torch.Tensor,
    i: int | torch.Tensor,
    h1: torch.Tensor | None = None,
    h2: torch.Tensor | None = None,
    aux: torch.Tensor | None = None,
    *,
    noise: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
    guidance: torch.Tensor | None = None,
    clip_range: float | None = None,
    out: tuple[torch.Tensor, ...] | None = None,
    model_input: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Fused sampler step; returns ``(x_next, x0[, h1][, xc])`` (see the module docstring)."""
    if coefs.dim() != 2 or coefs.shape[1] != len(COLUMNS) or coefs.device != x.device:
        raise FastdiffError(
            f"coefs must be a [N, {len(COLUMNS)}] table on {x.device}, got {tuple(coefs.shape)} on {coefs.device}"
        )
    if isinstance(i, torch.Tensor):
        if i.numel() != 1 or i.dtype.is_floating_point or i.device != x.device:
            raise FastdiffError(f"step index must be an int or a one-element integer tensor on {x.device}")
    elif not 0 <= int(i) < coefs.shape[0]:
        raise FastdiffError(f"step index {i} is outside the {coefs.shape[0]}-row coefficient table")
    if clip_range is not None and not clip_range > 0:
        raise FastdiffError(f"clip_range must be positive or None, got {clip_range}")
    if noise is not None and seeds is not None:
        raise FastdiffError("pass either noise or seeds, not both")
    if h2 is not None and h1 is None:
        raise FastdiffError("h2 (the x0 two steps back) needs h1")
    _check_vector("seeds", seeds, x, torch.int64)
    _check_vector("guidance", guidance, x, torch.float32)
    if x.numel() == 0:
        raise FastdiffError(f"x is empty (shape {tuple(x.shape)}): nothing to step")
    if not (x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))):
        x = x.contiguous()
    model_output = _like("model_output", model_output, x, 2 if guidance is not None else 1)
    h1, h2, aux, noise = (
        None if t is None else _like(n, t, x)
        for n, t in zip(("h1", "h2", "aux", "noise"), (h1, h2, aux, noise), strict=True)
    )
    if model_input is not None:
        rows = 2 if guidance is not None else 1
        dense_like_x = model_input.stride() == x.stride()  # x is dense: its batch stride is one image
        if tuple(model_input.shape) != (rows * x.shape[0], *x.shape[1:]) or not dense_like_x:
            raise FastdiffError(f"model_input must be a dense tensor with {rows}x the batch of x, laid out like x")
        if model_input.device != x.device:
            raise FastdiffError(f"model_input must be on {x.device}, got {model_input.device}")
    n_out = 2 + (h2 is not None) + (aux is not None)
    if out is None:
        out = tuple(torch.empty_like(x) for _ in range(n_out))
    elif len(out) != n_out or any(
        t.shape != x.shape or t.stride() != x.stride() or t.dtype != x.dtype or t.device != x.device for t in out
    ):
        raise FastdiffError(f"out must be {n_out} {x.dtype} tensors of shape {tuple(x.shape)} laid out like x")
    channels_last, channels, hw = layout_of(x)
    step_in_memory = isinstance(i, torch.Tensor)
    numel = x.numel()
    dummy = x
    block = block_size(numel, x.device)
    _sampler_step_kernel[(triton.cdiv(numel, block),)](
        x, model_output, h1 if h1 is not None else dummy, h2 if h2 is not None else dummy,
        aux if aux is not None else dummy, noise if noise is not None else dummy,
        seeds if seeds is not None else coefs, guidance if guidance is not None else coefs, coefs,
        i if step_in_memory else coefs, 0 if step_in_memory else int(i), *coefs.stride(),
        0.0 if clip_range is None else float(clip_range),
        out[0], out[1], out[2] if h2 is not None else dummy, out[-1] if aux is not None else dummy,
        model_input if model_input is not None else dummy,
        numel, numel // x.shape[0], channels, hw,
        STEP_IN_MEMORY=step_in_memory, HAS_H1=h1 is not None, HAS_H2=h2 is not None, HAS_AUX=aux is not None,
        NOISE=1 if noise is not None else 2 if seeds is not None else 0, HAS_GUIDANCE=guidance is not None,
        HAS_CLIP=clip_range is not None, HAS_MODEL_INPUT=model_input is not None, CHANNELS_LAST=channels_last,
        BLOCK=block, num_warps=4, **pdl_launch(x.device),
    )  # fmt: skip
    return out


SAMPLE_SHAPES: dict[str, tuple[tuple[int, ...], float | None, bool]] = {
    "small": ((2, 3, 7, 9), 1.0, False),
    "cifar10-b1": ((1, 3, 32, 32), 1.0, False),
    "cifar10-b256": ((256, 3, 32, 32), 1.0, False),
    "large": ((256, 3, 32, 32), 1.0, False),
    "sd15-b2": ((1, 4, 64, 64), None, True),
}
"""size -> (sample shape, clip_range, guided): CIFAR-10 pixels (DDPM/DDIM clip to [-1, 1]), SD1.5 latents with
classifier-free guidance (a batch-2 U-Net output for one image)."""


def sampler_step_example_inputs(
    size: str, dtype: torch.dtype, device: str | torch.device, seed: int = 0
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A UniPC-shaped step (history, corrector, in-kernel noise) with the step index as a device tensor."""
    if size not in SAMPLE_SHAPES:
        raise FastdiffError(f"unknown example size {size!r}; expected one of {', '.join(SAMPLE_SHAPES)}")
    shape, clip_range, guided = SAMPLE_SHAPES[size]
    gen = torch.Generator().manual_seed(seed)

    def draw(scale: float, rows: int = 1) -> torch.Tensor:
        t = (scale * torch.randn((rows * shape[0], *shape[1:]), generator=gen)).to(device=device, dtype=dtype)
        return t.contiguous(memory_format=torch.channels_last)

    x, h1, h2, aux = draw(1.5), draw(0.8), draw(0.7), draw(1.2)
    model_output = draw(1.0, 2 if guided else 1)
    coefs = (torch.rand((10, len(COLUMNS)), generator=gen) * 2 - 1).to(device)
    seeds = torch.arange(shape[0], dtype=torch.int64, device=device) + 1000 * seed
    guidance = torch.full((shape[0],), 7.5, device=device) if guided else None
    kwargs = {"seeds": seeds, "guidance": guidance, "clip_range": clip_range}
    return (x, model_output, coefs, torch.tensor(3, device=device), h1, h2, aux), kwargs


def sampler_step_cost(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[float, float]:
    """FLOPs: 2 per coefficient term and 2 more for guidance per element (in-kernel noise counted by
    ``philox_noise``); bytes: every input tensor read once, every output written once."""
    x, model_output, _, _, *history = args
    present = [t for t in history if t is not None]
    terms = 2 + 4 + len(present) + (1 if kwargs.get("seeds") is not None or kwargs.get("noise") is not None else 0)
    flops = (2.0 * terms + (3.0 if kwargs.get("guidance") is not None else 0.0)) * x.numel()
    reads = [x, model_output, *present] + ([kwargs["noise"]] if kwargs.get("noise") is not None else [])
    n_out = 2 + (len(history) > 1 and history[1] is not None) + (len(history) > 2 and history[2] is not None)
    moved = sum(t.numel() * t.element_size() for t in reads) + n_out * x.numel() * x.element_size()
    return flops, float(moved)


OP = KernelOp(
    name="sampler_step",
    triton=sampler_step,
    ref=sampler_step_ref,
    example_inputs=sampler_step_example_inputs,
    cost=sampler_step_cost,
)

__all__ = ["COL", "COLUMNS", "OP", "SAMPLE_SHAPES", "sampler_step", "sampler_step_ref"]
