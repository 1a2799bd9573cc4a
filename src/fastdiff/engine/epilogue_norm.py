"""A GroupNorm helped by the epilogue of the conv that writes its input: which (conv, norm) pairs qualify.

Two fusions, each the autotune's choice on the GPU (the gather kernel only), timed against the conv at its best plus
the norm at its best (see ``FusedModel.autotune``):

* the whole norm in the epilogue (``epilogue_norms``; impls ``triton[-sc]-gn[-k<N>]``): where the conv's output
  tiles can hold whole images and whole groups (:func:`fastdiff.kernels.conv2d.norm_out_unsupported`: the 4x4 to
  16x16 levels of the DDPM U-Net), the conv stores its output and the norm's; the norm launches nothing;
* the norm's statistics in the epilogue (``epilogue_stats``; impls ``triton[-sc]-st[-k<N>]``), at any size: the
  conv writes per-tile partial (count, mean, M2) of its output (``FoldedGroupNorm(finish=False)``), and the norm
  runs as one elementwise pass that merges them (``group_norm_act(..., stats=)``, impl ``apply``) instead of
  reading its input for the statistics first. The norm's readers read a plain tensor in both (unlike the folded
  norm of :mod:`fastdiff.engine.fold`, whose consumers normalise on load).

Left alone: norms writing a concat part, norms of the step cache's kept feature, producers with a folded norm or
fp8 input, and every norm but the first of a conv output several norms read; the whole norm in the epilogue also
leaves norms writing fp8 (an fp8 conv reads them).
"""

from __future__ import annotations

from fastdiff.engine.ir import Op
from fastdiff.kernels.conv2d import norm_out_unsupported


def epilogue_stats(ops: list[Op]) -> dict[str, Op]:
    """``{name of the producing conv: its GroupNorm op}`` for every pair whose statistics the conv's epilogue can
    write."""
    producer = {id(op.output): op for op in ops}
    pairs: dict[str, Op] = {}
    for norm in ops:
        if norm.kind != "group_norm" or norm.stage != "step":
            continue
        x, y = norm.inputs[0], norm.output
        conv = producer.get(id(x))
        if conv is None or conv.kind != "conv" or conv.stage != "step" or conv.name in pairs:
            continue
        if any(key in conv.params for key in ("stats", "norm", "fp8_scale")):
            continue
        if y.concat is not None or x.persistent or (x.concat is not None and x.concat.persistent):
            continue
        pairs[conv.name] = norm
    return pairs


def epilogue_norms(ops: list[Op]) -> dict[str, Op]:
    """``{name of the producing conv: its GroupNorm op}`` for every pair the conv's epilogue can take whole."""
    pairs = {}
    for name, norm in epilogue_stats(ops).items():
        n, channels, h, w = norm.inputs[0].shape
        if "fp8_scale" not in norm.params and norm_out_unsupported(n, channels, (h, w), norm.params["groups"]) is None:
            pairs[name] = norm
    return pairs
