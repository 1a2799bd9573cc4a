"""The launch of one op on one implementation: :func:`build_call` returns a closure over the op's bound tensors
(arena views, device weights) that runs it, one builder per op kind (:data:`BUILDERS`).

A conv running a fusion with a partner op (``engine/fusion.py``) gets its kernel arguments from the fusion
(:meth:`fastdiff.engine.fusion.Fusion.conv_args`); a partner that runs inside its conv's launch (``fused``) launches
nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fastdiff.engine.epilogue_norm import norm_partials
from fastdiff.engine.fusion import BoundModel
from fastdiff.engine.impl import Impl
from fastdiff.engine.ir import Op, tokens
from fastdiff.errors import FastdiffError
from fastdiff.kernels.attention import attention
from fastdiff.kernels.attention_gate import attention_gate
from fastdiff.kernels.common import activation_ref
from fastdiff.kernels.conv2d import conv2d
from fastdiff.kernels.conv2d_gluon import conv2d_gluon, default_gluon_config
from fastdiff.kernels.conv2d_tma import conv2d_tma
from fastdiff.kernels.depthwise_conv2d import depthwise_conv2d
from fastdiff.kernels.group_norm_act import group_norm_act
from fastdiff.kernels.layer_norm import layer_norm
from fastdiff.kernels.linear import linear
from fastdiff.kernels.tap_sum_conv2d import tap_columns, tap_sum_conv2d

Call = Callable[[], None]


def build_call(model: BoundModel, op: Op, impl: Impl) -> Call:
    """The launch of ``op`` on ``impl`` over ``model``'s bound tensors and device weights."""
    if not impl.launches:  # run inside another op's launch (a shortcut conv, an epilogue GroupNorm)
        return _nothing
    if op.kind not in BUILDERS:
        raise FastdiffError(f"internal: unknown op kind {op.kind}")
    return BUILDERS[op.kind](model, op, impl)


def _nothing() -> None:
    return None


def conv_call(model: BoundModel, op: Op, impl: Impl) -> Call:
    x, out = model.tensor(op.inputs[0]), model.tensor(op.output)
    w, p = model.device_weights[op.name], op.params
    temb = None
    if p["temb"] is not None:
        channels = op.output.shape[1]
        temb = model.temb_row[:, p["temb"] : p["temb"] + channels].expand(model.batch, channels)
    stride, padding, act, up = p["stride"], p["padding"], p["act"], p["upsample"]
    if "pad_end" in p and impl.kernel == "cudnn":  # the library weight has the extra first tap row and column
        padding += 1
    elif "pad_end" in p:  # (top/left, bottom/right): the gather kernel's bounds check pads the end
        padding = (padding, p["pad_end"])
    residual = model.tensor(op.inputs[1]) if len(op.inputs) > 1 else None
    kw: dict[str, Any] = dict(
        bias=w.get("bias"), padding=padding, time_emb=temb, residual=residual, out_scale=p["scale"], out=out
    )
    for fusion in model.fusions:  # -sc, -gn, -st: the partner's operands (engine/fusion.py)
        if impl.fuses(fusion.tag):
            kw.update(fusion.conv_args(model, op, model.pairs[fusion.tag][op.name]))
    split_k = impl.split_k  # -k<N>: the reduction split N ways
    workspace = model.split_workspace if split_k > 1 else None
    if impl.kernel == "triton-tma" and impl.fp8:
        packed, weight_scale = w["packed_fp8"], w["weight_scale"]
        return lambda: conv2d_tma(
            x, packed, **kw, activation=act, weight_scale=weight_scale, split_k=split_k, workspace=workspace
        )
    if impl.kernel == "triton-taps":
        raw, packed, partials = w["weight"], w["packed_taps"], tap_partials(model, op)
        return lambda: tap_sum_conv2d(x, raw, kw["bias"], padding=padding, out=out, packed=packed, partials=partials)
    if impl.kernel == "gluon":
        packed, (_, cout, ho, wo) = w["packed"], op.output.shape
        config = default_gluon_config(model.batch, ho, wo, cout, model.device)
        if impl.programs_per_sm == 2:  # persistent: two programs per SM loop over the tiles
            config = dataclasses.replace(config, programs_per_sm=2)
        return lambda: conv2d_gluon(x, packed, **kw, config=config)
    if impl.kernel == "triton-tma":
        packed = w["packed_up2"] if up == 2 else w["packed"]
        return lambda: conv2d_tma(x, packed, **kw, activation=act, upsample=up, split_k=split_k, workspace=workspace)
    if impl.kernel == "triton":  # the gather kernel
        packed = w["packed"]
        return lambda: conv2d(
            x, packed, **kw, stride=stride, activation=act, upsample=up, split_k=split_k, workspace=workspace
        )
    if impl.kernel != "cudnn":
        raise FastdiffError(f"internal: {impl} is no conv implementation")
    return _cudnn_conv(x, w["weight"], kw, stride, act, up)


