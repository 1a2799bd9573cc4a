"""The engine's executor: a model forward lowered to fused kernels over one planned NHWC arena.

``FusedModel(model, batch, dtype, device)`` asks the model family's lowering (:mod:`fastdiff.engine.lower`) for
the forward as a list of ops of :mod:`fastdiff.engine.ir`, then:

* plans memory: every step activation is a logical ``[B, C, H, W]`` channels-last view of one arena laid out by
  :func:`fastdiff.engine.plan.plan_memory` (buffers reused when lifetimes allow); concat parts are channel
  slices their producers write in place (zero-copy concat); ``context``-stage outputs (cross-attention K/V) have
  their own buffers, written once per text context by :meth:`FusedModel.set_context`;
* packs each op's weights in the engine dtype on the host and streams them to the device during the first
  forward (``engine.weights.WeightStreamer``: module k runs while module k+1 uploads);
* binds each op to a kernel; where there are several implementations (conv: ``kernels.conv2d``, on Hopper also
  ``kernels.conv2d_tma`` for stride-1 convs and its Gluon form ``kernels.conv2d_gluon`` (``gluon``, ``gluon-p2``:
  persistent, two programs per SM) for those without an activation, ``kernels.tap_sum_conv2d`` (``triton-taps``)
  for a conv of at most 8 output channels, or cuDNN + a torch epilogue; token GEMM: ``kernels.linear`` or
  cuBLAS + a torch epilogue; the gather conv also with its reduction split over 2-16 programs where its grid
  leaves SMs idle, ``triton-k<split>``, and the fp8 TMA conv the same way, ``triton-tma-fp8-k<split>`` (the
  fp16/bf16 TMA conv also runs split, ``triton-tma-k<split>``, when an op's impl is set to it; not offered); a
  ResnetBlock2D's conv2 also with its 1x1 conv_shortcut summed in, ``triton-sc[-k<split>]``, or the Gluon conv's
  ``gluon[-p2]-sc``, timed against the pair unfused (:mod:`fastdiff.engine.shortcut`); a conv whose output a
  GroupNorm reads also with that norm in its epilogue, ``triton[-sc]-gn[-k<split>]``, or with the norm's
  statistics in its epilogue, ``triton[-sc]-st[-k<split>]`` (the norm then one elementwise pass, ``apply``), timed
  against the conv and the norm apart (:mod:`fastdiff.engine.epilogue_norm`); attention:
  ``kernels.attention`` (also with its keys split over 2-8 programs per query block where those leave SMs idle,
  ``triton-kv<split>``, and for at most 512 keys its whole-rows schedule, ``triton-rows``) or torch SDPA;
  GroupNorm: the kernel's own launch plan or whole groups at 16, 32 or 64 channel lanes per program)
  ``autotune`` times them on the GPU
  and keeps the fastest (``conv_impl`` / ``attention_impl`` narrow the choice; ``conv_impl`` covers both convs and
  GEMMs: "triton", our kernels, or the vendor library);
* with ``fp8=True`` (Hopper), the convs that read a GroupNorm's output run on e4m3 operands
  (:mod:`fastdiff.engine.fp8`): the norm writes e4m3 at a scale taken from its affine, the TMA conv multiplies
  e4m3 x e4m3 with per-output-channel weight scales and writes the engine dtype;
* evaluates the time embedding only per timestep: for a sampler's timesteps, the time MLP and every block's
  projection (+ the bias of the conv it is added to) are computed once in fp32 into a table ``[N, sum(C)]``; a
  step selects its row on the device (one ``index_select``) and each epilogue reads its slice (batch stride 0);
* step caching (``fastdiff.models.step_cache``): the value a U-Net's lowering marks as its deep feature lives in
  a persistent buffer (the whole concat buffer it is a channel slice of: every forward writes the other slices,
  only full forwards write it); a shallow forward (``shallow=True``) runs ``shallow_ops``, the step ops the output
  needs given that value (the op graph sliced backwards from the output, stopping at the value), in model order.

Op-level fusions (in the lowerings and kernels): GroupNorm + SiLU in one pass; conv + bias + time embedding +
residual + 1/output_scale_factor in the conv epilogue; Upsample2D (nearest x2 + conv) as one conv launch reading
the low-resolution input; DDPM's asymmetric downsample padding ((0, 1): the gather kernel's bounds check pads the
end; cuDNN gets a 4x4 stride-2 conv with a zero first tap row and column); attention's q/k/v projections as one
GEMM; GEGLU in the feed-forward GEMM's epilogue.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch import nn
from triton.runtime.errors import OutOfResources

from fastdiff.atomic import write_text_atomic
from fastdiff.devices import normalize_device
from fastdiff.engine.epilogue_norm import epilogue_norms, epilogue_stats
from fastdiff.engine.fp8 import fp8_unsupported, mark_fp8_convs
from fastdiff.engine.ir import GraphBuilder, Op, Value
from fastdiff.engine.lower import lowering_for
from fastdiff.engine.plan import BufferSpec, MemoryPlan, plan_memory
from fastdiff.engine.shortcut import fusable_shortcuts
from fastdiff.engine.weights import WeightStreamer
from fastdiff.errors import FastdiffError
from fastdiff.kernels.attention import ROWS_MAX_KEYS, attention, split_kv_choices
from fastdiff.kernels.attention_gate import attention_gate
from fastdiff.kernels.common import GroupNormPartials, SplitWorkspace, activation_ref
from fastdiff.kernels.conv2d import OutputGroupNorm, conv2d, pack_conv_weight, split_k_choices
from fastdiff.kernels.conv2d_gluon import conv2d_gluon, default_gluon_config, gluon_conv_unsupported
from fastdiff.kernels.conv2d_tma import (
    conv2d_tma,
    pack_conv_weight_fp8,
    pack_upsample2_weight,
    tma_conv_unsupported,
    tma_split_k_choices,
)
from fastdiff.kernels.depthwise_conv2d import depthwise_conv2d, pack_depthwise_weight
from fastdiff.kernels.fp8 import FP8_DTYPE
from fastdiff.kernels.group_norm_act import LANE_CHOICES, group_norm_act
from fastdiff.kernels.layer_norm import layer_norm
from fastdiff.kernels.linear import linear, pack_linear_weight
from fastdiff.kernels.tap_sum_conv2d import pack_tap_weight, tap_columns, tap_sum_conv2d, tap_sum_unsupported

log = logging.getLogger(__name__)

CONV_IMPLS = ("auto", "triton", "cudnn")
ATTENTION_IMPLS = ("auto", "triton", "sdpa")
TUNING_CACHE: dict[str, dict[str, float]] = {}
"""Per-op timings of the implementations (``FusedModel.autotune``), reused by later builds; mirrored on disk in
``tuning_cache_path()`` so a new process on the same GPU / torch / triton skips the timing too."""


def source_digest(root: Path) -> str:
    """A short digest of the ``*.py`` files in ``root`` (names and bytes, in name order)."""
    digest = hashlib.sha1()
    for path in sorted(root.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@functools.cache
def kernels_revision() -> str:
    """:func:`source_digest` of the kernel modules (``fastdiff/kernels``): part of every tuning-cache key, so the
    timings of other kernel code (another fastdiff version, a changed launch plan) are not reused."""
    return source_digest(Path(__file__).resolve().parent.parent / "kernels")


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


def tokens(t: torch.Tensor) -> torch.Tensor:
    """A channels-last ``[B, C, H, W]`` tensor (or channel slice of one) as its token matrix ``[B*H*W, C]`` (a
    view; the row stride is the parent buffer's channel count)."""
    b, c, h, w = t.shape
    return t.permute(0, 2, 3, 1).reshape(b * h * w, c)


WEIGHT_ROLES: dict[tuple[str, str], set[str]] = {
    ("conv", "triton"): {"packed", "bias"},
    ("conv", "triton-tma"): {"packed", "packed_up2", "bias"},
    ("conv", "triton-tma-fp8"): {"packed_fp8", "weight_scale", "bias"},
    ("conv", "triton-taps"): {"weight", "packed_taps", "bias"},
    ("conv", "gluon"): {"packed", "bias"},
    ("conv", "gluon-p2"): {"packed", "bias"},
    ("conv", "gluon-sc"): {"packed", "bias"},
    ("conv", "gluon-p2-sc"): {"packed", "bias"},
    ("conv", "cudnn"): {"weight", "bias"},
    ("conv", "fused"): {"packed", "bias"},
    ("depthwise", "triton"): {"packed"},
    ("depthwise", "cudnn"): {"weight"},
    ("linear", "triton"): {"packed", "bias"},
    ("linear", "cublas"): {"packed", "bias"},
}
"""(op kind, implementation) -> the device weight layouts it reads (the others are dropped after autotune)."""


def _is_gather(impl: str) -> bool:
    """Whether a conv implementation is the gather kernel (``kernels.conv2d``): plain, split-K, with the shortcut
    summed in, the output's GroupNorm or its statistics in the epilogue."""
    return impl == "triton" or impl.startswith(("triton-k", "triton-sc", "triton-gn", "triton-st"))


def _sums_shortcut(impl: str) -> bool:
    """Whether a conv implementation sums its 1x1 conv_shortcut into its own reduction (the shortcut conv then runs
    no launch): the gather kernel's ``triton-sc*`` or the Gluon conv's ``gluon[-p2]-sc``."""
    return impl.startswith("triton-sc") or (impl.startswith("gluon") and impl.endswith("-sc"))


def _with_epilogue(impl: str, tag: str) -> str:
    """The gather implementation ``impl`` with the GroupNorm of its output (``tag`` "gn") or its statistics ("st")
    in the epilogue: ``triton[-sc][-k<N>]`` -> ``triton[-sc]-<tag>[-k<N>]``."""
    base, _, split = impl.partition("-k")
    return f"{base}-{tag}" + (f"-k{split}" if split else "")


class FusedModel:
    """The fused forward of one model at one (batch, size, dtype, device); see the module docstring.

    ``bind_timesteps(timesteps)`` returns the step model ``(x_in, step_index[, shallow]) -> model output`` that
    :class:`fastdiff.engine.graph.SamplingLoop` runs; ``forward(x_in, t)`` is the plain call. Text-conditioned
    models read the text states set by ``set_context``. ``size`` is the input's (height, width) (default: the
    family's, e.g. the config's ``sample_size``); ``context_tokens`` the text length (default 77).
    ``cached_value`` is the step cache's deep feature (None for a model without one: the VAE) and
    ``shallow_ops`` the step ops of a shallow forward.
    """

    def __init__(
        self,
        model: nn.Module,
        batch: int,
        dtype: torch.dtype,
        device: torch.device | str,
        conv_impl: str = "auto",
        attention_impl: str = "auto",
        streamer: WeightStreamer | None = None,
        *,
        size: tuple[int, int] | None = None,
        context_tokens: int | None = None,
        fp8: bool = False,
    ) -> None:
        family = lowering_for(model)
        if conv_impl not in CONV_IMPLS or attention_impl not in ATTENTION_IMPLS:
            raise FastdiffError(
                f"conv_impl must be one of {CONV_IMPLS} and attention_impl one of {ATTENTION_IMPLS}, "
                f"got {conv_impl!r}, {attention_impl!r}"
            )
        self.device = normalize_device(device)
        if fp8:
            reason = fp8_unsupported(self.device, dtype, conv_impl)
            if reason is not None:
                raise FastdiffError(reason)
        self.dtype, self.batch = dtype, batch
        self.cfg = model.config
        self.height, self.width = size if size is not None else family.default_size(model)
        self.conv_impl, self.attention_impl = conv_impl, attention_impl
        graph = GraphBuilder(batch, self.height, self.width, context_tokens)
        with torch.no_grad():
            family.lower(model, graph, self.device)
            if graph.temb_channels:
                self._proj_w = torch.cat([w for w, _ in graph.temb_proj]).to(self.device, torch.float32)
                self._proj_b = torch.cat([b for _, b in graph.temb_proj]).to(self.device, torch.float32)
        if graph.output is None:
            raise FastdiffError(f"internal: the {type(model).__name__} lowering set no output")
        self.values, self.ops, self.inputs, self.out_value = graph.values, graph.ops, graph.inputs, graph.output
        self.fp8_convs = mark_fp8_convs(self.ops) if fp8 else 0  # engine/fp8.py, while the fp32 weights are here
        self.shortcuts = fusable_shortcuts(self.ops)  # engine/shortcut.py: conv2 name -> its 1x1 conv_shortcut op
        self.split_workspace = SplitWorkspace()  # shared by the split kernels: the ops run one after another
        self.tap_partials: dict[str, torch.Tensor] = {}  # by op name: the triton-taps convs' stage-1 buffers
        self.x_in_value = self.inputs["x_in"]
        self.step_ops = [op for op in self.ops if op.stage == "step"]
        self._op_by_name = {op.name: op for op in self.ops}
        self._pair_bias: dict[str, torch.Tensor | None] = {}
        self.context_ops = [op for op in self.ops if op.stage == "context"]
        self.cached_value = graph.cached
        self._shallow_index: list[int] = []
        if self.cached_value is not None:
            _root(self.cached_value).persistent = True  # outlives the full forward that wrote it
            self._shallow_index = self._shallow_slice()
        self.shallow_ops = [self.step_ops[i] for i in self._shallow_index]
        shallow = {id(op) for op in self.shallow_ops}  # a pair runs in the shallow step (step cache) or not at all
        self.epilogue_norms, self.epilogue_stats = (  # engine/epilogue_norm.py: conv name -> the GroupNorm whose
            {  # whole pass / statistics its epilogue may take
                name: norm
                for name, norm in pairs(self.ops).items()
                if (id(self._op_by_name[name]) in shallow) == (id(norm) in shallow)
            }
            for pairs in (epilogue_norms, epilogue_stats)
        )
        self.norm_stats: dict[str, GroupNormPartials] = {}  # by norm name: the partials of a -st conv for its norm
        self._time_features = graph.time_features
        self._temb_channels = graph.temb_channels
        self.temb_row = torch.zeros((1, self._temb_channels), dtype=dtype, device=self.device)
        self.context: torch.Tensor | None = None
        if "context" in self.inputs:
            _, dim, length, _ = self.inputs["context"].shape
            self.context = torch.zeros((batch, length, dim), dtype=dtype, device=self.device)
        self.plan = self._plan()
        self.arena = torch.empty(self.plan.peak_bytes, dtype=torch.uint8, device=self.device)
        self.persistent = {
            v.name: torch.empty((v.shape[0], v.shape[2], v.shape[3], v.shape[1]), dtype=dtype, device=self.device)
            .permute(0, 3, 1, 2)
            for v in self.values
            if v.persistent
        }  # fmt: skip
        self.tensors: dict[str, torch.Tensor] = {}
        self.streamer = streamer or WeightStreamer(self.device)
        self._device_weights: dict[str, dict[str, torch.Tensor]] = {}
        self._x_in: torch.Tensor | None = None
        self._calls: list[Callable[[], None]] = []
        self._shallow_calls: list[Callable[[], None]] = []
        self._context_calls: list[Callable[[], None]] = []
        self.ops_timed = 0  # set by autotune()

    @property
    def weights_loaded(self) -> bool:
        """Whether every op's weights are on the device (after the first forward)."""
        return len(self._device_weights) == len(self.ops)

    def weight_bytes(self) -> int:
        """Bytes of the device weights (every layout still held)."""
        return sum(t.numel() * t.element_size() for w in self._device_weights.values() for t in w.values())

    # ------------------------------------------------------------------------------------------------ plan
    def _fused_access(self) -> dict[int, list[Value]]:
        """Step-op index -> the values that op also reads or writes when a fusion the autotune may pick runs: a
        conv2 reads its shortcut conv's input (engine/shortcut.py), a conv with a GroupNorm in its epilogue writes
        the norm's output (engine/epilogue_norm.py). The arena plan keeps them live there too,
        whichever implementation runs: otherwise the fused op could write its output over bytes it still reads."""
        index = {id(op): i for i, op in enumerate(self.step_ops)}
        extra: dict[int, list[Value]] = {}
        for name, sc in self.shortcuts.items():
            extra.setdefault(index[id(self._op_by_name[name])], []).append(sc.inputs[0])
        for name, norm in self.epilogue_norms.items():  # a conv with a GroupNorm in its epilogue writes its output
            extra.setdefault(index[id(self._op_by_name[name])], []).append(norm.output)
        return extra

    def _plan(self) -> MemoryPlan:
        """The step arena: every non-persistent, non-input buffer over its lifetime in the step ops (including the
        accesses of the fusions the autotune may pick: :meth:`_fused_access`)."""
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        fused_access = self._fused_access()
        for index, op in enumerate(self.step_ops):
            for v in [*op.inputs, op.output, *fused_access.get(index, ())]:
                r = _root(v)
                if r.producer == "external" or r.persistent:
                    continue
                first.setdefault(r.name, index)
                last[r.name] = index
        last[self.out_value.name] = len(self.step_ops)  # read by the sampler step after the forward
        roots = {_root(v).name: _root(v) for v in self.values}
        specs = [
            BufferSpec(name, math.prod(v.shape) * self._value_dtype(v).itemsize, first[name], last[name])
            for name, v in roots.items()
            if name in first
        ]
        return plan_memory(specs)

    def _shallow_slice(self) -> list[int]:
        """Indices (in order) of the step ops that the output needs when ``cached_value`` is given: the producers
        of what each needed op reads (every part of a concat it reads whole), from the output's producer back,
        never through the cached value's producer."""
        producer = {id(op.output): i for i, op in enumerate(self.step_ops)}
        parts: dict[int, list[Value]] = {}
        for v in self.values:
            if v.concat is not None:
                parts.setdefault(id(v.concat), []).append(v)
        needed: set[int] = set()
        todo = [producer[id(self.out_value)]]
        while todo:
            index = todo.pop()
            if index in needed:
                continue
            needed.add(index)
            for v in self.step_ops[index].inputs:
                for part in parts.get(id(v), [v]):
                    if part is not self.cached_value and id(part) in producer:  # not an input or a context value
                        todo.append(producer[id(part)])
        return sorted(needed)

    def _tensor(self, v: Value) -> torch.Tensor:
        if v.name in self.tensors:
            return self.tensors[v.name]
        if v.producer == "external":
            if v.name == "context":
                b, d, length, _ = v.shape
                return self.context.view(b, length, 1, d).permute(0, 3, 1, 2)
            if self._x_in is None:
                raise FastdiffError("internal: input not bound")
            return self._x_in
        if v.concat is not None:
            parent = self._tensor(v.concat)
            t = parent[:, v.channel_offset : v.channel_offset + v.shape[1]]
        elif v.persistent:
            t = self.persistent[v.name]
        else:
            t = self.plan.tensor(self.arena, v.name, v.shape, self._value_dtype(v))
        self.tensors[v.name] = t
        return t

    def _value_dtype(self, v: Value) -> torch.dtype:
        return FP8_DTYPE if v.fp8 else self.dtype

    # --------------------------------------------------------------------------------------------- weights
    def _host_weights(self, op: Op) -> dict[str, torch.Tensor]:
        """The device-layout weights of ``op`` in the engine dtype, packed on the host."""
        out: dict[str, torch.Tensor] = {}
        triton_too, library_too = self.conv_impl in ("auto", "triton"), self.conv_impl in ("auto", "cudnn")
        if op.kind == "conv" and "fp8_scale" in op.params:  # e4m3 [Cout, K] and (input scale x channel scales)
            out["packed_fp8"], scale = pack_conv_weight_fp8(op.weights["weight"])
            out["weight_scale"] = scale * op.params["fp8_scale"]
            if "bias" in op.weights:
                out["bias"] = op.weights["bias"].to(self.dtype)
        elif op.kind == "conv":
            weight = op.weights["weight"]
            if triton_too:
                out["packed"] = pack_conv_weight(weight).to(self.dtype)
                if op.params["upsample"] == 2 and weight.shape[-1] == 3 and self.device.type == "cuda":
                    out["packed_up2"] = pack_upsample2_weight(weight).to(self.dtype)  # conv2d_tma's phase form
                if self._taps_fit(op):  # tap_sum_conv2d's [Cin, K*K*Cout] (and the raw weight for its shape)
                    out["packed_taps"] = pack_tap_weight(weight).to(self.dtype)
                    library_too = True
            if library_too:
                if "pad_end" in op.params:  # padding (p, p + 1) == a zero first tap row and column, padding p + 1
                    weight = F.pad(weight, (1, 0, 1, 0))
                out["weight"] = weight.to(self.dtype).contiguous(memory_format=torch.channels_last)
            if "bias" in op.weights:
                out["bias"] = op.weights["bias"].to(self.dtype)
        elif op.kind == "linear":  # one layout, W^T [K, N], read by both kernels.linear and cuBLAS
            out["packed"] = pack_linear_weight(op.weights["weight"], op.params["geglu"]).to(self.dtype)
            if "bias" in op.weights:
                out["bias"] = op.weights["bias"].to(self.dtype)
        elif op.kind == "depthwise":
            weight = op.weights["weight"]
            if triton_too:
                out["packed"] = pack_depthwise_weight(weight).to(self.dtype)
            if library_too:
                out["weight"] = weight.to(self.dtype).contiguous(memory_format=torch.channels_last)
        elif op.kind in ("group_norm", "layer_norm", "gate"):
            out = {k: v.to(self.dtype) for k, v in op.weights.items() if v is not None}
        return out

    # ----------------------------------------------------------------------------------------------- calls
    def _norm_partials(self, norm: Op) -> GroupNormPartials:
        """The buffers of the partial statistics a ``-st`` conv writes for ``norm`` (which merges them)."""
        if norm.name not in self.norm_stats:
            self.norm_stats[norm.name] = GroupNormPartials(norm.params["groups"])
        return self.norm_stats[norm.name]

    def _summed_bias(self, op: Op, sc: Op) -> torch.Tensor | None:
        """conv2's bias + its shortcut's (the fused pair's one bias), made once per pair."""
        key = f"{op.name}+{sc.name}"
        if key not in self._pair_bias:
            biases = [b for b in (self._device_weights[n].get("bias") for n in (op.name, sc.name)) if b is not None]
            self._pair_bias[key] = (biases[0] + biases[1]) if len(biases) == 2 else (biases or [None])[0]
        return self._pair_bias[key]

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
        if "pad_end" in p and impl == "cudnn":  # the library weight has the extra first tap row and column
            padding += 1
        elif "pad_end" in p:  # (top/left, bottom/right): the gather kernel's bounds check pads the end
            padding = (padding, p["pad_end"])
        split_k = int(impl.rpartition("-k")[2]) if "-k" in impl else 1  # -k<N>: the reduction split N ways
        workspace = self.split_workspace if split_k > 1 else None
        shortcut = shortcut_weight = None
        if _sums_shortcut(impl):  # -sc: + the 1x1 conv_shortcut summed into the reduction (engine/shortcut.py)
            sc = self.shortcuts[op.name]
            shortcut, shortcut_weight = self._tensor(sc.inputs[0]), self._device_weights[sc.name]["packed"]
            bias, residual = self._summed_bias(op, sc), None
        if impl.startswith("triton-tma-fp8"):
            packed, weight_scale = w["packed_fp8"], w["weight_scale"]
            return lambda: conv2d_tma(
                x, packed, bias, padding=padding, time_emb=temb, residual=residual, activation=act,
                out_scale=scale, out=out, weight_scale=weight_scale, split_k=split_k, workspace=workspace,
            )  # fmt: skip
        if impl == "triton-taps":
            raw, packed, partials = w["weight"], w["packed_taps"], self._tap_partials(op)
            return lambda: tap_sum_conv2d(x, raw, bias, padding=padding, out=out, packed=packed, partials=partials)
        if impl.startswith("gluon"):
            packed, (_, cout, ho, wo) = w["packed"], op.output.shape
            config = default_gluon_config(self.batch, ho, wo, cout, self.device)
            if impl.startswith("gluon-p2"):  # persistent: two programs per SM loop over the tiles
                config = dataclasses.replace(config, programs_per_sm=2)
            return lambda: conv2d_gluon(x, packed, bias, padding=padding, time_emb=temb, residual=residual,
                                        out_scale=scale, out=out, config=config, shortcut=shortcut,
                                        shortcut_weight=shortcut_weight)  # fmt: skip
        if impl.startswith("triton-tma"):
            packed = w["packed_up2"] if up == 2 else w["packed"]
            return lambda: conv2d_tma(
                x, packed, bias, padding=padding, time_emb=temb, residual=residual, activation=act,
                out_scale=scale, out=out, upsample=up, split_k=split_k, workspace=workspace,
            )  # fmt: skip
        if impl.startswith("triton"):  # the gather kernel; -gn: + the GroupNorm of the output in the epilogue
            norm_out = None
            if "-gn" in impl:
                gn = self.epilogue_norms[op.name]
                gw, gp = self._device_weights[gn.name], gn.params
                norm_out = OutputGroupNorm(gp["groups"], self._tensor(gn.output), gw.get("weight"), gw.get("bias"),
                                           gp["eps"], gp["act"])  # fmt: skip
            packed = w["packed"]
            stats = None
            if "-st" in impl:  # -st: the partial statistics of the output for its GroupNorm
                stats = self._norm_partials(self.epilogue_stats[op.name])
            return lambda: conv2d(
                x, packed, bias, stride=stride, padding=padding, time_emb=temb, residual=residual,
                activation=act, out_scale=scale, out=out, upsample=up, stats=stats, split_k=split_k,
                workspace=workspace, shortcut=shortcut, shortcut_weight=shortcut_weight, norm_out=norm_out,
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

    def _linear_call(self, op: Op, impl: str) -> Callable[[], None]:
        x, out = tokens(self._tensor(op.inputs[0])), tokens(self._tensor(op.output))
        residual = tokens(self._tensor(op.inputs[1])) if len(op.inputs) > 1 else None
        w, geglu, scale = self._device_weights[op.name], op.params["geglu"], op.params["scale"]
        weight_t, bias = w["packed"], w.get("bias")
        if impl == "triton":
            return lambda: linear(
                x, weight_t, bias, residual=residual, geglu=geglu, out_scale=scale, out=out, packed=True
            )
        half = out.shape[1]

        def cublas_linear() -> None:  # cuBLAS GEMM (+ bias), then the epilogue in torch ops
            y = torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)
            if geglu:
                y = y[:, :half] * F.gelu(y[:, half:])
            if residual is not None:
                torch.add(y, residual, out=out)
            else:
                out.copy_(y)
            if scale is not None:
                out.mul_(scale)

        return cublas_linear

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
        core = self._tensor(op.output)
        heads, head_dim = op.params["heads"], op.params["head_dim"]
        b, _, h, w = core.shape
        if op.params["cross"]:
            q = tokens(self._tensor(op.inputs[0])).view(b, h * w, heads, head_dim).transpose(1, 2)
            kv = self._tensor(op.inputs[1])
            kv_tokens = tokens(kv).view(b, kv.shape[2] * kv.shape[3], 2, heads, head_dim)
            k, v = (kv_tokens[:, :, i].transpose(1, 2) for i in range(2))
        else:
            qkv = tokens(self._tensor(op.inputs[0])).view(b, h * w, 3, heads, head_dim)  # dense NHWC: a view
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        o = tokens(core).view(b, h * w, heads, head_dim).transpose(1, 2)
        if impl == "triton-rows":  # whole score rows per program, the value columns split
            return lambda: attention(q, k, v, out=o, schedule="rows")
        if impl.startswith("triton"):  # -kv<N>: the keys split over N programs per query block
            split = int(impl.removeprefix("triton-kv")) if impl != "triton" else 1
            workspace = self.split_workspace
            return lambda: attention(q, k, v, out=o, split_kv=split, workspace=workspace)
        return lambda: o.copy_(F.scaled_dot_product_attention(q, k, v))

    def _call(self, op: Op, impl: str) -> Callable[[], None]:
        if impl == "fused":  # run inside another op's launch (a shortcut conv, an epilogue GroupNorm)
            return lambda: None
        if op.kind == "conv":
            return self._conv_call(op, impl)
        if op.kind == "linear":
            return self._linear_call(op, impl)
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
        if op.kind == "group_norm":  # "triton" (the kernel's own plan), "triton-c<lanes>" or "apply" (a -st conv's
            w, p = self._device_weights[op.name], op.params  # statistics)
            lanes = int(impl.removeprefix("triton-c")) if impl.startswith("triton-c") else None
            stats = self._norm_partials(op) if impl == "apply" else None
            return lambda: group_norm_act(
                x, p["groups"], w["weight"], w["bias"], p["eps"], activation=p["act"], out=out,
                fp8_scale=p.get("fp8_scale"), lanes=lanes, stats=stats,
            )  # fmt: skip
        if op.kind == "layer_norm":
            w, eps = self._device_weights[op.name], op.params["eps"]
            x2, out2 = tokens(x), tokens(out)
            return lambda: layer_norm(x2, w["weight"], w["bias"], eps, out=out2)
        if op.kind == "center":
            return lambda: torch.add(x, x, out=out).sub_(1.0)
        raise FastdiffError(f"internal: unknown op kind {op.kind}")

    def _candidates(self, op: Op) -> tuple[str, ...]:
        """The implementations ``op`` may run: two to time, or the one forced / the only one."""
        if op.kind == "conv" and "fp8_scale" in op.params:  # the TMA kernel, also split-K where its grid leaves SMs
            return ("triton-tma-fp8", *(f"triton-tma-fp8-k{split}" for split in self._tma_split_choices(op)))
        if op.kind in ("conv", "depthwise", "linear"):
            library = "cublas" if op.kind == "linear" else "cudnn"
            ours = ("triton", "triton-tma") if op.kind == "conv" and self._tma_fits(op) else ("triton",)
            if op.kind == "conv" and self._taps_fit(op):  # + the tap-sum form of a conv with few output channels
                ours = (*ours, "triton-taps")
            if op.kind == "conv" and self._gluon_fits(op):  # + the Gluon TMA conv, one tile per program or persistent
                ours = (*ours, "gluon", "gluon-p2")
            if op.kind == "conv" and self.device.type == "cuda":
                ours = (*ours, *(f"triton-k{split}" for split in self._split_k_choices(op)))
                if op.name in self.shortcuts:  # + the gather kernel with the shortcut summed in (engine/shortcut.py)
                    ours = (*ours, "triton-sc", *(f"triton-sc-k{split}" for split in self._split_k_choices(op)))
                if op.name in self.shortcuts and self._gluon_shortcut_fits(op):  # + the Gluon conv's form of it
                    ours = (*ours, "gluon-sc", "gluon-p2-sc")
                gather = [impl for impl in ours if _is_gather(impl)]
                if op.name in self.epilogue_norms:  # + each gather variant with the GroupNorm in its epilogue
                    ours = (*ours, *(_with_epilogue(impl, "gn") for impl in gather))
                if op.name in self.epilogue_stats and op.name not in self.epilogue_norms:  # + each with the
                    ours = (*ours, *(_with_epilogue(impl, "st") for impl in gather))  # GroupNorm's statistics
            return {"auto": (*ours, library), "triton": ours, "cudnn": (library,)}[self.conv_impl]
        if op.kind == "attention":
            ours = ("triton",)
            if self.device.type == "cuda":  # + the keys split over programs where the query blocks leave SMs idle
                q, kv = op.inputs[0].shape, op.inputs[-1].shape
                splits = split_kv_choices(q[0], op.params["heads"], q[2] * q[3], kv[2] * kv[3], self.device)
                ours = (*ours, *(f"triton-kv{split}" for split in splits))
                if kv[2] * kv[3] <= ROWS_MAX_KEYS:  # + whole score rows, the value columns split
                    ours = (*ours, "triton-rows")
            return {"auto": (*ours, "sdpa"), "triton": ours, "sdpa": ("sdpa",)}[self.attention_impl]
        if op.kind == "group_norm" and self.device.type == "cuda":  # the kernel's plan, or whole groups per width
            group = op.inputs[0].shape[1] // op.params["groups"]
            return ("triton", *(f"triton-c{lanes}" for lanes in LANE_CHOICES if lanes >= group))
        return ("torch",) if op.kind == "center" else ("triton",)

    def _split_k_choices(self, op: Op) -> tuple[int, ...]:
        """The split-K factors of the gather conv worth timing for ``op`` (its grid leaves SMs idle)."""
        (n, cin, *_), (_, cout, ho, wo) = op.inputs[0].shape, op.output.shape
        return split_k_choices(n, cin, cout, (ho, wo), op.params["ksize"], self.dtype, self.device)

    def _tma_split_choices(self, op: Op) -> tuple[int, ...]:
        """The split-K factors of the fp8 TMA conv worth timing for ``op`` (:func:`tma_split_k_choices`; CUDA only).
        Not offered to the fp16/bf16 TMA conv: on the H100 its split forms lost to the gather kernel's at batch 1 and
        to its own unsplit form at batch 256's 4x4 level (the README's "Split-K for the fp8 convs")."""
        if self.device.type != "cuda":
            return ()
        (n, cin, *_), (_, cout, ho, wo) = op.inputs[0].shape, op.output.shape  # fp8: never an Upsample2D
        return tma_split_k_choices(n, ho, wo, cin, cout, op.params["ksize"], FP8_DTYPE, self.device)

    def _taps_fit(self, op: Op) -> bool:
        """Whether ``op`` can run as :func:`tap_sum_conv2d` (a stride-1 conv of at most ``MAX_COUT`` output
        channels with a bias-only epilogue, on the GPU: its gain is the GPU's re-read input)."""
        p = op.params
        if op.kind != "conv" or self.device.type != "cuda" or "pad_end" in p or p["upsample"] != 1:
            return False
        if any(p.get(key) is not None for key in ("temb", "act", "scale")) or len(op.inputs) > 1:  # + a residual
            return False
        if "fp8_scale" in p:
            return False
        x = op.inputs[0]
        probe = torch.empty(x.shape, device="meta")
        return tap_sum_unsupported(probe, op.output.shape[1], p["ksize"], p["stride"], p["padding"]) is None

    def _tap_partials(self, op: Op) -> torch.Tensor:
        """The fp32 stage-1 buffer of a ``triton-taps`` conv: one per op, made when its call is first built."""
        if op.name not in self.tap_partials:
            (n, _, h, w), cout, k = op.inputs[0].shape, op.output.shape[1], op.params["ksize"]
            cols = tap_columns(k, cout)
            self.tap_partials[op.name] = torch.empty(
                (n, cols, h, w), device=self.device, dtype=torch.float32, memory_format=torch.channels_last
            )
        return self.tap_partials[op.name]

    def _gluon_fits(self, op: Op) -> bool:
        """Whether :func:`conv2d_gluon` can run ``op`` (the TMA conv's domain in fp16/bf16, no activation or
        upsampling)."""
        p = op.params
        if not self._tma_fits(op) or p["upsample"] != 1 or "fp8_scale" in p:
            return False
        if op.output.shape[1] < 64:  # tiles at least 64 channels wide (the shapes it was measured on)
            return False
        reason = gluon_conv_unsupported(self._tensor(op.inputs[0]), op.output.shape[1], p["ksize"],
                                        stride=p["stride"], padding=p["padding"], activation=p["act"])  # fmt: skip
        return reason is None

    def _tma_fits(self, op: Op) -> bool:
        """Whether the TMA conv kernel can run ``op`` (CUDA on Hopper or newer, stride 1, Upsample2D at most)."""
        if self.device.type != "cuda" or "pad_end" in op.params:
            return False
        p = op.params
        reason = tma_conv_unsupported(self._tensor(op.inputs[0]), op.output.shape[1], p["ksize"], stride=p["stride"],
                                      padding=p["padding"], upsample=p["upsample"])  # fmt: skip
        return reason is None

    def _gluon_shortcut_fits(self, op: Op) -> bool:
        """Whether :func:`conv2d_gluon` can run ``op`` with its 1x1 conv_shortcut summed in (the conv in its domain,
        the shortcut's input in the TMA domain)."""
        if not self._gluon_fits(op):
            return False
        shortcut = self._tensor(self.shortcuts[op.name].inputs[0])
        return tma_conv_unsupported(shortcut, op.output.shape[1], 1) is None

    def _default_why(self, op: Op) -> str:
        if op.kind == "conv" and "fp8_scale" in op.params:
            return "fp8 (e4m3) input: the TMA kernel only"
        if op.kind in ("conv", "depthwise", "linear"):
            return f"conv_impl={self.conv_impl}" + (" (not timed off CUDA)" if self.conv_impl == "auto" else "")
        if op.kind == "attention":
            return f"attention_impl={self.attention_impl}" + (
                " (not timed off CUDA)" if self.attention_impl == "auto" else ""
            )
        if op.kind == "group_norm" and self.device.type != "cuda":
            return "the kernel's own plan (not timed off CUDA)"
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
        for name, sc in self.shortcuts.items():  # a shortcut summed in its conv2 (_sums_shortcut) runs no launch
            if _sums_shortcut(self._op_by_name[name].impl or ""):
                sc.impl, sc.why = "fused", f"summed in {name} (the reduction runs on over this conv's input)"
            elif sc.impl == "fused":  # back to its own fastest (or default) implementation
                sc.impl, sc.why = (min(sc.times_us, key=sc.times_us.get) if sc.times_us else None), None
        for pairs, tag, marker, why in (  # a GroupNorm in its producer's epilogue runs no launch; one whose
            (self.epilogue_norms, "-gn", "fused", "in {}'s epilogue (its output tiles hold whole images and groups)"),
            (self.epilogue_stats, "-st", "apply", "one pass, with the statistics {} writes in its epilogue"),
        ):  # statistics the producer writes runs one elementwise pass; each back to its own when not chosen
            for name, gn in pairs.items():
                if tag in (self._op_by_name[name].impl or ""):
                    gn.impl, gn.why = marker, why.format(name)
                elif gn.impl == marker:
                    gn.impl, gn.why = (min(gn.times_us, key=gn.times_us.get) if gn.times_us else None), None
        for op in self.ops:
            op.impl = op.impl or self._candidates(op)[0]
            op.why = op.why or self._default_why(op)
        self._calls = [self._call(op, op.impl) for op in self.step_ops]
        self._shallow_calls = [self._calls[i] for i in self._shallow_index]
        self._context_calls = [self._call(op, op.impl) for op in self.context_ops]

    # ------------------------------------------------------------------------------------------- forward
    @torch.no_grad()
    def time_table(self, timesteps: torch.Tensor) -> torch.Tensor:
        """[N, sum(C)] per-step epilogue addends (projection(act(MLP(sinusoid(t)))) + conv bias), fp32 -> dtype.
        Built without autograd: the engine writes rows of it into its buffers with ``out=`` ops."""
        t = timesteps.to(self.device)
        if self._time_features is None:
            return torch.zeros((t.shape[0], 0), dtype=self.dtype, device=self.device)
        return F.linear(self._time_features(t), self._proj_w, self._proj_b).to(self.dtype)

    @torch.no_grad()
    def set_context(self, context: torch.Tensor) -> None:
        """Text states [B, L, D] for the next forwards: copied into the static context buffer, and the
        cross-attention K/V of every block projected once (device work only: no host sync)."""
        if self.context is None:
            raise FastdiffError(f"{type(self).__name__}: this model takes no text context")
        if tuple(context.shape) != tuple(self.context.shape):
            raise FastdiffError(
                f"text states {tuple(context.shape)} do not match the prepared {tuple(self.context.shape)}"
            )
        self.context.copy_(context)
        if self.weights_loaded and self._context_calls:
            for call in self._context_calls:
                call()

    def _streamed_forward(self, x_in: torch.Tensor) -> None:
        """The first forward, interleaved with the weight upload: for each module, pack its weights on the host
        and queue their copy on the copy stream, then queue its compute behind that module's event only. The
        GPU runs module k while the host packs and the copy engine uploads modules k+1, ... (the context-stage
        ops run in model order too, on the context set so far).
        """
        self._check_input(x_in)
        self._x_in, self.tensors = x_in, {}
        for op in self.ops:
            self._device_weights[op.name] = self.streamer.submit(op.name, self._host_weights(op))
            op.weights = {}  # the fp32 source copies are no longer needed
            self.streamer.wait(op.name)
            op.impl = op.impl or self._candidates(op)[0]
            self._call(op, self._first_forward_impl(op))()
        self._bind(x_in)

    def _first_forward_impl(self, op: Op) -> str:
        """``op``'s implementation in the streamed first forward: a GroupNorm that runs in its producer's epilogue
        runs on its own there (its weights upload after the conv's)."""
        if op.kind == "conv" and "-gn" in op.impl:
            return op.impl.replace("-gn", "")
        if op.kind == "group_norm" and op.impl == "fused":
            return self._candidates(op)[0]
        return op.impl

    def forward_from_row(self, x_in: torch.Tensor, shallow: bool = False) -> torch.Tensor:
        """The model output for ``x_in`` with the time embedding already in ``temb_row`` (the first call
        streams the weights in, see ``_streamed_forward``); ``shallow``: only ``shallow_ops``, on the deep feature
        the last full forward left in ``cached_value``'s buffer."""
        if shallow and (self.cached_value is None or not self.weights_loaded):
            raise FastdiffError("internal: a shallow forward needs a step cache and a full forward before it")
        if not self.weights_loaded:
            self._streamed_forward(x_in)
        else:
            if self._x_in is None or x_in.data_ptr() != self._x_in.data_ptr():
                self._bind(x_in)
            for call in self._shallow_calls if shallow else self._calls:
                call()
        return self._tensor(self.out_value)

    @torch.no_grad()
    def forward(
        self, x_in: torch.Tensor, t: torch.Tensor | None = None, context: torch.Tensor | None = None,
        shallow: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Model output for ``x_in`` (channels-last, engine dtype) at one timestep ``t`` (shared by the batch;
        None for models without a time input), with text states ``context`` [B, L, D] when given; ``shallow`` as
        in ``forward_from_row``."""
        if t is not None and self._temb_channels:
            self.temb_row.copy_(self.time_table(t.reshape(-1)[:1]))
        if context is not None:
            self.set_context(context)
        return self.forward_from_row(x_in, shallow)

    def bind_timesteps(self, timesteps: torch.Tensor) -> Callable[..., torch.Tensor]:
        """The step model for a sampler's timesteps: (x_in, step index [1] on the device[, shallow]) -> model
        output (``shallow`` None or False: a full forward, which always refreshes the deep feature)."""
        table = self.time_table(timesteps)

        def step(x_in: torch.Tensor, index: torch.Tensor, shallow: bool | None = None) -> torch.Tensor:
            torch.index_select(table, 0, index, out=self.temb_row)
            return self.forward_from_row(x_in, bool(shallow))

        return step

    # -------------------------------------------------------------------------------------------- choice
    def autotune(self, x_in: torch.Tensor, reps: int = 20) -> None:
        """On CUDA, time each op that has two implementations (CUDA graph of ``reps`` launches, so launch
        overhead does not count) and keep the faster; records the times and the reason per op, and in
        ``ops_timed`` how many ops were not in the tuning cache. The arena's activations are overwritten."""
        if self.device.type != "cuda":
            return
        if not self.weights_loaded:
            self._streamed_forward(x_in)
        self._bind(x_in)
        _load_tuning_cache()
        self.ops_timed = 0
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.arena.view(self.dtype)[: self.arena.numel() // self.dtype.itemsize].normal_(generator=gen)
        self.temb_row.normal_(generator=gen)
        for op in self.ops:
            candidates = self._candidates(op)
            if len(candidates) < 2:
                continue
            timed_now = self.ops_timed
            op.times_us = self._candidate_times(op, candidates, reps)
            why = "timed" if self.ops_timed > timed_now else "timed earlier (tuning cache, same shapes)"
            effective = dict(op.times_us)
            sc = self.shortcuts.get(op.name)
            if sc is not None:  # unfused, the pair also pays for the shortcut conv's own launch at its best
                sc_us = min(sc.times_us.values()) if sc.times_us else time_call_us(self._call(sc, sc.impl), reps)
                effective = {k: v + (0.0 if _sums_shortcut(k) else sc_us) for k, v in effective.items()}
                why += f" (unfused + {sc.name} {sc_us:.1f} us)"
            norms = {id(n): n for n in (self.epilogue_norms.get(op.name), self.epilogue_stats.get(op.name)) if n}
            if norms and any("-st" in k or "-gn" in k for k in effective):
                # apart, each norm launches on its own at its best; a -gn conv runs its whole norm, after a -st
                # conv its norm runs as the one-pass form
                added = dict.fromkeys(effective, 0.0)
                for gn in norms.values():
                    gn_us = min(self._candidate_times(gn, self._candidates(gn), reps).values())
                    apply_us = math.inf
                    st = [k for k in effective if "-st" in k and effective[k] < math.inf]
                    if st and gn is self.epilogue_stats.get(op.name):
                        self._call(op, st[0])()  # the partials exist before the norm's one-pass form is timed
                        apply_us = self._candidate_times(gn, ("apply",), reps)["apply"]
                    for k in effective:
                        if "-gn" in k and gn is self.epilogue_norms.get(op.name):
                            continue
                        added[k] += apply_us if "-st" in k and gn is self.epilogue_stats.get(op.name) else gn_us
                    why += f" (apart + {gn.name} {gn_us:.1f} us; after -st {apply_us:.1f} us)"
                effective = {k: v + added[k] for k, v in effective.items()}
            op.impl = min(effective, key=effective.get)
            op.why = f"{why}: " + ", ".join(f"{k} {v:.1f} us" for k, v in op.times_us.items())
        if self.ops_timed:
            _save_tuning_cache()
        self._bind(x_in)
        self.drop_unused_weights()
        if self._context_calls:  # the timing overwrote the K/V buffers: recompute them from the context
            for call in self._context_calls:
                call()

    def _candidate_times(self, op: Op, candidates: tuple[str, ...], reps: int) -> dict[str, float]:
        """Microseconds of each of ``op``'s candidates: the tuning cache's, the missing ones timed now (then
        ``ops_timed`` counts the op). A candidate that does not fit this GPU (Triton's ``OutOfResources``: e.g. the
        larger tile of an epilogue GroupNorm on a GPU with less shared memory than Hopper's) times as infinite."""
        known = TUNING_CACHE.setdefault(self._tuning_key(op), {})
        missing = [impl for impl in candidates if impl not in known]
        for impl in missing:
            try:
                known[impl] = time_call_us(self._call(op, impl), reps)
            except OutOfResources as err:
                log.info("%s: %s does not fit this GPU (%s)", op.name, impl, err)
                known[impl] = math.inf
        self.ops_timed += bool(missing)
        return {impl: known[impl] for impl in candidates}

    def time_ops(self, reps: int = 20) -> list[float]:
        """Microseconds of each op of ``step_ops`` (in order) with its chosen implementation, timed like
        ``autotune`` (a CUDA graph of ``reps`` launches, :func:`time_call_us`; launch overhead excluded; 0 for a
        shortcut summed in its conv2 or a GroupNorm in its producer's epilogue). Needs
        CUDA and a bound forward (any ``forward`` call); the ops overwrite the arena's activations."""
        if self.device.type != "cuda":
            raise FastdiffError("FusedModel.time_ops needs CUDA")
        if not self._calls:
            raise FastdiffError("FusedModel.time_ops before the first forward")
        pairs = zip(self.step_ops, self._calls, strict=True)
        return [0.0 if op.impl == "fused" else time_call_us(call, reps) for op, call in pairs]  # fused: no launch

    def _tuning_key(self, op: Op) -> str:
        """What an op's timing depends on: kind, shapes, strided (concat slice) or not, flags (an fp8 input scale
        only as present: its value does not change the time), the fused partners' shapes, dtype, GPU, library
        versions and the kernels' source (:func:`kernels_revision`) (a string: it is a JSON key on disk)."""
        params = {k: (v is not None if k in ("temb", "fp8_scale") else v) for k, v in op.params.items()}
        if op.name in self.shortcuts:  # its -sc candidates also run the shortcut conv: that input's size and layout
            sc_in = self.shortcuts[op.name].inputs[0]
            params["shortcut_in"] = (sc_in.shape, sc_in.concat is not None)
        if op.name in self.epilogue_norms:  # its -gn candidates also run this norm
            gn = self.epilogue_norms[op.name]
            affine = self._device_weights.get(gn.name, {}).get("weight") is not None
            params["norm_out"] = (gn.params["groups"], gn.params["eps"], gn.params["act"], affine)
        if op.name in self.epilogue_stats:  # its -st candidates also write this norm's statistics
            params["stats_out"] = self.epilogue_stats[op.name].params["groups"]
        values = [(v.shape, v.concat is not None) for v in (*op.inputs, op.output)]
        gpu = torch.cuda.get_device_name(self.device)
        return repr((op.kind, values, sorted(params.items()), str(self.dtype), gpu, torch.__version__,
                     triton.__version__, kernels_revision()))  # fmt: skip

    def drop_unused_weights(self) -> None:
        """Free the weight layouts the chosen implementation does not read."""
        for op in self.ops:
            gather = op.kind == "conv" and _is_gather(op.impl)  # every gather variant reads the plain kernel's
            impl = "triton" if gather else op.impl
            if impl.startswith("triton-tma"):  # a split-K TMA conv reads what the unsplit one does
                impl = impl.partition("-k")[0]
            reads = WEIGHT_ROLES.get((op.kind, impl))
            if op.impl != "triton-taps":
                self.tap_partials.pop(op.name, None)
            if reads is not None:
                w = self._device_weights[op.name]
                for role in set(w) - reads:
                    del w[role]

    def layer_table(self) -> list[dict]:
        """One row per op: name, kind, stage, output shape, implementation, why, times, where its output lives."""
        rows = []
        for op in self.ops:
            out = op.output
            where = f"slice [{out.channel_offset}:] of {out.concat.name}" if out.concat is not None else "own buffer"
            rows.append(dict(name=op.name, kind=op.kind, stage=op.stage, shape=list(out.shape), impl=op.impl,
                             why=op.why, times_us=op.times_us, output=where))  # fmt: skip
        return rows


def _root(v: Value) -> Value:
    while v.concat is not None:
        v = v.concat
    return v


TIMING_WARMUP_S = 0.005
"""How long :func:`time_call_us` replays its graph before timing: the GPU's clocks drop during an idle gap (a
kernel compile between two candidates) and take milliseconds to come back."""
TIMED_REPLAYS = 5
"""Replays :func:`time_call_us` takes the median of."""


def time_call_us(call: Callable[[], None], reps: int) -> float:
    """Median microseconds per ``call()`` from :data:`TIMED_REPLAYS` replays of a CUDA graph of up to ``reps``
    calls (fewer for slow ops: the graph holds about 2 ms of work), so launch overhead does not count, after
    replaying it for :data:`TIMING_WARMUP_S` (clocks up again after an idle gap)."""
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
    warm_until = time.perf_counter() + TIMING_WARMUP_S
    while True:
        graph.replay()
        torch.cuda.synchronize()
        if time.perf_counter() >= warm_until:
            break
    times = []
    for _ in range(TIMED_REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return sorted(times)[len(times) // 2]
