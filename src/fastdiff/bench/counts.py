"""FLOP and byte counts of what one U-Net step runs: the engine's ops and the eager model's profiler events,
mapped onto the per-op formulas of :mod:`fastdiff.kernels.cost_model` (its docstring states the conventions)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from fastdiff.kernels.cost_model import (
    ACT_FLOPS,
    Cost,
    attention_cost,
    attention_gate_cost,
    conv2d_cost,
    elementwise_cost,
    group_norm_cost,
    layer_norm_cost,
    linear_cost,
    matmul_cost,
)

if TYPE_CHECKING:
    from fastdiff.engine.ir import Op


def engine_op_cost(op: Op, elem_bytes: int) -> Cost:
    """The cost of one :class:`fastdiff.engine.ir.Op`, from its value shapes and params only.

    conv: :func:`conv2d_cost` (an upsampling conv reads its input at the low resolution; a bias (every U-Net conv
    has one) unless ``temb`` is set (the bias is folded into it)) + the activation and ``scale`` per output element.
    depthwise: 7x7 depthwise conv + temb add. attention: :func:`attention_cost` over H*W tokens. gate: two 1x1 convs
    to ``inter``, bias + bias + sum + ReLU (4 per hidden element), the 1x1 to one channel, its bias + sigmoid (5 per
    pixel), times x (1 per output element); x and g read, the output written, weights and biases read. center: 2x - 1.
    layer_norm: :func:`layer_norm_cost` over B*H*W tokens. linear: :func:`linear_cost` over B*H*W tokens (bias,
    GEGLU, residual, scale as the op has them). Cross-attention: :func:`attention_cost` with its K/V token count.
    """
    out, x = op.output.shape, op.inputs[0].shape
    b, c_out, h, w = out
    p = op.params
    if op.kind == "conv":
        temb = p.get("temb") is not None
        return conv2d_cost(
            b, x[1], c_out, h, w, p["ksize"], 1, elem_bytes, x[2], x[3], bias=not temb, residual=len(op.inputs) > 1,
            temb=temb, act=p.get("act"), scale=p.get("scale") is not None,
        )  # fmt: skip
    if op.kind == "depthwise":
        return conv2d_cost(b, c_out, c_out, h, w, p.get("ksize", 7), c_out, elem_bytes, bias=False, temb=True)
    if op.kind == "group_norm":
        return group_norm_cost(b, c_out, h * w, elem_bytes, act=p.get("act"))
    if op.kind == "attention":
        kv_len = op.inputs[1].shape[2] * op.inputs[1].shape[3] if p.get("cross") else h * w
        return attention_cost(b, p["heads"], h * w, kv_len, p["head_dim"], elem_bytes)
    if op.kind == "layer_norm":
        return layer_norm_cost(b * h * w, c_out, elem_bytes)
    if op.kind == "linear":
        return linear_cost(
            b * h * w, c_out, x[1], elem_bytes, bias=p["bias"],
            geglu=p["geglu"], residual=len(op.inputs) > 1, scale=p.get("scale") is not None,
        )  # fmt: skip
    if op.kind == "gate":
        return attention_gate_cost(b * h * w, c_out, op.inputs[1].shape[1], p["inter"], elem_bytes)
    if op.kind == "center":
        return elementwise_cost(math.prod(out), flops_per_element=2, elem_bytes=elem_bytes)
    raise ValueError(f"engine_op_cost: unknown op kind {op.kind!r}")


_CONVS = {f"aten::{n}" for n in ("convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution", "conv2d")}
_MATMULS = {"aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul"}
_NORMS = {"aten::native_group_norm", "aten::group_norm"}
_ELEMENTWISE = {  # name -> FLOPs per element
    **dict.fromkeys(["add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "neg", "relu", "relu_"], 1),
    **dict.fromkeys(["silu", "silu_", "gelu", "gelu_", "sigmoid", "sigmoid_", "tanh", "exp"], ACT_FLOPS),
    **dict.fromkeys(["softmax", "_softmax"], ACT_FLOPS),
    **dict.fromkeys(["copy_", "clone", "_to_copy"], 0),
}


def aten_op_cost(
    name: str, input_shapes: list[list[int]], elem_bytes: int, out_shape: list[int] | None = None
) -> Cost | None:
    """The cost of one torch-profiler event of the eager model (``record_shapes=True``: ``event.input_shapes``,
    non-tensor arguments as ``[]``); None for ops not known here.

    Convolutions: input, weight (and bias, when the third shape is ``[Cout]``); the output size is ``out_shape``
    when given, else a stride-1 'same' conv is assumed (the shapes alone do not say the stride). Matmuls:
    mm/bmm/addmm/baddbmm/linear/matmul (bias reads and adds counted as elementwise). GroupNorm and
    scaled-dot-product attention (all its ``_scaled_dot_product_*`` variants, counted flash-style). Elementwise
    ops: the broadcast output's elements, every tensor input read, one output written. The profiler nests
    events (``aten::conv2d`` > ``aten::convolution`` > ...): count one level only.
    """
    shapes = [list(s) for s in input_shapes] + [[]] * 3  # padded: missing arguments read as non-tensors
    tensors = [s for s in shapes if s]
    if not tensors:
        return None
    short = name.removeprefix("aten::")
    if name in _CONVS:
        x, wt = shapes[0], shapes[1]
        if len(x) != 4 or len(wt) != 4:
            return None
        bias = shapes[2] == [wt[0]]
        ho, wo = (x[2], x[3]) if out_shape is None else (out_shape[2], out_shape[3])
        groups = x[1] // wt[1]
        return conv2d_cost(x[0], x[1], wt[0], ho, wo, (wt[2], wt[3]), groups, elem_bytes, x[2], x[3], bias)
    if name in _MATMULS:
        addm = short in ("addmm", "baddbmm")
        a, bm = shapes[1:3] if addm else shapes[:2]
        bias_shape = shapes[0] if addm else (shapes[2] if short == "linear" else [])
        if short == "linear":
            bm = bm[::-1]  # weight is [out, in]
        if len(a) < 2 or len(bm) < 2:
            return None
        if len(bm) == 2:  # a shared right operand: fold a's leading dims into m
            batch, m, k, n = 1, math.prod(a[:-1]), a[-1], bm[1]
        else:
            batch, m, k, n = math.prod(torch.broadcast_shapes(a[:-2], bm[:-2])), a[-2], a[-1], bm[-1]
        cost = matmul_cost(m, n, k, elem_bytes)
        cost = Cost(cost.flops * batch, cost.bytes * batch)
        if bias_shape:
            cost = cost + Cost(float(batch * m * n), float(math.prod(bias_shape) * elem_bytes))
        return cost
    if name in _NORMS:
        x = shapes[0]
        return group_norm_cost(x[0], x[1], math.prod(x[2:]), elem_bytes) if len(x) >= 2 else None
    if short == "scaled_dot_product_attention" or short.startswith("_scaled_dot_product_"):
        q, k = shapes[0], shapes[1]
        if len(q) < 3 or len(k) < 3:
            return None
        return attention_cost(math.prod(q[:-2]), 1, q[-2], k[-2], q[-1], elem_bytes)
    if short in _ELEMENTWISE:
        if short == "copy_":  # copy_(dst, src): read src, write dst
            return elementwise_cost(math.prod(tensors[0]), elem_bytes=elem_bytes, flops_per_element=0)
        try:
            out = math.prod(torch.broadcast_shapes(*tensors))
        except RuntimeError:
            out = math.prod(tensors[0])
        reads = sum(math.prod(s) for s in tensors)
        return Cost(float(out * _ELEMENTWISE[short]), float((reads + out) * elem_bytes))
    return None
