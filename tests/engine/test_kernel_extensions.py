"""Kernel features the engine relies on: channel slices of wider channels-last buffers (zero-copy concat parts)
read in place by group_norm_act and read / written in place by attention_gate; conv2d(upsample=2) (Upsample2D's
interpolate + conv in one launch), also from and into slices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fastdiff.kernels import attention_gate as gate
from fastdiff.kernels import group_norm_act as gn
from fastdiff.kernels.conv2d import conv2d, conv2d_ref, pack_conv_weight

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("design", ["single_pass", "two_phase", "auto"])
@pytest.mark.parametrize(("offset", "channels", "total"), [(0, 12, 21), (9, 12, 21), (5, 6, 11)])
def test_channel_slice_input(design, offset, channels, total, monkeypatch):
    gen = torch.Generator().manual_seed(offset * 100 + channels)
    big = torch.full((2, 7, 5, total), float("nan")).permute(0, 3, 1, 2)  # NaN outside the slice
    x_ref = torch.randn(2, channels, 7, 5, generator=gen)
    big[:, offset : offset + channels] = x_ref
    big = big.to(DEVICE)
    x = big[:, offset : offset + channels]
    assert not x.is_contiguous(memory_format=torch.channels_last)
    copies = []
    monkeypatch.setattr(
        gn, "_as_channels_last", lambda t: copies.append(t) or t.contiguous(memory_format=torch.channels_last)
    )
    weight = (1 + 0.1 * torch.randn(channels, generator=gen)).to(DEVICE)
    bias = (0.1 * torch.randn(channels, generator=gen)).to(DEVICE)
    residual = torch.randn(2, channels, 7, 5, generator=gen).to(DEVICE).contiguous(memory_format=torch.channels_last)
    out = gn.group_norm_act(x, 3, weight, bias, 1e-5, activation="silu", residual=residual, design=design)
    ref = gn.group_norm_act_ref(x_ref.to(DEVICE), 3, weight, bias, 1e-5, activation="silu", residual=residual)
    assert not any(t.data_ptr() == x.data_ptr() for t in copies)  # x itself was not copied
    assert torch.isfinite(out).all()
    assert float((out - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("n", [1, 3])
def test_attention_gate_slices_in_and_out(n):
    """x, g and out as channel slices of wider channels-last buffers (NaN around them): read/written in place."""
    gen = torch.Generator().manual_seed(n)
    cx, cg, inter, h, w = 5, 7, 4, 6, 3

    def nan_buffer(channels: int) -> torch.Tensor:
        return torch.full((n, h, w, channels), float("nan")).permute(0, 3, 1, 2).to(DEVICE)

    x_buf, g_buf, out_buf = nan_buffer(cx + 4), nan_buffer(cg + 2), nan_buffer(cx + cg)
    x, g, out = x_buf[:, 2 : 2 + cx], g_buf[:, 1 : 1 + cg], out_buf[:, cg:]
    x.copy_(torch.randn(n, cx, h, w, generator=gen))
    g.copy_(torch.randn(n, cg, h, w, generator=gen))
    weights = [
        torch.randn(shape, generator=gen).to(DEVICE) for shape in ((inter, cx), (inter, cg), (inter,), (1, inter), (1,))
    ]
    w_x, w_g, b_g, w_psi, b_psi = weights
    result = gate.attention_gate(x, g, w_x, w_g, b_g, w_psi, b_psi, out=out)
    ref = gate.attention_gate_ref(x.clone(), g.clone(), w_x, w_g, b_g, w_psi, b_psi)
    assert result.data_ptr() == out.data_ptr()
    assert torch.isfinite(out).all() and torch.isnan(out_buf[:, :cg]).all()  # only the slice was written
    assert float((out - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize(("cin", "cout", "h", "w", "ksize", "padding"), [(5, 7, 3, 5, 3, 1), (6, 4, 4, 3, 1, 0)])
def test_conv2d_upsample(cin, cout, h, w, ksize, padding):
    """Nearest x2 + conv + bias + residual, input a channel slice, output a channel slice (NaN around both)."""
    gen = torch.Generator().manual_seed(cin * 10 + ksize)
    x_buf = torch.full((2, h, w, cin + 3), float("nan")).permute(0, 3, 1, 2).to(DEVICE)
    x = x_buf[:, 3:]
    x.copy_(torch.randn(2, cin, h, w, generator=gen))
    weight = (torch.randn(cout, cin, ksize, ksize, generator=gen) / (cin * ksize * ksize) ** 0.5).to(DEVICE)
    bias = torch.randn(cout, generator=gen).to(DEVICE)
    ho, wo = 2 * h + 2 * padding - ksize + 1, 2 * w + 2 * padding - ksize + 1
    residual = torch.randn(2, cout, ho, wo, generator=gen).to(DEVICE)
    out_buf = torch.full((2, ho, wo, cout + 2), float("nan")).permute(0, 3, 1, 2).to(DEVICE)
    out = out_buf[:, :cout]
    conv2d(x, pack_conv_weight(weight), bias, padding=padding, residual=residual, out=out, upsample=2)
    ref = conv2d_ref(x.clone(), weight, bias, padding=padding, residual=residual, upsample=2)
    explicit = F.conv2d(F.interpolate(x.clone(), scale_factor=2.0, mode="nearest"), weight, bias, padding=padding)
    assert torch.isfinite(out).all() and torch.isnan(out_buf[:, cout:]).all()
    tol = 1e-5 if DEVICE.type == "cpu" else 3e-3  # tf32 dot on the GPU
    assert float((out - ref).norm() / ref.norm()) < tol
    assert float((ref - explicit - residual).norm() / ref.norm()) < 1e-5
