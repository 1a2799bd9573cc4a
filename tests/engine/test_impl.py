"""Implementations as values (``engine/impl.py``): every name the candidates produce round-trips, bad names are one-line
errors; the candidate lists of tiny U-Nets' ops (on the CPU, and on a faked 132-SM CUDA device: no kernel runs) are
the names the engine offered before the executor was split into parts; and the autotune's choice weighs a fusion by
the pair's time (fake timings, no GPU)."""

from __future__ import annotations

import pytest
import torch

from fastdiff.engine import tuning
from fastdiff.engine.candidates import candidates
from fastdiff.engine.executor import FusedModel
from fastdiff.engine.fp8 import mark_fp8_ops
from fastdiff.engine.graph import channels_last_empty
from fastdiff.engine.impl import APPLY, FUSED, Impl, impl_names, impls_from_names
from fastdiff.errors import FastdiffError
from fastdiff.kernels import attention, conv2d, conv2d_tma
from fastdiff.models.ddpm_unet import DDPMUNet, DDPMUNetConfig

from .conftest import make_tiny

WIDE = dict(
    sample_size=(8, 8), in_channels=3, out_channels=3, block_out_channels=(64, 128), norm_num_groups=8,
    down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    layers_per_block=1, attention_head_dim=None,
)  # fmt: skip
"""64 and 128 channels: the Gluon conv's domain (fp16)."""
FP8 = dict(
    sample_size=(8, 12), in_channels=3, out_channels=3, block_out_channels=(16, 32), norm_num_groups=4,
    down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    layers_per_block=1, attention_head_dim=8,
)  # fmt: skip


def model_of(name: str):
    if name in ("wide", "fp8"):
        torch.manual_seed(0)
        return DDPMUNet(DDPMUNetConfig(**(WIDE if name == "wide" else FP8))).eval()
    return make_tiny(name, 0)


def engine(monkeypatch, name: str, batch: int, dtype=torch.float32, impls=("auto", "auto"), cuda=True, **kw):
    """A FusedModel on the CPU with its input bound; ``cuda``: its device faked as a 132-SM CUDA GPU for the
    candidates (TMA, Gluon, split, fusion forms: the fit checks read shapes and strides only)."""
    fused = FusedModel(model_of(name), batch, dtype, "cpu", *impls, **kw)
    fused._x_in = channels_last_empty(fused.x_in_value.shape, dtype, torch.device("cpu"))
    if cuda:
        for module in (conv2d, conv2d_tma, attention):
            monkeypatch.setattr(module, "num_sms", lambda device: 132)
        fused.device = torch.device("cuda")
    return fused


def names(fused: FusedModel, op_name: str) -> list[str]:
    return [impl.name for impl in candidates(fused, fused.op_by_name[op_name])]


