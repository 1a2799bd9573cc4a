"""group_norm_act (GroupNorm + affine + activation + residual, NHWC) vs its plain-torch ref in float64."""

from __future__ import annotations

import zlib

import pytest
import torch

import fastdiff.kernels.group_norm_act as gn_module
from fastdiff.errors import FastdiffError
from fastdiff.kernels.group_norm_act import OP, group_norm_act, group_norm_act_ref

from .conftest import DEVICE, DTYPES, needs_cuda, rel_err

# No dot: fp32 statistics and FMAs, so output rounding is what separates the 16-bit results from the ref.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_inputs(n, c, groups, h, w, residual, dtype, seed, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    x = (offset + 2.0 * torch.randn((n, c, h, w), generator=gen)).to(device=DEVICE, dtype=dtype)
    weight = (1.0 + 0.5 * torch.randn(c, generator=gen)).to(device=DEVICE, dtype=dtype)
    bias = torch.randn(c, generator=gen).to(device=DEVICE, dtype=dtype)
    res = torch.randn((n, c, h, w), generator=gen).to(device=DEVICE, dtype=dtype) if residual else None
    return x.contiguous(memory_format=torch.channels_last), weight, bias, res


def run_case(n, c, groups, h, w, activation, residual, design, dtype, offset=0.0, lanes=None) -> float:
    seed = zlib.crc32(repr((n, c, groups, h, w, activation, residual, design, str(dtype))).encode())
    x, weight, bias, res = make_inputs(n, c, groups, h, w, residual, dtype, seed, offset)
    out = torch.full_like(x, float("nan"))
    got = group_norm_act(
        x, groups, weight, bias, 1e-6, activation=activation, residual=res, out=out, design=design, lanes=lanes
    )
    assert got.data_ptr() == out.data_ptr()
    assert got.is_contiguous(memory_format=torch.channels_last)
    ref = group_norm_act_ref(
        x.double(), groups, weight.double(), bias.double(), 1e-6, activation=activation,
        residual=None if res is None else res.double(),
    )  # fmt: skip
    return rel_err(got, ref)


