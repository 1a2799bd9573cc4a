"""FLOP and byte counts of U-Net kernels, from shapes only.

Conventions (every function below):

* FLOPs: a multiply-add is 2 FLOPs; every other add, multiply, subtract or compare is 1; an activation
  (SiLU, GELU, sigmoid) is ``ACT_FLOPS`` = 4 per element, ReLU is 1. Per-channel / per-group scalar work
  (a group's mean and rsqrt, softmax row maxima) is not counted.
* Bytes: the ideal minimum traffic: each input tensor read once, each output written once, weights read once,
  all in the element size given. Intermediates a fused kernel keeps on chip (attention scores, the gate's hidden
  activation) are never counted, and neither is re-reading from caches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fastdiff.engine.fused_unet import Op

ACT_FLOPS = 4
"""FLOPs per element of SiLU, GELU or sigmoid (the convention; ReLU counts 1)."""


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes of one kernel (or a sum of kernels)."""

    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOP/byte (0 when no bytes move)."""
        return self.flops / self.bytes if self.bytes else 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.bytes + other.bytes)


def _act_flops(act: str | None) -> int:
    return 0 if act is None else (1 if act == "relu" else ACT_FLOPS)


def conv2d_cost(
    batch: int, c_in: int, c_out: int, h_out: int, w_out: int, kernel: int | tuple[int, int], groups: int = 1,
    elem_bytes: int = 2, h_in: int | None = None, w_in: int | None = None, bias: bool = True,
    residual: bool = False, temb: bool = False,
) -> Cost:  # fmt: skip
    """A 2-D convolution with an optional fused epilogue.

    FLOPs = 2*B*Cout*Hout*Wout*(Cin/groups)*kh*kw, plus B*Cout*Hout*Wout for each epilogue add (``bias``,
    ``residual``, ``temb``: a per-(sample, channel) time-embedding addend). Bytes = (input B*Cin*Hin*Win
    + weights Cout*(Cin/groups)*kh*kw + output B*Cout*Hout*Wout + residual (the output's size) + bias Cout
    + temb B*Cout) * elem_bytes. ``h_in``/``w_in`` default to ``h_out``/``w_out`` (a stride-1 'same' conv).
    """
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    h_in, w_in = h_out if h_in is None else h_in, w_out if w_in is None else w_in
    out = batch * c_out * h_out * w_out
    weights = c_out * (c_in // groups) * kh * kw
    flops = 2 * out * (c_in // groups) * kh * kw + out * (int(bias) + int(residual) + int(temb))
    elems = batch * c_in * h_in * w_in + weights + out * (1 + int(residual)) + c_out * bias + batch * c_out * temb
    return Cost(float(flops), float(elems * elem_bytes))


def matmul_cost(m: int, n: int, k: int, elem_bytes: int = 2, bias: bool = False) -> Cost:
    """[m, k] @ [k, n]: 2*m*n*k FLOPs (+ m*n for a bias row added to every output row); bytes
    (m*k + k*n + m*n (+ n for the bias)) * elem_bytes."""
    return Cost(float(2 * m * n * k + m * n * bias), float((m * k + k * n + m * n + n * bias) * elem_bytes))


def group_norm_cost(
    batch: int, channels: int, hw: int, elem_bytes: int = 2, act: bool = False, residual: bool = False
) -> Cost:
    """GroupNorm (+ an optional activation, + an optional residual add) over ``batch*channels*hw`` elements.

    FLOPs per element: 7 = statistics 3 (add to the sum, square, add to the sum of squares) + normalise 2
    (subtract the mean, multiply by rstd) + affine 2 (times gamma, plus beta); + ACT_FLOPS (4) with an activation;
    + 1 with a residual. Bytes = (x read once + y written once (+ residual read) + gamma and beta 2*C) * elem_bytes.
    """
    n = batch * channels * hw
    flops = n * (7 + ACT_FLOPS * int(act) + int(residual))
    return Cost(float(flops), float((n * (2 + int(residual)) + 2 * channels) * elem_bytes))


def attention_cost(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, elem_bytes: int = 2) -> Cost:
    """Flash-style attention: FLOPs = 4*B*H*Lq*Lkv*D (Q K^T and P V; softmax and scaling not counted).
    Bytes = (Q and O: 2*B*H*Lq*D, K and V: 2*B*H*Lkv*D) * elem_bytes; the score matrix is never written."""
    flops = 4 * batch * heads * q_len * kv_len * head_dim
    return Cost(float(flops), float(2 * batch * heads * (q_len + kv_len) * head_dim * elem_bytes))


def elementwise_cost(
    elements: int, inputs: int = 1, outputs: int = 1, flops_per_element: float = 1, elem_bytes: int = 2
) -> Cost:
    """``elements * flops_per_element`` FLOPs; bytes = elements * (inputs + outputs) * elem_bytes."""
    return Cost(float(elements * flops_per_element), float(elements * (inputs + outputs) * elem_bytes))


def engine_op_cost(op: Op, elem_bytes: int) -> Cost:
    """The cost of one :class:`fastdiff.engine.fused_unet.Op`, from its value shapes and params only.

    conv: :func:`conv2d_cost` (an upsampling conv reads its input at the low resolution; a bias (every U-Net conv
    has one) unless ``temb`` is set (the bias is folded into it)) + the activation and ``scale`` per output element.
    depthwise: 7x7 depthwise conv + temb add. attention: :func:`attention_cost` over H*W tokens. gate: two 1x1 convs
    to ``inter``, bias + bias + sum + ReLU (4 per hidden element), the 1x1 to one channel, its bias + sigmoid (5 per
    pixel), times x (1 per output element); x and g read, the output written, weights and biases read. center: 2x - 1.
    """
    out, x = op.output.shape, op.inputs[0].shape
    b, c_out, h, w = out
    p = op.params
    if op.kind == "conv":
        temb = p.get("temb") is not None
        cost = conv2d_cost(
            b, x[1], c_out, h, w, p["ksize"], 1, elem_bytes, x[2], x[3], not temb, len(op.inputs) > 1, temb
        )
        return cost + Cost(float(b * c_out * h * w * (_act_flops(p.get("act")) + (p.get("scale") is not None))), 0)
    if op.kind == "depthwise":
        return conv2d_cost(b, c_out, c_out, h, w, p.get("ksize", 7), c_out, elem_bytes, bias=False, temb=True)
    if op.kind == "group_norm":
        return group_norm_cost(b, c_out, h * w, elem_bytes, act=p.get("act") is not None)
    if op.kind == "attention":
        return attention_cost(b, p["heads"], h * w, h * w, p["head_dim"], elem_bytes)
    if op.kind == "gate":
        inter, c_g, pixels = p["inter"], op.inputs[1].shape[1], b * h * w
        flops = pixels * (2 * inter * (c_out + c_g + 1) + 4 * inter + 1 + ACT_FLOPS + c_out)
        elems = pixels * (2 * c_out + c_g) + inter * (c_out + c_g + 1) + 2 * inter + 1
        return Cost(float(flops), float(elems * elem_bytes))
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
