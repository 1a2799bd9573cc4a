"""What every kernel test shares: the device, the dtypes a kernel is checked in, and the error measure.

The kernel tests are a package (``__init__.py``), so a test module reads these with ``from .conftest import ...``.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16", marks=needs_cuda),
    pytest.param(torch.bfloat16, id="bf16", marks=needs_cuda),
]
"""fp32 everywhere (Triton's interpreter on the CPU); the 16-bit types on CUDA only."""


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; fails on a NaN in ``out``."""
    assert not out.isnan().any(), "output has NaN"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def float64(value):
    """A floating tensor as float64 (for the references); anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    return value