SPLITS_SC = "triton-k2 triton-k4 triton-sc triton-sc-k2 triton-sc-k4".split()
GN = "triton-gn triton-gn-k2 triton-gn-k4 triton-sc-gn triton-sc-gn-k2 triton-sc-gn-k4".split()
CONV2_SC_GN = ["triton", *SPLITS_SC, *GN]  # no "triton-tma": candidates.NOT_REPEATABLE
GLUON_SC_GN = ["triton", "gluon", "gluon-p2", *SPLITS_SC, "gluon-sc", "gluon-p2-sc", *GN]
EXPECTED = [
    # (model, batch, dtype, (conv_impl, attention_impl), CUDA faked, op, names): the executor's at git c13dbe9,
    # less the fp16 TMA conv (candidates.NOT_REPEATABLE)
    ("pow2", 1, torch.float32, ("auto", "auto"), True, "down_blocks.1.resnets.0.conv2", [*CONV2_SC_GN, "cudnn"]),
    ("pow2", 1, torch.float32, ("auto", "auto"), True, "conv_in", ["triton", "triton-taps", "triton-gn", "cudnn"]),
    ("pow2", 1, torch.float32, ("auto", "auto"), True, "down_blocks.0.attentions.0.core",
     ["triton", "triton-kv2", "triton-rows", "sdpa"]),
    ("pow2", 1, torch.float32, ("auto", "auto"), True, "down_blocks.0.resnets.0.norm1",
     ["triton", "triton-c4", "triton-c8", "triton-c16", "triton-c32", "triton-c64"]),
    ("pow2", 1, torch.float32, ("cudnn", "sdpa"), True, "down_blocks.0.resnets.0.conv2", ["cudnn"]),
    ("pow2", 1, torch.float32, ("auto", "auto"), False, "down_blocks.0.resnets.0.conv2", ["triton", "cudnn"]),
    ("pow2", 1, torch.float32, ("auto", "auto"), False, "down_blocks.0.resnets.0.norm1", ["triton"]),
    ("attn_pad0", 1, torch.float32, ("auto", "auto"), True, "down_blocks.1.resnets.0.conv2",
     ["triton", "triton-sc", "triton-st", "triton-sc-st", "cudnn"]),
    ("attn_pad0", 1, torch.float32, ("auto", "auto"), True, "conv_in", ["triton", "triton-taps", "triton-st", "cudnn"]),
    ("wide", 1, torch.float16, ("auto", "auto"), True, "down_blocks.1.resnets.0.conv2", [*GLUON_SC_GN, "cudnn"]),
    ("wide", 2, torch.float16, ("triton", "triton"), True, "down_blocks.1.resnets.0.conv2", GLUON_SC_GN),
    # 16-bit attention on CUDA: each schedule on its tiles (kernels.attention.attention_tiles; 16 queries cap BLOCK_M)
    ("wide", 1, torch.float16, ("auto", "auto"), True, "mid_block.attentions.0.core",
     ["triton", "triton-t16x64x4x3", "triton-t16x128x8x3", "triton-t16x32x4x2", "triton-rows",
      "triton-rows-t16x128x4x2", "triton-rows-t16x128x8x2", "triton-rows-t16x32x4x2", "sdpa"]),
]  # fmt: skip


@pytest.mark.parametrize(("model", "batch", "dtype", "impls", "cuda", "op", "expected"), EXPECTED)
def test_candidates_are_the_names_offered_before(monkeypatch, model, batch, dtype, impls, cuda, op, expected):
    assert names(engine(monkeypatch, model, batch, dtype, impls, cuda), op) == expected


def test_token_gemm_candidates_are_its_tiles(monkeypatch):
    """A token GEMM on CUDA: the Triton kernel on its default tile for its rows, its other tiles, its TMA form on
    each tile (Hopper, 16-byte aligned rows: here the GEMMs whose widths are multiples of 8), cuBLAS; off CUDA the
    default tile and cuBLAS (tiles are timed by the engine's autotune and pinned by a kernel plan)."""
    from sd_fixtures import tiny_unet_config

    from fastdiff.kernels.linear import linear_tiles
    from fastdiff.models.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel

    torch.manual_seed(0)
    config = {k: v for k, v in tiny_unet_config("sd21").items() if not k.startswith("_")}
    unet = UNet2DConditionModel(UNet2DConditionConfig.from_dict(config)).eval()
    fused = FusedModel(unet, 2, torch.float16, "cpu", size=(8, 8), context_tokens=77)
    fused._x_in = channels_last_empty(fused.x_in_value.shape, torch.float16, torch.device("cpu"))
    linears = [op for op in fused.ops if op.kind == "linear"]
    assert {op.stage for op in linears} == {"step", "context"}
    for op in linears:
        assert names(fused, op.name) == ["triton", "cublas"]
    fused.device = torch.device("cuda")
    aligned = {op.name: op.output.shape[1] % 8 == 0 and op.inputs[0].shape[1] % 8 == 0 for op in linears}
    assert any(aligned.values()) and not all(aligned.values())  # sd21's 30-wide attention: rows of 60 bytes
    for op in linears:
        n, _, h, w = op.inputs[0].shape
        forms = [f"-t{'x'.join(map(str, tile))}" for tile in linear_tiles(n * h * w)[1:]]
        tma_forms = [f"-t{'x'.join(map(str, tile))}" for tile in linear_tiles(n * h * w, tma=True)[1:]]
        tma = ["triton-tma", *(f"triton-tma{t}" for t in tma_forms)] if aligned[op.name] else []
        expected = ["triton", *(f"triton{t}" for t in forms), *tma, "cublas"]
        assert names(fused, op.name) == expected


