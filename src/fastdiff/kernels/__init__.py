"""Triton kernels: each module holds ``<op>_ref`` (plain torch, the definition), the kernel(s), the wrapper
``<op>`` and ``OP = KernelOp(...)``. ``REGISTRY`` maps op name -> KernelOp (for the tests and benchmarks; the
engine imports the kernel functions themselves). Shared helpers live in ``common``, the FLOP/byte formulas in
``cost_model``.

Conventions: activations are logical ``[N, C, H, W]`` tensors in channels-last memory (NHWC); attention takes
``[B, heads, L, head_dim]``; layer_norm and linear take 2-D token matrices ``[B*H*W, C]`` (a channels-last
activation's rows: unit column stride, any row stride). On the GPU the kernels run fp16/bf16 with fp32
accumulation and statistics; on the CPU they run in fp32 in Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from fastdiff.kernels import (
    attention,
    attention_gate,
    conv2d,
    conv2d_tma,
    depthwise_conv2d,
    group_norm_act,
    layer_norm,
    linear,
    philox_noise,
    sampler_step,
    tap_sum_conv2d,
)
from fastdiff.kernels.registry import KernelOp

REGISTRY: dict[str, KernelOp] = {
    module.OP.name: module.OP
    for module in (
        conv2d,
        conv2d_tma,
        tap_sum_conv2d,
        depthwise_conv2d,
        group_norm_act,
        layer_norm,
        linear,
        attention,
        attention_gate,
        sampler_step,
        philox_noise,
    )
}
"""Op name -> KernelOp, in the order a U-Net forward meets them."""

__all__ = ["REGISTRY", "KernelOp"]
