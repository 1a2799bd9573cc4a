"""GroupNorm folded into the convs around it: a graph rewrite over the lowered op list.

A ``group_norm`` op whose input is written by a ``conv`` and whose output is read only as the main input of
``conv`` ops disappears: the producing conv gains ``params["stats"]`` (its epilogue writes the norm's per-(image,
group) statistics of the values it stores) and every consumer reads the producer's output directly with
``params["norm"]`` (it normalises, applies the affine and the activation while loading its input tile), the
norm's affine riding along in the consumer's weights as ``norm_weight`` / ``norm_bias``. See
:class:`fastdiff.kernels.conv2d.FoldedGroupNorm` for the kernel side.

What stays a standalone ``group_norm``: norms of a concatenation (the up path's skip concat: two producers), of the
graph input, of a depthwise conv's output, of the step cache's kept feature, norms that write a concat part, and
norms read by a ``linear`` (the transformer's ``proj_in``) or an attention projection. A norm of one concat part
(a down block's output, also kept for its skip) folds: its producer writes the slice and its statistics. Folded
convs run the Triton gather kernel, split-K or not (cuDNN has no hooks for a prologue or statistics).
"""

from __future__ import annotations

from fastdiff.engine.ir import Op

FOLD_KEYS = ("stats", "norm")
"""The conv params a fold sets: each holds a :class:`NormSpec` tuple ``(name, groups, eps, activation)``."""

NormSpec = tuple[str, int, float, str | None]


def fold_group_norms(ops: list[Op]) -> list[Op]:
    """``ops`` with every foldable step-stage GroupNorm removed and its producer / consumer convs rewired (in
    place on those ops); returns the new list in the same order."""
    producer = {id(op.output): op for op in ops}
    readers: dict[int, list[tuple[Op, int]]] = {}
    for op in ops:
        for index, value in enumerate(op.inputs):
            readers.setdefault(id(value), []).append((op, index))
    dropped: set[int] = set()
    for norm in ops:
        if norm.kind != "group_norm" or norm.stage != "step":
            continue
        x, y = norm.inputs[0], norm.output
        source = producer.get(id(x))
        if source is None or source.kind != "conv" or source.stage != "step" or "stats" in source.params:
            continue  # the graph input, a depthwise conv, or a conv that already feeds another norm
        if y.concat is not None or x.persistent or (x.concat is not None and x.concat.persistent):
            continue  # the norm writes a concat part (read whole later), or x is the step cache's kept feature
        consumers = readers.get(id(y), [])
        if not consumers or any(c.kind != "conv" or index != 0 or "norm" in c.params for c, index in consumers):
            continue  # also read by a linear / an attention projection, or as a residual
        p = norm.params
        spec: NormSpec = (norm.name, p["groups"], p["eps"], p["act"])
        source.params["stats"] = spec
        for consumer, _ in consumers:
            consumer.inputs[0] = x
            consumer.params["norm"] = spec
            if norm.weights.get("weight") is not None:
                consumer.weights["norm_weight"] = norm.weights["weight"]
                consumer.weights["norm_bias"] = norm.weights["bias"]
        dropped.add(id(norm))
    return [op for op in ops if id(op) not in dropped]
