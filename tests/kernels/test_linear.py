"""linear (token-matrix GEMM + fused bias / GEGLU / activation / residual / scale) vs its plain-torch ref in
float64, on odd shapes and strided row views."""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

import fastdiff.kernels.linear as linear_module
from fastdiff.errors import FastdiffError
from fastdiff.kernels.cost_model import Cost, matmul_cost
from fastdiff.kernels.linear import FEW_ROWS, OP, TUNING_CONFIGS, linear, linear_ref, linear_tiles, pack_linear_weight

from .conftest import CUDA, DEVICE, DTYPES, float64, needs_cuda, rel_err

# fp32 on the GPU is a tf32 dot (~3e-4); the interpreter computes fp32 exactly.
TOLERANCE = {torch.float32: 1e-3 if CUDA else 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def reference(args: tuple, kwargs: dict) -> torch.Tensor:
    """linear_ref on float64 copies of the (already rounded) inputs."""
    return linear_ref(*[float64(a) for a in args], **{k: float64(v) for k, v in kwargs.items() if k != "out"})


def rows_view(m: int, n: int, pad: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Standard-normal [m, n]: a column slice at offset 1 of a [m, n + pad] matrix when ``pad``."""
    big = torch.randn((m, n + pad), generator=gen).to(device=DEVICE, dtype=dtype)
    return big[:, 1 : 1 + n] if pad else big


def make_inputs(case: dict, dtype: torch.dtype, seed: int) -> tuple[tuple, dict]:
    gen = torch.Generator().manual_seed(seed)
    m, k, n, geglu = case["m"], case["k"], case["n"], case.get("geglu", False)
    pad = 5 if case.get("strided") else 0
    n_w = 2 * n if geglu else n
    x = rows_view(m, k, pad, dtype, gen)
    weight = (torch.randn((n_w, k), generator=gen) / k**0.5).to(device=DEVICE, dtype=dtype)
    bias = torch.randn(n_w, generator=gen).to(device=DEVICE, dtype=dtype) if case.get("bias") else None
    kwargs = {"geglu": geglu, "packed": True}
    if case.get("res"):
        kwargs["residual"] = rows_view(m, n, pad + 2, dtype, gen)
    for key, name in (("act", "activation"), ("scale", "out_scale")):
        if case.get(key) is not None:
            kwargs[name] = case[key]
    return (x, pack_linear_weight(weight, geglu), bias), kwargs


CASES = [
    pytest.param(dict(m=45, k=40, n=24, geglu=True, bias=True, res=True, strided=True), id="m45_k40_n24_geglu_res"),
    pytest.param(dict(m=45, k=40, n=24), id="m45_k40_n24_plain"),
    pytest.param(dict(m=33, k=64, n=50, bias=True, act="gelu", scale=0.5, strided=True), id="k64_even_gelu_scale"),
    pytest.param(
        dict(m=70, k=17, n=40, geglu=True, act="silu", res=True, scale=0.7071, strided=True),
        id="k17_geglu_nobias_silu_res_scale",
    ),
    pytest.param(dict(m=5, k=3, n=7, bias=True, act="relu"), id="m5_k3_n7_relu"),
    pytest.param(dict(m=154, k=768, n=320), id="cross_attn_kv_154x768x320", marks=needs_cuda),
    pytest.param(dict(m=2048, k=640, n=640, bias=True, res=True, strided=True), id="proj_2048x640", marks=needs_cuda),
    pytest.param(dict(m=512, k=1280, n=5120, geglu=True, bias=True), id="ff_geglu_512x1280x5120", marks=needs_cuda),
    pytest.param(dict(m=128, k=5120, n=1280, bias=True, res=True), id="ff_out_128x5120x1280", marks=needs_cuda),
    pytest.param(
        dict(m=1000, k=333, n=333, geglu=True, bias=True, res=True, strided=True),
        id="odd_1000x333x333_geglu",
        marks=needs_cuda,
    ),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_linear_matches_ref(case: dict, dtype: torch.dtype) -> None:
    """Into a NaN-poisoned ``out``: a column slice of a wider matrix for the strided cases, whose other columns
    must stay untouched."""
    args, kwargs = make_inputs(case, dtype, seed=zlib.crc32(str(case).encode()))
    ref = reference(args, kwargs)
    m, n = ref.shape
    pad = 3 if case.get("strided") else 0
    wide = torch.full((m, n + pad), float("nan"), dtype=dtype, device=DEVICE)
    out = wide[:, 2 : 2 + n] if pad else wide
    assert linear(*args, **kwargs, out=out) is out
    assert rel_err(out, ref) < TOLERANCE[dtype]
    if pad:
        assert wide[:, :2].isnan().all() and wide[:, 2 + n :].isnan().all()


@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[5]])
def test_every_tile_matches_ref_and_repeats(case) -> None:
    """Every tile ``linear_tiles`` offers (what the engine's autotune times and a kernel plan pins), on ragged
    shapes with the whole epilogue: the ref's result, and the same bits on a repeat (16-bit on CUDA; fp32 in the
    interpreter)."""
    dtype = torch.float16 if CUDA else torch.float32
    args, kwargs = make_inputs(case, dtype, seed=zlib.crc32(str(case).encode()))
    ref = reference(args, kwargs)
    tiles = linear_tiles(case["m"])
    assert sorted(tiles) == sorted(TUNING_CONFIGS)
    for tile in tiles:
        got = linear(*args, **kwargs, tile=tile)
        assert rel_err(got, ref) < TOLERANCE[dtype], tile
        assert torch.equal(linear(*args, **kwargs, tile=tile), got), tile
    if CUDA:  # no tile: the first
        assert torch.equal(linear(*args, **kwargs), linear(*args, **kwargs, tile=tiles[0]))


def test_default_tile_by_rows() -> None:
    """Few rows (cross-attention K/V of 2 x 77 tokens) start on the small tile, many on the large one; the TMA
    form has the 4-warp tiles only (Triton 3.6's TMA races with 8 warps on short loops)."""
    assert linear_tiles(154)[0] == TUNING_CONFIGS[-1] == linear_tiles(FEW_ROWS)[0]
    assert linear_tiles(FEW_ROWS + 1)[0] == TUNING_CONFIGS[0] == linear_tiles(8192)[0]
    tma = linear_tiles(8192, tma=True)
    assert tma[0] == (128, 128, 64, 4, 4) and sorted(tma) == sorted(t for t in TUNING_CONFIGS if t[3] == 4)
    assert linear_tiles(154, tma=True)[0] == TUNING_CONFIGS[-1]


def test_ref_is_diffusers_geglu_and_nn_linear() -> None:
    """The ref's GEGLU is diffusers' ``value, gate = proj(x).chunk(2, -1); value * gelu(gate)`` of nn.Linear."""
    gen = torch.Generator().manual_seed(1)
    proj = torch.nn.Linear(6, 2 * 5).double()
    x = torch.randn((4, 6), generator=gen, dtype=torch.float64)
    with torch.no_grad():
        value, gate = proj(x).chunk(2, dim=-1)
        expected = value * F.gelu(gate)
        assert torch.allclose(linear_ref(x, proj.weight, proj.bias, geglu=True), expected, rtol=0, atol=1e-12)
        packed = pack_linear_weight(proj.weight, geglu=True)
        assert torch.equal(packed, proj.weight.t()) and packed.is_contiguous()
        assert torch.allclose(linear_ref(x, packed, proj.bias, geglu=True, packed=True), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_raw_weight_matches_packed(dtype: torch.dtype) -> None:
    case = dict(m=45, k=40, n=24, geglu=True, bias=True, act="gelu")
    (x, packed, bias), kwargs = make_inputs(case, dtype, seed=7)
    raw = packed.t().contiguous()
    kwargs.pop("packed")
    got = linear(x, raw, bias, **kwargs)
    assert got.shape == (45, 24) and got.is_contiguous()
    assert rel_err(got, reference((x, raw, bias), kwargs)) < TOLERANCE[dtype]
    assert torch.equal(got, linear(x, packed, bias, **kwargs, packed=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_added_in_place(dtype: torch.dtype) -> None:
    """``out=residual`` (the transformer block's ``hidden = proj(attn) + hidden``): the result is as if the
    residual were read before any write, also when the CUDA autotuner times its configs on this new shape."""
    case = dict(m=77, k=48, n=56, bias=True, res=True, strided=True)
    args, kwargs = make_inputs(case, dtype, seed=9)
    ref = reference(args, kwargs)
    residual = kwargs["residual"]
    assert linear(*args, **kwargs, out=residual) is residual
    assert rel_err(residual, ref) < TOLERANCE[dtype]


SPLIT_CASES = [
    pytest.param(dict(m=45, k=300, n=24, geglu=True, bias=True, res=True, strided=True), id="k300_geglu_res"),
    pytest.param(dict(m=37, k=256, n=40, act="silu", scale=0.5), id="k256_even_silu_scale"),
    pytest.param(dict(m=160, k=640, n=96, bias=True, res=True), id="k640_res", marks=needs_cuda),
    pytest.param(dict(m=128, k=5120, n=1280, geglu=True, bias=True), id="k5120_geglu", marks=needs_cuda),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_split_k_matches_ref(case: dict, dtype: torch.dtype) -> None:
    """Forced K splits (3 here: 128-deep slices, the last one short) give the unsplit result; a split count
    larger than K allows collapses to one."""
    args, kwargs = make_inputs(case, dtype, seed=zlib.crc32(str(case).encode()))
    ref = reference(args, kwargs)
    out = torch.full(ref.shape, float("nan"), dtype=dtype, device=DEVICE)
    assert linear(*args, **kwargs, out=out, split_k=3) is out
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert rel_err(linear(*args, **kwargs, split_k=64), ref) < TOLERANCE[dtype]


def test_split_k_picked_only_for_few_tiles_and_deep_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a 132-SM GPU: the mid block's feed-forward output (128 x 5120 -> 1280: 10 tiles) splits 4 ways (the cap),
    K = 2048 two ways (1024 deep each); 40 tiles (512 rows), shallow K (cross-attention K/V, K=768; GEGLU
    1280 -> 2 x 5120) and full grids never split."""
    assert linear_module._split_k(128, 1280, 5120, torch.device("cpu")) == 1  # the interpreter: one "SM"
    monkeypatch.setattr(linear_module, "num_sms", lambda device: 132)
    cuda = torch.device("cuda")
    assert linear_module._split_k(128, 1280, 5120, cuda) == 4
    assert linear_module._split_k(128, 1280, 2048, cuda) == 2
    assert linear_module._split_k(512, 1280, 5120, cuda) == 1  # 40 tiles: over a quarter of the SMs
    assert linear_module._split_k(128, 5120, 1280, cuda) == 1
    assert linear_module._split_k(154, 320, 768, cuda) == 1
    assert linear_module._split_k(8192, 320, 1280, cuda) == 1


def test_example_inputs_and_cost() -> None:
    args, kwargs = OP.example_inputs("small", torch.float32, DEVICE, 3)
    assert rel_err(OP.triton(*args, **kwargs), reference(args, kwargs)) < TOLERANCE[torch.float32]
    flops, moved = OP.cost(args, kwargs)
    # M=45, K=40, N=24 with GEGLU (48 weight columns), bias and residual:
    # 2*45*48*40 = 172800 multiply-add FLOPs + bias 45*48 = 2160 + GEGLU 45*24*(4 + 1) = 5400 + residual 1080
    assert flops == 181440
    # elements: x 45*40 = 1800 + weights 40*48 = 1920 + bias 48 + residual 1080 + out 1080 = 5928; fp32
    assert moved == 4 * 5928
    # without the epilogue the cost is matmul_cost's (3 x 7 @ 7 x 5, + bias: 225 FLOPs, 152 bytes at fp16)
    x, raw, bias = torch.empty(3, 7, dtype=torch.float16), torch.empty(5, 7, dtype=torch.float16), torch.empty(5)
    assert Cost(*OP.cost((x, raw, bias), {})) == matmul_cost(3, 5, 7, bias=True) == Cost(225, 152)


@needs_cuda
@pytest.mark.parametrize("size", ["sd15-b2-ff", "sd15-b2-proj", "sd15-b2-kv"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_example_inputs_model_shapes(size: str, dtype: torch.dtype) -> None:
    args, kwargs = OP.example_inputs(size, dtype, DEVICE, 5)
    assert rel_err(OP.triton(*args, **kwargs), reference(args, kwargs)) < TOLERANCE[dtype]


def _bad_calls() -> dict:
    (x, packed, bias), _ = make_inputs(dict(m=4, k=6, n=5, bias=True), torch.float32, seed=0)
    raw = packed.t()
    geglu_w = torch.zeros(6, 7, device=DEVICE)  # packed [K=6, N_w=7]: odd
    return {
        "x_not_2d": ((x[None], raw, bias), {}, "2-D token matrix"),
        "x_column_stride": ((x.t().contiguous().t(), raw, bias), {}, "input needs unit column stride"),
        "raw_weight_k": ((x, raw[:, :5], bias), {}, r"not a \[N_w, K\] matrix for K=6"),
        "packed_weight_k": ((x, packed[:5], bias), {"packed": True}, r"not a packed \[K, N_w\] matrix"),
        "weight_3d": ((x, raw[None], bias), {}, "linear weight"),
        "weight_dtype": ((x, raw.double(), bias), {}, "must match input"),
        "geglu_odd_raw": ((x, geglu_w.t(), None), {"geglu": True}, "even number of rows"),
        "geglu_odd_packed": ((x, geglu_w, None), {"geglu": True, "packed": True}, "even number of output columns"),
        "bias_shape": ((x, raw, bias[:4]), {}, "bias must have shape"),
        "bias_strided": ((x, raw, torch.zeros(10, device=DEVICE)[::2]), {}, "bias must be contiguous"),
        "bad_activation": ((x, raw, bias), {"activation": "tanh"}, "unknown activation"),
        "bad_split_k": ((x, raw, bias), {"split_k": 0}, "split_k must be"),
        "tile_length": ((x, raw, bias), {"tile": (32, 32, 32, 4)}, "tile must be"),
        "tile_not_pow2": ((x, raw, bias), {"tile": (32, 48, 32, 4, 1)}, "tile must be"),
        "tile_deep_k": ((x, raw, bias), {"tile": (32, 32, 128, 4, 1)}, "BLOCK_K at most 64"),
        "residual_shape": ((x, raw, bias), {"residual": torch.zeros(4, 6, device=DEVICE)}, "residual must have"),
        "residual_stride": ((x, raw, bias), {"residual": torch.zeros(5, 4, device=DEVICE).t()}, "residual needs"),
        "out_shape": ((x, raw, bias), {"out": torch.empty(5, 5, device=DEVICE)}, "out must have shape"),
        "out_dtype": ((x, raw, bias), {"out": torch.empty(4, 5, device=DEVICE, dtype=torch.float64)}, "out must be"),
        "out_device": ((x, raw, bias), {"out": torch.empty(4, 5, device="meta")}, "out must have shape"),
        "out_stride": ((x, raw, bias), {"out": torch.empty(5, 4, device=DEVICE).t()}, "out needs unit column"),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_bad_arguments_raise_one_line(name: str) -> None:
    args, kwargs, message = _bad_calls()[name]
    with pytest.raises(FastdiffError, match=message) as info:
        linear(*args, **kwargs)
    assert "\n" not in str(info.value)


def test_pack_errors() -> None:
    with pytest.raises(FastdiffError, match="2-D"):
        pack_linear_weight(torch.zeros(2, 3, 4))
    with pytest.raises(FastdiffError, match="even number of rows"):
        pack_linear_weight(torch.zeros(5, 4), geglu=True)


TMA_CASES = [
    pytest.param(dict(m=45, k=40, n=24, geglu=True, bias=True, res=True), id="m45_k40_n24_geglu_res"),
    pytest.param(dict(m=70, k=24, n=40, geglu=True, act="silu", res=True, scale=0.7071), id="k24_geglu_silu_scale"),
    pytest.param(dict(m=33, k=64, n=56, bias=True, act="gelu"), id="k64_n56_gelu"),
    pytest.param(
        dict(m=1000, k=328, n=336, geglu=True, bias=True, res=True), id="odd_1000x328x336_geglu", marks=needs_cuda
    ),  # fmt: skip
    pytest.param(dict(m=8192, k=320, n=1280, geglu=True, bias=True), id="sd15_ff_geglu_8192x320", marks=needs_cuda),
]


needs_tma = pytest.mark.skipif(
    CUDA and torch.cuda.get_device_capability()[0] < 9, reason="TMA needs a Hopper-class GPU"
)


@needs_tma
@pytest.mark.parametrize("case", TMA_CASES)
def test_tma_linear_matches_ref_on_every_tile(case, monkeypatch) -> None:
    """The TMA form on ragged shapes (rows past M, columns past K and N zero-filled by the copy engine; a GEGLU
    value tile reading gate columns it never stores) with the whole epilogue: the ref's result on each tile
    ``linear_tiles`` offers, and the same bits on a repeat."""
    launches = []
    tma_kernel = linear_module._linear_tma_kernel

    class Counting:  # the TMA kernel's launches, so a call that fell back to the pointer kernel shows
        def __getitem__(self, grid):
            launches.append(grid)
            return tma_kernel[grid]

    monkeypatch.setattr(linear_module, "_linear_tma_kernel", Counting())
    args, kwargs = make_inputs(case, torch.float16, seed=zlib.crc32(str(case).encode()))
    ref = reference(args, kwargs)
    tiles = linear_tiles(case["m"], tma=True) if CUDA else [None]
    for tile in tiles:
        got = linear(*args, **kwargs, tile=tile, tma=True)
        assert rel_err(got, ref) < TOLERANCE[torch.float16], tile
        assert torch.equal(linear(*args, **kwargs, tile=tile, tma=True), got), tile
    assert len(launches) == 2 * len(tiles)


@needs_tma
def test_tma_linear_says_why_not() -> None:
    """A column slice at an odd offset (unaligned base), a weight with strided columns, fp32, and a K split:
    one-line errors before any launch."""
    case = dict(m=45, k=40, n=24, strided=True)
    args, kwargs = make_inputs(case, torch.float16, seed=1)
    assert (
        linear_module.tma_linear_unsupported(args[0], args[1])
        == "TMA needs 16-byte aligned base pointers and row strides"
    )
    with pytest.raises(FastdiffError, match=r"^linear\(tma=True\): TMA needs 16-byte aligned"):
        linear(*args, **kwargs, tma=True)
    args32, kwargs32 = make_inputs(dict(m=45, k=40, n=24), torch.float32, seed=1)
    with pytest.raises(FastdiffError, match="is not fp16, bf16 or e4m3"):
        linear(*args32, **kwargs32, tma=True)
    aligned, kwargs = make_inputs(dict(m=45, k=40, n=24), torch.float16, seed=1)
    every_other = torch.cat([aligned[1], aligned[1]], dim=1)[:, ::2]  # the packed weight's values, column stride 2
    assert linear_module.tma_linear_unsupported(aligned[0], every_other) == "TMA needs unit column strides"
    with pytest.raises(FastdiffError, match="unit column strides"):
        linear(aligned[0], every_other, aligned[2], **kwargs, tma=True)
    with pytest.raises(FastdiffError, match="does not split K"):
        linear(*aligned, **kwargs, tma=True, split_k=2)
