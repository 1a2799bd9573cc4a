"""The engine's fp8 (``fp8=True``): which norm -> conv / GEMM pairs run in e4m3, as a transform of the op list.

A GroupNorm (+ activation) or LayerNorm whose every reader runs in fp8 writes its output in e4m3 at the scale of
its affine (:func:`fastdiff.kernels.fp8.norm_output_scale`), and those readers multiply it with e4m3 weights (per
output channel scales) on the fp8 tensor cores. A reader runs in fp8 when the norm's output is its input and never
its residual, and it is a conv the TMA kernel runs in fp8 (stride 1, no Upsample2D, input and output channels
multiples of 16) or a token GEMM of the step the TMA GEMM runs in fp8 (input channels a multiple of 16: its e4m3
rows are 16-byte aligned). In a U-Net that is both 3x3 convs of every ResNet block (most of a step's FLOPs), in
DDPMUNet also each attention's q|k|v conv, and in a Stable Diffusion U-Net each transformer block's q|k|v, cross-
attention query and GEGLU projections (after its LayerNorms) and proj_in (after the block's GroupNorm). Everything
else (shortcuts, up/down-sampling, conv_in, conv_out, the other GEMMs, attention, the norms' inputs, every op's
output) stays in the engine dtype.
"""

from __future__ import annotations

import torch

from fastdiff.engine.ir import Op, Value
from fastdiff.kernels.fp8 import fp8_supported, norm_output_scale

FP8_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
"""The activation dtypes of an fp8 engine: its e4m3 convs read and write them."""


def fp8_unsupported(
    device: torch.device, dtype: torch.dtype | None, conv_impl: str = "auto", role: str = "engine"
) -> str | None:
    """Why the engine cannot run fp8 with these settings (one line, checked in this order: the device, the
    activation ``dtype`` when given, the conv implementation), or None. ``role`` names the dtype's
    owner in the message ("engine", "pipeline"). The one home of fp8's preconditions: the engine, its step model
    and the pipeline all ask it."""
    reason = fp8_supported(device)
    if reason is not None:
        return reason
    if dtype is not None and dtype not in FP8_ACTIVATION_DTYPES:
        return f"fp8 convs read and write fp16 or bf16 activations: the {role} dtype cannot be {dtype}"
    if conv_impl == "cudnn":
        return "fp8 runs its convs on the TMA kernel: not with conv_impl='cudnn'"
    return None


def _fp8_reader(op: Op, value: Value) -> bool:
    p = op.params
    if op.inputs[0] is not value or any(v is value for v in op.inputs[1:]):
        return False
    if op.kind == "linear":
        return op.stage == "step" and value.shape[1] % 16 == 0
    return (
        op.kind == "conv"
        and p["stride"] == 1
        and p["upsample"] == 1
        and value.shape[1] % 16 == 0
        and op.output.shape[1] % 16 == 0  # not a 3-channel conv_out: cheap, and its error is the model output's
    )


def mark_fp8_ops(ops: list[Op]) -> int:
    """Mark the fp8 pairs of ``ops`` in place (the norm's and its readers' ``params["fp8_scale"]``, the norm
    output's ``Value.fp8``); returns how many convs and GEMMs run in fp8. Needs the norms' source weights
    (before the executor streams them)."""
    readers: dict[int, list[Op]] = {}
    for op in ops:
        for value in op.inputs:
            readers.setdefault(id(value), []).append(op)
    marked = 0
    for norm in ops:
        y = norm.output
        if norm.kind not in ("group_norm", "layer_norm") or norm.stage != "step":
            continue
        if y.persistent or y.concat is not None:
            continue
        users = readers.get(id(y), [])
        if not users or not all(_fp8_reader(user, y) for user in users):
            continue
        scale = norm_output_scale(norm.weights.get("weight"), norm.weights.get("bias"))
        norm.params["fp8_scale"] = scale
        y.fp8 = True
        for user in users:
            user.params["fp8_scale"] = scale
        marked += len(users)
    return marked
