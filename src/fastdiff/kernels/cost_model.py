"""FLOP and byte counts of the U-Net ops, from shapes only: the one formula per op that the kernels' ``OP.cost``
and ``fastdiff.bench.counts`` (engine ops, profiler events) both use.

Conventions (every function below):

* FLOPs: a multiply-add is 2 FLOPs; every other add, multiply, subtract or compare is 1; an activation
  (SiLU, GELU, sigmoid) is ``ACT_FLOPS`` = 4 per element, ReLU is 1. Per-channel / per-group scalar work
  (a group's mean and rsqrt, softmax row maxima) is not counted.
* Bytes: the ideal minimum traffic: each input tensor read once, each output written once, weights read once,
  all in the element size given. Intermediates a fused kernel keeps on chip (attention scores, the gate's hidden
  activation) are never counted, and neither is re-reading from caches.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def act_flops(activation: str | None) -> int:
    """FLOPs per element of an activation by name: 0 for none, 1 for ReLU, ``ACT_FLOPS`` otherwise."""
    return 0 if activation is None else (1 if activation == "relu" else ACT_FLOPS)


def conv2d_cost(
    batch: int, c_in: int, c_out: int, h_out: int, w_out: int, kernel: int | tuple[int, int], groups: int = 1,
    elem_bytes: int = 2, h_in: int | None = None, w_in: int | None = None, bias: bool = True,
    residual: bool = False, temb: bool = False, act: str | None = None, scale: bool = False,
    stats_groups: int = 0,
) -> Cost:  # fmt: skip
    """A 2-D convolution with the conv2d kernel's fused epilogue (bias, time embedding, activation, residual,
    scale) and, optionally, the GroupNorm statistics of its output.

    FLOPs = 2*B*Cout*Hout*Wout*(Cin/groups)*kh*kw, plus B*Cout*Hout*Wout for each epilogue add or multiply
    (``bias``, ``temb``: a per-(sample, channel) time-embedding addend, ``residual``, ``scale``) and
    ``act_flops(act)`` per output element. Bytes = (input B*Cin*Hin*Win + weights Cout*(Cin/groups)*kh*kw
    + output B*Cout*Hout*Wout + residual (the output's size) + bias Cout + temb B*Cout) * elem_bytes.
    ``h_in``/``w_in`` default to ``h_out``/``w_out`` (a stride-1 'same' conv).

    ``stats_groups`` > 0 (``conv2d(..., stats=)``), statistics of the output: 3 FLOPs per output element; bytes + one
    fp32 (count, mean, M2) per (sample, group) 3*B*``stats_groups`` * 4 (the minimum; the per-tile partials and
    their merge are per-group scalar work).
    """
    kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
    h_in, w_in = h_out if h_in is None else h_in, w_out if w_in is None else w_in
    out = batch * c_out * h_out * w_out
    inputs = batch * c_in * h_in * w_in
    weights = c_out * (c_in // groups) * kh * kw
    epilogue = int(bias) + int(temb) + int(residual) + int(scale) + act_flops(act) + 3 * (stats_groups > 0)
    flops = 2 * out * (c_in // groups) * kh * kw + out * epilogue
    elems = inputs + weights + out * (1 + int(residual)) + c_out * bias + batch * c_out * temb
    stat_bytes = 4 * batch * 3 * stats_groups
    return Cost(float(flops), float(elems * elem_bytes + stat_bytes))


def matmul_cost(m: int, n: int, k: int, elem_bytes: int = 2, bias: bool = False) -> Cost:
    """[m, k] @ [k, n]: 2*m*n*k FLOPs (+ m*n for a bias row added to every output row); bytes
    (m*k + k*n + m*n (+ n for the bias)) * elem_bytes."""
    return Cost(float(2 * m * n * k + m * n * bias), float((m * k + k * n + m * n + n * bias) * elem_bytes))


def group_norm_cost(
    batch: int,
    channels: int,
    hw: int,
    elem_bytes: int = 2,
    act: str | None = None,
    residual: bool = False,
    affine: bool = True,
) -> Cost:
    """GroupNorm (+ an optional activation, + an optional residual add) over ``batch*channels*hw`` elements.

    FLOPs per element: statistics 3 (add to the sum, square, add to the sum of squares) + normalise 2 (subtract
    the mean, multiply by rstd) + affine 2 (times gamma, plus beta; 0 without ``affine``) + ``act_flops(act)``
    + 1 with a residual. Bytes = (x read once + y written once (+ residual read) + gamma and beta 2*C) *
    elem_bytes.
    """
    n = batch * channels * hw
    flops = n * (5 + 2 * int(affine) + act_flops(act) + int(residual))
    return Cost(float(flops), float((n * (2 + int(residual)) + 2 * channels * int(affine)) * elem_bytes))


def layer_norm_cost(rows: int, channels: int, elem_bytes: int = 2, affine: bool = True) -> Cost:
    """LayerNorm over the ``channels`` of each of ``rows`` tokens: a GroupNorm with one group per row, so the
    same counts as :func:`group_norm_cost` with ``hw`` = 1.

    FLOPs per element: statistics 3 (add to the sum; the deviation from the mean squared and added to the sum
    of squares, a multiply-add) + normalise 2 (the deviation, times rstd) + affine 2 (times gamma, plus beta; 0
    without ``affine``) = 7. Bytes = (x read once + y written once + gamma and beta 2*C) * elem_bytes.
    """
    return group_norm_cost(rows, channels, 1, elem_bytes, affine=affine)


def linear_cost(
    m: int, n: int, k: int, elem_bytes: int = 2, bias: bool = False, geglu: bool = False, residual: bool = False,
    act: str | None = None, scale: bool = False,
) -> Cost:  # fmt: skip
    """A token-matrix linear layer ``[m, k] @ [k, n_w]`` with the linear kernel's fused epilogue; ``n`` is the
    output width (``n_w`` = 2n weight columns with ``geglu``, else n).

    FLOPs = 2*m*n_w*k, + m*n_w for the ``bias``, + m*n*(``ACT_FLOPS`` + 1) for GEGLU (GELU of the gate, times
    the value), + m*n for each of ``residual`` and ``scale``, + ``act_flops(act)`` per output element. Bytes =
    (x m*k + weights k*n_w + bias n_w + residual m*n + output m*n) * elem_bytes; the 2n-wide GEGLU intermediate
    stays on chip. Without the epilogue this is :func:`matmul_cost`.
    """
    n_w = 2 * n if geglu else n
    epilogue = (ACT_FLOPS + 1) * int(geglu) + int(residual) + int(scale) + act_flops(act)
    flops = 2 * m * n_w * k + m * n_w * int(bias) + m * n * epilogue
    elems = m * k + k * n_w + n_w * int(bias) + m * n * (1 + int(residual))
    return Cost(float(flops), float(elems * elem_bytes))


def attention_cost(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int, elem_bytes: int = 2) -> Cost:
    """Flash-style attention: FLOPs = 4*B*H*Lq*Lkv*D (Q K^T and P V; softmax and scaling not counted).
    Bytes = (Q and O: 2*B*H*Lq*D, K and V: 2*B*H*Lkv*D) * elem_bytes; the score matrix is never written."""
    flops = 4 * batch * heads * q_len * kv_len * head_dim
    return Cost(float(flops), float(2 * batch * heads * (q_len + kv_len) * head_dim * elem_bytes))


def attention_gate_cost(
    pixels: int, c_x: int, c_g: int, inter: int, elem_bytes: int = 2, hidden_biases: int = 2, psi_bias: bool = True
) -> Cost:
    """The ConvNeXt U-Net's skip gate ``x * sigmoid(w_psi . relu(w_g g + b_g + w_x x + b_x) + b_psi)`` over
    ``pixels`` = B*H*W.

    FLOPs per pixel: the 1x1 convs to ``inter`` 2*inter*(Cx + Cg) and to one channel 2*inter; per hidden
    element the ``hidden_biases`` (b_g, b_x: 0 to 2) adds, their sum and the ReLU; the ``psi_bias`` add and the
    sigmoid (``ACT_FLOPS``); times x (Cx). Bytes = (x and g read, the output written, the weights
    inter*(Cx + Cg + 1) and biases read) * elem_bytes; the hidden activation stays on chip.
    """
    flops = pixels * (2 * inter * (c_x + c_g + 1) + inter * (hidden_biases + 2) + int(psi_bias) + ACT_FLOPS + c_x)
    elems = pixels * (2 * c_x + c_g) + inter * (c_x + c_g + 1) + inter * hidden_biases + int(psi_bias)
    return Cost(float(flops), float(elems * elem_bytes))


def elementwise_cost(
    elements: int, inputs: int = 1, outputs: int = 1, flops_per_element: float = 1, elem_bytes: int = 2
) -> Cost:
    """``elements * flops_per_element`` FLOPs; bytes = elements * (inputs + outputs) * elem_bytes."""
    return Cost(float(elements * flops_per_element), float(elements * (inputs + outputs) * elem_bytes))
