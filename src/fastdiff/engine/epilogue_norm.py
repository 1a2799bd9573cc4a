"""A GroupNorm helped by the epilogue of the conv that writes its input: which (conv, norm) pairs qualify, and the
two fusions (:class:`fastdiff.engine.fusion.Fusion`) the engine offers for them.

Each is the autotune's choice on the GPU (the gather kernel only), timed against the conv at its best plus the norm at
its best (``engine/tuning.py``):

* the whole norm in the epilogue (:data:`EPILOGUE_NORM`, pairs :func:`epilogue_norms`; impls
  ``triton[-sc]-gn[-k<N>]``): where the conv's output tiles can hold whole images and whole groups
  (:func:`fastdiff.kernels.conv2d.norm_out_unsupported`: the 4x4 to 16x16 levels of the DDPM U-Net), the conv stores
  its output and the norm's; the norm launches nothing;
* the norm's statistics in the epilogue (:data:`EPILOGUE_STATS`, pairs :func:`epilogue_stats`; impls
  ``triton[-sc]-st[-k<N>]``), for images of at most :data:`STATS_MAX_PIXELS`: the conv writes per-tile partial
  (count, mean, M2) of its output (:class:`fastdiff.kernels.common.GroupNormPartials`), and the norm runs as one
  elementwise pass that merges them (``group_norm_act(..., stats=)``, impl ``apply``) instead of reading its input for
  the statistics first. The norm's readers read a plain tensor in both. The engine offers the second only where the
  first does not apply.

Left alone: norms writing a concat part, norms of the step cache's kept feature, producers with fp8 input, and every
norm but the first qualifying one of a conv output several norms read; the whole norm in the epilogue also leaves
norms writing fp8 (an fp8 conv reads them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from fastdiff.engine.fusion import BoundModel, Fusion
from fastdiff.engine.impl import APPLY, Impl
from fastdiff.engine.ir import Op, Value
from fastdiff.engine.tuning import candidate_times
from fastdiff.kernels.common import GroupNormPartials
from fastdiff.kernels.conv2d import OutputGroupNorm, norm_out_unsupported

STATS_MAX_PIXELS = 1024
"""The largest image (Ho*Wo) whose GroupNorm statistics a conv's epilogue is offered to write: each program of the
norm merges one partial per row tile of the image, a number that grows with it (a VAE decoder's 512x512 level would
be thousands), and the statistics cost the conv about as much as they save the norm already at 32x32."""


def _pairs(ops: list[Op], accept: Callable[[Op], bool]) -> dict[str, Op]:
    """``{name of the producing conv: the first GroupNorm of its output that ``accept``s}`` over the pairs either
    fusion may take."""
    producer = {id(op.output): op for op in ops}
    pairs: dict[str, Op] = {}
    for norm in ops:
        if norm.kind != "group_norm" or norm.stage != "step":
            continue
        x, y = norm.inputs[0], norm.output
        conv = producer.get(id(x))
        if conv is None or conv.kind != "conv" or conv.stage != "step" or conv.name in pairs:
            continue
        if "fp8_scale" in conv.params:
            continue
        if y.concat is not None or x.persistent or (x.concat is not None and x.concat.persistent):
            continue
        if accept(norm):
            pairs[conv.name] = norm
    return pairs


def _whole_norm_fits(norm: Op) -> bool:
    n, channels, h, w = norm.inputs[0].shape
    return "fp8_scale" not in norm.params and norm_out_unsupported(n, channels, (h, w), norm.params["groups"]) is None


def epilogue_norms(ops: list[Op]) -> dict[str, Op]:
    """``{name of the producing conv: its GroupNorm op}`` for every pair the conv's epilogue can take whole."""
    return _pairs(ops, _whole_norm_fits)


def epilogue_stats(ops: list[Op]) -> dict[str, Op]:
    """``{name of the producing conv: its GroupNorm op}`` for every pair whose statistics the conv's epilogue may
    write (images of at most :data:`STATS_MAX_PIXELS`)."""
    return _pairs(ops, lambda norm: norm.inputs[0].shape[2] * norm.inputs[0].shape[3] <= STATS_MAX_PIXELS)