def test_fp8_conv_candidates(monkeypatch):
    fused = engine(monkeypatch, "fp8", 1, torch.float16)
    assert mark_fp8_ops(fused.ops) > 0  # what fp8=True does (which off the interpreter needs a Hopper GPU)
    expected = ["triton-tma-fp8", "triton-tma-fp8-k2", "triton-tma-fp8-k4"]
    assert names(fused, "down_blocks.0.resnets.0.conv1") == expected


def test_fp8_token_gemm_candidates():
    """A token GEMM reading an e4m3 norm output: the fp8 TMA GEMM on its tiles (CUDA faked), nothing else."""
    from sd_fixtures import tiny_unet_config

    from fastdiff.kernels.linear import linear_tiles
    from fastdiff.models.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel

    torch.manual_seed(0)
    config = {k: v for k, v in tiny_unet_config("sd15").items() if not k.startswith("_")}
    unet = UNet2DConditionModel(UNet2DConditionConfig.from_dict(config)).eval()
    fused = FusedModel(unet, 2, torch.float16, "cpu", size=(8, 8), context_tokens=77)
    assert mark_fp8_ops(fused.ops) > 0
    name = "down_blocks.0.attentions.0.transformer_blocks.0.ff.net.0.proj"
    assert names(fused, name) == ["triton-tma-fp8"]  # off CUDA: the default tile only
    fused.device = torch.device("cuda")
    tiles = [f"triton-tma-fp8-t{'x'.join(map(str, tile))}" for tile in linear_tiles(2 * 8 * 8, tma=True)[1:]]
    assert names(fused, name) == ["triton-tma-fp8", *tiles]


ROUND_TRIP_MODELS = [("pow2", 1, torch.float32), ("pow2", 64, torch.float32), ("attn_pad0", 3, torch.float32),
                     ("wide", 2, torch.float16)]  # fmt: skip


@pytest.mark.parametrize(("model", "batch", "dtype"), ROUND_TRIP_MODELS)
def test_every_candidate_name_round_trips(monkeypatch, model, batch, dtype):
    fused = engine(monkeypatch, model, batch, dtype)
    offered = {impl for op in fused.ops for impl in candidates(fused, op)}
    assert len(offered) > 10
    for impl in offered | {FUSED, APPLY, Impl("triton-tma", split_k=3), Impl("triton", ("sc", "st"), split_k=8)}:
        assert Impl.parse(impl.name) == impl and str(impl) == impl.name
    choice = {op.name: candidates(fused, op)[-1] for op in fused.ops}
    assert impls_from_names(impl_names(choice)) == choice


@pytest.mark.parametrize(
    "name",
    ["", "TRITON", "triton-", "triton-k1", "triton-k03", "triton-gn-sc", "triton-gn-st", "gluon-gn", "gluon-sc-p2",
     "triton-p2", "cudnn-k2", "triton-tma-sc", "triton-fp8", "triton-kv1", "triton-sc-kv2", "triton-rows-k2",
     "triton-c0", "fused-sc", "winograd", "triton-fold", "cudnn-t64x64x4x2", "triton-k2-t64x64x4x2",
     "triton-rows-t64x64x64x4x2", "triton-kv2-t64x64x64x4x2", "triton-t64x64x4", "triton-t064x64x4x2"],
)  # fmt: skip
def test_bad_names_are_one_line_errors(name):
    with pytest.raises(FastdiffError, match="unknown implementation") as err:
        Impl.parse(name)
    assert "\n" not in str(err.value)


