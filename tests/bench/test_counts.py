"""FLOP/byte counts against hand arithmetic, the engine and aten op mappings, roofline points, ceilings and plot.

Every expected number is worked out by hand in the comment beside it (not with the formula under test).
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from fastdiff.bench.counts import aten_op_cost, engine_op_cost
from fastdiff.bench.roofline import measure_ceilings, plot_roofline, roofline_point
from fastdiff.engine.ir import Op, Value
from fastdiff.kernels import REGISTRY
from fastdiff.kernels.cost_model import (
    Cost,
    attention_cost,
    conv2d_cost,
    elementwise_cost,
    group_norm_cost,
    matmul_cost,
)


def test_cost_add_and_intensity():
    total = Cost(10.0, 4.0) + Cost(20.0, 6.0)
    assert total == Cost(30.0, 10.0)
    assert total.intensity == 3.0
    assert Cost(5.0, 0.0).intensity == 0.0


def test_conv2d_3x3_same_odd_channels_non_square():
    # B=2, Cin=3, Cout=5, 7x9 out, 3x3: outputs 2*5*7*9 = 630; MACs 630 * 3*3*3 = 17010 -> 34020 FLOPs; bias +630
    cost = conv2d_cost(2, 3, 5, 7, 9, 3)
    assert cost.flops == 34650
    # elements: input 2*3*7*9 = 378, weights 5*3*3*3 = 135, output 630, bias 5 -> 1148; fp16 -> 2296 bytes
    assert cost.bytes == 2296


def test_conv2d_stride2():
    # 7x9 input, 3x3 stride 2 pad 1 -> 4x5 out; outputs 2*5*4*5 = 200; 200*27*2 = 10800 FLOPs + bias 200
    cost = conv2d_cost(2, 3, 5, 4, 5, 3, elem_bytes=4, h_in=7, w_in=9)
    assert cost.flops == 11000
    # elements: input 378 + weights 135 + output 200 + bias 5 = 718; fp32 -> 2872 bytes
    assert cost.bytes == 2872


def test_conv2d_grouped_with_residual_and_temb():
    # B=1, C=6 -> 6, groups=3 (2 input channels per group), 3x3 on 4x4: outputs 96; 2*96*2*9 = 3456 + residual 96
    # + temb 96 = 3648 (no bias)
    cost = conv2d_cost(1, 6, 6, 4, 4, 3, groups=3, bias=False, residual=True, temb=True)
    assert cost.flops == 3648
    # elements: input 96 + weights 6*2*9 = 108 + output 96 + residual 96 + temb 6 = 402 -> 804 bytes
    assert cost.bytes == 804


def test_matmul():
    # [3, 7] @ [7, 5]: 2*3*5*7 = 210 FLOPs; elements 21 + 35 + 15 = 71 -> 142 bytes
    assert matmul_cost(3, 5, 7) == Cost(210, 142)
    # + bias row: + 15 FLOPs, + 5 elements -> 225 FLOPs, 152 bytes
    assert matmul_cost(3, 5, 7, bias=True) == Cost(225, 152)


def test_group_norm():
    # B=2, C=6, 4x5: 240 elements at 7 FLOPs = 1680; bytes (240 read + 240 written + 12 gamma/beta) * 2 = 984
    assert group_norm_cost(2, 6, 20) == Cost(1680, 984)
    # + SiLU: 240 * 11 = 2640 FLOPs, same bytes; + ReLU instead: 240 * 8 = 1920
    assert group_norm_cost(2, 6, 20, act="silu") == Cost(2640, 984)
    assert group_norm_cost(2, 6, 20, act="relu") == Cost(1920, 984)
    # + SiLU + residual: 240 * 12 = 2880 FLOPs; bytes (720 + 12) * 2 = 1464
    assert group_norm_cost(2, 6, 20, act="silu", residual=True) == Cost(2880, 1464)
    # no affine: 240 * 5 = 1200 FLOPs; bytes 480 * 2 = 960
    assert group_norm_cost(2, 6, 20, affine=False) == Cost(1200, 960)


def test_attention_and_elementwise():
    # B=2, H=3, L=10, D=4: 4*2*3*10*10*4 = 9600 FLOPs; Q, K, V, O each 2*3*10*4 = 240 -> 960 elements -> 1920 bytes
    assert attention_cost(2, 3, 10, 10, 4) == Cost(9600, 1920)
    # Lq=10, Lkv=6, B=H=1, D=4: 4*10*6*4 = 960 FLOPs; Q+O 80, K+V 48 -> 128 elements * 4 bytes = 512
    assert attention_cost(1, 1, 10, 6, 4, elem_bytes=4) == Cost(960, 512)
    # 100 elements, 2 inputs, 1 output, 3 FLOPs each: 300 FLOPs, 300 elements * 2 = 600 bytes
    assert elementwise_cost(100, inputs=2, flops_per_element=3) == Cost(300, 600)


CONV_PARAMS = dict(stride=1, padding=1, ksize=3, upsample=1, temb=None, act=None, scale=None)


def conv_op(x_shape, out_shape, residual: bool = False, **params) -> Op:
    x, out = Value("x", x_shape), Value("y", out_shape)
    inputs = [x, Value("r", out_shape)] if residual else [x]
    return Op("y", "conv", inputs, out, {**CONV_PARAMS, **params})  # no weights: counts use shapes only


def test_engine_conv_ops():
    op = conv_op((2, 3, 7, 9), (2, 5, 7, 9))
    assert engine_op_cost(op, 2) == conv2d_cost(2, 3, 5, 7, 9, 3) == Cost(34650, 2296)
    op = conv_op((2, 3, 7, 9), (2, 5, 4, 5), stride=2)
    assert engine_op_cost(op, 4) == Cost(11000, 2872)
    # temb (bias folded in, so no separate bias) + residual + SiLU + scale: 34020 + 630 * (1 + 1 + 4 + 1) = 38430;
    # elements 378 + 135 + 630 + residual 630 + temb 2*5 = 1783 -> 3566 bytes
    op = conv_op((2, 3, 7, 9), (2, 5, 7, 9), residual=True, temb=0, act="silu", scale=0.5)
    assert engine_op_cost(op, 2) == Cost(38430, 3566)
    # nearest x2 upsample then 3x3: input read at 3x5; outputs 1*6*6*10 = 360; 2*360*4*9 = 25920 + bias 360;
    # elements: input 1*4*3*5 = 60 + weights 6*4*9 = 216 + output 360 + bias 6 = 642 -> 1284 bytes
    op = conv_op((1, 4, 3, 5), (1, 6, 6, 10), upsample=2)
    assert engine_op_cost(op, 2) == Cost(26280, 1284)


def test_engine_gate_and_other_ops():
    x, g, out = Value("x", (1, 4, 3, 5)), Value("g", (1, 6, 3, 5)), Value("out", (1, 4, 3, 5))
    gate = Op("gate", "gate", [x, g], out, {"inter": 3})
    # 15 pixels, Cx=4, Cg=6, inter=3: 1x1 convs 2*15*4*3 = 360 + 2*15*6*3 = 540 + psi 2*15*3 = 90 -> 990;
    # two biases, sum, ReLU on 45 hidden values: 180; psi bias + sigmoid 15 * 5 = 75; x * psi 60 -> 1305 FLOPs.
    # elements: x 60 + g 90 + out 60 + weights 12 + 18 + 3 + biases 3 + 3 + 1 = 250 -> 500 bytes
    assert engine_op_cost(gate, 2) == Cost(1305, 500)
    # the matmul part of it, from the shape functions: 360 + 540 + 90
    mm = matmul_cost(15, 3, 4).flops + matmul_cost(15, 3, 6).flops + matmul_cost(15, 1, 3).flops
    assert mm == 990
    # depthwise 7x7 + temb on [1, 4, 5, 6]: outputs 120; 2*120*49 = 11760 + 120; elements 120 + 196 + 120 + 4
    dw = Op("dw", "depthwise", [Value("x", (1, 4, 5, 6))], Value("y", (1, 4, 5, 6)), {"temb": 0})
    assert engine_op_cost(dw, 2) == Cost(11880, 880)
    attn = Op("a", "attention", [Value("qkv", (2, 36, 2, 5))], Value("o", (2, 12, 2, 5)), {"heads": 3, "head_dim": 4})
    assert engine_op_cost(attn, 2) == Cost(9600, 1920)  # 10 tokens, as in test_attention_and_elementwise
    gn = Op("gn", "group_norm", [Value("x", (2, 6, 4, 5))], Value("y", (2, 6, 4, 5)), {"groups": 3, "act": "silu"})
    assert engine_op_cost(gn, 2) == Cost(2640, 984)
    center = Op("c", "center", [Value("x", (1, 3, 4, 4))], Value("y", (1, 3, 4, 4)), {})
    assert engine_op_cost(center, 2) == Cost(96, 192)  # 48 elements * (mul, sub); 96 elements * 2 bytes
    with pytest.raises(ValueError, match="mystery"):
        engine_op_cost(Op("m", "mystery", [x], out, {}), 2)


def kernel_cost(name: str, *args, **kwargs) -> Cost:
    """``REGISTRY[name].cost`` of a call on fp16 tensors of the given shapes (only shapes and dtypes count)."""
    tensors = [torch.empty(a, dtype=torch.float16) if isinstance(a, tuple) else a for a in args]
    named = {k: torch.empty(v, dtype=torch.float16) if isinstance(v, tuple) else v for k, v in kwargs.items()}
    return Cost(*REGISTRY[name].cost(tuple(tensors), named))


def test_kernel_costs_are_the_engine_costs():
    """One formula per op: each kernel's ``OP.cost`` equals the engine op's cost and the hand counts above."""
    # conv with time embedding (no bias), residual, SiLU and scale: 38430 FLOPs, 3566 bytes (test_engine_conv_ops)
    conv = kernel_cost("conv2d", (2, 3, 7, 9), (27, 5), None, padding=1, time_emb=(2, 5), residual=(2, 5, 7, 9),
                       activation="silu", out_scale=0.5)  # fmt: skip
    op = conv_op((2, 3, 7, 9), (2, 5, 7, 9), residual=True, temb=0, act="silu", scale=0.5)
    assert conv == engine_op_cost(op, 2) == Cost(38430, 3566)
    # nearest x2 upsampling conv + bias: 26280 FLOPs, 1284 bytes; stride 2: 11000 FLOPs, 1436 bytes at fp16
    upsample = kernel_cost("conv2d", (1, 4, 3, 5), (6, 4, 3, 3), (6,), padding=1, upsample=2)
    assert upsample == engine_op_cost(conv_op((1, 4, 3, 5), (1, 6, 6, 10), upsample=2), 2) == Cost(26280, 1284)
    strided = kernel_cost("conv2d", (2, 3, 7, 9), (27, 5), (5,), stride=2, padding=1)
    assert strided == engine_op_cost(conv_op((2, 3, 7, 9), (2, 5, 4, 5), stride=2), 2) == Cost(11000, 1436)
    dw = Op("dw", "depthwise", [Value("x", (1, 4, 5, 6))], Value("y", (1, 4, 5, 6)), {"temb": 0})
    depthwise = kernel_cost("depthwise_conv2d", (1, 4, 5, 6), (49, 4), None, time_emb=(1, 4))
    assert depthwise == engine_op_cost(dw, 2) == Cost(11880, 880)
    gate = Op("gate", "gate", [Value("x", (1, 4, 3, 5)), Value("g", (1, 6, 3, 5))], Value("o", (1, 4, 3, 5)),
              {"inter": 3})  # fmt: skip
    gate_kernel = kernel_cost("attention_gate", (1, 4, 3, 5), (1, 6, 3, 5), (3, 4, 1, 1), (3, 6, 1, 1), (3,),
                              (1, 3, 1, 1), (1,), b_x=(3,))  # fmt: skip
    assert gate_kernel == engine_op_cost(gate, 2) == Cost(1305, 500)
    attn = Op("a", "attention", [Value("qkv", (2, 36, 2, 5))], Value("o", (2, 12, 2, 5)), {"heads": 3, "head_dim": 4})
    assert kernel_cost("attention", (2, 3, 10, 4), (2, 3, 10, 4), (2, 3, 10, 4)) == engine_op_cost(attn, 2)
    assert engine_op_cost(attn, 2) == Cost(9600, 1920)
    gn = Op("gn", "group_norm", [Value("x", (2, 6, 4, 5))], Value("y", (2, 6, 4, 5)), {"groups": 3, "act": "silu"})
    gn_kernel = kernel_cost("group_norm_act", (2, 6, 4, 5), 3, (6,), (6,), 1e-5, activation="silu")
    assert gn_kernel == engine_op_cost(gn, 2) == Cost(2640, 984)


def test_aten_convolution_shapes():
    # as the profiler records aten::conv2d / aten::convolution (non-tensor arguments are [])
    shapes = [[2, 3, 7, 9], [5, 3, 3, 3], [5], [], [], [], []]
    assert aten_op_cost("aten::conv2d", shapes, 2) == Cost(34650, 2296)
    assert aten_op_cost("aten::convolution", shapes + [[], []], 4, out_shape=[2, 5, 4, 5]) == Cost(11000, 2872)
    # cudnn_convolution has no bias argument: 34020 FLOPs, (1148 - 5) * 2 bytes
    assert aten_op_cost("aten::cudnn_convolution", [[2, 3, 7, 9], [5, 3, 3, 3], [], [], []], 2) == Cost(34020, 2286)


def test_aten_matmuls_and_others():
    # nn.Linear(6, 4) on [3, 6] -> aten::addmm(bias [4], [3, 6], [6, 4]): 2*3*4*6 = 144 + bias 12 = 156 FLOPs;
    # elements 18 + 24 + 12 + 4 = 58 -> fp32 232 bytes
    assert aten_op_cost("aten::addmm", [[4], [3, 6], [6, 4], [], []], 4) == Cost(156, 232)
    # aten::linear on [2, 3, 6]: m = 6 -> 288 + 24 = 312 FLOPs; elements 36 + 24 + 24 + 4 = 88 -> 352 bytes
    assert aten_op_cost("aten::linear", [[2, 3, 6], [4, 6], [4]], 4) == Cost(312, 352)
    # bmm [2, 3, 4] @ [2, 4, 5]: 2 * (2*3*5*4) = 240 FLOPs; 2 * (12 + 20 + 15) = 94 elements -> 188 bytes
    assert aten_op_cost("aten::bmm", [[2, 3, 4], [2, 4, 5]], 2) == Cost(240, 188)
    assert aten_op_cost("aten::native_group_norm", [[2, 6, 4, 5], [6], [6], [], [], [], [], []], 2) == Cost(1680, 984)
    qkv = [[2, 3, 10, 4]] * 3
    assert aten_op_cost("aten::scaled_dot_product_attention", qkv + [[]] * 5, 2) == Cost(9600, 1920)
    assert aten_op_cost("aten::_scaled_dot_product_flash_attention", qkv, 2) == Cost(9600, 1920)
    # silu on 378 elements: 4 FLOPs each = 1512; read + write 756 elements -> 1512 bytes
    assert aten_op_cost("aten::silu", [[2, 3, 7, 9]], 2) == Cost(1512, 1512)
    # broadcast add: 378 FLOPs; reads 378 + 3, writes 378 -> 759 elements -> 1518 bytes
    assert aten_op_cost("aten::add", [[2, 3, 7, 9], [1, 3, 1, 1], []], 2) == Cost(378, 1518)
    assert aten_op_cost("aten::copy_", [[2, 3, 7, 9], [2, 3, 7, 9], []], 2) == Cost(0, 1512)
    assert aten_op_cost("aten::view", [[2, 3, 7, 9], []], 2) is None
    assert aten_op_cost("aten::empty", [[], [], []], 2) is None


CEILINGS = {"tflops": 100.0, "gbps": 1000.0, "matmul": "synthetic"}


def test_roofline_point_bounds():
    # intensity 10 < ridge 100e12 / 1000e9 = 100: memory-bound; attainable 10 * 1000 GB/s = 10 TFLOP/s;
    # 1e9 FLOPs in 1 ms = 1 TFLOP/s -> 10 % of the bound; 1e8 bytes in 1 ms = 100 GB/s
    p = roofline_point(Cost(1e9, 1e8), 1e-3, CEILINGS)
    assert p["bound"] == "memory" and p["ridge"] == pytest.approx(100)
    assert p["intensity"] == pytest.approx(10)
    assert p["attainable_tflops"] == pytest.approx(10)
    assert p["tflops"] == pytest.approx(1) and p["gbps"] == pytest.approx(100)
    assert p["pct_of_bound"] == pytest.approx(10)
    # intensity 1000: compute-bound; 1e12 FLOPs in 20 ms = 50 TFLOP/s -> 50 %
    p = roofline_point(Cost(1e12, 1e9), 0.02, CEILINGS)
    assert p["bound"] == "compute" and p["pct_of_bound"] == pytest.approx(50)
    # a copy (no FLOPs): 1e9 bytes in 2 ms = 500 GB/s -> 50 % of the bandwidth bound
    p = roofline_point(Cost(0, 1e9), 2e-3, CEILINGS)
    assert p["bound"] == "memory" and p["pct_of_bound"] == pytest.approx(50)
    with pytest.raises(ValueError):
        roofline_point(Cost(1, 1), 0.0, CEILINGS)


def test_measure_ceilings_cpu_tiny():
    t0 = time.perf_counter()
    c = measure_ceilings(torch.device("cpu"), matmul_size=64, copy_bytes=1 << 20, repeats=3, warmup=1)
    assert time.perf_counter() - t0 < 1.0
    for key in ("tflops", "gbps"):
        assert math.isfinite(c[key]) and c[key] > 0
    assert c["copy_bytes"] == 1 << 20 and "64x64x64" in c["matmul"] and c["method"]


def test_plot_roofline_writes_png(tmp_path):
    points = [
        {**roofline_point(Cost(1e9, 1e8), 1e-3, CEILINGS), "name": "conv_in"},
        {**roofline_point(Cost(1e12, 1e9), 0.02, CEILINGS), "name": "mid.conv1"},
        {**roofline_point(Cost(0, 1e9), 2e-3, CEILINGS), "name": "copy"},  # no FLOPs: not drawable, skipped
    ]
    path = tmp_path / "sub" / "roofline.png"
    plot_roofline(points, CEILINGS, path, "test roofline")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == ["roofline.png"]  # no temp file left behind
