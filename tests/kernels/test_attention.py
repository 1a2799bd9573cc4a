"""attention (flash-style softmax(q k^T s) v) against the explicit plain-torch ref in float64."""

from __future__ import annotations

import zlib

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.attention import (
    OP,
    ROWS_MAX_KEYS,
    attention,
    attention_ref,
    attention_tiles,
    split_kv_choices,
)
from fastdiff.kernels.common import SplitWorkspace

from .conftest import CUDA, DEVICE, DTYPES, needs_cuda, rel_err

# fp32 on the GPU runs both products in tf32 (~3e-4); the probabilities go to the tensor cores in 16 bits.
TOLERANCE = {torch.float32: 2e-3 if CUDA else 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def make_qkv(batch, heads, lq, lk, head_dim, projected, dtype, seed):
    """Contiguous [B, heads, L, d], or the [B, L, heads, d].transpose(1, 2) view a fused projection gives."""
    gen = torch.Generator().manual_seed(seed)

    def draw(length: int, scale: float) -> torch.Tensor:
        if projected:
            t = scale * torch.randn((batch, length, heads, head_dim), generator=gen)
            return t.to(device=DEVICE, dtype=dtype).transpose(1, 2)
        t = scale * torch.randn((batch, heads, length, head_dim), generator=gen)
        return t.to(device=DEVICE, dtype=dtype)

    return draw(lq, 1.5), draw(lk, 1.5), draw(lk, 1.0)


CASES = [
    pytest.param((1, 2, 7, 7, 8, False, None), id="seq7_d8"),
    pytest.param((2, 1, 64, 64, 40, True, None), id="seq64_d40_projected"),
    pytest.param((1, 2, 33, 77, 64, False, None), id="q33_kv77_d64_cross"),
    pytest.param((5, 1, 7, 77, 40, True, 0.3), id="b5_q7_kv77_d40_scale"),
    pytest.param((1, 1, 20, 5, 160, False, None), id="q20_kv5_d160"),
    pytest.param((1, 8, 4096, 4096, 40, True, None), id="sd15_self_seq4096_d40", marks=needs_cuda),
    pytest.param((2, 8, 1024, 77, 40, True, None), id="sd15_cross_kv77_d40", marks=needs_cuda),
    pytest.param((2, 8, 1024, 77, 80, True, None), id="cross_kv77_d80", marks=needs_cuda),
    pytest.param((2, 8, 256, 77, 160, True, None), id="cross_kv77_d160", marks=needs_cuda),
    pytest.param((8, 1, 256, 256, 256, False, None), id="cifar_seq256_d256", marks=needs_cuda),
    pytest.param((2, 2, 300, 300, 512, False, None), id="seq300_d512", marks=needs_cuda),
    pytest.param((3, 4, 1000, 1000, 32, False, None), id="seq1000_d32", marks=needs_cuda),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_attention_matches_ref(case: tuple, dtype: torch.dtype) -> None:
    batch, heads, lq, lk, head_dim, projected, scale = case
    q, k, v = make_qkv(batch, heads, lq, lk, head_dim, projected, dtype, zlib.crc32(repr((case, str(dtype))).encode()))
    out = torch.full((batch, heads, lq, head_dim), float("nan"), device=DEVICE, dtype=dtype)
    got = attention(q, k, v, scale=scale, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = attention_ref(q.double(), k.double(), v.double(), scale=scale)
    assert rel_err(got, ref) < TOLERANCE[dtype]


SPLIT_CASES = [
    pytest.param((1, 1, 40, 100, 24, 3), id="kv100_3_splits_ragged_end"),
    pytest.param((2, 3, 17, 77, 40, 4), id="b2_h3_cross_kv77_4_splits"),
    pytest.param((1, 2, 9, 20, 16, 8), id="kv20_8_splits_some_empty"),
    pytest.param((1, 1, 256, 256, 256, 4), id="cifar_b1_seq256_d256_4_splits", marks=needs_cuda),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_kv_matches_ref(case: tuple, dtype: torch.dtype) -> None:
    """The keys split over programs, merged by the last split in the same launch: splits whose keys end mid-block,
    splits with no keys at all (more splits than key blocks), two calls on one workspace (counters back at 0)."""
    batch, heads, lq, lk, head_dim, split = case
    workspace = SplitWorkspace()
    for seed in range(2):
        q, k, v = make_qkv(batch, heads, lq, lk, head_dim, True, dtype, zlib.crc32(repr((case, seed)).encode()))
        got = attention(q * 4, k, v, split_kv=split, workspace=workspace)  # large logits: maxima differ by split
        ref = attention_ref((q * 4).double(), k.double(), v.double())
        assert rel_err(got, ref) < TOLERANCE[dtype]
        assert not workspace.counters.any()
    assert torch.equal(attention(q * 4, k, v, split_kv=split, workspace=workspace), got)  # same bits on a repeat


ROWS_CASES = [
    pytest.param((1, 2, 7, 7, 8, False), id="seq7_d8"),
    pytest.param((2, 1, 19, 19, 40, True), id="b2_seq19_d40_projected"),
    pytest.param((1, 2, 33, 77, 64, False), id="q33_kv77_d64_cross"),
    pytest.param((1, 1, 20, 5, 160, True), id="q20_kv5_d160_two_value_slices_ragged"),
    pytest.param((1, 1, 40, 300, 24, True), id="kv300_d24_512_key_rows"),
    pytest.param((1, 1, 16, 16, 256, False), id="ddpm_4x4_seq16_d256"),
    pytest.param((1, 1, 256, 256, 256, True), id="ddpm_b1_seq256_d256", marks=needs_cuda),
    pytest.param((8, 1, 256, 256, 256, False), id="ddpm_b8_seq256_d256", marks=needs_cuda),
    pytest.param((2, 8, 1024, 77, 40, True), id="sd15_cross_kv77_d40", marks=needs_cuda),
    pytest.param((2, 2, 100, 512, 512, False), id="kv512_d512", marks=needs_cuda),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROWS_CASES)
def test_rows_schedule_matches_ref(case: tuple, dtype: torch.dtype) -> None:
    """Whole score rows per program, the value columns split: ragged query blocks, key counts below a power of two,
    head dims that leave the last value slice part-empty, logits of +-hundreds (the exact softmax subtracts each
    row's max), and the same bits on a repeat."""
    batch, heads, lq, lk, head_dim, projected = case
    q, k, v = make_qkv(batch, heads, lq, lk, head_dim, projected, dtype, zlib.crc32(repr(case).encode()))
    out = torch.full((batch, heads, lq, head_dim), float("nan"), device=DEVICE, dtype=dtype)
    got = attention(q * 4, k, v, out=out, schedule="rows")
    assert got.data_ptr() == out.data_ptr()
    assert rel_err(got, attention_ref((q * 4).double(), k.double(), v.double())) < TOLERANCE[dtype]
    assert torch.equal(attention(q * 4, k, v, schedule="rows"), got)


TILE_CASES = [
    pytest.param((2, 1, 19, 23, 40, "stream"), id="q19_kv23_d40_stream"),
    pytest.param((1, 2, 9, 40, 160, "stream"), id="q9_kv40_d160_stream"),
    pytest.param((1, 2, 33, 77, 64, "rows"), id="q33_kv77_d64_rows"),
    pytest.param((1, 1, 20, 5, 160, "rows"), id="q20_kv5_d160_rows"),
    pytest.param((8, 1, 256, 256, 256, "stream"), id="ddpm_b8_seq256_d256_stream", marks=needs_cuda),
    pytest.param((2, 8, 1024, 77, 40, "rows"), id="sd15_cross_kv77_d40_rows", marks=needs_cuda),
]


@pytest.mark.parametrize("case", TILE_CASES)
def test_every_tile_matches_ref_and_repeats(case: tuple) -> None:
    """Every tile ``attention_tiles`` offers (what the engine's autotune times and a kernel plan pins) on ragged
    shapes: the ref's result, and the same bits on a repeat (16-bit on CUDA; fp32 in the interpreter)."""
    batch, heads, lq, lk, head_dim, schedule = case
    dtype = torch.float16 if CUDA else torch.float32
    q, k, v = make_qkv(batch, heads, lq, lk, head_dim, True, dtype, zlib.crc32(repr(case).encode()))
    ref = attention_ref((q * 4).double(), k.double(), v.double())
    tiles = attention_tiles(head_dim, lq, schedule)
    assert len(tiles) > 2 and len(set(tiles)) == len(tiles)
    assert all(tile[0] <= max(16, 1 << (lq - 1).bit_length()) for tile in tiles)  # BLOCK_M capped at the queries
    for tile in tiles:
        got = attention(q * 4, k, v, schedule=schedule, tile=tile)
        assert rel_err(got, ref) < TOLERANCE[dtype], tile
        assert torch.equal(attention(q * 4, k, v, schedule=schedule, tile=tile), got), tile
    if CUDA:  # no tile: the first, on 16-bit inputs
        assert torch.equal(attention(q * 4, k, v, schedule=schedule), attention(q * 4, k, v, schedule=schedule,
                                                                                   tile=tiles[0]))  # fmt: skip


@pytest.mark.parametrize(
    "tile",
    [(64, 64, 4), (48, 64, 4, 2), (64, 64, 4, 0), (64.0, 64, 4, 2), [64, 64, 4, 2], (256, 64, 4, 2), (8, 64, 4, 2)],
)
def test_bad_tile_raises_one_line(tile) -> None:
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(FastdiffError, match="tile must be") as info:
        attention(q, q, q, tile=tile)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("lk", "kwargs", "match"),
    [
        pytest.param(8, {"schedule": "blocks"}, "schedule must be", id="unknown_schedule"),
        pytest.param(ROWS_MAX_KEYS + 1, {"schedule": "rows"}, "at most 512 keys", id="rows_too_many_keys"),
        pytest.param(8, {"schedule": "rows", "split_kv": 2}, "no split_kv", id="rows_with_split_kv"),
    ],
)
def test_bad_schedule_raises(lk: int, kwargs: dict, match: str) -> None:
    q, k = torch.randn(1, 1, 8, 16), torch.randn(1, 1, lk, 16)
    with pytest.raises(FastdiffError, match=match):
        attention(q, k, k, **kwargs)


def test_large_logits_stay_finite() -> None:
    """Scores of +-hundreds: the online softmax must subtract the running max (a naive exp overflows)."""
    q, k, v = make_qkv(1, 1, 24, 70, 16, False, torch.float32, seed=7)
    got = attention(q * 20, k, v)
    assert rel_err(got, attention_ref((q * 20).double(), k.double(), v.double())) < TOLERANCE[torch.float32]


def test_example_inputs_and_cost() -> None:
    args, kwargs = OP.example_inputs("small", torch.float32, DEVICE, 0)
    flops, moved = OP.cost(args, kwargs)
    q = args[0]
    assert flops == 4.0 * q.shape[0] * q.shape[1] * q.shape[2] * args[1].shape[2] * q.shape[3]
    assert moved == 4 * q.numel() * 4


@pytest.mark.parametrize(
    "shapes",
    [((1, 2, 8, 16), (1, 2, 9, 16), (1, 2, 10, 16)), ((1, 2, 8, 16), (1, 3, 9, 16), (1, 3, 9, 16))],
    ids=["k_v_lengths_differ", "heads_differ"],
)
def test_mismatched_shapes_raise(shapes: tuple) -> None:
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(FastdiffError):
        attention(q, k, v)


@pytest.mark.parametrize("split_kv", [0, 2.0, True])
def test_bad_split_kv_raises(split_kv) -> None:
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(FastdiffError, match="split_kv"):
        attention(q, q, q, split_kv=split_kv)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        pytest.param((1, 1, 256, 256), (2,), id="ddpm_b1_4_query_blocks"),
        pytest.param((1, 1, 256, 40), (), id="40_keys_under_32_per_split"),
        pytest.param((33, 1, 256, 256), (), id="b33_132_query_blocks_fill_the_sms"),
        pytest.param((2, 8, 4096, 77), (), id="sd15_cross_many_query_blocks"),
    ],
)
def test_split_kv_choices(monkeypatch: pytest.MonkeyPatch, shape: tuple, expected: tuple) -> None:
    """Splits are offered only where the query blocks leave SMs idle (132 SMs)."""
    import fastdiff.kernels.attention as attention_module

    monkeypatch.setattr(attention_module, "num_sms", lambda device: 132)
    assert split_kv_choices(*shape, torch.device("cpu")) == expected
