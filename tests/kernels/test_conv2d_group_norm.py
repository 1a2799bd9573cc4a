"""conv2d with a GroupNorm folded in (``FoldedGroupNorm``): the statistics epilogue (``stats=``), the normalising
prologue (``norm=``) and the two chained, against ``conv2d_ref`` / ``group_stats_ref`` in float64.

The shapes are picked for the tiling corners (in the interpreter, one SM: 128-row tiles, channel tiles of up to
128): row tiles that straddle samples or hold several, groups of 3 channels (not a power of two), groups split
between two channel tiles or wider than one, stride 2, nearest x2 upsampling, and means of +-50 against a standard
deviation of about 1 (a sum-of-squares variance loses most of its digits there). fp16 runs in the interpreter too.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.conv2d import (
    OP,
    FoldedGroupNorm,
    conv2d,
    conv2d_ref,
    group_stats_ref,
    pack_conv_weight,
)
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
STATS_TOLERANCE = 1e-5
"""Statistics are fp32 of the stored values in every dtype: mean error in standard deviations, rstd relative."""
EPS = 1e-5


def stats_err(mean_rstd: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest of |mean - mean_ref| * rstd_ref (the mean's error in standard deviations) and the relative error
    of rstd, over every (sample, group); fails on NaN."""
    assert not mean_rstd.isnan().any(), "statistics have NaN"
    got, ref = mean_rstd.double().cpu(), ref.double().cpu()
    mean_err = ((got[..., 0] - ref[..., 0]).abs() * ref[..., 1]).max()
    rstd_err = ((got[..., 1] - ref[..., 1]).abs() / ref[..., 1]).max()
    return max(mean_err.item(), rstd_err.item())


def channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def nan_like(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return channels_last(torch.full(ref.shape, float("nan"), dtype=dtype, device=DEVICE))


def group_norm(case: dict, channels: int, dtype: torch.dtype, gen: torch.Generator) -> FoldedGroupNorm:
    """The case's norm over ``channels``: non-trivial affine unless ``affine`` is False, SiLU unless told."""
    weight = bias = None
    if case.get("affine", True):
        weight = (1.0 + 0.2 * torch.randn(channels, generator=gen)).to(device=DEVICE, dtype=dtype)
        bias = (0.2 * torch.randn(channels, generator=gen)).to(device=DEVICE, dtype=dtype)
    return FoldedGroupNorm(case["groups"], weight, bias, EPS, case.get("norm_act", "silu"))


def as_float64(fold: FoldedGroupNorm) -> FoldedGroupNorm:
    """The same norm with float64 affine parameters (for the references)."""
    return FoldedGroupNorm(fold.groups, float64(fold.weight), float64(fold.bias), fold.eps, fold.activation)


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
    ),
    pytest.param(
        dict(n=3, cin=7, cout=96, groups=32, h=3, w=5, k=1, bias=True, res=True, scale=0.5, corner="several"),
        id="c96_g32_cg3_k1_res_scale_3_samples_in_one_tile",
    ),
    pytest.param(
        dict(n=3, cin=5, cout=200, groups=8, h=5, w=7, padding=1, temb=True, act="silu", offset=50.0, corner="split"),
        id="c200_g8_cg25_group_split_between_channel_tiles_temb_silu_mean50",
    ),
    pytest.param(
        dict(n=2, cin=4, cout=272, groups=2, h=7, w=9, stride=2, padding=1, bias=True, corner="wide"),
        id="c272_g2_cg136_group_wider_than_channel_tile_k3s2",
    ),
]


def assert_corner(case: dict, fold: FoldedGroupNorm) -> None:
    """The labelled tiling corner really happens (the interpreter's tiles; the GPU's are smaller)."""
    if CUDA:
        return
    block_m, block_n, hw, cout = fold.tiles
    cg = cout // fold.groups
    corner = case["corner"]
    if corner == "straddle":
        assert hw % block_m and case["n"] * hw > block_m
    elif corner == "several":
        assert block_m >= 2 * hw and case["n"] > 2
    elif corner == "split":
        assert cg < block_n < cout and block_n % cg  # a group crosses the first channel-tile boundary
    elif corner == "wide":
        assert cg > block_n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", STATS_CASES)
