"""A GroupNorm helped by the epilogue of the conv that writes its input: which (conv, norm) pairs qualify.

Two fusions, each the autotune's choice on the GPU (the gather kernel only), timed against the conv at its best plus
the norm at its best (see ``FusedModel.autotune``):

* the whole norm in the epilogue (``epilogue_norms``; impls ``triton[-sc]-gn[-k<N>]``): where the conv's output
  tiles can hold whole images and whole groups (:func:`fastdiff.kernels.conv2d.norm_out_unsupported`: the 4x4 to
  16x16 levels of the DDPM U-Net), the conv stores its output and the norm's; the norm launches nothing;
* the norm's statistics in the epilogue (``epilogue_stats``; impls ``triton[-sc]-st[-k<N>]``), for images of at
  most :data:`STATS_MAX_PIXELS`: the conv writes per-tile partial (count, mean, M2) of its output
  (:class:`fastdiff.kernels.common.GroupNormPartials`), and the norm runs as one elementwise pass that merges them
  (``group_norm_act(..., stats=)``, impl ``apply``) instead of reading its input for the statistics first. The
  norm's readers read a plain tensor in both. The engine offers the second only where the first does not apply.

Left alone: norms writing a concat part, norms of the step cache's kept feature, producers with fp8 input, and every
norm but the first qualifying one of a conv output several norms read; the whole norm in the epilogue also leaves
norms writing fp8 (an fp8 conv reads them).
"""

from __future__ import annotations

from collections.abc import Callable

from fastdiff.engine.ir import Op
from fastdiff.kernels.conv2d import norm_out_unsupported

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