class EpilogueNormFusion(Fusion):
    """The whole GroupNorm in the conv's epilogue (``-gn``): every gather form of the conv (split, with the shortcut
    summed in) also writes the norm's output; the norm launches nothing. Not in the streamed first forward: the
    norm's weights upload after the conv's launch."""

    tag = "gn"
    partner_why = "in {}'s epilogue (its output tiles hold whole images and groups)"
    in_first_forward = False

    def pairs(self, ops: list[Op]) -> dict[str, Op]:
        return epilogue_norms(ops)

    def variants(self, model: BoundModel, conv: Op, partner: Op, ours: tuple[Impl, ...]) -> tuple[Impl, ...]:
        return tuple(impl.with_fusion(self.tag) for impl in ours if impl.kernel == "triton")

    def conv_args(self, model: BoundModel, conv: Op, partner: Op) -> dict[str, Any]:
        w, p = model.device_weights[partner.name], partner.params
        out = model.tensor(partner.output)
        return {"norm_out": OutputGroupNorm(p["groups"], out, w.get("weight"), w.get("bias"), p["eps"], p["act"])}

    def access(self, partner: Op) -> Value | None:
        return partner.output  # the conv writes the norm's output too

    def key_params(self, model: BoundModel, partner: Op) -> dict[str, Any]:
        affine = model.device_weights.get(partner.name, {}).get("weight") is not None
        p = partner.params
        return {"norm_out": (p["groups"], p["eps"], p["act"], affine)}

    def saved_bytes(self, partner: Op, elem_bytes: int) -> int:
        return math.prod(partner.inputs[0].shape) * elem_bytes  # the norm never reads its input


class EpilogueStatsFusion(Fusion):
    """The GroupNorm's statistics in the conv's epilogue (``-st``): every gather form of the conv also writes the
    norm's partial statistics, and the norm runs ``apply``, one pass that merges them. Offered only where the whole
    norm (``-gn``) is not."""

    tag = "st"
    partner_impl = APPLY
    partner_why = "one pass, with the statistics {} writes in its epilogue"

    def pairs(self, ops: list[Op]) -> dict[str, Op]:
        return epilogue_stats(ops)

    def variants(self, model: BoundModel, conv: Op, partner: Op, ours: tuple[Impl, ...]) -> tuple[Impl, ...]:
        if conv.name in model.pairs[EPILOGUE_NORM.tag]:
            return ()
        return tuple(impl.with_fusion(self.tag) for impl in ours if impl.kernel == "triton")

    def conv_args(self, model: BoundModel, conv: Op, partner: Op) -> dict[str, Any]:
        return {"stats": norm_partials(model, partner)}

    def key_params(self, model: BoundModel, partner: Op) -> dict[str, Any]:
        return {"stats_out": partner.params["groups"]}

    def fused_partner_us(
        self, model: BoundModel, conv: Op, partner: Op, effective: dict[Impl, float], reps: int
    ) -> float:
        """The norm's ``apply`` pass, on the partials of the first ``-st`` candidate that fits the GPU (run first)."""
        st = [impl for impl, us in effective.items() if impl.fuses(self.tag) and us < math.inf]
        if not st:
            return math.inf
        model.call(conv, st[0])()  # the partials exist before the norm's one-pass form is timed
        return candidate_times(model, partner, (APPLY,), reps)[APPLY]


def norm_partials(model: BoundModel, norm: Op) -> GroupNormPartials:
    """The buffer of the partial statistics a ``-st`` conv writes for ``norm`` (which merges them), one per norm."""
    state = model.fusion_state.setdefault(EPILOGUE_STATS.tag, {})
    if norm.name not in state:
        state[norm.name] = GroupNormPartials(norm.params["groups"])
    return state[norm.name]


EPILOGUE_NORM = EpilogueNormFusion()
EPILOGUE_STATS = EpilogueStatsFusion()