def _cudnn_conv(x: torch.Tensor, weight: torch.Tensor, kw: dict, stride: int, act: str | None, up: int) -> Call:
    """cuDNN conv (+ bias), then the epilogue in as few torch ops as the flags allow."""
    bias, padding, temb, residual, scale, out = (
        kw[k] for k in ("bias", "padding", "time_emb", "residual", "out_scale", "out")
    )
    temb4 = None if temb is None else temb[:, :, None, None]

    def cudnn_conv() -> None:
        src = x if up == 1 else F.interpolate(x, scale_factor=float(up), mode="nearest")
        y = F.conv2d(src, weight, bias, stride=stride, padding=padding)
        if temb4 is not None:
            y += temb4
        if act is not None:
            y = activation_ref(y, act)
        write_epilogue(y, residual, scale, out)

    return cudnn_conv


def tap_partials(model: BoundModel, op: Op) -> torch.Tensor:
    """The fp32 stage-1 buffer of a ``triton-taps`` conv: one per op, made when its call is first built."""
    if op.name not in model.tap_partials:
        (n, _, h, w), cout, k = op.inputs[0].shape, op.output.shape[1], op.params["ksize"]
        cols = tap_columns(k, cout)
        model.tap_partials[op.name] = torch.empty(
            (n, cols, h, w), device=model.device, dtype=torch.float32, memory_format=torch.channels_last
        )
    return model.tap_partials[op.name]


def linear_call(model: BoundModel, op: Op, impl: Impl) -> Call:
    x, out = tokens(model.tensor(op.inputs[0])), tokens(model.tensor(op.output))
    residual = tokens(model.tensor(op.inputs[1])) if len(op.inputs) > 1 else None
    w, geglu, scale = model.device_weights[op.name], op.params["geglu"], op.params["scale"]
    bias = w.get("bias")
    if impl.fp8:  # e4m3 input from its norm, e4m3 weights [N_w, K]: the TMA kernel
        packed, weight_scale, tile = w["packed_fp8"], w["weight_scale"], impl.tile or None
        return lambda: linear(
            x, packed, bias, residual=residual, geglu=geglu, out_scale=scale, out=out, packed=True, tile=tile,
            tma=True, weight_scale=weight_scale,
        )  # fmt: skip
    weight_t = w["packed"]
    if impl.kernel in ("triton", "triton-tma"):
        tile, tma = impl.tile or None, impl.kernel == "triton-tma"
        return lambda: linear(
            x, weight_t, bias, residual=residual, geglu=geglu, out_scale=scale, out=out, packed=True, tile=tile, tma=tma
        )
    half = out.shape[1]

    def cublas_linear() -> None:  # cuBLAS GEMM (+ bias), then the epilogue in torch ops
        y = torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)
        if geglu:
            y = y[:, :half] * F.gelu(y[:, half:])
        write_epilogue(y, residual, scale, out)

    return cublas_linear


def write_epilogue(y: torch.Tensor, residual: torch.Tensor | None, scale: float | None, out: torch.Tensor) -> None:
    """The tail of a vendor-library op's epilogue in torch: ``out = (y + residual) * scale`` (each where given)."""
    if residual is not None:
        torch.add(y, residual, out=out)
    else:
        out.copy_(y)
    if scale is not None:
        out.mul_(scale)


