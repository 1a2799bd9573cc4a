"""A U-Net forward (DDPMUNet or ConvNeXtUNet) rewritten onto fused kernels, over planned NHWC buffers.

Built once per (model, batch, resolution, dtype) from a loaded :class:`~fastdiff.models.ddpm_unet.DDPMUNet` or
:class:`~fastdiff.models.convnext_unet.ConvNeXtUNet`:

* every activation is a logical ``[B, C, H, W]`` channels-last tensor viewing one arena laid out by
  :func:`fastdiff.engine.plan.plan_memory` (buffers reused when lifetimes allow);
* zero-copy concat: the up path's ``cat([h, skip])`` is one buffer; the skip (written by the down path, or by
  ConvNeXt's attention gate) and the up path's h are written by their producers straight into their channel
  slices, and every later reader (conv, GroupNorm, gate, residual) reads the slice in place (the layer table
  says where each output lives);
* GroupNorm + SiLU -> ``group_norm_act``; conv + bias (+ time embedding) (+ residual, x 1/output_scale_factor)
  -> one ``conv2d`` launch with its fused epilogue, or cuDNN (``F.conv2d``) + one torch op for the epilogue,
  chosen per layer by timing both on the GPU (``conv_impl="auto"``); attention -> one 1x1 conv for q, k and v,
  the flash ``attention`` kernel (or torch SDPA, timed likewise), one 1x1 conv for the output projection with
  bias + residual + rescale in its epilogue;
* ConvNeXt blocks: depthwise 7x7 + time embedding -> ``depthwise_conv2d`` (or cuDNN, timed), GroupNorm(1) ->
  ``group_norm_act``, conv1 + bias + GELU and conv2 + bias + residual -> ``conv2d`` epilogues; the attention
  gate on each skip -> ``attention_gate``, written into its concat slice;
* Upsample2D (nearest x2, then 3x3 conv) is one ``conv2d(upsample=2)`` launch: the upsampled tensor is never
  written;
* DDPM's asymmetric downsample padding (pad right/bottom by one, stride 2) is a 4x4 stride-2 pad-1 conv whose
  first tap row and column are zero, so it needs no pad copy;
* the time embedding depends only on the timestep: for a sampler's timesteps, the MLP and every block's
  projection (+ the bias of the conv it is added to) are evaluated once in fp32 into a table ``[N, sum(C)]``;
  a step selects its row on the device (one ``index_select``) and each epilogue reads its slice (batch
  stride 0).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch import nn

from fastdiff.atomic import write_text_atomic
from fastdiff.devices import normalize_device
from fastdiff.engine.plan import BufferSpec, MemoryPlan, plan_memory
from fastdiff.engine.weights import WeightStreamer
from fastdiff.errors import FastdiffError
from fastdiff.kernels.attention import attention
from fastdiff.kernels.attention_gate import attention_gate
from fastdiff.kernels.common import activation_ref
from fastdiff.kernels.conv2d import conv2d, pack_conv_weight
from fastdiff.kernels.depthwise_conv2d import depthwise_conv2d, pack_depthwise_weight
from fastdiff.kernels.group_norm_act import group_norm_act
from fastdiff.models import convnext_unet
from fastdiff.models.convnext_unet import AttentionGate, ConvNeXtBlock, ConvNeXtUNet, SelfAttention
from fastdiff.models.ddpm_unet import Attention, DDPMUNet, ResnetBlock2D, timestep_embedding

log = logging.getLogger(__name__)

CONV_IMPLS = ("auto", "triton", "cudnn")
ATTENTION_IMPLS = ("auto", "triton", "sdpa")
TUNING_CACHE: dict[str, dict[str, float]] = {}
"""Per-op timings of the implementations (``FusedUNet.autotune``), reused by later builds; mirrored on disk in
``tuning_cache_path()`` so a new process on the same GPU / torch / triton skips the timing too."""


def tuning_cache_path() -> Path:
    """``$FASTDIFF_CACHE_DIR/engine_tuning.json`` (default ``~/.cache/fastdiff``)."""
    root = os.environ.get("FASTDIFF_CACHE_DIR") or Path.home() / ".cache" / "fastdiff"
    return Path(root) / "engine_tuning.json"


def _load_tuning_cache() -> None:
    path = tuning_cache_path()
    if TUNING_CACHE or not path.is_file():
        return
    try:
        TUNING_CACHE.update(json.loads(path.read_text()))
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable tuning cache %s: %s", path, exc)


def _save_tuning_cache() -> None:
    path = tuning_cache_path()
    try:
        write_text_atomic(path, json.dumps(TUNING_CACHE, indent=0, sort_keys=True))
    except OSError as exc:
        log.warning("could not write the tuning cache %s: %s", path, exc)


SLICE_WRITERS = frozenset({"conv", "gate"})
"""Op kinds whose kernels write a channel slice of a wider channels-last buffer (a concat part) in place. Every
kernel reads slices in place (conv2d, depthwise_conv2d, group_norm_act, attention_gate)."""


@dataclass(eq=False)
class Value:
    """One activation: logical ``[B, C, H, W]``; a channel slice of ``concat`` when that is set."""

    name: str
    shape: tuple[int, int, int, int]
    producer: str = ""
    concat: Value | None = None
    channel_offset: int = 0


@dataclass(eq=False)
class Op:
    """One fused launch (or two, for the cuDNN path). ``weights`` are fp32 source tensors by role."""

    name: str
    kind: str
    inputs: list[Value]
    output: Value
    params: dict
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    impl: str = ""
    why: str = ""
    times_us: dict[str, float] = field(default_factory=dict)


class FusedUNet:
    """The fused forward of one DDPMUNet or ConvNeXtUNet at one (batch, resolution, dtype, device).

    ``bind_timesteps(timesteps)`` returns the step model ``(x_in, step_index) -> model output`` that
    :class:`fastdiff.engine.graph.SamplingLoop` runs; ``forward(x_in, t)`` is the plain call (tests).
    """

    def __init__(
        self,
        model: DDPMUNet | ConvNeXtUNet,
        batch: int,
        dtype: torch.dtype,
        device: torch.device | str,
        conv_impl: str = "auto",
        attention_impl: str = "auto",
        streamer: WeightStreamer | None = None,
    ) -> None:
        if not isinstance(model, DDPMUNet | ConvNeXtUNet):
            raise FastdiffError(f"the fused engine supports DDPMUNet and ConvNeXtUNet, got {type(model).__name__}")
        if conv_impl not in CONV_IMPLS or attention_impl not in ATTENTION_IMPLS:
            raise FastdiffError(
                f"conv_impl must be one of {CONV_IMPLS} and attention_impl one of {ATTENTION_IMPLS}, "
                f"got {conv_impl!r}, {attention_impl!r}"
            )
        self.device = normalize_device(device)
        self.dtype, self.batch = dtype, batch
        self.cfg = cfg = model.config
        size = cfg.sample_size if cfg.sample_size is not None else 32
        self.height, self.width = (size, size) if isinstance(size, int) else tuple(size)
        self.conv_impl, self.attention_impl = conv_impl, attention_impl
        self.values: list[Value] = []
        self.ops: list[Op] = []
        self._temb_channels = 0
        self._temb_proj: list[tuple[torch.Tensor, torch.Tensor]] = []  # (weight, bias + conv bias) per block
        with torch.no_grad():
            if isinstance(model, DDPMUNet):
                self._trace_ddpm(model)
                mlp, self._time_act = model.time_embedding, "silu"
            else:
                self._trace_convnext(model)
                mlp, self._time_act = model.time_mlp, "gelu"
            self._time_mlp = copy.deepcopy(mlp).to(self.device, torch.float32).requires_grad_(False)
            self._proj_w = torch.cat([w for w, _ in self._temb_proj]).to(self.device, torch.float32)
            self._proj_b = torch.cat([b for _, b in self._temb_proj]).to(self.device, torch.float32)
        self.temb_row = torch.zeros((1, self._temb_channels), dtype=dtype, device=self.device)
        self.plan = self._plan()
        self.arena = torch.empty(self.plan.peak_bytes, dtype=torch.uint8, device=self.device)
        self.tensors: dict[str, torch.Tensor] = {}
        self.streamer = streamer or WeightStreamer(self.device)
        self._device_weights: dict[str, dict[str, torch.Tensor]] = {}
        self._x_in: torch.Tensor | None = None
        self._calls: list[Callable[[], None]] = []
        self.ops_timed = 0  # set by autotune()

    # ----------------------------------------------------------------------------------------------- trace
    def _value(self, name: str, channels: int, h: int, w: int) -> Value:
        value = Value(name, (self.batch, channels, h, w))
        self.values.append(value)
        return value

    def _op(self, name: str, kind: str, inputs: list[Value], output: Value, params: dict, weights=None) -> Value:
        op = Op(name, kind, [v for v in inputs if v is not None], output, params, weights or {})
        output.producer = kind
        self.ops.append(op)
        return output

    def _add_temb(self, proj: nn.Linear, conv_bias: torch.Tensor) -> int:
        """Register a block's time projection (its conv's bias folded in); returns its column offset."""
        offset = self._temb_channels
        self._temb_channels += proj.out_features
        self._temb_proj.append((proj.weight.detach().float(), (proj.bias + conv_bias).detach().float()))
        return offset

    def _conv(
        self, name: str, conv: nn.Conv2d, x: Value, *, temb: int | None = None, residual: Value | None = None,
        act: str | None = None, scale: float | None = None, downsample_pad0: bool = False, upsample: int = 1,
    ) -> Value:  # fmt: skip
        weight = conv.weight.detach().float()
        bias = None if conv.bias is None else conv.bias.detach().float()
        stride, padding = conv.stride[0], conv.padding[0]
        if downsample_pad0:  # pad (0, 1, 0, 1) then 3x3/s2/p0 == 4x4/s2/p1 with a zero first row and column
            weight = F.pad(weight, (1, 0, 1, 0))
            padding = 1
        ksize = weight.shape[-1]
        _, _, h, w = x.shape
        h, w = h * upsample, w * upsample
        ho = (h + 2 * padding - ksize) // stride + 1
        wo = (w + 2 * padding - ksize) // stride + 1
        out = self._value(name, weight.shape[0], ho, wo)
        weights = {"weight": weight}
        if temb is None and bias is not None:
            weights["bias"] = bias
        params = dict(stride=stride, padding=padding, ksize=ksize, upsample=upsample, temb=temb, act=act, scale=scale)
        return self._op(name, "conv", [x, residual], out, params, weights)

    def _group_norm(self, name: str, norm: nn.GroupNorm, x: Value, act: str | None) -> Value:
        out = self._value(name, x.shape[1], x.shape[2], x.shape[3])
        weights = {"weight": norm.weight.detach().float(), "bias": norm.bias.detach().float()}
        return self._op(name, "group_norm", [x], out, dict(groups=norm.num_groups, eps=norm.eps, act=act), weights)

    def _resnet(self, name: str, block: ResnetBlock2D, x: Value) -> Value:
        offset = self._add_temb(block.time_emb_proj, block.conv1.bias)
        a = self._group_norm(f"{name}.norm1", block.norm1, x, "silu")
        h = self._conv(f"{name}.conv1", block.conv1, a, temb=offset)
        c = self._group_norm(f"{name}.norm2", block.norm2, h, "silu")
        skip = x if block.conv_shortcut is None else self._conv(f"{name}.conv_shortcut", block.conv_shortcut, x)
        scale = None if block.output_scale_factor == 1.0 else 1.0 / block.output_scale_factor
        return self._conv(f"{name}.conv2", block.conv2, c, residual=skip, scale=scale)

    def _attention(self, name: str, attn: Attention, x: Value) -> Value:
        """diffusers-style attention: q, k, v Linears fused into one 1x1 conv."""
        _, channels, _, _ = x.shape
        inner = attn.heads * attn.head_dim
        normed = self._group_norm(f"{name}.group_norm", attn.group_norm, x, None)
        qkv_conv = nn.Conv2d(channels, 3 * inner, 1)
        qkv_conv.weight = nn.Parameter(
            torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]).detach()[:, :, None, None]
        )
        qkv_conv.bias = nn.Parameter(torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias]).detach())
        out_conv = nn.Conv2d(inner, channels, 1)
        out_conv.weight = nn.Parameter(attn.to_out[0].weight.detach()[:, :, None, None])
        out_conv.bias = nn.Parameter(attn.to_out[0].bias.detach())
        scale = None if attn.rescale_output_factor == 1.0 else 1.0 / attn.rescale_output_factor
        return self._attention_core(name, normed, x, qkv_conv, out_conv, attn.heads, attn.head_dim, scale)

    def _attention_core(
        self, name: str, normed: Value, x: Value, qkv_conv: nn.Conv2d, out_conv: nn.Conv2d, heads: int,
        head_dim: int, scale: float | None,
    ) -> Value:  # fmt: skip
        """qkv 1x1 conv (channels ordered q|k|v, head, dim) -> flash attention -> out 1x1 conv + residual x."""
        _, _, h, w = x.shape
        qkv = self._conv(f"{name}.to_qkv", qkv_conv, normed)
        core = self._value(f"{name}.core", heads * head_dim, h, w)
        self._op(f"{name}.core", "attention", [qkv], core, dict(heads=heads, head_dim=head_dim))
        return self._conv(f"{name}.to_out", out_conv, core, residual=x, scale=scale)

    def _concat(self, name: str, parts: list[Value]) -> Value:
        """One buffer whose channel slices are ``parts``: their producers write them in place (zero copies)."""
        _, _, h, w = parts[0].shape
        cat = self._value(name, sum(p.shape[1] for p in parts), h, w)
        offset = 0
        for part in parts:
            if part.concat is not None or part.producer not in SLICE_WRITERS:
                raise FastdiffError(f"internal: {part.name} ({part.producer}) cannot be written into {name}")
            part.concat, part.channel_offset = cat, offset
            offset += part.shape[1]
        return cat

    def _trace_ddpm(self, model: DDPMUNet) -> None:
        cfg = model.config
        x = Value("x_in", (self.batch, cfg.in_channels, self.height, self.width), producer="external")
        self.x_in_value = x
        if cfg.center_input_sample:
            centred = self._value("center_input", cfg.in_channels, self.height, self.width)
            x = self._op("center_input", "center", [x], centred, {})
        h = self._conv("conv_in", model.conv_in, x)
        skips = [h]
        for i, block in enumerate(model.down_blocks):
            for j, resnet in enumerate(block.resnets):
                h = self._resnet(f"down_blocks.{i}.resnets.{j}", resnet, h)
                if block.attentions is not None:
                    h = self._attention(f"down_blocks.{i}.attentions.{j}", block.attentions[j], h)
                skips.append(h)
            if block.downsamplers is not None:
                down = block.downsamplers[0]
                h = self._conv(f"down_blocks.{i}.downsamplers.0.conv", down.conv, h, downsample_pad0=down.padding == 0)
                skips.append(h)
        if model.mid_block is not None:
            mid = model.mid_block
            h = self._resnet("mid_block.resnets.0", mid.resnets[0], h)
            if mid.attentions is not None:
                h = self._attention("mid_block.attentions.0", mid.attentions[0], h)
            h = self._resnet("mid_block.resnets.1", mid.resnets[1], h)
        for i, block in enumerate(model.up_blocks):
            for j, resnet in enumerate(block.resnets):
                cat = self._concat(f"up_blocks.{i}.cat.{j}", [h, skips.pop()])
                h = self._resnet(f"up_blocks.{i}.resnets.{j}", resnet, cat)
                if block.attentions is not None:
                    h = self._attention(f"up_blocks.{i}.attentions.{j}", block.attentions[j], h)
            if block.upsamplers is not None:
                h = self._upsample_conv(f"up_blocks.{i}.upsamplers.0", block.upsamplers[0].conv, h)
        h = self._group_norm("conv_norm_out", model.conv_norm_out, h, "silu")
        self.out_value = self._conv("conv_out", model.conv_out, h)

    def _convnext_block(self, name: str, block: ConvNeXtBlock, x: Value) -> Value:
        offset = self._add_temb(block.time_proj, block.depthwise.bias)
        _, channels, h, w = x.shape
        dw = self._value(f"{name}.depthwise", channels, h, w)
        weights = {"weight": block.depthwise.weight.detach().float()}
        self._op(f"{name}.depthwise", "depthwise", [x], dw, dict(temb=offset), weights)
        a = self._group_norm(f"{name}.norm1", block.norm1, dw, None)
        b = self._conv(f"{name}.conv1", block.conv1, a, act="gelu")
        c = self._group_norm(f"{name}.norm2", block.norm2, b, None)
        res = x if isinstance(block.res_conv, nn.Identity) else self._conv(f"{name}.res_conv", block.res_conv, x)
        return self._conv(f"{name}.conv2", block.conv2, c, residual=res)

    def _self_attention(self, name: str, attn: SelfAttention, x: Value) -> Value:
        normed = self._group_norm(f"{name}.norm", attn.norm, x, None)
        return self._attention_core(name, normed, x, attn.to_qkv, attn.to_out, attn.heads, attn.head_dim, None)

    def _gate(self, name: str, gate: AttentionGate, skip: Value, g: Value) -> Value:
        out = self._value(name, *skip.shape[1:])
        weights = {
            "w_x": gate.residual_conv.weight, "b_x": gate.residual_conv.bias, "w_g": gate.gate_conv.weight,
            "b_g": gate.gate_conv.bias, "w_psi": gate.psi.weight, "b_psi": gate.psi.bias,
        }  # fmt: skip
        params = dict(inter=gate.psi.weight.shape[1])
        return self._op(name, "gate", [skip, g], out, params, {k: v.detach().float() for k, v in weights.items()})

    def _trace_convnext(self, model: ConvNeXtUNet) -> None:
        cfg = model.config
        x = Value("x_in", (self.batch, cfg.in_channels, self.height, self.width), producer="external")
        self.x_in_value = x
        h = self._conv("init_conv", model.init_conv, x)
        skips = []
        for i, level in enumerate(model.downs):
            h = self._convnext_block(f"downs.{i}.block1", level["block1"], h)
            h = self._convnext_block(f"downs.{i}.block2", level["block2"], h)
            skips.append(h)
            if "downsample" in level:
                h = self._conv(f"downs.{i}.downsample", level["downsample"], h)
        h = self._convnext_block("mid_block1", model.mid_block1, h)
        if model.mid_attn is not None:
            h = self._self_attention("mid_attn", model.mid_attn, h)
        h = self._convnext_block("mid_block2", model.mid_block2, h)
        for i, level in enumerate(model.ups):
            skip = self._gate(f"ups.{i}.gate", level["gate"], skips.pop(), h)
            cat = self._concat(f"ups.{i}.cat", [h, skip])
            h = self._convnext_block(f"ups.{i}.block1", level["block1"], cat)
            h = self._convnext_block(f"ups.{i}.block2", level["block2"], h)
            if "upsample" in level:
                h = self._upsample_conv(f"ups.{i}", level["upsample"], h)
        h = self._convnext_block("final_block", model.final_block, h)
        self.out_value = self._conv("final_conv", model.final_conv, h)

    def _upsample_conv(self, name: str, conv: nn.Conv2d, h: Value) -> Value:
        """Nearest x2 then conv: one conv2d launch reading h at half resolution (never materialised)."""
        return self._conv(f"{name}.conv", conv, h, upsample=2)

    # ------------------------------------------------------------------------------------------------ plan
    def _plan(self) -> MemoryPlan:
        first: dict[str, int] = {}
        last: dict[str, int] = {}

        def root(v: Value) -> Value:
            while v.concat is not None:
                v = v.concat
            return v

        for index, op in enumerate(self.ops):
            for v in [*op.inputs, op.output]:
                r = root(v)
                if r.producer == "external":
                    continue
                first.setdefault(r.name, index)
                last[r.name] = index
        last[self.out_value.name] = len(self.ops)  # read by the sampler step after the forward
        roots = {root(v).name: root(v) for v in self.values if root(v).producer != "external"}
        specs = [
            BufferSpec(name, math.prod(v.shape) * self.dtype.itemsize, first[name], last[name])
            for name, v in roots.items()
            if name in first
        ]
        return plan_memory(specs)

    def _tensor(self, v: Value) -> torch.Tensor:
        if v.name in self.tensors:
            return self.tensors[v.name]
        if v.producer == "external":
            if self._x_in is None:
                raise FastdiffError("internal: input not bound")
            return self._x_in
        if v.concat is not None:
            parent = self._tensor(v.concat)
            t = parent[:, v.channel_offset : v.channel_offset + v.shape[1]]
        else:
            t = self.plan.tensor(self.arena, v.name, v.shape, self.dtype)
        self.tensors[v.name] = t
        return t

    # --------------------------------------------------------------------------------------------- weights
    def _host_weights(self, op: Op) -> dict[str, torch.Tensor]:
        """The device-layout weights of ``op`` in the engine dtype, packed on the host."""
        out: dict[str, torch.Tensor] = {}
        if op.kind == "conv":
            weight = op.weights["weight"]
            if self.conv_impl in ("auto", "triton"):
                out["packed"] = pack_conv_weight(weight).to(self.dtype)
            if self.conv_impl in ("auto", "cudnn"):
                out["weight"] = weight.to(self.dtype).contiguous(memory_format=torch.channels_last)
            if "bias" in op.weights:
                out["bias"] = op.weights["bias"].to(self.dtype)
        elif op.kind == "depthwise":
            weight = op.weights["weight"]
            if self.conv_impl in ("auto", "triton"):
                out["packed"] = pack_depthwise_weight(weight).to(self.dtype)
            if self.conv_impl in ("auto", "cudnn"):
                out["weight"] = weight.to(self.dtype).contiguous(memory_format=torch.channels_last)
        elif op.kind in ("group_norm", "gate"):
            out = {k: v.to(self.dtype) for k, v in op.weights.items() if v is not None}
        return out

    # ----------------------------------------------------------------------------------------------- calls
    def _conv_call(self, op: Op, impl: str) -> Callable[[], None]:
        x, out = self._tensor(op.inputs[0]), self._tensor(op.output)
        residual = self._tensor(op.inputs[1]) if len(op.inputs) > 1 else None
        w = self._device_weights[op.name]
        bias = w.get("bias")
        p = op.params
        temb = None
        if p["temb"] is not None:
            channels = op.output.shape[1]
            temb = self.temb_row[:, p["temb"] : p["temb"] + channels].expand(self.batch, channels)
        stride, padding, act, scale, up = p["stride"], p["padding"], p["act"], p["scale"], p["upsample"]
        if impl == "triton":
            packed = w["packed"]
            return lambda: conv2d(
                x, packed, bias, stride=stride, padding=padding, time_emb=temb, residual=residual,
                activation=act, out_scale=scale, out=out, upsample=up,
            )  # fmt: skip
        weight = w["weight"]
        temb4 = None if temb is None else temb[:, :, None, None]

        def cudnn_conv() -> None:  # cuDNN conv (+ bias), then the epilogue in as few torch ops as the flags allow
            src = x if up == 1 else F.interpolate(x, scale_factor=float(up), mode="nearest")
            y = F.conv2d(src, weight, bias, stride=stride, padding=padding)
            if temb4 is not None:
                y += temb4
            if act is not None:
                y = activation_ref(y, act)
            if residual is not None:
                torch.add(y, residual, out=out)
            else:
                out.copy_(y)
            if scale is not None:
                out.mul_(scale)

        return cudnn_conv

    def _depthwise_call(self, op: Op, impl: str) -> Callable[[], None]:
        x, out = self._tensor(op.inputs[0]), self._tensor(op.output)
        channels = op.output.shape[1]
        offset = op.params["temb"]
        temb = self.temb_row[:, offset : offset + channels].expand(self.batch, channels)
        w = self._device_weights[op.name]
        if impl == "triton":
            packed = w["packed"]
            return lambda: depthwise_conv2d(x, packed, None, time_emb=temb, out=out)
        weight, temb4 = w["weight"], temb[:, :, None, None]
        return lambda: torch.add(F.conv2d(x, weight, None, padding=3, groups=channels), temb4, out=out)

    def _attention_call(self, op: Op, impl: str) -> Callable[[], None]:
        qkv, core = self._tensor(op.inputs[0]), self._tensor(op.output)
        heads, head_dim = op.params["heads"], op.params["head_dim"]
        b, _, h, w = core.shape
        tokens = qkv.permute(0, 2, 3, 1).reshape(b, h * w, 3, heads, head_dim)  # a view: qkv is dense NHWC
        q, k, v = (tokens[:, :, i].transpose(1, 2) for i in range(3))
        o = core.permute(0, 2, 3, 1).view(b, h * w, heads, head_dim).transpose(1, 2)
        if impl == "triton":
            return lambda: attention(q, k, v, out=o)
        return lambda: o.copy_(F.scaled_dot_product_attention(q, k, v))

    def _call(self, op: Op, impl: str) -> Callable[[], None]:
        if op.kind == "conv":
            return self._conv_call(op, impl)
        if op.kind == "attention":
            return self._attention_call(op, impl)
        if op.kind == "depthwise":
            return self._depthwise_call(op, impl)
        x, out = self._tensor(op.inputs[0]), self._tensor(op.output)
        if op.kind == "gate":
            g, w = self._tensor(op.inputs[1]), self._device_weights[op.name]
            return lambda: attention_gate(
                x, g, w["w_x"], w["w_g"], w.get("b_g"), w["w_psi"], w.get("b_psi"), b_x=w.get("b_x"), out=out
            )
        if op.kind == "group_norm":
            w, p = self._device_weights[op.name], op.params
            return lambda: group_norm_act(
                x, p["groups"], w["weight"], w["bias"], p["eps"], activation=p["act"], out=out
            )
        if op.kind == "center":
            return lambda: torch.add(x, x, out=out).sub_(1.0)
        raise FastdiffError(f"internal: unknown op kind {op.kind}")

    def _default_impl(self, op: Op) -> str:
        if op.kind in ("conv", "depthwise"):
            return "cudnn" if self.conv_impl == "cudnn" else "triton"
        if op.kind == "attention":
            return "sdpa" if self.attention_impl == "sdpa" else "triton"
        return {"group_norm": "triton", "gate": "triton", "center": "torch"}[op.kind]

    def _default_why(self, op: Op) -> str:
        if op.kind in ("conv", "depthwise"):
            return f"conv_impl={self.conv_impl}" + (" (not timed off CUDA)" if self.conv_impl == "auto" else "")
        if op.kind == "attention":
            return f"attention_impl={self.attention_impl}" + (
                " (not timed off CUDA)" if self.attention_impl == "auto" else ""
            )
        return "single implementation"

    def _check_input(self, x_in: torch.Tensor) -> None:
        if tuple(x_in.shape) != self.x_in_value.shape or x_in.dtype != self.dtype:
            raise FastdiffError(
                f"input {tuple(x_in.shape)} {x_in.dtype} does not match the prepared "
                f"{self.x_in_value.shape} {self.dtype}"
            )

    def _bind(self, x_in: torch.Tensor) -> None:
        self._check_input(x_in)
        self._x_in = x_in
        self.tensors = {}
        for op in self.ops:
            op.impl = op.impl or self._default_impl(op)
            op.why = op.why or self._default_why(op)
        self._calls = [self._call(op, op.impl) for op in self.ops]

    # ------------------------------------------------------------------------------------------- forward
    @torch.no_grad()
    def time_table(self, timesteps: torch.Tensor) -> torch.Tensor:
        """[N, sum(C)] per-step epilogue addends (projection(act(MLP(sinusoid(t)))) + conv bias), fp32 -> dtype.
        Built without autograd: the engine writes rows of it into its buffers with ``out=`` ops."""
        t = timesteps.to(self.device)
        if self._time_act == "silu":
            cfg = self.cfg
            emb = timestep_embedding(t, cfg.block_out_channels[0], cfg.flip_sin_to_cos, cfg.freq_shift)
        else:
            emb = convnext_unet.timestep_embedding(t, self.cfg.base_dim)
        temb = activation_ref(self._time_mlp(emb), self._time_act)
        return F.linear(temb, self._proj_w, self._proj_b).to(self.dtype)

    def _streamed_forward(self, x_in: torch.Tensor) -> None:
        """The first forward, interleaved with the weight upload: for each module, pack its weights on the host
        and queue their copy on the copy stream, then queue its compute behind that module's event only. The
        GPU runs module k while the host packs and the copy engine uploads modules k+1, ...
        """
        self._check_input(x_in)
        self._x_in, self.tensors = x_in, {}
        for op in self.ops:
            self._device_weights[op.name] = self.streamer.submit(op.name, self._host_weights(op))
            op.weights = {}  # the fp32 source copies are no longer needed
            self.streamer.wait(op.name)
            op.impl = op.impl or self._default_impl(op)
            self._call(op, op.impl)()
        self._bind(x_in)

    def forward_from_row(self, x_in: torch.Tensor) -> torch.Tensor:
        """The model output for ``x_in`` with the time embedding already in ``temb_row`` (the first call
        streams the weights in, see ``_streamed_forward``)."""
        if len(self._device_weights) < len(self.ops):
            self._streamed_forward(x_in)
        else:
            if self._x_in is None or x_in.data_ptr() != self._x_in.data_ptr():
                self._bind(x_in)
            for call in self._calls:
                call()
        return self._tensor(self.out_value)

    @torch.no_grad()
    def forward(self, x_in: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Model output for ``x_in`` (channels-last, engine dtype) at one timestep ``t`` (shared by the batch)."""
        self.temb_row.copy_(self.time_table(t.reshape(-1)[:1]))
        return self.forward_from_row(x_in)

    def bind_timesteps(self, timesteps: torch.Tensor) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The step model for a sampler's timesteps: (x_in, step index [1] on the device) -> model output."""
        table = self.time_table(timesteps)

        def step(x_in: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            torch.index_select(table, 0, index, out=self.temb_row)
            return self.forward_from_row(x_in)

        return step

    # -------------------------------------------------------------------------------------------- choice
    def autotune(self, x_in: torch.Tensor, reps: int = 20) -> None:
        """On CUDA, time each conv / attention op with both implementations (CUDA graph of ``reps`` launches,
        so launch overhead does not count) and keep the faster; records the times and the reason per op, and in
        ``ops_timed`` how many ops were not in the tuning cache."""
        if self.device.type != "cuda":
            return
        if len(self._device_weights) < len(self.ops):
            self._streamed_forward(x_in)
        self._bind(x_in)
        _load_tuning_cache()
        self.ops_timed = 0
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.arena.view(self.dtype)[: self.arena.numel() // self.dtype.itemsize].normal_(generator=gen)
        self.temb_row.normal_(generator=gen)
        for op in self.ops:
            if op.kind in ("conv", "depthwise") and self.conv_impl == "auto":
                candidates = ("triton", "cudnn")
            elif op.kind == "attention" and self.attention_impl == "auto":
                candidates = ("triton", "sdpa")
            else:
                continue
            key = self._tuning_key(op)
            if key not in TUNING_CACHE:
                TUNING_CACHE[key] = {impl: time_call_us(self._call(op, impl), reps) for impl in candidates}
                why, self.ops_timed = "timed", self.ops_timed + 1
            else:
                why = "timed earlier (tuning cache, same shapes)"
            op.times_us = dict(TUNING_CACHE[key])
            op.impl = min(op.times_us, key=op.times_us.get)
            op.why = f"{why}: " + ", ".join(f"{k} {v:.1f} us" for k, v in op.times_us.items())
        if self.ops_timed:
            _save_tuning_cache()
        self._bind(x_in)
        self.drop_unused_weights()

    def time_ops(self, reps: int = 20) -> list[float]:
        """Microseconds of each op of ``ops`` (in order) with its chosen implementation, timed like ``autotune``
        (a CUDA graph of ``reps`` launches, median of 3 replays; launch overhead excluded). Needs CUDA and a
        bound forward (any ``forward`` call); the ops overwrite the arena's activations."""
        if self.device.type != "cuda":
            raise FastdiffError("FusedUNet.time_ops needs CUDA")
        if not self._calls:
            raise FastdiffError("FusedUNet.time_ops before the first forward")
        return [time_call_us(call, reps) for call in self._calls]

    def _tuning_key(self, op: Op) -> str:
        """What an op's timing depends on: kind, shapes, strided (concat slice) or not, flags, dtype, GPU and
        library versions (a string: it is a JSON key on disk)."""
        params = {k: (v is not None if k == "temb" else v) for k, v in op.params.items()}
        values = [(v.shape, v.concat is not None) for v in (*op.inputs, op.output)]
        gpu = torch.cuda.get_device_name(self.device)
        return repr((op.kind, values, sorted(params.items()), str(self.dtype), gpu, torch.__version__,
                     triton.__version__))  # fmt: skip

    def drop_unused_weights(self) -> None:
        """Free the conv weight layout the chosen implementation does not read."""
        for op in self.ops:
            if op.kind in ("conv", "depthwise") and op.impl:
                self._device_weights[op.name].pop("weight" if op.impl == "triton" else "packed", None)

    def layer_table(self) -> list[dict]:
        """One row per op: name, kind, output shape, implementation, why, times, where its output lives."""
        rows = []
        for op in self.ops:
            out = op.output
            where = f"slice [{out.channel_offset}:] of {out.concat.name}" if out.concat is not None else "own buffer"
            rows.append(dict(name=op.name, kind=op.kind, shape=list(out.shape), impl=op.impl, why=op.why,
                             times_us=op.times_us, output=where))  # fmt: skip
        return rows


def time_call_us(call: Callable[[], None], reps: int) -> float:
    """Median microseconds per ``call()`` from replays of a CUDA graph of up to ``reps`` calls (fewer for slow
    ops: the graph holds about 2 ms of work), so launch overhead does not count."""
    call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    end.synchronize()
    reps = max(1, min(reps, int(2.0 / max(start.elapsed_time(end), 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            call()
    graph.replay()
    times = []
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]
