"""conv2d (implicit GEMM + fused epilogue) against its plain-torch ref in float64, on odd shapes."""

from __future__ import annotations

import zlib

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.common import SplitWorkspace
from fastdiff.kernels.conv2d import (
    OP,
    GemmTiles,
    conv2d,
    conv2d_ref,
    pack_conv_weight,
    padding_pair,
    split_k_choices,
    unpack_conv_weight,
)

from .conftest import CUDA, DEVICE, DTYPES, float64, needs_cuda, rel_err

# fp32 on the GPU is a tf32 dot (~3e-4); the interpreter computes fp32 exactly.
TOLERANCE = {torch.float32: 1e-3 if CUDA else 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def reference(args: tuple, kwargs: dict) -> torch.Tensor:
    """conv2d_ref on float64 copies of the (already rounded) inputs."""
    return conv2d_ref(*[float64(a) for a in args], **{k: float64(v) for k, v in kwargs.items()})


def make_inputs(case: dict, dtype: torch.dtype, seed: int) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(seed)
    n, cin, cout, h, w, k = case["n"], case["cin"], case["cout"], case["h"], case["w"], case["k"]
    stride, padding = case.get("stride", 1), case.get("padding", 0)
    pads = sum(padding_pair(padding))
    ho, wo = (h + pads - k) // stride + 1, (w + pads - k) // stride + 1

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)

    x = randn(n, cin, h, w).contiguous(memory_format=torch.channels_last)
    weight = (torch.randn((cout, cin, k, k), generator=gen) / (cin * k * k) ** 0.5).to(device=DEVICE, dtype=dtype)
    kwargs = {"stride": stride, "padding": padding}
    if case.get("temb"):
        kwargs["time_emb"] = randn(n, cout)
    if case.get("res"):
        kwargs["residual"] = randn(n, cout, ho, wo).contiguous(memory_format=torch.channels_last)
    if case.get("act"):
        kwargs["activation"] = case["act"]
    if case.get("scale"):
        kwargs["out_scale"] = case["scale"]
    if case.get("shortcut"):  # a ResnetBlock2D's 1x1 conv_shortcut input, at the output's size
        cin_sc = case["shortcut"]
        kwargs["shortcut"] = randn(n, cin_sc, ho, wo).contiguous(memory_format=torch.channels_last)
        kwargs["shortcut_weight"] = (torch.randn((cout, cin_sc, 1, 1), generator=gen) / cin_sc**0.5).to(DEVICE, dtype)
    bias = randn(cout) if case.get("bias") else None
    return (x, pack_conv_weight(weight), bias), kwargs


