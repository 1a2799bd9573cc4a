"""conv2d's GroupNorm statistics epilogue (``stats=``, a ``GroupNormPartials``) and the standalone norm that merges
them (``group_norm_act(..., stats=)``), against ``conv2d_ref`` / ``group_norm_act_ref`` in float64.

The shapes are picked for the tiling corners (in the interpreter, one SM: 128-row tiles, channel tiles of up to
128): row tiles that straddle samples or hold several, groups of 3 channels (not a power of two), groups split
between two channel tiles or wider than one, stride 2, and means of +-50 against a standard deviation of about 1 (a
sum-of-squares variance loses most of its digits there). fp16 runs in the interpreter too.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.common import GroupNormPartials
from fastdiff.kernels.conv2d import OP, conv2d, conv2d_ref, pack_conv_weight
from fastdiff.kernels.group_norm_act import group_norm_act, group_norm_act_ref

from .conftest import CUDA, DEVICE, float64, needs_cuda, rel_err

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=needs_cuda),
]
"""fp32 and fp16 everywhere (the interpreter runs fp16 dots), bf16 on CUDA."""
# fp32 on the GPU is a tf32 dot (~3e-4); the interpreter computes fp32 exactly.
TOLERANCE = {torch.float32: 1e-3 if CUDA else 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
EPS = 1e-5


def channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def nan_like(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return channels_last(torch.full(ref.shape, float("nan"), dtype=dtype, device=DEVICE))


def affine(channels: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A non-trivial GroupNorm affine (weight, bias) over ``channels``."""
    weight = (1.0 + 0.2 * torch.randn(channels, generator=gen)).to(device=DEVICE, dtype=dtype)
    bias = (0.2 * torch.randn(channels, generator=gen)).to(device=DEVICE, dtype=dtype)
    return weight, bias


def conv_inputs(case: dict, cin: int, cout: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[tuple, dict]:
    """Packed weights, bias and the epilogue operands of one conv of the case; ``offset`` (a mean far from 0)
    goes into the bias, else the time embedding, else the residual."""
    n, k = case["n"], case.get("k", 3)
    ho = (case["h"] * case.get("upsample", 1) + 2 * case.get("padding", 0) - k) // case.get("stride", 1) + 1
    wo = (case["w"] * case.get("upsample", 1) + 2 * case.get("padding", 0) - k) // case.get("stride", 1) + 1
    offset = case.get("offset", 0.0)

    def randn(*shape: int, shift: float = 0.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) + shift).to(device=DEVICE, dtype=dtype)

    weight = (torch.randn((cout, cin, k, k), generator=gen) / (cin * k * k) ** 0.5).to(device=DEVICE, dtype=dtype)
    kwargs = {k_: case[k_] for k_ in ("stride", "padding", "upsample") if k_ in case}
    bias = randn(cout, shift=offset) if case.get("bias") else None
    if case.get("temb"):
        kwargs["time_emb"] = randn(n, cout, shift=0.0 if bias is not None else offset)
    if case.get("res"):
        shift = 0.0 if bias is not None or case.get("temb") else offset
        kwargs["residual"] = channels_last(randn(n, cout, ho, wo, shift=shift))
    for name, key in (("act", "activation"), ("scale", "out_scale")):
        if name in case:
            kwargs[key] = case[name]
    return (pack_conv_weight(weight), bias), kwargs


def seed_of(case: dict, dtype: torch.dtype) -> int:
    return zlib.crc32(f"{case}{dtype}".encode())


def reference(x: torch.Tensor, weights: tuple, kwargs: dict, **extra) -> torch.Tensor:
    """conv2d_ref on float64 copies of the (already rounded) inputs."""
    return conv2d_ref(float64(x), *[float64(a) for a in weights], **{k: float64(v) for k, v in kwargs.items()}, **extra)


# ------------------------------------------------------------------------------------------ statistics epilogue
STATS_CASES = [
    pytest.param(
        dict(n=3, cin=5, cout=48, groups=16, h=11, w=13, padding=1, bias=True, offset=50.0, corner="straddle"),
        id="c48_g16_cg3_k3p1_rows_straddle_samples_mean50_b3",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        dict(n=3, cin=7, cout=96, groups=32, h=3, w=5, k=1, bias=True, res=True, scale=0.5, corner="several"),
        id="c96_g32_cg3_k1_res_scale_3_samples_in_one_tile",
    ),
    pytest.param(
        dict(n=3, cin=5, cout=200, groups=8, h=5, w=7, padding=1, temb=True, act="silu", offset=50.0, corner="split"),
        id="c200_g8_cg25_group_split_between_channel_tiles_temb_silu_mean50",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        dict(n=2, cin=4, cout=272, groups=2, h=7, w=9, stride=2, padding=1, bias=True, corner="wide"),
        id="c272_g2_cg136_group_wider_than_channel_tile_k3s2",
    ),
]


def assert_corner(case: dict, stats: GroupNormPartials) -> None:
    """The labelled tiling corner really happens (the interpreter's tiles; the GPU's are smaller)."""
    if CUDA:
        return
    block_m, block_n, hw, cout = stats.tiles
    cg = cout // stats.groups
    corner = case["corner"]
    if corner == "straddle":
        assert hw % block_m and case["n"] * hw > block_m
    elif corner == "several":
        assert block_m >= 2 * hw and case["n"] > 2
    elif corner == "split":
        assert cg < block_n < cout and block_n % cg  # a group crosses the first channel-tile boundary
    elif corner == "wide":
        assert cg > block_n


