"""The engine's op vocabulary: activations (``Value``), fused launches (``Op``) and the ``GraphBuilder`` that a
model family's lowering (``fastdiff.engine.lower``) uses to write its forward as a list of ops.

Every activation is a logical ``[B, C, H, W]`` tensor in channels-last memory, so a token sequence is the same
thing: ``[B, C, H, W]`` channels-last *is* the token matrix ``[B*H*W, C]`` (the text states are ``[B, D, L, 1]``).
The builder knows nothing of kernels or memory; :class:`fastdiff.engine.executor.FusedModel` plans the buffers,
packs the weights and binds each op to a kernel.

Op kinds (``OP_KINDS``) and what the executor runs for them:

* ``conv``: conv + bias (+ time embedding) (+ activation) (+ residual, x scale), optionally reading its input
  upsampled x2 (nearest) without materialising it -> ``kernels.conv2d``, ``kernels.conv2d_tma`` (Hopper) or
  cuDNN + torch epilogue;
* ``depthwise``: 7x7 depthwise conv + time embedding (ConvNeXt);
* ``group_norm``: GroupNorm (+ SiLU) -> ``kernels.group_norm_act``;
* ``layer_norm``: LayerNorm over channels per token -> ``kernels.layer_norm``;
* ``linear``: token GEMM + bias (+ GEGLU) (+ residual) -> ``kernels.linear`` or cuBLAS + torch epilogue;
* ``attention``: softmax(q k^T / sqrt(d)) v over the tokens, self-attention from one fused q|k|v buffer or
  cross-attention from a q buffer and a k|v buffer -> ``kernels.attention`` or torch SDPA;
* ``gate``: ConvNeXt's attention gate on a skip -> ``kernels.attention_gate``;
* ``center``: ``2x - 1`` (``center_input_sample``).

Op-level fusions (in the lowerings and kernels): GroupNorm + SiLU in one pass; conv + bias + time embedding +
residual + 1/output_scale_factor in the conv epilogue; Upsample2D (nearest x2 + conv) as one conv launch reading
the low-resolution input; DDPM's asymmetric downsample padding ((0, 1): the gather kernel's bounds check pads the
end; cuDNN gets a 4x4 stride-2 conv with a zero first tap row and column); attention's q/k/v projections as one
GEMM; GEGLU in the feed-forward GEMM's epilogue. (Fusions of two ops into one launch, which the autotune weighs
against the two apart, are the executor's: ``fastdiff.engine.fusion``.)

An op's ``stage`` is ``"step"`` (every forward) or ``"context"`` (once per text context: the cross-attention
K/V projections, whose outputs are ``persistent`` values that every later step reads).

Step caching (``fastdiff.models.step_cache``): a U-Net's lowering marks its deep feature with
``GraphBuilder.cache``; the executor keeps it in a persistent buffer and runs a shallow forward as the step ops the
output needs given that value (:func:`shallow_slice`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fastdiff.errors import FastdiffError
from fastdiff.models.ddpm_unet import Attention, ResnetBlock2D

OP_KINDS = frozenset({"conv", "depthwise", "group_norm", "layer_norm", "linear", "attention", "gate", "center"})
SLICE_WRITERS = frozenset({"conv", "gate", "linear"})
"""Op kinds whose kernels write a channel slice of a wider channels-last buffer (a concat part) in place. Every
kernel reads slices in place."""

TimeFeatures = Callable[[torch.Tensor], torch.Tensor]
"""timesteps [N] -> fp32 features [N, D] (the time MLP and its activation), on the engine's device."""


def tokens(t: torch.Tensor) -> torch.Tensor:
    """A channels-last ``[B, C, H, W]`` tensor (or channel slice of one) as its token matrix ``[B*H*W, C]`` (a
    view; the row stride is the parent buffer's channel count)."""
    b, c, h, w = t.shape
    return t.permute(0, 2, 3, 1).reshape(b * h * w, c)


