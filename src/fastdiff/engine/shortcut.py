"""A ResnetBlock2D's 1x1 ``conv_shortcut`` summed inside the conv that adds it (``conv2``): which op pairs qualify
(:func:`fusable_shortcuts`), and the fusion the engine offers for them (:data:`SHORTCUT`).

``conv2`` adds the shortcut's output as its residual: ``(act(conv2(h) + b2) + (conv_sc(x) + b_sc)) * scale``. With
no activation on ``conv2`` that is ``(conv2(h) + conv_sc(x) + b2 + b_sc) * scale``: one GEMM whose reduction runs
over conv2's taps and then the shortcut's input channels (:func:`fastdiff.kernels.conv2d.conv2d` or, on Hopper,
:func:`fastdiff.kernels.conv2d_gluon.conv2d_gluon` with ``shortcut=``). The shortcut's output is then never written nor
read back, and one launch goes. Whether a pair runs fused, and in which kernel, is the autotune's choice on the GPU
(unfused, each conv of the pair may use any of its implementations), against conv2 at its best plus the shortcut at
its best: :data:`SHORTCUT` (a :class:`fastdiff.engine.fusion.Fusion`, tag ``sc``: ``triton-sc[-k<N>]``,
``gluon[-p2]-sc``).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fastdiff.engine.candidates import gluon_fits
from fastdiff.engine.fusion import BoundModel, Fusion
from fastdiff.engine.impl import Impl
from fastdiff.engine.ir import Op, Value
from fastdiff.engine.tuning import candidate_times
from fastdiff.kernels.conv2d_tma import tma_conv_unsupported


def fusable_shortcuts(ops: list[Op]) -> dict[str, Op]:
    """``{name of the adding conv: its shortcut conv}`` for every step-stage conv whose residual is written by a
    plain 1x1 conv (stride 1, no padding, upsampling, activation, scale, time embedding or fp8) that
    nothing else reads, when the adding conv has no activation and no fp8 input."""
    producer = {id(op.output): op for op in ops}
    readers: dict[int, int] = {}
    for op in ops:
        for value in op.inputs:
            readers[id(value)] = readers.get(id(value), 0) + 1
    pairs = {}
    for op in ops:
        if op.kind != "conv" or op.stage != "step" or len(op.inputs) < 2:
            continue
        if op.params["act"] is not None or "fp8_scale" in op.params:
            continue
        residual = op.inputs[1]
        sc = producer.get(id(residual))
        if sc is None or sc.kind != "conv" or sc.stage != "step" or readers.get(id(residual)) != 1:
            continue
        p = sc.params
        plain = p["ksize"] == 1 and p["stride"] == 1 and p["padding"] == 0 and p["upsample"] == 1 and "pad_end" not in p
        if not plain or p["act"] is not None or p["scale"] is not None or p["temb"] is not None:
            continue
        if "fp8_scale" in p or len(sc.inputs) > 1 or residual.concat is not None:
            continue
        if residual.persistent or sc.inputs[0].shape[2:] != op.output.shape[2:]:
            continue
        pairs[op.name] = sc
    return pairs


class ShortcutFusion(Fusion):
    """conv2 + its conv_shortcut in one reduction (``-sc``): the gather conv, split or not, and where the conv and
    the shortcut's input are in its domain, the Gluon conv."""

    tag = "sc"
    partner_why = "summed in {} (the reduction runs on over this conv's input)"

    def pairs(self, ops: list[Op]) -> dict[str, Op]:
        return fusable_shortcuts(ops)

    def variants(self, model: BoundModel, conv: Op, partner: Op, ours: tuple[Impl, ...]) -> tuple[Impl, ...]:
        kernels = ("triton", "gluon") if self._gluon_fits(model, conv, partner) else ("triton",)
        return tuple(impl.with_fusion(self.tag) for kernel in kernels for impl in ours if impl.kernel == kernel)

    @staticmethod
    def _gluon_fits(model: BoundModel, conv: Op, partner: Op) -> bool:
        """Whether the Gluon conv can run ``conv`` with the shortcut summed in (the conv in its domain, the
        shortcut's input in the TMA domain)."""
        if not gluon_fits(model, conv):
            return False
        return tma_conv_unsupported(model.tensor(partner.inputs[0]), conv.output.shape[1], 1) is None

    def conv_args(self, model: BoundModel, conv: Op, partner: Op) -> dict[str, Any]:
        shortcut_weight = model.device_weights[partner.name]["packed"]
        bias = summed_bias(model, conv, partner)
        return dict(shortcut=model.tensor(partner.inputs[0]), shortcut_weight=shortcut_weight, bias=bias, residual=None)

    def access(self, partner: Op) -> Value | None:
        return partner.inputs[0]

    def key_params(self, model: BoundModel, partner: Op) -> dict[str, Any]:
        sc_in = partner.inputs[0]  # the -sc candidates also read this input: its size and layout
        return {"shortcut_in": (sc_in.shape, sc_in.concat is not None)}

    def partner_us(self, model: BoundModel, conv: Op, partner: Op, reps: int) -> float:
        """The shortcut's best time when the autotune timed it (it runs before its conv2), else its bound
        implementation's, through the tuning cache like every other timing (a time taken afresh in each process
        would let two processes with the same cache choose differently)."""
        if partner.times_us:
            return min(partner.times_us.values())
        impl = model.impls[partner.name]
        return candidate_times(model, partner, (impl,), reps)[impl]

    def saved_bytes(self, partner: Op, elem_bytes: int) -> int:
        return 2 * math.prod(partner.output.shape) * elem_bytes  # the shortcut's output: written, read back


def summed_bias(model: BoundModel, conv: Op, shortcut: Op) -> torch.Tensor | None:
    """conv2's bias + its shortcut's (the fused pair's one bias), made once per pair, when the call is built.

    That may be before the forward has waited for the two biases' uploads (a plan's ``-sc`` is built with its
    module's upload, and with compile workers every call is built before any wait): the sum waits for both first.
    Without that wait it read device memory the copy stream had not written yet: an all-NaN SD 1.5 image on the H100
    where the process's earlier GPU work had left NaN bit patterns there, and a missing conv2 bias (wrong, finite
    images) where the memory was fresh (docs/engine/nan-with-gpu-drawn-weights.md)."""
    pair_bias = model.fusion_state.setdefault(SHORTCUT.tag, {})
    key = f"{conv.name}+{shortcut.name}"
    if key not in pair_bias:
        for name in (conv.name, shortcut.name):  # the current stream waits for their copies (once per module)
            model.streamer.wait(name)
        weights = model.device_weights
        biases = [b for b in (weights[n].get("bias") for n in (conv.name, shortcut.name)) if b is not None]
        pair_bias[key] = (biases[0] + biases[1]) if len(biases) == 2 else (biases or [None])[0]
    return pair_bias[key]


SHORTCUT = ShortcutFusion()
