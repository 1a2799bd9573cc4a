"""Test setup: Triton runs in its interpreter when there is no GPU (must be set before triton is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
