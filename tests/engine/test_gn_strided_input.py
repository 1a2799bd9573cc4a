"""group_norm_act reads a channel slice of a wider channels-last tensor in place (zero-copy concat parts)."""

from __future__ import annotations

import pytest
import torch

from fastdiff.kernels import group_norm_act as gn

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
    monkeypatch.setattr(gn, "_as_channels_last", lambda t: copies.append(t) or t.contiguous(memory_format=torch.channels_last))
    weight = (1 + 0.1 * torch.randn(channels, generator=gen)).to(DEVICE)
    bias = (0.1 * torch.randn(channels, generator=gen)).to(DEVICE)
    residual = torch.randn(2, channels, 7, 5, generator=gen).to(DEVICE).contiguous(memory_format=torch.channels_last)
    out = gn.group_norm_act(x, 3, weight, bias, 1e-5, activation="silu", residual=residual, design=design)
    ref = gn.group_norm_act_ref(x_ref.to(DEVICE), 3, weight, bias, 1e-5, activation="silu", residual=residual)
    assert not any(t.data_ptr() == x.data_ptr() for t in copies)  # x itself was not copied
    assert torch.isfinite(out).all()
    assert float((out - ref).norm() / ref.norm()) < 1e-5