def test_stats_epilogue_matches_ref(case: dict, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(seed_of(case, dtype))
    x = channels_last(torch.randn((case["n"], case["cin"], case["h"], case["w"]), generator=gen).to(DEVICE, dtype))
    weights, kwargs = conv_inputs(case, case["cin"], case["cout"], dtype, gen)
    ref_fold = FoldedGroupNorm(case["groups"], eps=EPS)
    ref = reference(x, weights, kwargs, stats=ref_fold)
    fold = FoldedGroupNorm(case["groups"], eps=EPS)
    conv2d(x, *weights, **kwargs, stats=fold)  # allocates the partials; poison them, then the call under test
    partials, mean_rstd, arrivals = fold.partials, fold.mean_rstd, fold.arrivals
    partials.fill_(float("nan"))  # a slot no tile writes must never be read
    mean_rstd.fill_(float("nan"))  # every (sample, group) is finished by the call under test
    out = nan_like(ref, dtype)
    assert conv2d(x, *weights, **kwargs, out=out, stats=fold) is out
    # reused: fixed addresses for CUDA graphs; every image's last tile reset its arrival counter
    assert fold.partials is partials and fold.mean_rstd is mean_rstd and fold.arrivals is arrivals
    assert arrivals.tolist() == [0] * case["n"]
    assert_corner(case, fold)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert mean_rstd.shape == (case["n"], case["groups"], 2) and mean_rstd.dtype == torch.float32
    assert stats_err(mean_rstd, group_stats_ref(out.double(), case["groups"], EPS)) < STATS_TOLERANCE
    if dtype == torch.float32:  # the reference's own statistics (before rounding) agree too
        assert stats_err(mean_rstd, ref_fold.mean_rstd) < 10 * TOLERANCE[dtype]


@pytest.mark.parametrize("split_k", [1, 3], ids=["one_program_per_tile", "split_k3"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", STATS_CASES)
def test_stats_left_to_the_standalone_norm(case: dict, dtype: torch.dtype, split_k: int) -> None:
    """``finish=False``: the conv writes only its partials (the unused slots stay NaN and are never read; no
    ``mean_rstd``, no arrivals), and ``group_norm_act(..., stats=)`` merges them while it normalises: equal to
    ``group_norm_act_ref`` of the stored tensor in float64, twice with new inputs (no stale partial counts)."""
    gen = torch.Generator().manual_seed(seed_of(case, dtype) + split_k)
    weights, kwargs = conv_inputs(case, case["cin"], case["cout"], dtype, gen)
    norm = group_norm(case, case["cout"], dtype, gen)
    fold = FoldedGroupNorm(case["groups"], eps=EPS, finish=False)
    x = channels_last(torch.randn((case["n"], case["cin"], case["h"], case["w"]), generator=gen).to(DEVICE, dtype))
    conv2d(x, *weights, **kwargs, stats=fold, split_k=split_k)  # allocates the buffers; poison them
    fold.partials.fill_(float("nan"))
    fold.mean_rstd.fill_(float("nan"))
    for _ in range(2):
        x = channels_last(torch.randn(x.shape, generator=gen).to(DEVICE, dtype))
        y = conv2d(x, *weights, **kwargs, stats=fold, split_k=split_k)
        assert_corner(case, fold)
        out = nan_like(y, dtype)
        got = group_norm_act(y, case["groups"], norm.weight, norm.bias, EPS, activation="silu", out=out, stats=fold)
        ref = group_norm_act_ref(y.double(), case["groups"], float64(norm.weight), float64(norm.bias), EPS,
                                 activation="silu")  # fmt: skip
        assert got is out and rel_err(out, ref) < TOLERANCE[dtype]
    assert fold.mean_rstd.isnan().all() and not fold.arrivals.any()


def test_standalone_norm_merges_more_partials_than_one_step() -> None:
    """A 91x91 image spans 65 row tiles of 128: more partials per (image, group) than the norm merges in one step
    (64), so the running merge over steps is what normalises (the unwritten entries poisoned with NaN)."""
    gen = torch.Generator().manual_seed(11)
    case = dict(n=1, h=91, w=91, padding=1, bias=True, offset=20.0)
    weights, kwargs = conv_inputs(case, 3, 8, torch.float32, gen)
    fold = FoldedGroupNorm(2, eps=EPS, finish=False)
    x = channels_last(torch.randn((1, 3, 91, 91), generator=gen).to(DEVICE))
    conv2d(x, *weights, **kwargs, stats=fold)
    fold.partials.fill_(float("nan"))
    y = conv2d(x, *weights, **kwargs, stats=fold)
    if not CUDA:
        assert fold.partials.shape[2] * fold.partials.shape[3] > 64
    got = group_norm_act(y, 2, None, None, EPS, activation="gelu", stats=fold)
    ref = group_norm_act_ref(y.double(), 2, None, None, EPS, activation="gelu")
    assert rel_err(got, ref) < TOLERANCE[torch.float32]


def test_standalone_norm_rejects_statistics_it_cannot_use() -> None:
    gen = torch.Generator().manual_seed(5)
    x = channels_last(torch.randn((2, 6, 5, 5), generator=gen).to(DEVICE))
    packed = pack_conv_weight(torch.randn((8, 6, 3, 3), generator=gen).to(DEVICE))
    fold = FoldedGroupNorm(4, finish=False)
    with pytest.raises(FastdiffError, match="finish=False"):  # no conv wrote them yet
        group_norm_act(x, 2, None, None, stats=FoldedGroupNorm(2, finish=False))
    y = conv2d(x, packed, padding=1, stats=fold)
    with pytest.raises(FastdiffError, match="4 groups"):
        group_norm_act(y, 2, None, None, stats=fold)
    with pytest.raises(FastdiffError, match="do not apply"):
        group_norm_act(y, 4, None, None, stats=fold, lanes=16)
    with pytest.raises(FastdiffError, match="x is 2 x 8 x 9"):
        group_norm_act(y[:, :, :3, :3], 4, None, None, stats=fold)
    finished = FoldedGroupNorm(4)
    conv2d(x, packed, padding=1, stats=finished)
    with pytest.raises(FastdiffError, match="finish=False"):
        group_norm_act(y, 4, None, None, stats=finished)
    with pytest.raises(FastdiffError, match="finished statistics"):
        conv2d(y, pack_conv_weight(torch.randn((3, 8, 1, 1), generator=gen).to(DEVICE)), norm=fold)


# ----------------------------------------------------------------------------------------- normalising prologue
NORM_CASES = [
    pytest.param(
        dict(n=3, cin=48, groups=16, cout=7, h=11, w=13, padding=1, offset=-50.0),
        id="c48_g16_cg3_k3p1_silu_mean-50_padding_after_norm",
    ),
    pytest.param(dict(n=3, cin=96, groups=32, cout=5, h=3, w=5, k=1), id="c96_g32_cg3_k1_3_samples_in_one_tile"),
    pytest.param(
        dict(n=3, cin=48, groups=16, cout=6, h=9, w=11, stride=2, padding=1, offset=-50.0),
        id="c48_g16_k3s2p1_stride2",
    ),
    pytest.param(
        dict(n=3, cin=48, groups=16, cout=6, h=5, w=7, padding=1, upsample=2, offset=50.0),
        id="c48_g16_k3p1_upsample2_mean50",
    ),
    pytest.param(
        dict(n=2, cin=200, groups=8, cout=9, h=5, w=7, padding=1, norm_act="gelu", offset=50.0),
        id="c200_g8_cg25_groups_split_between_k_chunks_gelu",
    ),
    pytest.param(
        dict(n=2, cin=40, groups=8, cout=9, h=6, w=7, padding=1, norm_act=None, affine=False, bias=True),
        id="c40_g8_no_affine_no_act",
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", NORM_CASES)
def test_norm_prologue_matches_ref(case: dict, dtype: torch.dtype) -> None:
    """The prologue alone, with exact statistics of the input (``mean_rstd`` set from torch)."""
    gen = torch.Generator().manual_seed(seed_of(case, dtype))
    n, cin = case["n"], case["cin"]
    scale = 0.5 + torch.rand((1, cin, 1, 1), generator=gen)  # per-channel spread within the groups
    x = torch.randn((n, cin, case["h"], case["w"]), generator=gen) * scale + case.get("offset", 0.0)
    x = channels_last(x.to(DEVICE, dtype))
    weights, kwargs = conv_inputs({**case, "offset": 0.0}, cin, case["cout"], dtype, gen)
    fold = group_norm(case, cin, dtype, gen)
    fold.mean_rstd = group_stats_ref(x.double(), case["groups"], EPS)
    ref = reference(x, weights, kwargs, norm=as_float64(fold))
    out = nan_like(ref, dtype)
    conv2d(x, *weights, **kwargs, out=out, norm=fold)
    assert rel_err(out, ref) < TOLERANCE[dtype]


# ------------------------------------------------------------------------------------------------------ chained
CHAIN_CASES = [
    pytest.param(
        dict(n=3, cin=5, mid=48, groups=16, cout=7, h=11, w=13, padding=1, temb=True),
        id="resnet_c48_g16_k3_temb_then_k3_res_scale_rows_straddle",
    ),
    pytest.param(
        dict(n=3, cin=6, mid=96, groups=32, cout=6, h=3, w=5, k1=1, upsample=2, padding=1),
        id="c96_g32_k1_then_upsample2_k3",
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CHAIN_CASES)
def test_conv_stats_then_conv_norm_equals_group_norm_between(case: dict, dtype: torch.dtype) -> None:
    """conv1(stats) -> conv2(norm) == conv2_ref(silu(group_norm(conv1_ref(x)))), twice with new inputs (the
    buffers are reused and must not keep the first call's statistics)."""
    gen = torch.Generator().manual_seed(seed_of(case, dtype))
    n, h, w = case["n"], case["h"], case["w"]
    first = {"n": n, "h": h, "w": w, "k": case.get("k1", 3), "padding": case["padding"] if "k1" not in case else 0}
    first.update(bias=True, temb=case.get("temb", False))
    second = {"n": n, "h": h, "w": w, "padding": case["padding"], "upsample": case.get("upsample", 1)}
    second.update(bias=True, res=case.get("upsample", 1) == 1, scale=0.5)
    w1, kw1 = conv_inputs(first, case["cin"], case["mid"], dtype, gen)
    w2, kw2 = conv_inputs(second, case["mid"], case["cout"], dtype, gen)
    fold = group_norm(case, case["mid"], dtype, gen)
    for _ in range(2):
        x = channels_last(torch.randn((n, case["cin"], h, w), generator=gen).to(DEVICE, dtype))
        mid = conv2d(x, *w1, **kw1, stats=fold)
        out = conv2d(mid, *w2, **kw2, norm=fold)
        ref = reference(reference(x, w1, kw1), w2, kw2, norm=as_float64(fold))
        assert rel_err(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_chain_with_mean50_normalises_the_stored_tensor(dtype: torch.dtype) -> None:
    """At mean 50 the stored fp16 tensor is 50 +- 1 in steps of 1/32: conv2 must normalise exactly that tensor
    (its statistics, as stored), so the reference starts from conv1's output as the kernel stored it."""
    case = dict(n=3, h=11, w=13, padding=1, bias=True, offset=50.0, groups=16)
    gen = torch.Generator().manual_seed(seed_of(case, dtype))
    w1, kw1 = conv_inputs(case, 5, 48, dtype, gen)
    w2, kw2 = conv_inputs({**case, "offset": 0.0}, 48, 7, dtype, gen)
    fold = group_norm(case, 48, dtype, gen)
    x = channels_last(torch.randn((3, 5, 11, 13), generator=gen).to(DEVICE, dtype))
    mid = conv2d(x, *w1, **kw1, stats=fold)
    assert rel_err(mid, reference(x, w1, kw1)) < TOLERANCE[dtype]
    out = conv2d(mid, *w2, **kw2, norm=fold)
    assert stats_err(fold.mean_rstd, group_stats_ref(mid.double(), 16, EPS)) < STATS_TOLERANCE
    assert rel_err(out, reference(mid, w2, kw2, norm=as_float64(fold))) < TOLERANCE[dtype]


# --------------------------------------------------------------------------------------------- cost and errors
def test_cost_counts_the_folded_norm_by_hand() -> None:
    gen = torch.Generator().manual_seed(0)
    x = channels_last(torch.randn((2, 6, 5, 5), generator=gen))
    packed = pack_conv_weight(torch.randn((4, 6, 3, 3), generator=gen))
    norm = FoldedGroupNorm(3, torch.ones(6), torch.zeros(6), activation="silu")
    stats = FoldedGroupNorm(2)
    flops, moved = OP.cost((x, packed, None), {"padding": 1, "norm": norm, "stats": stats})
    out, inputs = 2 * 4 * 25, 2 * 6 * 25
    # GEMM 2*out*Cin*9; prologue normalise 2 + affine 2 + SiLU 4 per input element; statistics 3 per output
    assert flops == 2 * out * 6 * 9 + inputs * 8 + out * 3 == 24600
    # x, weights, y and gamma/beta in fp32; mean/rstd of 2x3 (sample, group) read, (count, mean, M2) of 2x2 written
    assert moved == 4 * (inputs + 4 * 6 * 9 + out + 2 * 6) + 4 * 2 * 3 * 2 + 4 * 2 * 2 * 3 == 3008
    plain = OP.cost((x, packed, None), {"padding": 1})
    assert plain == (2 * out * 6 * 9, 4 * (inputs + 4 * 6 * 9 + out))


def test_bad_arguments_raise() -> None:
    x = channels_last(torch.randn(2, 6, 5, 5, device=DEVICE))
    packed = pack_conv_weight(torch.randn(8, 6, 3, 3, device=DEVICE))
    with pytest.raises(FastdiffError, match="positive int"):
        FoldedGroupNorm(0)
    with pytest.raises(FastdiffError, match="together"):
        FoldedGroupNorm(2, weight=torch.ones(6))
    with pytest.raises(FastdiffError, match="activation"):
        FoldedGroupNorm(2, activation="tanh")
    with pytest.raises(FastdiffError, match="do not divide 8"):
        conv2d(x, packed, stats=FoldedGroupNorm(3))
    with pytest.raises(FastdiffError, match="must be a FoldedGroupNorm"):
        conv2d(x, packed, norm=3)
    with pytest.raises(FastdiffError, match="stats= first"):
        conv2d(x, packed, norm=FoldedGroupNorm(2))
    with pytest.raises(FastdiffError, match="weight/bias shapes"):
        conv2d(x, packed, norm=FoldedGroupNorm(2, torch.ones(8, device=DEVICE), torch.zeros(8, device=DEVICE)))
    fold = FoldedGroupNorm(2)
    fold.mean_rstd = torch.ones(1, 2, 2, device=DEVICE)  # one sample's statistics, two in the input
    with pytest.raises(FastdiffError, match="1 samples"):
        conv2d(x, packed, norm=fold)
    with pytest.raises(FastdiffError, match="different"):
        conv2d(x, pack_conv_weight(torch.randn(6, 6, 3, 3, device=DEVICE)), norm=fold, stats=fold)