@pytest.mark.parametrize("split_k", [1, 3], ids=["one_program_per_tile", "split_k3"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", STATS_CASES)
def test_stats_epilogue_then_standalone_norm_match_ref(case: dict, dtype: torch.dtype, split_k: int) -> None:
    """The conv writes its output (equal to ``conv2d_ref``) and the partials of its statistics (reused: a fixed
    address for CUDA graphs; the slots no tile writes stay NaN and are never read), and ``group_norm_act(...,
    stats=)`` merges them while it normalises: equal to ``group_norm_act_ref`` of the stored tensor in float64,
    twice with new inputs (no stale partial counts)."""
    gen = torch.Generator().manual_seed(seed_of(case, dtype) + split_k)
    weights, kwargs = conv_inputs(case, case["cin"], case["cout"], dtype, gen)
    weight, bias = affine(case["cout"], dtype, gen)
    stats = GroupNormPartials(case["groups"])
    x = channels_last(torch.randn((case["n"], case["cin"], case["h"], case["w"]), generator=gen).to(DEVICE, dtype))
    conv2d(x, *weights, **kwargs, stats=stats, split_k=split_k)  # allocates the partials; poison them
    partials = stats.partials
    partials.fill_(float("nan"))
    for _ in range(2):
        x = channels_last(torch.randn(x.shape, generator=gen).to(DEVICE, dtype))
        ref_y = reference(x, weights, kwargs)
        y = nan_like(ref_y, dtype)
        assert conv2d(x, *weights, **kwargs, out=y, stats=stats, split_k=split_k) is y
        assert stats.partials is partials
        assert_corner(case, stats)
        assert rel_err(y, ref_y) < TOLERANCE[dtype]
        out = nan_like(y, dtype)
        got = group_norm_act(y, case["groups"], weight, bias, EPS, activation="silu", out=out, stats=stats)
        ref = group_norm_act_ref(y.double(), case["groups"], float64(weight), float64(bias), EPS, activation="silu")
        assert got is out and rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.slow
def test_standalone_norm_merges_more_partials_than_one_step() -> None:
    """A 91x91 image spans 65 row tiles of 128: more partials per (image, group) than the norm merges in one step
    (64), so the running merge over steps is what normalises (the unwritten entries poisoned with NaN)."""
    gen = torch.Generator().manual_seed(11)
    case = dict(n=1, h=91, w=91, padding=1, bias=True, offset=20.0)
    weights, kwargs = conv_inputs(case, 3, 8, torch.float32, gen)
    stats = GroupNormPartials(2)
    x = channels_last(torch.randn((1, 3, 91, 91), generator=gen).to(DEVICE))
    conv2d(x, *weights, **kwargs, stats=stats)
    stats.partials.fill_(float("nan"))
    y = conv2d(x, *weights, **kwargs, stats=stats)
    if not CUDA:
        assert stats.partials.shape[2] * stats.partials.shape[3] > 64
    got = group_norm_act(y, 2, None, None, EPS, activation="gelu", stats=stats)
    ref = group_norm_act_ref(y.double(), 2, None, None, EPS, activation="gelu")
    assert rel_err(got, ref) < TOLERANCE[torch.float32]


def test_standalone_norm_rejects_statistics_it_cannot_use() -> None:
    gen = torch.Generator().manual_seed(5)
    x = channels_last(torch.randn((2, 6, 5, 5), generator=gen).to(DEVICE))
    packed = pack_conv_weight(torch.randn((8, 6, 3, 3), generator=gen).to(DEVICE))
    stats = GroupNormPartials(4)
    with pytest.raises(FastdiffError, match="a conv wrote"):  # no conv wrote them yet
        group_norm_act(x, 2, None, None, stats=GroupNormPartials(2))
    y = conv2d(x, packed, padding=1, stats=stats)
    with pytest.raises(FastdiffError, match="4 groups"):
        group_norm_act(y, 2, None, None, stats=stats)
    with pytest.raises(FastdiffError, match="do not apply"):
        group_norm_act(y, 4, None, None, stats=stats, lanes=16)
    with pytest.raises(FastdiffError, match="x is 2 x 8 x 9"):
        group_norm_act(y[:, :, :3, :3], 4, None, None, stats=stats)


# --------------------------------------------------------------------------------------------- cost and errors
def test_cost_counts_the_statistics_by_hand() -> None:
    gen = torch.Generator().manual_seed(0)
    x = channels_last(torch.randn((2, 6, 5, 5), generator=gen))
    packed = pack_conv_weight(torch.randn((4, 6, 3, 3), generator=gen))
    flops, moved = OP.cost((x, packed, None), {"padding": 1, "stats": GroupNormPartials(2)})
    out, inputs = 2 * 4 * 25, 2 * 6 * 25
    # GEMM 2*out*Cin*9; statistics 3 per output
    assert flops == 2 * out * 6 * 9 + out * 3 == 22200
    # x, weights and y in fp32; (count, mean, M2) of 2x2 (sample, group) written
    assert moved == 4 * (inputs + 4 * 6 * 9 + out) + 4 * 2 * 2 * 3 == 2912
    plain = OP.cost((x, packed, None), {"padding": 1})
    assert plain == (2 * out * 6 * 9, 4 * (inputs + 4 * 6 * 9 + out))


def test_bad_arguments_raise() -> None:
    x = channels_last(torch.randn(2, 6, 5, 5, device=DEVICE))
    packed = pack_conv_weight(torch.randn(8, 6, 3, 3, device=DEVICE))
    with pytest.raises(FastdiffError, match="positive int"):
        GroupNormPartials(0)
    with pytest.raises(FastdiffError, match="do not divide 8"):
        conv2d(x, packed, stats=GroupNormPartials(3))
    with pytest.raises(FastdiffError, match="must be a GroupNormPartials"):
        conv2d(x, packed, stats=3)
