"""Which conv pairs may sum a ResnetBlock2D's 1x1 conv_shortcut inside the conv that adds it
(``engine.shortcut.fusable_shortcuts``); the fused forward itself is checked in ``test_executor.py``."""

from __future__ import annotations

import torch

from fastdiff.engine.ir import GraphBuilder
from fastdiff.engine.shortcut import fusable_shortcuts


def _conv(g: GraphBuilder, name: str, x, cout: int, k: int = 3, residual=None, act=None):
    out = g.value(name, cout, x.shape[2], x.shape[3])
    scale = None if residual is None else 0.5  # 1/output_scale_factor on the adding conv only
    params = dict(stride=1, padding=k // 2, ksize=k, act=act, scale=scale, upsample=1, temb=None)
    g.op(name, "conv", [x, residual], out, params, {"weight": torch.randn(cout, x.shape[1], k, k)})
    return out


def test_which_shortcuts_fuse():
    g = GraphBuilder(1, 4, 4)
    x = g.input("x_in", 4, 4, 4)
    sc = _conv(g, "a.conv_shortcut", x, 6, k=1)
    _conv(g, "a.conv2", _conv(g, "a.conv1", x, 6), 6, residual=sc)  # the ResnetBlock2D pattern: fuses
    sc_b = _conv(g, "b.conv_shortcut", x, 6, k=1)
    _conv(g, "b.conv2", x, 6, residual=sc_b, act="silu")  # an activation after the sum would not distribute
    sc_c = _conv(g, "c.conv_shortcut", x, 6, k=1)
    _conv(g, "c.conv2", x, 6, residual=sc_c)
    _conv(g, "c.other", sc_c, 6)  # the shortcut's output is read again: it must be written
    wide = _conv(g, "d.conv_shortcut", x, 6, k=3)  # not a 1x1
    _conv(g, "d.conv2", x, 6, residual=wide)
    pairs = fusable_shortcuts(g.ops)
    assert {name: op.name for name, op in pairs.items()} == {"a.conv2": "a.conv_shortcut"}
