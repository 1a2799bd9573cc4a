"""The kernel registry: op name -> KernelOp(triton, ref, example_inputs, cost). The tests and
``benchmarks/kernels.py`` read it; the engine calls the kernel functions directly."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ExampleInputs = Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]


@dataclass(frozen=True)
class KernelOp:
    """One fused op: ``triton(*args, **kw)`` must equal ``ref(*args, **kw)`` within tolerance.

    ``example_inputs(size: "small"|"large", dtype, device, seed) -> (args, kwargs)`` gives inputs at shapes the
    models really use ("small" is interpreter-sized, "large" the DDPM-CIFAR10 batch-256 shape).
    """

    name: str
    triton: Callable[..., torch.Tensor]
    ref: Callable[..., torch.Tensor]
    example_inputs: ExampleInputs
    cost: Callable[[tuple[Any, ...], dict[str, Any]], tuple[float, float]] | None = None
    """(args, kwargs) -> (useful FLOPs, minimal bytes moved): for achieved TFLOP/s and GB/s."""