def test_bad_combinations_are_errors():
    for kwargs in (dict(kernel="winograd"), dict(kernel="gluon", fusions=("gn",)), dict(kernel="triton", split_k=0),
                   dict(kernel="cudnn", fp8=True), dict(kernel="triton", fusions=("st", "sc")),
                   dict(kernel="triton", rows=True, lanes=8)):  # fmt: skip
        with pytest.raises(FastdiffError, match="invalid implementation"):
            Impl(**kwargs)
    assert Impl("triton", split_k=4).with_fusion("gn").with_fusion("sc").name == "triton-sc-gn-k4"
    assert Impl.parse("triton-sc-gn-k4").without_fusion("gn") == Impl("triton", ("sc",), split_k=4)


class Launch:
    """What the patched ``FusedModel.call`` returns: the (op, implementation) the fake timer looks up."""

    def __init__(self, op, impl) -> None:
        self.op, self.impl = op, impl

    def __call__(self) -> None:
        return None


def fake_autotune(monkeypatch, fused: FusedModel, times: dict[tuple[str, str], float]) -> None:
    """``tuning.choose_impls`` with every launch timed from ``times`` ((op, implementation) -> us; 10 otherwise)."""
    monkeypatch.setattr(tuning, "TUNING_CACHE", {})
    monkeypatch.setattr(tuning, "tuning_key", lambda model, op: op.name)
    monkeypatch.setattr(FusedModel, "call", lambda self, op, impl: Launch(op, impl))
    monkeypatch.setattr(tuning, "time_call_us", lambda call, reps: times.get((call.op.name, call.impl.name), 10.0))
    tuning.choose_impls(fused, 5)


def test_autotune_weighs_a_fusion_by_the_pair(monkeypatch):
    """conv2 + shortcut + GroupNorm: apart 10 + 4 + 3 us; shortcut summed in 13; norm in the epilogue 14; both 12.5."""
    fused = engine(monkeypatch, "pow2", 1)
    conv = "down_blocks.1.resnets.0.conv2"
    sc, norm = fused.pairs["sc"][conv], fused.pairs["gn"][conv]
    both = [impl.name for impl in candidates(fused, fused.op_by_name[conv]) if impl.fusions == ("sc", "gn")]
    times = {(conv, name): 12.5 for name in both}  # every split form too (the others take 10)
    times |= {(sc.name, impl.name): 4.0 for impl in candidates(fused, sc)}
    times |= {(norm.name, impl.name): 3.0 for impl in candidates(fused, norm)}
    fake_autotune(monkeypatch, fused, times)
    assert fused.impls[conv].name == "triton-sc-gn"
    assert f"(apart + {sc.name} 4.0 us) (apart + {norm.name} 3.0 us)" in fused.op_by_name[conv].why
    times |= {(conv, name): 13.5 for name in both}  # now triton-sc (13) wins: the norm apart costs less here
    fake_autotune(monkeypatch, fused, times)
    assert fused.impls[conv].name == "triton-sc"


def test_autotune_times_the_statistics_form_of_the_norm(monkeypatch):
    """conv -> GroupNorm with -st offered: apart 10 + 5 us; statistics in the epilogue 10.5 + the apply pass 1."""
    fused = engine(monkeypatch, "attn_pad0", 1)
    conv = "conv_in"
    norm = fused.pairs["st"][conv]
    st = [impl.name for impl in candidates(fused, fused.op_by_name[conv]) if impl.fuses("st")]
    times = {(conv, name): 10.5 for name in st} | {(norm.name, "apply"): 1.0}
    times |= {(norm.name, impl.name): 5.0 for impl in candidates(fused, norm)}
    fake_autotune(monkeypatch, fused, times)
    assert fused.impls[conv].name == "triton-st"
    assert tuning.TUNING_CACHE[norm.name]["apply"] == 1.0
    assert f"(apart + {norm.name} 5.0 us; after -st 1.0 us)" in fused.op_by_name[conv].why
