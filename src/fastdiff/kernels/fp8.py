"""FP8 (e4m3) for the engine's fp8 convs: the format, the scales, the rounding, the weight packing.

e4m3 (``torch.float8_e4m3fn``, Triton's ``float8e4nv``) has 3 mantissa bits, a largest value of 448 and no
infinities; Hopper's tensor cores multiply it at twice the fp16 rate. Two things get quantised:

* a conv's weights, per output channel: ``w_scale[n] = max|W[n]| / 448``, ``W8 = e4m3(W / w_scale)``
  (:func:`fastdiff.kernels.conv2d_tma.pack_conv_weight_fp8`; K-contiguous ``[Cout, K*K*Cin]``, what fp8 wgmma
  reads);
* the activations a GroupNorm (+ activation) hands to such a conv, per tensor, with a scale taken from the
  norm's affine instead of calibration data (:func:`norm_output_scale`): a normalised value beyond
  ``NORM_BOUND`` standard deviations saturates, anything smaller keeps e4m3's full relative precision (which is
  flat over its normal range, 2^-6 .. 448 times the scale, so a generous bound costs nothing measurable).

The conv multiplies its fp32 accumulator by ``a_scale * w_scale[n]`` (one vector, folded at load) before its
epilogue; its output stays fp16/bf16.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fastdiff.errors import FastdiffError

E4M3_MAX = 448.0
"""Largest finite e4m3 value."""
FP8_DTYPE = torch.float8_e4m3fn
NORM_BOUND = 16.0
"""Standard deviations of a normalised value that the activation scale keeps unsaturated."""
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")
"""Triton's CPU interpreter rounds to e4m3 wrongly (below); compiled code uses the hardware conversion."""


def quantize_e4m3_ref(t: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``e4m3(clamp(t / scale, -448, 448))`` in torch (round to nearest even)."""
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


@triton.jit
def to_e4m3(y):
    """fp32 -> e4m3, saturating at +-448, rounded to nearest even.

    Compiled, that is the hardware conversion (``cvt.rn.satfinite.e4m3x2.f32`` on Hopper) after a clamp. Triton
    3.9's CPU interpreter drops the carry when its own rounding crosses a power of two, so there the rounding is
    done first in fp32 (3 mantissa bits kept in the normal range, multiples of 2^-9 below 2^-6) and the
    conversion only meets representable values. (The bit arithmetic cost the GroupNorm's e4m3 store 1.4x on the
    H100, hence not used there.)
    """
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if _INTERPRETED:
        bits = y.to(tl.uint32, bitcast=True)
        magnitude = (tl.abs(y) + 24576.0) - 24576.0  # 1.5 * 2^14: the sum rounds to a multiple of 2^-9 (even)
        small = magnitude.to(tl.uint32, bitcast=True) | (bits & 0x80000000)  # the sign back (-0 stays -0)
        bits = tl.where(tl.abs(y) >= 0.015625, (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000, small)
        y = bits.to(tl.float32, bitcast=True)
    return y.to(tl.float8e4nv)


def norm_output_scale(weight: torch.Tensor | None, bias: torch.Tensor | None) -> float:
    """The per-tensor e4m3 scale of a GroupNorm's output (before SiLU / GELU / ReLU, which never enlarge a
    magnitude beyond it): ``(NORM_BOUND * max|gamma| + max|beta|) / 448``."""
    gamma = 1.0 if weight is None else float(weight.detach().abs().max())
    beta = 0.0 if bias is None else float(bias.detach().abs().max())
    bound = NORM_BOUND * gamma + beta
    if not bound > 0:
        raise FastdiffError("a GroupNorm with zero weight and bias has no fp8 scale")
    return bound / E4M3_MAX


def fp8_supported(device: torch.device) -> str | None:
    """Why fp8 convs cannot run on ``device``, or None (CUDA on Hopper or newer; the CPU in Triton's interpreter)."""
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device)[0] < 9:
            return f"fp8 needs a Hopper-class GPU (compute capability 9.0), not {torch.cuda.get_device_name(device)}"
        return None
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "fp8 runs on CUDA (Hopper) or, for tests, in Triton's CPU interpreter"


__all__ = [
    "E4M3_MAX",
    "FP8_DTYPE",
    "NORM_BOUND",
    "fp8_supported",
    "norm_output_scale",
    "quantize_e4m3_ref",
    "to_e4m3",
]
