"""conv2d with the GroupNorm of its output in the epilogue (``norm_out=OutputGroupNorm``): the raw output against
``conv2d_ref`` in float64, the normalised output against ``F.group_norm`` + activation of the output as stored.

The shapes are picked for the tiling corners (in the interpreter, one SM: 128-row tiles): several images per row
tile and images past the batch in it, channel tiles with groups past Cout (20 channels in a 32-wide tile), a
non-square image, stride 2, nearest x2 upsampling, split-K, residual and time embedding in the epilogue before
the norm, and means of +-50 against a standard deviation of about 1 (the variance is two-pass). fp16 runs in the
interpreter too.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
import torch.nn.functional as F

from fastdiff.errors import FastdiffError
from fastdiff.kernels.common import GroupNormPartials, activation_ref
from fastdiff.kernels.conv2d import OutputGroupNorm, conv2d, conv2d_ref, norm_out_unsupported

from .conftest import CUDA, DEVICE, needs_cuda, rel_err

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16", marks=needs_cuda),
]
"""fp32 and fp16 everywhere (the interpreter runs fp16 dots), bf16 on CUDA."""
# fp32 on the GPU is a tf32 dot (~3e-4); the interpreter computes fp32 exactly. The normalised output is compared
# with the norm of the stored output, so only its own rounding counts.
TOLERANCE = {torch.float32: 1e-3 if CUDA else 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
NORM_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

CASES = [
    pytest.param(dict(n=1, cin=32, cout=64, hw=(4, 4), k=3, groups=8), id="b1_4x4_whole_image_tile"),
    pytest.param(dict(n=3, cin=16, cout=48, hw=(4, 4), k=3, groups=12, split_k=3, residual=True),
                 id="b3_4x4_images_past_the_batch_split3_residual"),
    pytest.param(dict(n=2, cin=8, cout=20, hw=(8, 8), k=3, groups=5, act=None, affine=False),
                 id="b2_8x8_groups_past_cout_no_affine_no_act"),
    pytest.param(dict(n=1, cin=12, cout=24, hw=(2, 8), k=1, groups=6, temb=False), id="b1_2x8_non_square_1x1"),
    pytest.param(dict(n=2, cin=8, cout=16, hw=(8, 8), k=3, groups=4, stride=2), id="b2_stride2_8x8_to_4x4"),
    pytest.param(dict(n=1, cin=8, cout=16, hw=(4, 4), k=3, groups=4, up=2, split_k=2), id="b1_upsample2_split2"),
    pytest.param(dict(n=2, cin=8, cout=32, hw=(4, 4), k=3, groups=4, mean=50.0), id="b2_mean50"),
    pytest.param(dict(n=1, cin=256, cout=256, hw=(16, 16), k=3, groups=32, split_k=4), id="ddpm_b1_16x16",
                 marks=needs_cuda),
    pytest.param(dict(n=5, cin=128, cout=256, hw=(8, 8), k=3, groups=32, residual=True), id="b5_8x8_128_to_256",
                 marks=needs_cuda),
]  # fmt: skip


def make_case(case: dict, dtype: torch.dtype, seed: int) -> tuple[dict, torch.Tensor, OutputGroupNorm]:
    """conv2d keyword arguments (x, weight, epilogue operands), the raw output buffer and the norm (NaN-filled
    outputs), from a case dict."""
    gen = torch.Generator().manual_seed(seed)
    n, cin, cout, (h, w), k = case["n"], case["cin"], case["cout"], case["hw"], case["k"]
    stride, up = case.get("stride", 1), case.get("up", 1)
    ho, wo = (h * up + 2 * (k // 2) - k) // stride + 1, (w * up + 2 * (k // 2) - k) // stride + 1

    def draw(*shape: int, scale: float = 1.0, shift: float = 0.0, image: bool = False) -> torch.Tensor:
        t = (scale * torch.randn(shape, generator=gen) + shift).to(DEVICE, dtype)
        return t.contiguous(memory_format=torch.channels_last) if image else t

    def nan_image() -> torch.Tensor:
        return torch.full((n, cout, ho, wo), float("nan"), device=DEVICE, dtype=dtype).contiguous(
            memory_format=torch.channels_last
        )

    args = dict(
        x=draw(n, cin, h, w, image=True), weight=draw(cout, cin, k, k, scale=2.0 / (cin * k * k) ** 0.5),
        bias=draw(cout, shift=case.get("mean", 0.0)), stride=stride, padding=k // 2, upsample=up,
        time_emb=draw(n, cout) if case.get("temb", True) else None,
        residual=draw(n, cout, ho, wo, image=True) if case.get("residual") else None,
        split_k=case.get("split_k", 1),
    )  # fmt: skip
    affine = case.get("affine", True)
    weight = (torch.rand(cout, generator=gen) + 0.5).to(DEVICE, dtype) if affine else None
    bias = draw(cout) if affine else None
    norm = OutputGroupNorm(case["groups"], nan_image(), weight, bias, 1e-5, case.get("act", "silu"))
    return args, nan_image(), norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_norm_out_matches_ref(case: dict, dtype: torch.dtype) -> None:
    args, out, norm = make_case(case, dtype, zlib.crc32(repr((case, str(dtype))).encode()))
    got = conv2d(**args, out=out, norm_out=norm)
    assert got.data_ptr() == out.data_ptr()
    ref_args = {key: (v.double() if isinstance(v, torch.Tensor) else v) for key, v in args.items() if key != "split_k"}
    assert rel_err(got, conv2d_ref(**ref_args)) < TOLERANCE[dtype]
    affine = [None if t is None else t.double() for t in (norm.weight, norm.bias)]
    normed = activation_ref(F.group_norm(got.double(), norm.groups, *affine, norm.eps), norm.activation)
    assert rel_err(norm.out, normed) < NORM_TOLERANCE[dtype]
    ref_out = dataclasses.replace(norm, out=torch.empty_like(norm.out))
    conv2d_ref(**{key: v for key, v in args.items() if key != "split_k"}, norm_out=ref_out)  # the ref's own path
    assert rel_err(norm.out, ref_out.out) < 10 * NORM_TOLERANCE[dtype] + TOLERANCE[dtype]


@pytest.mark.parametrize(
    ("n", "cout", "hw", "groups", "message"),
    [
        pytest.param(1, 64, (3, 4), 8, "power of two", id="12_pixels"),
        pytest.param(1, 64, (32, 32), 8, "power of two <= 256", id="32x32_too_large"),
        pytest.param(1, 48, (4, 4), 4, "group width 12", id="group_width_12"),
        pytest.param(1, 64, (4, 4), 6, "do not divide", id="groups_do_not_divide"),
    ],
)
def test_norm_out_unsupported(n: int, cout: int, hw: tuple, groups: int, message: str) -> None:
    assert message in norm_out_unsupported(n, cout, hw, groups)
    assert norm_out_unsupported(n, cout, (4, 4), cout // 4) is None
    x = torch.randn(n, 8, *hw, device=DEVICE)
    out = torch.empty(n, cout, *hw, device=DEVICE)
    with pytest.raises(FastdiffError, match="norm_out"):
        conv2d(x, torch.randn(cout, 8, 3, 3, device=DEVICE), padding=1, norm_out=OutputGroupNorm(groups, out))


def test_norm_out_bad_arguments_raise() -> None:
    x = torch.randn(1, 8, 4, 4, device=DEVICE)
    w = torch.randn(16, 8, 3, 3, device=DEVICE)
    out = torch.empty(1, 16, 4, 4, device=DEVICE)
    with pytest.raises(FastdiffError, match="does not combine"):
        conv2d(x, w, padding=1, norm_out=OutputGroupNorm(4, out), stats=GroupNormPartials(4))
    with pytest.raises(FastdiffError, match=r"norm_out.out must be a \[1, 16, 4, 4\]"):
        conv2d(x, w, padding=1, norm_out=OutputGroupNorm(4, out[:, :8]))
    with pytest.raises(FastdiffError, match="overlaps"):  # the normalised output over the raw one
        conv2d(x, w, padding=1, out=out, norm_out=OutputGroupNorm(4, out))
    buffer = torch.empty(2, 16, 4, 4, device=DEVICE)
    with pytest.raises(FastdiffError, match="overlaps"):  # over the residual
        conv2d(x, w, padding=1, residual=buffer[0:1], norm_out=OutputGroupNorm(4, buffer[0:1]))
    conv2d(x, w, padding=1, residual=buffer[0:1], norm_out=OutputGroupNorm(4, buffer[1:2]))  # apart: fine
    with pytest.raises(FastdiffError, match="together"):
        conv2d(x, w, padding=1, norm_out=OutputGroupNorm(4, out, weight=torch.ones(16, device=DEVICE)))
    with pytest.raises(FastdiffError, match="contiguous"):
        conv2d(x, w, padding=1, norm_out=OutputGroupNorm(4, out, torch.ones(8, device=DEVICE),
                                                          torch.ones(8, device=DEVICE)))  # fmt: skip