@dataclass(eq=False)
class Value:
    """One activation: logical ``[B, C, H, W]``; a channel slice of ``concat`` when that is set.

    ``producer`` is the kind of the op that writes it, ``"external"`` for a graph input. ``persistent`` values
    (outputs of ``context``-stage ops; the buffer holding the step cache's deep feature) get their own allocation
    instead of a place in the step arena, so they outlive the forward that wrote them. ``fp8`` values are stored in
    e4m3 (the engine's fp8: ``fastdiff.engine.fp8``), the others in the engine dtype.
    """

    name: str
    shape: tuple[int, int, int, int]
    producer: str = ""
    concat: Value | None = None
    channel_offset: int = 0
    persistent: bool = False
    fp8: bool = False


@dataclass(eq=False)
class Op:
    """One fused launch (or a library call and its epilogue). ``weights`` are its source tensors by role (conv and
    GEMM weights in the model's dtype, the rest fp32)."""

    name: str
    kind: str
    inputs: list[Value]
    output: Value
    params: dict
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    stage: str = "step"
    why: str = ""
    """Why the executor's choice of implementation (``FusedModel.impls``) fell as it did."""
    times_us: dict[str, float] = field(default_factory=dict)
    """The autotune's microseconds per implementation name."""


class GraphBuilder:
    """Collects the values and ops of one forward at a fixed (batch, height, width).

    ``inputs`` maps input names (``"x_in"``; ``"context"`` for text-conditioned models) to their values;
    ``output`` is the model output; ``cached`` the step cache's deep feature (see :meth:`cache`). Time embeddings:
    a lowering sets ``time_features`` and registers each block's projection with :meth:`add_temb`; the executor
    evaluates all of them once per timestep into one table row.
    """

    def __init__(self, batch: int, height: int, width: int, context_tokens: int | None = None) -> None:
        self.batch, self.height, self.width = batch, height, width
        self.context_tokens = context_tokens
        self.values: list[Value] = []
        self.ops: list[Op] = []
        self.inputs: dict[str, Value] = {}
        self.output: Value | None = None
        self.cached: Value | None = None
        self.time_features: TimeFeatures | None = None
        self.temb_channels = 0
        self.temb_proj: list[tuple[torch.Tensor, torch.Tensor]] = []  # (weight, bias + conv bias) per block

    # --------------------------------------------------------------------------------------------- basics
    def input(self, name: str, channels: int, h: int, w: int) -> Value:
        """A graph input (bound by the executor's caller, never planned)."""
        value = Value(name, (self.batch, channels, h, w), producer="external")
        self.inputs[name] = value
        return value

    def value(self, name: str, channels: int, h: int, w: int, persistent: bool = False) -> Value:
        value = Value(name, (self.batch, channels, h, w), persistent=persistent)
        self.values.append(value)
        return value

    def op(
        self, name: str, kind: str, inputs: list[Value | None], output: Value, params: dict,
        weights: dict[str, torch.Tensor] | None = None, stage: str = "step",
    ) -> Value:  # fmt: skip
        if kind not in OP_KINDS:
            raise FastdiffError(f"internal: unknown op kind {kind!r}")
        op = Op(name, kind, [v for v in inputs if v is not None], output, params, weights or {}, stage)
        output.producer = kind
        self.ops.append(op)
        return output

    def cache(self, value: Value) -> None:
        """Mark ``value`` as the step cache's deep feature (``fastdiff.models.step_cache``): a full forward writes
        it, a shallow forward reads it as the last full one left it and runs only the ops the output needs besides
        it. The executor gives its buffer (the whole concat it is a slice of) its own persistent allocation."""
        if self.cached is not None:
            raise FastdiffError(f"internal: {self.cached.name} is already the cached value, not {value.name}")
        self.cached = value

    def add_temb(self, proj: nn.Linear, conv_bias: torch.Tensor | None) -> int:
        """Register a block's time projection (its conv's bias folded in); returns its column offset."""
        offset = self.temb_channels
        self.temb_channels += proj.out_features
        bias = proj.bias if conv_bias is None else proj.bias + conv_bias
        self.temb_proj.append((proj.weight.detach().float(), bias.detach().float()))
        return offset

    def concat(self, name: str, parts: list[Value]) -> Value:
        """One buffer whose channel slices are ``parts``: their producers write them in place (zero copies)."""
        _, _, h, w = parts[0].shape
        cat = self.value(name, sum(p.shape[1] for p in parts), h, w)
        offset = 0
        for part in parts:
            if part.concat is not None or part.producer not in SLICE_WRITERS:
                raise FastdiffError(f"internal: {part.name} ({part.producer}) cannot be written into {name}")
            part.concat, part.channel_offset = cat, offset
            offset += part.shape[1]
        return cat

    # ------------------------------------------------------------------------------------------ primitives
    def conv(
        self, name: str, conv: nn.Conv2d, x: Value, *, temb: int | None = None, residual: Value | None = None,
        act: str | None = None, scale: float | None = None, downsample_pad0: bool = False, upsample: int = 1,
        weight_scale: float = 1.0,
    ) -> Value:  # fmt: skip
        """``conv`` on ``x``; ``weight_scale`` multiplies the weight (a constant folded into the conv)."""
        weight = conv.weight.detach()  # in the model's dtype: packing is a layout change (weights.packed_weights)
        if weight_scale != 1.0:
            weight = weight.float() * weight_scale
        bias = None if conv.bias is None else conv.bias.detach().float()
        stride, padding = conv.stride[0], conv.padding[0]
        pad_end = padding + 1 if downsample_pad0 else padding  # Downsample2D(padding=0): F.pad (0, 1, 0, 1) first
        ksize = weight.shape[-1]
        _, _, h, w = x.shape
        h, w = h * upsample, w * upsample
        ho = (h + padding + pad_end - ksize) // stride + 1
        wo = (w + padding + pad_end - ksize) // stride + 1
        out = self.value(name, weight.shape[0], ho, wo)
        weights = {"weight": weight}
        if temb is None and bias is not None:
            weights["bias"] = bias
        params = dict(stride=stride, padding=padding, ksize=ksize, upsample=upsample, temb=temb, act=act, scale=scale)
        if pad_end != padding:  # bottom and right: the kernels read (padding, pad_end) as before/after
            params["pad_end"] = pad_end
        return self.op(name, "conv", [x, residual], out, params, weights)

    def group_norm(self, name: str, norm: nn.GroupNorm, x: Value, act: str | None) -> Value:
        out = self.value(name, *x.shape[1:])
        weights = {"weight": norm.weight.detach().float(), "bias": norm.bias.detach().float()}
        return self.op(name, "group_norm", [x], out, dict(groups=norm.num_groups, eps=norm.eps, act=act), weights)

    def layer_norm(self, name: str, norm: nn.LayerNorm, x: Value) -> Value:
        out = self.value(name, *x.shape[1:])
        weights = {"weight": norm.weight.detach().float(), "bias": norm.bias.detach().float()}
        return self.op(name, "layer_norm", [x], out, dict(eps=norm.eps), weights)

    def linear(
        self, name: str, weight: torch.Tensor, bias: torch.Tensor | None, x: Value, *,
        residual: Value | None = None, geglu: bool = False, scale: float | None = None, stage: str = "step",
    ) -> Value:  # fmt: skip
        """Per-token ``x @ weight^T + bias`` (``weight`` [N, C] as nn.Linear; a 1x1 conv's weight works too),
        with diffusers' GEGLU (``value * gelu(gate)`` of the two halves) when ``geglu``; output [B, N(/2), H, W]."""
        weight = weight.detach().reshape(weight.shape[0], -1)  # the model's dtype, as a conv's
        if weight.shape[1] != x.shape[1]:
            raise FastdiffError(f"internal: {name} weight {tuple(weight.shape)} does not fit {x.shape[1]} channels")
        channels = weight.shape[0] // 2 if geglu else weight.shape[0]
        out = self.value(name, channels, *x.shape[2:], persistent=stage == "context")
        weights = {"weight": weight}
        if bias is not None:
            weights["bias"] = bias.detach().float()
        params = dict(geglu=geglu, scale=scale, bias=bias is not None)
        return self.op(name, "linear", [x, residual], out, params, weights, stage)

    def attention(
        self, name: str, heads: int, head_dim: int, qkv: Value | None = None, q: Value | None = None,
        kv: Value | None = None,
    ) -> Value:  # fmt: skip
        """Self-attention over a fused ``qkv`` buffer (channels ordered q|k|v, head, dim), or cross-attention of
        ``q`` over ``kv`` (channels k|v, head, dim; its own token count). Output [B, heads*head_dim, H, W]."""
        if (qkv is None) == (q is None) or (q is None) != (kv is None):
            raise FastdiffError("internal: attention takes either qkv, or q and kv")
        source = qkv if qkv is not None else q
        out = self.value(name, heads * head_dim, *source.shape[2:])
        inputs = [qkv] if qkv is not None else [q, kv]
        return self.op(name, "attention", inputs, out, dict(heads=heads, head_dim=head_dim, cross=kv is not None))

    # ------------------------------------------------------------------------------------------ composites
    def resnet(self, name: str, block: ResnetBlock2D, x: Value) -> Value:
        """diffusers' ResnetBlock2D: GN+SiLU, conv (+ time embedding), GN+SiLU, conv + shortcut, / scale."""
        temb = None if block.time_emb_proj is None else self.add_temb(block.time_emb_proj, block.conv1.bias)
        a = self.group_norm(f"{name}.norm1", block.norm1, x, "silu")
        h = self.conv(f"{name}.conv1", block.conv1, a, temb=temb)
        c = self.group_norm(f"{name}.norm2", block.norm2, h, "silu")
        skip = x if block.conv_shortcut is None else self.conv(f"{name}.conv_shortcut", block.conv_shortcut, x)
        scale = None if block.output_scale_factor == 1.0 else 1.0 / block.output_scale_factor
        return self.conv(f"{name}.conv2", block.conv2, c, residual=skip, scale=scale)

    def spatial_attention(self, name: str, attn: Attention, x: Value) -> Value:
        """diffusers' single-block spatial Attention (GroupNorm, q/k/v, out + residual): q, k and v Linears fused
        into one 1x1 conv."""
        channels = x.shape[1]
        inner = attn.heads * attn.head_dim
        normed = self.group_norm(f"{name}.group_norm", attn.group_norm, x, None)
        qkv_conv = nn.Conv2d(channels, 3 * inner, 1)
        qkv_conv.weight = nn.Parameter(
            torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]).detach()[:, :, None, None]
        )
        qkv_conv.bias = nn.Parameter(torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias]).detach())
        out_conv = nn.Conv2d(inner, channels, 1)
        out_conv.weight = nn.Parameter(attn.to_out[0].weight.detach()[:, :, None, None])
        out_conv.bias = nn.Parameter(attn.to_out[0].bias.detach())
        scale = None if attn.rescale_output_factor == 1.0 else 1.0 / attn.rescale_output_factor
        return self.attention_block(name, normed, x, qkv_conv, out_conv, attn.heads, attn.head_dim, scale)

    def attention_block(
        self, name: str, normed: Value, x: Value, qkv_conv: nn.Conv2d, out_conv: nn.Conv2d, heads: int,
        head_dim: int, scale: float | None,
    ) -> Value:  # fmt: skip
        """qkv 1x1 conv (channels ordered q|k|v, head, dim) -> flash attention -> out 1x1 conv + residual x."""
        qkv = self.conv(f"{name}.to_qkv", qkv_conv, normed)
        core = self.attention(f"{name}.core", heads, head_dim, qkv=qkv)
        return self.conv(f"{name}.to_out", out_conv, core, residual=x, scale=scale)

    def upsample_conv(self, name: str, conv: nn.Conv2d, h: Value) -> Value:
        """Nearest x2 then conv: one conv2d launch reading h at half resolution (never materialised)."""
        return self.conv(f"{name}.conv", conv, h, upsample=2)

    def unet(self, model: nn.Module, x: Value, attend: Callable[[str, nn.Module, Value], Value]) -> Value:
        """The U-Net body diffusers' UNet2DModel and UNet2DConditionModel share, from the input ``x`` to conv_out:
        center_input_sample, conv_in, the down blocks (skips kept), the mid block, the up blocks (skips
        concatenated in place; the step cache's deep feature marked at the last one's input), the output head.
        ``attend(name, module, h)`` lowers one of the blocks' attention modules (what the families differ in)."""
        cfg = model.config
        if cfg.center_input_sample:
            x = self.op("center_input", "center", [x], self.value("center_input", *x.shape[1:]), {})
        h = self.conv("conv_in", model.conv_in, x)
        skips = [h]
        for i, block in enumerate(model.down_blocks):
            for j, resnet in enumerate(block.resnets):
                h = self.resnet(f"down_blocks.{i}.resnets.{j}", resnet, h)
                if block.attentions is not None:
                    h = attend(f"down_blocks.{i}.attentions.{j}", block.attentions[j], h)
                skips.append(h)
            if block.downsamplers is not None:
                down = block.downsamplers[0]
                name = f"down_blocks.{i}.downsamplers.0.conv"
                h = self.conv(name, down.conv, h, downsample_pad0=down.padding == 0)
                skips.append(h)
        if model.mid_block is not None:
            mid = model.mid_block
            h = self.resnet("mid_block.resnets.0", mid.resnets[0], h)
            if mid.attentions is not None:
                h = attend("mid_block.attentions.0", mid.attentions[0], h)
            h = self.resnet("mid_block.resnets.1", mid.resnets[1], h)
        for i, block in enumerate(model.up_blocks):
            if i == len(model.up_blocks) - 1:
                self.cache(h)  # the step cache's deep feature: the last up block's input (models.step_cache)
            for j, resnet in enumerate(block.resnets):
                cat = self.concat(f"up_blocks.{i}.cat.{j}", [h, skips.pop()])
                h = self.resnet(f"up_blocks.{i}.resnets.{j}", resnet, cat)
                if block.attentions is not None:
                    h = attend(f"up_blocks.{i}.attentions.{j}", block.attentions[j], h)
            if block.upsamplers is not None:
                h = self.upsample_conv(f"up_blocks.{i}.upsamplers.0", block.upsamplers[0].conv, h)
        h = self.group_norm("conv_norm_out", model.conv_norm_out, h, "silu")
        return self.conv("conv_out", model.conv_out, h)


def shallow_slice(step_ops: list[Op], values: list[Value], output: Value, cached: Value) -> list[int]:
    """Indices (in order) of the step ops that ``output`` needs when ``cached`` is given (the step cache's shallow
    forward): the producers of what each needed op reads (every part of a concat it reads whole), from the output's
    producer back, never through the cached value's producer."""
    producer = {id(op.output): i for i, op in enumerate(step_ops)}
    parts: dict[int, list[Value]] = {}
    for v in values:
        if v.concat is not None:
            parts.setdefault(id(v.concat), []).append(v)
    needed: set[int] = set()
    todo = [producer[id(output)]]
    while todo:
        index = todo.pop()
        if index in needed:
            continue
        needed.add(index)
        for v in step_ops[index].inputs:
            for part in parts.get(id(v), [v]):
                if part is not cached and id(part) in producer:  # not an input or a context value
                    todo.append(producer[id(part)])
    return sorted(needed)