def depthwise_call(model: BoundModel, op: Op, impl: Impl) -> Call:
    x, out = model.tensor(op.inputs[0]), model.tensor(op.output)
    channels, offset = op.output.shape[1], op.params["temb"]
    temb = model.temb_row[:, offset : offset + channels].expand(model.batch, channels)
    w = model.device_weights[op.name]
    if impl.kernel == "triton":
        packed = w["packed"]
        return lambda: depthwise_conv2d(x, packed, None, time_emb=temb, out=out)
    weight, temb4 = w["weight"], temb[:, :, None, None]
    return lambda: torch.add(F.conv2d(x, weight, None, padding=3, groups=channels), temb4, out=out)


def attention_call(model: BoundModel, op: Op, impl: Impl) -> Call:
    core = model.tensor(op.output)
    heads, head_dim = op.params["heads"], op.params["head_dim"]
    b, _, h, w = core.shape
    if op.params["cross"]:
        q = tokens(model.tensor(op.inputs[0])).view(b, h * w, heads, head_dim).transpose(1, 2)
        kv = model.tensor(op.inputs[1])
        kv_tokens = tokens(kv).view(b, kv.shape[2] * kv.shape[3], 2, heads, head_dim)
        k, v = (kv_tokens[:, :, i].transpose(1, 2) for i in range(2))
    else:
        qkv = tokens(model.tensor(op.inputs[0])).view(b, h * w, 3, heads, head_dim)  # dense NHWC: a view
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    o = tokens(core).view(b, h * w, heads, head_dim).transpose(1, 2)
    tile = impl.tile or None  # -t<...>: the kernel's tile (default: its first)
    if impl.kernel == "triton" and impl.rows:  # whole score rows per program, the value columns split
        return lambda: attention(q, k, v, out=o, schedule="rows", tile=tile)
    if impl.kernel == "triton":  # -kv<N>: the keys split over N programs per query block
        split, workspace = impl.split_kv, model.split_workspace
        return lambda: attention(q, k, v, out=o, split_kv=split, workspace=workspace, tile=tile)
    return lambda: o.copy_(F.scaled_dot_product_attention(q, k, v))


def group_norm_call(model: BoundModel, op: Op, impl: Impl) -> Call:
    """The kernel's own plan (``triton``), whole groups on ``lanes`` lanes (``triton-c<L>``), or ``apply``: one pass
    over the statistics its producer's epilogue wrote (``engine/epilogue_norm.py``)."""
    x, out = model.tensor(op.inputs[0]), model.tensor(op.output)
    w, p = model.device_weights[op.name], op.params
    stats = norm_partials(model, op) if impl.kernel == "apply" else None
    kw = dict(activation=p["act"], out=out, fp8_scale=p.get("fp8_scale"), lanes=impl.lanes, stats=stats)
    return lambda: group_norm_act(x, p["groups"], w["weight"], w["bias"], p["eps"], **kw)


def gate_call(model: BoundModel, op: Op, impl: Impl) -> Call:
    x, g, out = model.tensor(op.inputs[0]), model.tensor(op.inputs[1]), model.tensor(op.output)
    w = model.device_weights[op.name]
    return lambda: attention_gate(
        x, g, w["w_x"], w["w_g"], w.get("b_g"), w["w_psi"], w.get("b_psi"), b_x=w.get("b_x"), out=out
    )


def layer_norm_call(model: BoundModel, op: Op, impl: Impl) -> Call:
    x, out = tokens(model.tensor(op.inputs[0])), tokens(model.tensor(op.output))
    w, eps, fp8_scale = model.device_weights[op.name], op.params["eps"], op.params.get("fp8_scale")
    return lambda: layer_norm(x, w["weight"], w["bias"], eps, out=out, fp8_scale=fp8_scale)


def center_call(model: BoundModel, op: Op, impl: Impl) -> Call:
    x, out = model.tensor(op.inputs[0]), model.tensor(op.output)
    return lambda: torch.add(x, x, out=out).sub_(1.0)


BUILDERS: dict[str, Callable[[BoundModel, Op, Impl], Call]] = {
    "conv": conv_call,
    "linear": linear_call,
    "depthwise": depthwise_call,
    "attention": attention_call,
    "group_norm": group_norm_call,
    "gate": gate_call,
    "layer_norm": layer_norm_call,
    "center": center_call,
}
"""Op kind -> the builder of its launch."""
