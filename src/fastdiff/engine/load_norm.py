"""A GroupNorm applied by the conv that reads its output, as the conv loads its input: which (norm, conv) pairs
qualify.

The autotune's choice on the GPU (``FusedModel.autotune``), the TMA conv only: the conv's ``triton-tma-ln``
candidate reads the norm's *input* and normalises each box in registers
(``conv2d_tma(..., norm=FoldedGroupNorm)``), and the norm runs as a statistics-only pass (impl ``stats``:
:func:`fastdiff.kernels.group_norm_act.group_norm_stats`, one read of its input, ``[N, G, 2]`` written). The
norm's output tensor is then never written or read: a ResNet block's ``GroupNorm -> SiLU -> conv`` costs one read of
the activation for the statistics instead of a read and a write, at the price of the normalisation in the conv's
loop (nine times per element for a 3x3 conv). It is timed against the norm at its best plus the conv at its best.

A pair is a step-stage GroupNorm whose output one stride-1 conv reads, as its main input, and nothing else: not a
norm that writes a concat part (read whole later) or an fp8 tensor (the fp8 conv has no prologue), not one whose
output is also a residual or read by a linear / attention projection, not a conv with a folded norm or statistics
of its own (:mod:`fastdiff.engine.fold`). The norm's input may be a concat (the up path's skip concat): the
statistics pass reads it where it lies.
"""

from __future__ import annotations

from fastdiff.engine.ir import Op


def load_norms(ops: list[Op]) -> dict[str, Op]:
    """``{name of the consuming conv: its GroupNorm op}`` for every pair whose norm the conv may apply on load."""
    readers: dict[int, list[tuple[Op, int]]] = {}
    for op in ops:
        for index, value in enumerate(op.inputs):
            readers.setdefault(id(value), []).append((op, index))
    pairs: dict[str, Op] = {}
    for norm in ops:
        if norm.kind != "group_norm" or norm.stage != "step" or "fp8_scale" in norm.params:
            continue
        y = norm.output
        if y.concat is not None or y.persistent:
            continue
        users = readers.get(id(y), [])
        if len(users) != 1:
            continue
        conv, index = users[0]
        if conv.kind != "conv" or index != 0 or conv.stage != "step" or conv.params["stride"] != 1:
            continue
        if any(key in conv.params for key in ("stats", "norm", "fp8_scale")):
            continue
        pairs[conv.name] = norm
    return pairs
