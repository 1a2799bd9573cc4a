"""attention_gate (the ConvNeXt U-Net's skip gate) against its plain-torch ref and the model's module."""

from __future__ import annotations

import zlib

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.attention_gate import OP, attention_gate, attention_gate_ref

from .conftest import CUDA, DEVICE, DTYPES, float64, needs_cuda, rel_err

# Both 1x1 convs are tensor-core dots: tf32 for fp32 on the GPU, fp32 accumulation for the 16-bit types.
TOLERANCE = {torch.float32: 1e-3 if CUDA else 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def make_inputs(n, cx, cg, inter, h, w, biases, dtype, seed):
    """(args, kwargs) of attention_gate; weights scaled like torch's default init, x and g channels-last."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(shape, generator=gen)).to(device=DEVICE, dtype=dtype)

    x = draw(n, cx, h, w).contiguous(memory_format=torch.channels_last)
    g = draw(n, cg, h, w).contiguous(memory_format=torch.channels_last)
    w_x, w_g, w_psi = (
        draw(inter, cx, 1, 1, scale=cx**-0.5),
        draw(inter, cg, scale=cg**-0.5),
        draw(1, inter, 1, 1),
    )
    b_x, b_g, b_psi = (draw(inter), draw(inter), draw(1)) if biases else (None, None, None)
    return (x, g, w_x, w_g, b_g, w_psi, b_psi), {"b_x": b_x}


CASES = [
    pytest.param((1, 3, 5, 1, 7, 9, False), id="cx3_cg5_inter1_7x9_b1_nobias"),
    pytest.param((5, 33, 17, 70, 7, 9, True), id="cx33_cg17_inter70_7x9_b5"),
    pytest.param((1, 4, 4, 2, 32, 32, True), id="cx4_32x32"),
    pytest.param((2, 64, 64, 32, 32, 32, True), id="convnext_cifar_level0", marks=needs_cuda),
    pytest.param((3, 256, 256, 128, 8, 8, True), id="convnext_cifar_level2", marks=needs_cuda),
    pytest.param((2, 320, 96, 160, 9, 7, True), id="cx320_cg96_inter160", marks=needs_cuda),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_attention_gate_matches_ref(case: tuple, dtype: torch.dtype) -> None:
    args, kwargs = make_inputs(*case, dtype=dtype, seed=zlib.crc32(repr((case, str(dtype))).encode()))
    out = torch.full_like(args[0], float("nan"))
    got = attention_gate(*args, **kwargs, out=out)
    assert got.data_ptr() == out.data_ptr()
    ref = attention_gate_ref(*[float64(a) for a in args], **{k: float64(v) for k, v in kwargs.items()})
    assert rel_err(got, ref) < TOLERANCE[dtype]


def test_matches_the_model_module() -> None:
    """Weights from models.convnext_unet.AttentionGate by name: residual_conv -> x, gate_conv -> g, psi."""
    from fastdiff.models.convnext_unet import AttentionGate

    torch.manual_seed(0)
    gate = AttentionGate(skip_dim=12, gate_dim=20, inter_dim=6).to(DEVICE)
    skip = torch.randn(2, 12, 5, 7, device=DEVICE).contiguous(memory_format=torch.channels_last)
    g = torch.randn(2, 20, 5, 7, device=DEVICE).contiguous(memory_format=torch.channels_last)
    got = attention_gate(
        skip, g, gate.residual_conv.weight, gate.gate_conv.weight, gate.gate_conv.bias, gate.psi.weight,
        gate.psi.bias, b_x=gate.residual_conv.bias,
    )  # fmt: skip
    with torch.no_grad():
        ref = gate.double()(skip.double(), g.double())
    assert rel_err(got, ref) < TOLERANCE[torch.float32]


def test_example_inputs_and_cost() -> None:
    args, kwargs = OP.example_inputs("small", torch.float32, DEVICE, 0)
    flops, moved = OP.cost(args, kwargs)
    x, g, w_x = args[0], args[1], args[2]  # all three biases given
    n, cx, h, w = x.shape
    pixels, cg, inter = n * h * w, g.shape[1], w_x.shape[0]
    # per pixel: 1x1 convs to inter and to 1; per hidden element 2 biases, the sum, ReLU; psi bias, sigmoid; * x
    assert flops == pixels * (2 * inter * (cx + cg) + 2 * inter + 4 * inter + 1 + 4 + cx)
    assert moved == 4 * (pixels * (2 * cx + cg) + inter * (cx + cg + 1) + 2 * inter + 1)


def test_wrong_weight_shape_raises() -> None:
    args, kwargs = make_inputs(1, 4, 6, 3, 2, 2, True, torch.float32, seed=0)
    x, g, w_x, w_g, b_g, w_psi, b_psi = args
    with pytest.raises(FastdiffError):
        attention_gate(x, g, w_x, w_g[:, :5], b_g, w_psi, b_psi, **kwargs)
    with pytest.raises(FastdiffError):
        attention_gate(x, g[:, :, :1], w_x, w_g, b_g, w_psi, b_psi, **kwargs)
