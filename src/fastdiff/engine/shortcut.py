"""A ResnetBlock2D's 1x1 ``conv_shortcut`` summed inside the conv that adds it (``conv2``): which op pairs qualify.

``conv2`` adds the shortcut's output as its residual: ``(act(conv2(h) + b2) + (conv_sc(x) + b_sc)) * scale``. With
no activation on ``conv2`` that is ``(conv2(h) + conv_sc(x) + b2 + b_sc) * scale``: one GEMM whose reduction runs
over conv2's taps and then the shortcut's input channels (:func:`fastdiff.kernels.conv2d.conv2d` or, on Hopper,
:func:`fastdiff.kernels.conv2d_gluon.conv2d_gluon` with ``shortcut=``). The shortcut's output is then never written nor
read back, and one launch goes. Whether a pair runs fused, and in which kernel, is the autotune's choice on the GPU
(unfused, each conv of the pair may use any of its implementations): see ``FusedModel.autotune``.
"""

from __future__ import annotations

from fastdiff.engine.ir import Op


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