CASES = [
    pytest.param((1, 3, 1, 7, 9, "silu", False, "auto"), id="c3_g1_layernorm_7x9_b1"),
    pytest.param((5, 33, 3, 7, 9, "gelu", True, "single_pass"), id="c33_g3_7x9_b5_gelu_residual"),
    pytest.param((1, 33, 11, 7, 9, None, False, "single_pass"), id="c33_g11_7x9_b1"),
    pytest.param((5, 33, 1, 7, 9, "silu", True, "two_phase"), id="c33_g1_7x9_b5_two_phase_residual"),
    pytest.param((2, 33, 11, 7, 9, "gelu", False, "two_phase"), id="c33_g11_7x9_two_phase"),
    pytest.param((1, 4, 2, 32, 32, "silu", False, "auto"), id="c4_g2_32x32_b1"),
    pytest.param((1, 4, 1, 32, 32, "silu", False, "two_phase"), id="c4_g1_32x32_two_phase"),
    pytest.param((2, 320, 32, 16, 16, "silu", True, "auto"), id="c320_g32_16x16", marks=needs_cuda),
    pytest.param((2, 2048, 32, 8, 8, "silu", False, "auto"), id="c2048_g32_of_64ch_8x8", marks=needs_cuda),
    pytest.param((1, 320, 1, 64, 64, "gelu", False, "auto"), id="c320_g1_64x64_layernorm", marks=needs_cuda),
    pytest.param((2, 320, 32, 64, 64, "silu", False, "auto"), id="sd15_c320_g32_64x64", marks=needs_cuda),
    pytest.param((256, 128, 32, 32, 32, "silu", False, "auto"), id="cifar_b256_c128_32x32", marks=needs_cuda),
    pytest.param((3, 96, 32, 32, 32, None, True, "single_pass"), id="c96_g32_32x32_single", marks=needs_cuda),
    pytest.param((160, 384, 32, 16, 16, "silu", True, "auto"), id="cifar_b160_c384_g32_wide", marks=needs_cuda),
    pytest.param((3, 36, 3, 5, 7, "silu", True, "auto"), id="c36_g3_5x7_wide_one_group_per_block"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_group_norm_act_matches_ref(case: tuple, dtype: torch.dtype) -> None:
    assert run_case(*case, dtype=dtype) < TOLERANCE[dtype]


@pytest.mark.parametrize("design", ["single_pass", "two_phase"])
def test_streamed_blocks_match_ref(monkeypatch: pytest.MonkeyPatch, design: str) -> None:
    """Tiny register / stream budgets force the looped paths: many row tiles, groups wider than a block."""
    monkeypatch.setattr(gn_module, "MAX_REGISTER_TILE", 16)
    monkeypatch.setattr(gn_module, "WIDE_REGISTER_TILE", 16)
    monkeypatch.setattr(gn_module, "STREAM_TILE", 64)
    assert run_case(2, 33, 3, 7, 9, "silu", True, design, torch.float32) < 1e-5
    assert run_case(2, 96, 1, 3, 5, "gelu", False, design, torch.float32) < 1e-5


@pytest.mark.parametrize(
    "in_registers", [pytest.param(True, id="registers"), pytest.param(False, id="streamed", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("lanes", gn_module.LANE_CHOICES)
def test_forced_lanes_match_ref(monkeypatch: pytest.MonkeyPatch, lanes: int, in_registers: bool) -> None:
    """Each width the engine may time: 12-channel groups (1, 2 or all 3 per program, lanes left idle; 4-channel
    groups for the widths under 12: 1 or 2 per program), 7x9 rows in registers or streamed in row tiles; the
    two-phase design ignores the width."""
    if not in_registers:
        monkeypatch.setattr(gn_module, "LANES_REGISTER_TILE", 16)
        monkeypatch.setattr(gn_module, "STREAM_TILE", 64)
    groups = 3 if lanes >= 12 else 9
    plan = gn_module._plan(3, 36, 7 * 9, groups, torch.device("cpu"), "auto", lanes)
    expected = (lanes, min(groups, lanes * groups // 36), in_registers)
    assert (plan.block_c, plan.groups_per_block, plan.in_registers) == expected
    assert run_case(3, 36, groups, 7, 9, "silu", True, "auto", torch.float32, lanes=lanes) < 1e-5
    assert run_case(2, 36, groups, 7, 9, None, False, "two_phase", torch.float32, lanes=lanes) < 1e-5


@pytest.mark.parametrize("design", ["single_pass", "two_phase"])
def test_statistics_survive_a_large_mean(design: str) -> None:
    """Mean 1000, std 2: a fp32 sum-of-squares variance would lose ~all digits; Chan's merge does not."""
    assert run_case(2, 33, 3, 7, 9, None, False, design, torch.float32, offset=1000.0) < 1e-4


def test_nchw_input_gives_the_same_result() -> None:
    x, weight, bias, _ = make_inputs(2, 12, 4, 5, 7, False, torch.float32, seed=3)
    got = group_norm_act(x.contiguous(), 4, weight, bias, activation="silu")
    ref = group_norm_act_ref(x.double(), 4, weight.double(), bias.double(), activation="silu")
    assert rel_err(got, ref) < 1e-5


def test_without_affine() -> None:
    x, _, _, _ = make_inputs(1, 6, 3, 4, 5, False, torch.float32, seed=4)
    assert rel_err(group_norm_act(x, 3, None, None), group_norm_act_ref(x.double(), 3, None, None)) < 1e-5


def test_example_inputs_and_cost() -> None:
    args, kwargs = OP.example_inputs("small", torch.float32, DEVICE, 0)
    flops, moved = OP.cost(args, kwargs)
    n, c, h, w = args[0].shape  # affine GroupNorm + SiLU, no residual
    assert flops == (3 + 2 + 2 + 4) * n * c * h * w  # statistics, normalise, affine, SiLU
    assert moved == 4 * (2 * n * c * h * w + 2 * c)


@pytest.mark.parametrize(
    ("groups", "kwargs"),
    [(5, {}), (0, {}), (3, {"activation": "tanh"}), (3, {"design": "fast"}), (3, {"lanes": 24})],
    ids=["groups_not_dividing", "zero_groups", "bad_activation", "bad_design", "lanes_not_a_choice"],
)
def test_bad_arguments_raise(groups: int, kwargs: dict) -> None:
    x, weight, bias, _ = make_inputs(1, 6, 3, 2, 2, False, torch.float32, seed=0)
    with pytest.raises(FastdiffError):
        group_norm_act(x, groups, weight, bias, **kwargs)


def test_lanes_narrower_than_a_group_raise() -> None:
    x, weight, bias, _ = make_inputs(1, 33, 1, 2, 2, False, torch.float32, seed=0)
    with pytest.raises(FastdiffError, match="whole group of 33"):
        group_norm_act(x, 1, weight, bias, lanes=32)


def test_plan_wide_rows_only_when_the_gpu_is_full() -> None:
    """32-lane rows (two 12-channel groups of 384 per block) when batch x blocks fill the SMs (1 SM off CUDA);
    the 16-lane plan otherwise, and never for the forced two-phase design."""
    cpu = torch.device("cpu")
    wide = gn_module._plan(256, 384, 32 * 32, 32, cpu, "auto")
    assert (wide.design, wide.block_c, wide.groups_per_block, wide.in_registers) == ("single_pass", 32, 2, True)
    assert gn_module._plan(256, 384, 32 * 32, 32, cpu, "two_phase").design == "two_phase"
    big = gn_module._plan(1, 320, 64 * 64, 32, cpu, "auto")  # 4096 x 32 lanes > the wide register tile
    assert not (big.in_registers and big.block_c == 32)