CASES = [
    pytest.param(dict(n=1, cin=3, cout=16, h=7, w=9, k=3, stride=1, padding=1, bias=True), id="cin3_k3s1p1_bias"),
    pytest.param(
        dict(n=5, cin=33, cout=33, h=7, w=9, k=3, stride=2, padding=1, bias=True, temb=True, act="silu"),
        id="c33_k3s2p1_temb_silu_b5",
    ),
    pytest.param(dict(n=2, cin=16, cout=33, h=7, w=9, k=1, bias=True, res=True, scale=0.7071), id="k1s1p0_res_scale"),
    pytest.param(dict(n=5, cin=8, cout=16, h=7, w=9, k=1, stride=2, act="relu"), id="k1s2p0_relu_b5"),
    pytest.param(dict(n=1, cin=8, cout=8, h=7, w=9, k=3, bias=True, act="gelu"), id="k3s1p0_gelu"),
    pytest.param(
        dict(
            n=2,
            cin=5,
            cout=24,
            h=7,
            w=9,
            k=3,
            stride=2,
            bias=True,
            temb=True,
            res=True,
            act="silu",
            scale=0.5,
        ),
        id="k3s2p0_full_epilogue",
    ),
    pytest.param(dict(n=1, cin=4, cout=8, h=32, w=32, k=3, padding=1, bias=True, temb=True), id="resnet_conv1_32x32"),
    pytest.param(
        dict(n=1, cin=4, cout=8, h=32, w=32, k=3, padding=1, bias=True, res=True, scale=0.5),
        id="resnet_conv2_32x32",
    ),
    pytest.param(
        dict(n=2, cin=24, cout=40, h=7, w=9, k=3, padding=1, bias=True, scale=0.5, shortcut=37),
        id="resnet_conv2_with_1x1_shortcut_c37_b2",
    ),
    pytest.param(
        dict(n=3, cin=5, cout=12, h=6, w=5, k=3, stride=2, padding=1, shortcut=3, act="silu", res=True),
        id="k3s2_shortcut_c3_silu_res",
    ),
    pytest.param(
        dict(n=1, cin=130, cout=24, h=5, w=7, k=3, padding=1, bias=True, temb=True, res=True),
        id="cin130_latency_tiles_128_deep_steps_masked_second_chunk",
    ),
    pytest.param(dict(n=2, cin=1, cout=24, h=6, w=7, k=3, padding=1, bias=True), id="flat_k_cin1_one_step"),
    pytest.param(  # diffusers' Downsample2D(padding=0): F.pad (0, 1, 0, 1), then a 3x3 stride-2 conv
        dict(n=2, cin=24, cout=16, h=8, w=10, k=3, stride=2, padding=(0, 1), bias=True), id="downsample_pad_0_1"
    ),  # fmt: skip
    pytest.param(  # odd sizes: the last output row and column read the bottom/right padding; flattened reduction
        dict(n=3, cin=5, cout=8, h=7, w=6, k=3, stride=2, padding=(0, 1), res=True), id="pad_0_1_odd_flat_k"
    ),  # fmt: skip
    pytest.param(  # 135 (tap, channel) rows: three 64-deep steps, the last one masked past row 135
        dict(n=2, cin=15, cout=20, h=5, w=9, k=3, padding=1, bias=True, act="silu"), id="flat_k_cin15_three_steps"
    ),  # fmt: skip
    pytest.param(
        dict(n=256, cin=3, cout=128, h=32, w=32, k=3, padding=1, bias=True), id="ddpm_conv_in_b256", marks=needs_cuda
    ),  # fmt: skip
    pytest.param(
        dict(n=2, cin=320, cout=320, h=16, w=16, k=3, padding=1, bias=True, temb=True),
        id="c320_k3_16x16",
        marks=needs_cuda,
    ),
    pytest.param(
        dict(n=2, cin=320, cout=640, h=8, w=8, k=1, bias=True, res=True),
        id="c320_k1_shortcut",
        marks=needs_cuda,
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_conv2d_matches_ref(case: dict, dtype: torch.dtype) -> None:
    args, kwargs = make_inputs(case, dtype, seed=zlib.crc32(str(case).encode()))
    ref = reference(args, kwargs)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, device=DEVICE).contiguous(memory_format=torch.channels_last)
    assert conv2d(*args, **kwargs, out=out) is out
    assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_weight_and_nchw_input(dtype: torch.dtype) -> None:
    case = dict(n=2, cin=6, cout=10, h=7, w=9, k=3, padding=1, bias=True, temb=True, act="gelu")
    args, kwargs = make_inputs(case, dtype, seed=11)
    x, packed, bias = args
    raw = unpack_conv_weight(packed, x.shape[1])
    assert torch.equal(pack_conv_weight(raw), packed)
    kwargs["time_emb"] = kwargs["time_emb"].t().contiguous().t()  # column-major: strides (1, n)
    out = conv2d(x.contiguous(), raw, bias, **kwargs)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert rel_err(out, reference(args, kwargs)) < TOLERANCE[dtype]


def test_example_inputs_small_and_cost() -> None:
    args, kwargs = OP.example_inputs("small", torch.float32, DEVICE, 3)
    assert rel_err(OP.triton(*args, **kwargs), reference(args, kwargs)) < TOLERANCE[torch.float32]
    flops, moved = OP.cost(args, kwargs)
    n, cin, h, w = args[0].shape  # 3x3 'same' conv + bias + time embedding
    cout = args[1].shape[1]
    out = n * cout * h * w
    assert flops == 2 * out * cin * 9 + 2 * out  # multiply-adds, then the bias and time-embedding adds
    assert moved == 4 * (n * cin * h * w + 9 * cin * cout + cout + n * cout + out)
    assert (flops, moved) == (549360, 25008)  # (2, 12, 7, 9) -> 20 channels, by hand


@needs_cuda
@pytest.mark.parametrize("size", ["cifar10-b1", "sd15-b2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_example_inputs_model_shapes(size: str, dtype: torch.dtype) -> None:
    args, kwargs = OP.example_inputs(size, dtype, DEVICE, 5)
    assert rel_err(OP.triton(*args, **kwargs), reference(args, kwargs)) < TOLERANCE[dtype]


SPLIT_K_CASES = [
    pytest.param(
        dict(n=3, cin=20, cout=40, h=7, w=9, k=3, padding=1, bias=True, temb=True, res=True, act="silu", scale=0.5),
        3,
        id="k3p1_full_epilogue_split3",
    ),
    pytest.param(dict(n=1, cin=72, cout=24, h=5, w=5, k=3, padding=1, bias=True), 4, id="cin72_two_chunks_split4"),
    pytest.param(dict(n=2, cin=9, cout=17, h=9, w=11, k=4, stride=2, padding=1, act="gelu"), 16, id="k4s2_split16"),
    pytest.param(dict(n=2, cin=48, cout=33, h=7, w=9, k=1, res=True), 64, id="k1_more_splits_than_steps"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case, split_k", SPLIT_K_CASES)
def test_split_k_matches_ref_and_reuses_its_workspace(case: dict, split_k: int, dtype: torch.dtype) -> None:
    """Split-K: several row tiles (the interpreter's 128-row tiles over 3 x 63 rows), reductions that do not divide
    evenly among the splits, more splits than steps; the workspace's counters are back at 0 after each call, so a
    second call on the same workspace (new inputs) is right too, and the same inputs give the same bits."""
    workspace = SplitWorkspace()
    for seed in (1, 2):
        args, kwargs = make_inputs(case, dtype, seed=zlib.crc32(str(case).encode()) + seed)
        ref = reference(args, kwargs)
        out = torch.full(ref.shape, float("nan"), dtype=dtype, device=DEVICE).contiguous(
            memory_format=torch.channels_last
        )
        conv2d(*args, **kwargs, out=out, split_k=split_k, workspace=workspace)
        assert rel_err(out, ref) < TOLERANCE[dtype]
        assert workspace.counters is not None and not workspace.counters.any()
    again = conv2d(*args, **kwargs, split_k=split_k, workspace=workspace)
    assert torch.equal(again, out)


@pytest.mark.parametrize(
    "shape, expected",
    [
        pytest.param((1, 256, 256, 4, 3), (2, 4, 8), id="b1_4x4_256ch_18_steps"),
        pytest.param((1, 128, 128, 32, 3), (2, 4), id="b1_32x32_grid_of_128_9_steps"),
        pytest.param((1, 3, 128, 32, 3), (), id="b1_conv_in_one_flat_step"),  # 27 weight rows: one 32-deep step
        pytest.param((1, 512, 256, 4, 1), (2,), id="b1_1x1_4_steps"),
        pytest.param((1, 256, 256, 4, 1), (), id="b1_1x1_2_steps"),
        pytest.param((1, 64, 256, 4, 1), (), id="b1_1x1_one_step"),
        pytest.param((256, 128, 128, 32, 3), (), id="b256_grid_fills_the_gpu"),
    ],
)
def test_split_k_choices_on_an_h100_sized_gpu(monkeypatch, shape: tuple, expected: tuple) -> None:
    """Split factors are offered only where the unsplit grid leaves SMs idle (132 SMs, fp16 tiles)."""
    import fastdiff.kernels.conv2d as conv_module

    monkeypatch.setattr(conv_module, "num_sms", lambda device: 132)
    n, cin, cout, hw, k = shape
    assert split_k_choices(n, cin, cout, (hw, hw), k, torch.float16, torch.device("cpu")) == expected


@pytest.mark.parametrize(
    "shape, split_k, expected",
    [
        pytest.param((1024, 128, 1152), 1, (32, 32, 128, 4, 3), id="b1_32x32_c128_k3_128_programs"),
        pytest.param((1024, 128, 384), 2, (64, 32, 128, 4, 3), id="b1_32x32_c384_split2_tall_tiles"),
        pytest.param((256, 256, 512), 4, (64, 32, 128, 4, 3), id="b1_16x16_c512_split4"),
        pytest.param((256, 256, 256), 1, (16, 32, 128, 4, 3), id="b1_16x16_c256_128_programs"),
        pytest.param((64, 256, 256), 1, (16, 32, 128, 4, 3), id="b1_8x8_fewer_tiles_than_sms"),
        pytest.param((1024, 128, 3), 1, (32, 32, 16, 4, 3), id="b1_conv_in_cin3_keeps_its_step"),
        pytest.param((262144, 128, 128), 1, (128, 128, 64, 8, 3), id="b256_throughput_tiles"),
        pytest.param((16384, 256, 256), 1, (128, 128, 64, 8, 3), id="b256_8x8_256_programs_of_128x128"),
        pytest.param((4096, 256, 256), 1, (64, 32, 128, 4, 3), id="b256_4x4_64_programs_of_128x128"),
    ],
)
def test_gemm_blocks_on_an_h100_sized_gpu(monkeypatch, shape: tuple, split_k: int, expected: tuple) -> None:
    """The tile plan's two regimes (132 SMs, fp16): the largest tiles where they fill the GPU; otherwise 32-channel
    tiles with 128-deep steps and row blocks sized to about half a program per SM, split programs included."""
    import fastdiff.kernels.conv2d as conv_module

    monkeypatch.setattr(conv_module, "num_sms", lambda device: 132)
    assert conv_module._gemm_blocks(*shape, torch.float16, torch.device("cpu"), split_k) == expected


@pytest.mark.parametrize("split_k", [1, 3])
def test_latency_tiles_match_ref(monkeypatch, split_k: int) -> None:
    """The latency-regime tiles as on an H100 (132 SMs: 16-row blocks, 32 channels, 128-deep steps over Cin = 200, the
    second step masked), split or not, with the shortcut summed in: equal to the reference."""
    import fastdiff.kernels.conv2d as conv_module

    monkeypatch.setattr(conv_module, "num_sms", lambda device: 132)
    case = dict(n=1, cin=200, cout=40, h=5, w=6, k=3, padding=1, bias=True, temb=True, res=True, shortcut=130)
    args, kwargs = make_inputs(case, torch.float32, seed=21 + split_k)
    assert conv_module._gemm_blocks(30, 40, 200, torch.float32, torch.device(DEVICE), split_k)[:3] == (16, 32, 128)
    out = conv2d(*args, **kwargs, split_k=split_k)
    assert rel_err(out, reference(args, kwargs)) < TOLERANCE[torch.float32]


@pytest.mark.parametrize(
    "tiles, split_k",
    [
        pytest.param(GemmTiles(16, 16, 128, 2, 2), 1, id="m16_n16_k128_more_channel_tiles_than_the_plan"),
        pytest.param(GemmTiles(32, 64, 16, 4, 1), 3, id="m32_n64_k16_split3"),
    ],
)
def test_forced_tiles_match_ref(tiles: GemmTiles, split_k: int) -> None:
    """``tiles=`` replaces the plan (the sweep's knob): any valid plan computes the same conv."""
    case = dict(n=2, cin=130, cout=40, h=5, w=6, k=3, padding=1, bias=True, temb=True, res=True, act="silu")
    args, kwargs = make_inputs(case, torch.float32, seed=31 + split_k)
    out = conv2d(*args, **kwargs, split_k=split_k, tiles=tiles)
    assert rel_err(out, reference(args, kwargs)) < TOLERANCE[torch.float32]
    for bad in (dict(block_m=24), dict(block_k=8), dict(num_warps=3), dict(num_stages=0)):
        with pytest.raises(FastdiffError, match="bad conv tiles"):
            GemmTiles(**{"block_m": 16, "block_n": 32, "block_k": 64, **bad})


@pytest.mark.parametrize("split_k", [2, 5, 9])
def test_split_k_with_shortcut(split_k: int) -> None:
    """The shortcut's reduction steps follow the main conv's in the split ranges (a split may hold steps of both,
    or only shortcut steps); the shortcut a channel slice of a wider channels-last buffer (a concat part)."""
    case = dict(n=2, cin=12, cout=20, h=5, w=7, k=3, padding=1, bias=True, scale=0.7071, shortcut=19)
    args, kwargs = make_inputs(case, torch.float32, seed=17 + split_k)
    wide = torch.randn((2, 30, 5, 7), generator=torch.Generator().manual_seed(split_k))
    kwargs["shortcut"] = wide.to(DEVICE).contiguous(memory_format=torch.channels_last)[:, 4:23]
    out = conv2d(*args, **kwargs, split_k=split_k, workspace=SplitWorkspace())
    assert rel_err(out, reference(args, kwargs)) < TOLERANCE[torch.float32]
    fused = conv2d(*args, **kwargs)
    plain = conv2d(args[0], args[1], None, padding=1) + conv2d(kwargs["shortcut"], kwargs["shortcut_weight"])
    assert rel_err(fused, float64((plain + args[2][None, :, None, None]) * 0.7071)) < TOLERANCE[torch.float32]


def test_shortcut_arguments_raise() -> None:
    case = dict(n=1, cin=4, cout=8, h=5, w=5, k=3, padding=1, shortcut=6)
    (x, packed, _), kwargs = make_inputs(case, torch.float32, seed=3)
    sc, w_sc = kwargs["shortcut"], kwargs["shortcut_weight"]
    with pytest.raises(FastdiffError, match="together"):
        conv2d(x, packed, padding=1, shortcut=sc)
    with pytest.raises(FastdiffError, match="output's size"):
        conv2d(x, packed, padding=0, shortcut=sc, shortcut_weight=w_sc)
    with pytest.raises(FastdiffError, match=r"\[8, 6, 1, 1\]"):
        conv2d(x, packed, padding=1, shortcut=sc, shortcut_weight=w_sc[:, :5])
    with pytest.raises(FastdiffError, match="must match the input"):
        conv2d(x, packed, padding=1, shortcut=sc.double(), shortcut_weight=w_sc)


def test_bad_arguments_raise() -> None:
    args, kwargs = make_inputs(dict(n=1, cin=4, cout=8, h=5, w=5, k=3, bias=True), torch.float32, seed=0)
    x, packed, bias = args
    with pytest.raises(FastdiffError, match="packed conv weight"):
        conv2d(x, packed[:-1], bias)
    with pytest.raises(FastdiffError, match="activation"):
        conv2d(x, packed, bias, activation="tanh")
    with pytest.raises(FastdiffError, match="residual"):
        conv2d(x, packed, bias, residual=torch.zeros(1, 8, 5, 5, device=DEVICE))
    with pytest.raises(FastdiffError, match="time_emb"):
        conv2d(x, packed, bias, time_emb=torch.zeros(2, 8, device=DEVICE))
    with pytest.raises(FastdiffError, match="4-D"):
        conv2d(x[0], packed, bias)
    for padding in ((1,), (0, 1.0), True):
        with pytest.raises(FastdiffError, match="before, after"):
            conv2d(x, packed, bias, padding=padding)
    with pytest.raises(FastdiffError, match="bad conv"):
        conv2d(x, packed, bias, padding=(0, -1))
    for split_k in (0, 2.0, True):
        with pytest.raises(FastdiffError, match="split_k"):
            conv2d(x, packed, bias, split_k=split_k)
