"""Test setup: Triton runs in its interpreter when there is no GPU (must be set before triton is imported)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    """Run the test under this umask (restored afterwards); files created then should be ``0o666 & ~umask``."""
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)
