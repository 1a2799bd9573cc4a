"""Every REGISTRY op: triton vs ref on its own "small" example inputs (fp32; the interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels import REGISTRY

from .conftest import CUDA, DEVICE, float64, rel_err

# On the GPU fp32 dots run in tf32 (~3e-4); the interpreter computes in true fp32.
TOLERANCE = 2e-3 if CUDA else 1e-4
EXPECTED = {
    "conv2d",
    "conv2d_tma",
    "tap_sum_conv2d",
    "depthwise_conv2d",
    "group_norm_act",
    "layer_norm",
    "linear",
    "attention",
    "attention_gate",
    "sampler_step",
    "gaussian_noise",
}


def as_tuple(result) -> tuple[torch.Tensor, ...]:
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def poisoned_out(name: str, args: tuple, kwargs: dict):
    """NaN-filled ``out`` for the call (every op takes ``out=``), channels-last like the activations."""
    probe = as_tuple(REGISTRY[name].ref(*args, **kwargs))
    poisoned = tuple(
        torch.full_like(t, float("nan"), memory_format=torch.channels_last if t.dim() == 4 else torch.preserve_format)
        for t in probe
    )
    return poisoned if len(poisoned) > 1 else poisoned[0]


def test_registry_holds_every_op() -> None:
    assert set(REGISTRY) == EXPECTED
    for name, op in REGISTRY.items():
        assert op.name == name and op.cost is not None


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_triton_matches_ref_on_small_examples(name: str) -> None:
    op = REGISTRY[name]
    args, kwargs = op.example_inputs("small", torch.float32, DEVICE, 1234)
    got = as_tuple(op.triton(*args, **kwargs, out=poisoned_out(name, args, kwargs)))
    ref = as_tuple(op.ref(*[float64(a) for a in args], **{k: float64(v) for k, v in kwargs.items()}))
    assert len(got) == len(ref)
    for out, expected in zip(got, ref, strict=True):
        assert out.shape == expected.shape
        err = rel_err(out, expected)
        assert err < TOLERANCE, f"{name}: relative error {err:.2e}"
    flops, moved = op.cost(args, kwargs)
    assert flops > 0 and moved > 0


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_unknown_example_size_raises(name: str) -> None:
    with pytest.raises(FastdiffError):
        REGISTRY[name].example_inputs("huge", torch.float32, "cpu", 0)


def test_no_kernel_times_its_own_tiles() -> None:
    """No kernel module picks a tile by timing at run time (``triton.autotune``): such a pick can differ between
    processes, and with it the order of a kernel's sums, so a kernel plan would no longer fix the bytes. Tiles are
    arguments; the engine's autotune times them and the plan pins them (``engine/candidates.py``)."""
    import pathlib

    import fastdiff.kernels

    sources = sorted(pathlib.Path(fastdiff.kernels.__file__).parent.glob("*.py"))
    assert len(sources) > 10
    timed = [path.name for path in sources if "autotune(" in path.read_text() or "Autotuner" in path.read_text()]
    assert timed == []
