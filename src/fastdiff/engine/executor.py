"""The engine's executor: a model forward lowered to fused kernels over one planned NHWC arena.

``FusedModel(model, batch, dtype, device)`` asks the model family's lowering (:mod:`fastdiff.engine.lower`) for
the forward as a list of ops of :mod:`fastdiff.engine.ir`, then:

* plans memory: every step activation is a logical ``[B, C, H, W]`` channels-last view of one arena laid out by
  :func:`fastdiff.engine.plan.plan_memory` (buffers reused when lifetimes allow); concat parts are channel
  slices their producers write in place (zero-copy concat); ``context``-stage outputs (cross-attention K/V) have
  their own buffers, written once per text context by :meth:`FusedModel.set_context`;
* streams each op's weights to the device during the first forward and packs them there, in the engine dtype
  (:mod:`fastdiff.engine.weights`: module k runs while module k+1 uploads and packs);
* binds each op to an implementation (:class:`fastdiff.engine.impl.Impl`): the choice map ``impls`` (op name ->
  Impl) is the one thing the forward reads; its candidates come from :mod:`fastdiff.engine.candidates`, their
  launches from :mod:`fastdiff.engine.calls`, and on CUDA :meth:`FusedModel.autotune` times them and keeps the
  fastest (:mod:`fastdiff.engine.tuning`, with its tuning cache). ``conv_impl`` narrows convs and GEMMs to "triton"
  (our kernels) or the vendor library ("cudnn"), ``attention_impl`` attention to "triton" or "sdpa";
* offers the fusions of :data:`FUSIONS` (:mod:`fastdiff.engine.fusion`): a conv and a partner op in one launch
  (a ResnetBlock2D's conv_shortcut summed into its conv2; a GroupNorm, or its statistics, in the epilogue of the
  conv that writes its input), each timed against the pair apart;
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

Adding a fusion: one module with a :class:`fastdiff.engine.fusion.Fusion` subclass (which pairs it takes, the conv
implementations that run it, their kernel arguments, what the partner runs as meanwhile and costs apart; see
``engine/shortcut.py``), its instance added to :data:`FUSIONS` and its tag to
:data:`fastdiff.engine.impl.FUSION_TAGS` (where it goes in the implementation names). Candidates, launches, the
arena plan, the tuning keys, the autotune's pair costs, the first forward and the bench's op tables all ask the
registered fusions; nothing here changes.

Op-level fusions (one launch per op: GroupNorm + SiLU, the conv epilogue, Upsample2D in the conv, ...) are the
lowerings' and kernels' (:mod:`fastdiff.engine.ir`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fastdiff.devices import normalize_device
from fastdiff.engine.calls import build_call
from fastdiff.engine.candidates import ATTENTION_IMPLS, CONV_IMPLS, candidates, default_why, taps_fit
from fastdiff.engine.compile_pool import compile_workers, counting_compiles, precompile
from fastdiff.engine.epilogue_norm import EPILOGUE_NORM, EPILOGUE_STATS
from fastdiff.engine.fp8 import fp8_unsupported, mark_fp8_ops
from fastdiff.engine.fusion import Fusion
from fastdiff.engine.graph import channels_last_empty
from fastdiff.engine.impl import Impl, impl_names
from fastdiff.engine.ir import GraphBuilder, Op, Value, shallow_slice
from fastdiff.engine.kernel_plan import PlanEntry, structure_digest
from fastdiff.engine.lower import lowering_for
from fastdiff.engine.plan import BufferSpec, MemoryPlan, plan_memory
from fastdiff.engine.shortcut import SHORTCUT
from fastdiff.engine.tuning import (
    choose_impls,
    compile_candidates,
    load_tuning_cache,
    save_tuning_cache,
    time_call_us,
)
from fastdiff.engine.weights import WeightStreamer, packed_weights, roles_of, weight_roles
from fastdiff.errors import FastdiffError
from fastdiff.kernels.common import SplitWorkspace
from fastdiff.kernels.fp8 import FP8_DTYPE

FUSIONS: tuple[Fusion, ...] = (SHORTCUT, EPILOGUE_NORM, EPILOGUE_STATS)
"""The fusions the engine offers (:mod:`fastdiff.engine.fusion`), in the order the autotune adds their partners'
costs."""


class FusedModel:
    """The fused forward of one model at one (batch, size, dtype, device); see the module docstring.

    ``bind_timesteps(timesteps)`` returns the step model ``(x_in, step_index[, shallow]) -> model output`` that
    :class:`fastdiff.engine.graph.SamplingLoop` runs; ``forward(x_in, t)`` is the plain call. Text-conditioned
    models read the text states set by ``set_context``. ``size`` is the input's (height, width) (default: the
    family's, e.g. the config's ``sample_size``); ``context_tokens`` the text length (default 77).
    ``cached_value`` is the step cache's deep feature (None for a model without one: the VAE) and
    ``shallow_ops`` the step ops of a shallow forward. ``impls`` maps op names to their implementations (set by
    the autotune, or by hand before a forward); ``pairs[tag]`` maps a conv's name to its partner in that fusion.
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
        if fp8 and (reason := fp8_unsupported(self.device, dtype, conv_impl)) is not None:
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
        self.fp8_ops = mark_fp8_ops(self.ops) if fp8 else 0  # engine/fp8.py, while the fp32 weights are here
        self.split_workspace = SplitWorkspace()  # shared by the split kernels: the ops run one after another
        self.tap_partials: dict[str, torch.Tensor] = {}  # by op name: the triton-taps convs' stage-1 buffers
        self.x_in_value = self.inputs["x_in"]
        self.step_ops = [op for op in self.ops if op.stage == "step"]
        self.context_ops = [op for op in self.ops if op.stage == "context"]
        self.op_by_name = {op.name: op for op in self.ops}
        self.cached_value = graph.cached
        self._shallow_index: list[int] = []
        if self.cached_value is not None:
            _root(self.cached_value).persistent = True  # outlives the full forward that wrote it
            self._shallow_index = shallow_slice(self.step_ops, self.values, self.out_value, self.cached_value)
        self.shallow_ops = [self.step_ops[i] for i in self._shallow_index]
        shallow = {id(op) for op in self.shallow_ops}  # a pair runs in the shallow step (step cache) or not at all
        self.fusions = FUSIONS
        self.pairs: dict[str, dict[str, Op]] = {
            fusion.tag: {
                name: partner
                for name, partner in fusion.pairs(self.ops).items()
                if (id(self.op_by_name[name]) in shallow) == (id(partner) in shallow)
            }
            for fusion in self.fusions
        }
        self.fusion_state: dict[str, dict[str, Any]] = {}  # by fusion tag: its buffers (pair biases, statistics)
        self.impls: dict[str, Impl] = {}  # op name -> its implementation: the choice the forward binds
        self.plan_applied = False  # apply_plan set every op's implementation: the first forward packs only theirs
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
            v.name: channels_last_empty(v.shape, dtype, self.device) for v in self.values if v.persistent
        }
        self.tensors: dict[str, torch.Tensor] = {}
        self.streamer = streamer or WeightStreamer(self.device)
        self.device_weights: dict[str, dict[str, torch.Tensor]] = {}
        self._x_in: torch.Tensor | None = None
        self._calls: list[Callable[[], None]] = []
        self._shallow_calls: list[Callable[[], None]] = []
        self._context_calls: list[Callable[[], None]] = []
        self.ops_timed = 0  # set by autotune()
        self.compile_stats: dict[str, float] = {}  # the first forward's kernel compiles (compile_pool.precompile)

    @property
    def weights_loaded(self) -> bool:
        """Whether every op's weights are on the device (after the first forward)."""
        return len(self.device_weights) == len(self.ops)

    def weight_bytes(self) -> int:
        """Bytes of the device weights (every layout still held)."""
        return sum(t.numel() * t.element_size() for w in self.device_weights.values() for t in w.values())

    # ------------------------------------------------------------------------------------------------ plan
    def _fused_access(self) -> dict[int, list[Value]]:
        """Step-op index -> the values that op also reads or writes when a fusion the autotune may pick runs
        (:meth:`fastdiff.engine.fusion.Fusion.access`: a conv2 reads its shortcut conv's input, a conv with a
        GroupNorm in its epilogue writes the norm's output). The arena plan keeps them live there too, whichever
        implementation runs: otherwise the fused op could write its output over bytes it still reads."""
        index = {id(op): i for i, op in enumerate(self.step_ops)}
        extra: dict[int, list[Value]] = {}
        for fusion in self.fusions:
            for name, partner in self.pairs[fusion.tag].items():
                value = fusion.access(partner)
                if value is not None:
                    extra.setdefault(index[id(self.op_by_name[name])], []).append(value)
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

    def tensor(self, v: Value) -> torch.Tensor:
        """The bound tensor of ``v``: the input, a context or persistent buffer, an arena view, or a channel slice
        of its concat's."""
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
            parent = self.tensor(v.concat)
            t = parent[:, v.channel_offset : v.channel_offset + v.shape[1]]
        elif v.persistent:
            t = self.persistent[v.name]
        else:
            t = self.plan.tensor(self.arena, v.name, v.shape, self._value_dtype(v))
        self.tensors[v.name] = t
        return t

    def _value_dtype(self, v: Value) -> torch.dtype:
        return FP8_DTYPE if v.fp8 else self.dtype

    # ----------------------------------------------------------------------------------------------- binding
    def call(self, op: Op, impl: Impl) -> Callable[[], None]:
        """The launch of ``op`` on ``impl`` (:func:`fastdiff.engine.calls.build_call`)."""
        return build_call(self, op, impl)

    def _check_input(self, x_in: torch.Tensor) -> None:
        if tuple(x_in.shape) != self.x_in_value.shape or x_in.dtype != self.dtype:
            raise FastdiffError(
                f"input {tuple(x_in.shape)} {x_in.dtype} does not match the prepared "
                f"{self.x_in_value.shape} {self.dtype}"
            )

    def bind(self, x_in: torch.Tensor) -> None:
        """Bind the forward to the input ``x_in``: every op's launch on its implementation in ``impls`` (its first
        candidate where none is set); a fusion's partner runs as the fusion says while its conv runs it, and on its
        own (its fastest, or default) otherwise."""
        self._check_input(x_in)
        self._x_in = x_in
        self.tensors = {}
        for fusion in self.fusions:
            for name, partner in self.pairs[fusion.tag].items():
                conv_impl = self.impls.get(name)
                if conv_impl is not None and conv_impl.fuses(fusion.tag):
                    self.impls[partner.name], partner.why = fusion.partner_impl, fusion.partner_why.format(name)
                elif self.impls.get(partner.name) == fusion.partner_impl:
                    del self.impls[partner.name]
                    partner.why = ""
                    if partner.times_us:
                        self.impls[partner.name] = Impl.parse(min(partner.times_us, key=partner.times_us.get))
        for op in self.ops:
            if op.name not in self.impls:
                self.impls[op.name] = candidates(self, op)[0]
            op.why = op.why or default_why(self, op)
        self._calls = [self.call(op, self.impls[op.name]) for op in self.step_ops]
        self._shallow_calls = [self._calls[i] for i in self._shallow_index]
        self._context_calls = [self.call(op, self.impls[op.name]) for op in self.context_ops]

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
        """The first forward, interleaved with the weight upload.

        On CUDA with :func:`fastdiff.engine.compile_pool.compile_workers` > 1 (the default), every module's weights'
        upload and packing are queued on the copy stream first; then the kernels the forward would compile are
        recorded and compiled in forked worker processes (:func:`fastdiff.engine.compile_pool.precompile`) while the
        copy engine uploads; then each module's compute is queued behind its own upload event and loads its kernels
        from Triton's cache; last, the kernels of the forward the plan binds (its fusions, which the first forward
        runs apart) are compiled the same way (``compile_stats`` says what was compiled where). Otherwise each
        module's compute is queued right after its upload, so the GPU runs module k while the copy stream uploads and
        packs modules k+1, ..., and its kernels compile at their first launch. The context-stage ops run in
        model order too, on the context set so far."""
        self._check_input(x_in)
        self._x_in, self.tensors = x_in, {}
        if self.device.type == "cuda" and compile_workers() > 1:
            calls = [(op.name, self._upload_and_bind(op)) for op in self.ops]
            key = f"{self.structure()}:{self.plan_entry().digest()}"  # the kernels of the forward: ops and choices
            with counting_compiles() as counts:
                self.compile_stats = precompile([call for _, call in calls], self.device.type, f"first:{key}")
                for name, call in calls:
                    self._after_upload(name, call)
            self.compile_stats.update({f"launch_{k}": v for k, v in counts.items()})
            self.bind(x_in)  # the forward the plan asks for: its fused kernels (the first forward runs them apart)
            bound = precompile([*self._context_calls, *self._calls], self.device.type, f"bound:{key}")
            self.compile_stats.update({f"bound_{k}": v for k, v in bound.items()})
            if bound.get("kernels"):  # the recording skipped those calls' launches: the output is the bound forward's
                for call in (*self._context_calls, *self._calls):
                    call()
            return
        for op in self.ops:
            self._after_upload(op.name, self._upload_and_bind(op))
        self.bind(x_in)

    def _upload_and_bind(self, op: Op) -> Callable[[], None]:
        """Queue ``op``'s weights' upload; its first-forward call (its implementation: the plan's or the first
        candidate)."""
        if op.name not in self.impls:
            self.impls[op.name] = candidates(self, op)[0]
        first = self._first_forward_impl(op)
        # a plan names the implementations: only their layouts are packed and uploaded (the autotune needs all)
        roles = roles_of(op.kind, [self.impls[op.name], first]) if self.plan_applied else None
        taps = taps_fit(self, op)
        sources = {role: t for role, t in op.weights.items() if t is not None}
        self.device_weights[op.name] = self.streamer.submit(
            op.name, sources, lambda w: packed_weights(op, w, self.dtype, self.device, self.conv_impl, taps, roles)
        )
        op.weights = {}  # the source copies are no longer needed
        return self.call(op, first)

    def _after_upload(self, name: str, call: Callable[[], None]) -> None:
        """``call`` on the current stream once op ``name``'s weights are on the device."""
        self.streamer.wait(name)
        call()

    def _first_forward_impl(self, op: Op) -> Impl:
        """``op``'s implementation in the streamed first forward: a fusion that may not run there
        (``Fusion.in_first_forward``: its partner's weights upload after the conv's) runs as the two apart."""
        impl = self.impls[op.name]
        for fusion in self.fusions:
            if fusion.in_first_forward:
                continue
            if impl.fuses(fusion.tag):
                impl = impl.without_fusion(fusion.tag)
            elif impl == fusion.partner_impl and any(p is op for p in self.pairs[fusion.tag].values()):
                impl = candidates(self, op)[0]
        return impl

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
                self.bind(x_in)
            for call in self._shallow_calls if shallow else self._calls:
                call()
        return self.tensor(self.out_value)

    @torch.no_grad()
    def forward(
        self,
        x_in: torch.Tensor,
        t: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        shallow: bool = False,
    ) -> torch.Tensor:
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
        """On CUDA, time each op that has several implementations (CUDA graph of ``reps`` launches, so launch
        overhead does not count) and keep the fastest in ``impls`` (:func:`fastdiff.engine.tuning.choose_impls`);
        records the times and the reason per op, and in ``ops_timed`` how many ops were not in the tuning cache.
        The arena's activations are overwritten."""
        if self.device.type != "cuda":
            return
        if not self.weights_loaded:
            self._streamed_forward(x_in)
        self.bind(x_in)
        load_tuning_cache()
        compile_candidates(self)  # all at once, before any timing
        gen = torch.Generator(device=self.device).manual_seed(0)
        self.arena.view(self.dtype)[: self.arena.numel() // self.dtype.itemsize].normal_(generator=gen)
        self.temb_row.normal_(generator=gen)
        choose_impls(self, reps)
        if self.ops_timed:
            save_tuning_cache()
        self.bind(x_in)
        self.drop_unused_weights()
        if self._context_calls:  # the timing overwrote the K/V buffers: recompute them from the context
            for call in self._context_calls:
                call()

    def structure(self) -> str:
        """What a kernel plan entry for this forward is keyed by (:func:`fastdiff.engine.kernel_plan.structure_digest`):
        the ops and their shapes, the dtype, the fusion pairs, the implementation families allowed and fp8."""
        extra = {
            "pairs": sorted((tag, conv, p.name) for tag, pairs in self.pairs.items() for conv, p in pairs.items()),
            "conv_impl": self.conv_impl,
            "attention_impl": self.attention_impl,
        }
        return structure_digest(self.ops, str(self.dtype), extra)

    def plan_entry(self, label: str = "", made_by: dict | None = None) -> PlanEntry:
        """The choice this forward binds (every op's implementation) as a kernel plan entry."""
        return PlanEntry(impl_names({op.name: self.impls[op.name] for op in self.ops}), label, dict(made_by or {}))

    def apply_plan(self, entry: PlanEntry, x_in: torch.Tensor) -> str | None:
        """Take every op's implementation from ``entry`` (before the first forward, whose input ``x_in`` is: then
        only those kernels compile); None when applied, else why not (an op it lacks, a name this version does not
        know, or one that is not a candidate of its op here: the fit checks read the input's layout), and nothing
        is changed."""
        self._check_input(x_in)
        self._x_in, self.tensors = x_in, {}
        chosen: dict[str, Impl] = {}
        for op in self.ops:
            name = entry.choices.get(op.name)
            if name is None:
                return f"it has no implementation for op {op.name}"
            try:
                impl = Impl.parse(name)
            except FastdiffError as exc:
                return str(exc)
            partner_forms = [f.partner_impl for f in self.fusions if any(p is op for p in self.pairs[f.tag].values())]
            if impl not in candidates(self, op) and impl not in partner_forms:
                return f"{name} is not an implementation of op {op.name} here"
            chosen[op.name] = impl
        if len(entry.choices) != len(chosen):
            return "it names ops this model does not have"
        for fusion in self.fusions:  # a partner planned into its conv's launch needs a conv that runs it
            for name, partner in self.pairs[fusion.tag].items():
                if chosen[partner.name] == fusion.partner_impl and not chosen[name].fuses(fusion.tag):
                    return f"it runs {partner.name} in the launch of {name}, whose {chosen[name].name} does not"
        self.impls.update(chosen)
        self.plan_applied = True
        for op in self.ops:
            op.why = "kernel plan"
        return None

    def time_ops(self, reps: int = 20) -> list[float]:
        """Microseconds of each op of ``step_ops`` (in order) with its chosen implementation, timed like
        ``autotune`` (a CUDA graph of ``reps`` launches, :func:`fastdiff.engine.tuning.time_call_us`; launch
        overhead excluded; 0 for an op that runs in its partner's launch, ``fused``). Needs CUDA and a bound
        forward (any ``forward`` call); the ops overwrite the arena's activations."""
        if self.device.type != "cuda":
            raise FastdiffError("FusedModel.time_ops needs CUDA")
        if not self._calls:
            raise FastdiffError("FusedModel.time_ops before the first forward")
        pairs = zip(self.step_ops, self._calls, strict=True)
        return [time_call_us(call, reps) if self.impls[op.name].launches else 0.0 for op, call in pairs]

    def drop_unused_weights(self) -> None:
        """Free the weight layouts the chosen implementation does not read (:func:`weights.weight_roles`)."""
        for op in self.ops:
            impl = self.impls[op.name]
            if impl.kernel != "triton-taps":
                self.tap_partials.pop(op.name, None)
            reads = weight_roles(op.kind, impl)
            if reads is not None:
                w = self.device_weights[op.name]
                for role in set(w) - reads:
                    del w[role]

    def layer_table(self) -> list[dict]:
        """One row per op: name, kind, stage, output shape, implementation, why, times, where its output lives."""
        rows = []
        for op in self.ops:
            out, impl = op.output, self.impls.get(op.name)
            where = f"slice [{out.channel_offset}:] of {out.concat.name}" if out.concat is not None else "own buffer"
            row = dict(name=op.name, kind=op.kind, stage=op.stage, shape=list(out.shape))
            row.update(impl=impl.name if impl is not None else "", why=op.why, times_us=op.times_us, output=where)
            rows.append(row)
        return rows


def _root(v: Value) -> Value:
    while v.concat is not None:
        v = v.concat
    return v
