"""A GroupNorm computed in the epilogue of the conv that writes its input: which (conv, norm) pairs qualify.

A step-stage ``group_norm`` whose input is written by a step-stage ``conv`` can run inside that conv's epilogue
(:class:`fastdiff.kernels.conv2d.OutputGroupNorm`) when the conv's output tiles can hold whole images and whole
groups (:func:`fastdiff.kernels.conv2d.norm_out_unsupported`): the 4x4 to 16x16 levels of the DDPM U-Net. The conv
then stores its output and the norm's; the norm launches nothing and its readers read a plain tensor (unlike the
folded norm of :mod:`fastdiff.engine.fold`, whose consumers normalise on load). Whether a pair runs fused is the
autotune's choice on the GPU (the fused op is the gather kernel only), timed against the conv at its best plus the
norm at its best: see ``FusedModel.autotune``.

Left alone: norms writing fp8 (an fp8 conv reads them) or a concat part, norms of the step cache's kept feature,
producers with a folded norm or fp8 input, and every norm but the first of a conv output several norms read.
"""

from __future__ import annotations

from fastdiff.engine.ir import Op
from fastdiff.kernels.conv2d import norm_out_unsupported


def epilogue_norms(ops: list[Op]) -> dict[str, Op]:
    """``{name of the producing conv: its GroupNorm op}`` for every pair the conv's epilogue can take."""
    producer = {id(op.output): op for op in ops}
    pairs: dict[str, Op] = {}
    for norm in ops:
        if norm.kind != "group_norm" or norm.stage != "step" or "fp8_scale" in norm.params:
            continue
        x, y = norm.inputs[0], norm.output
        conv = producer.get(id(x))
        if conv is None or conv.kind != "conv" or conv.stage != "step" or conv.name in pairs:
            continue
        if any(key in conv.params for key in ("stats", "norm", "fp8_scale")):
            continue
        if y.concat is not None or x.persistent or (x.concat is not None and x.concat.persistent):
            continue
        n, channels, h, w = x.shape
        if norm_out_unsupported(n, channels, (h, w), norm.params["groups"]) is None:
            pairs[conv.name] = norm
    return pairs
