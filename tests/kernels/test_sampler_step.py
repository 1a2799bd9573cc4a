"""sampler_step (the fused generic sampler update) against its plain-torch ref in float64."""

from __future__ import annotations

import zlib

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.sampler_step import OP, sampler_step, sampler_step_ref

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16", marks=needs_cuda),
    pytest.param(torch.bfloat16, id="bf16", marks=needs_cuda),
]
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "output has NaN"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_inputs(shape, dtype, seed, channels_last=True):
    gen = torch.Generator().manual_seed(seed)

    def draw(scale: float) -> torch.Tensor:
        t = (scale * torch.randn(shape, generator=gen)).to(device=DEVICE, dtype=dtype)
        return t.contiguous(memory_format=torch.channels_last) if channels_last else t

    x, model_output, x0_prev, noise = draw(1.5), draw(1.0), draw(0.8), draw(1.0)
    coefs = (torch.rand((7, 6), generator=gen) * 2 - 1).to(DEVICE)
    return x, model_output, x0_prev, noise, coefs


def reference(x, model_output, x0_prev, noise, coefs, i, clip_range):
    as64 = [None if t is None else t.double() for t in (x, model_output, x0_prev, noise, coefs)]
    return sampler_step_ref(*as64, i, clip_range)


CASES = [
    pytest.param(((2, 3, 7, 9), 0, True, True, 1.0, "int"), id="c3_7x9_b2_all_terms_clip"),
    pytest.param(((1, 3, 7, 9), 6, False, True, None, "tensor"), id="c3_b1_no_x0_prev_step_tensor"),
    pytest.param(((5, 33, 7, 9), 3, True, False, 0.5, "tensor"), id="c33_b5_no_noise_clip"),
    pytest.param(((1, 4, 32, 32), 2, False, False, None, "int"), id="c4_32x32_first_order"),
    pytest.param(((2, 4, 64, 64), 5, True, True, None, "tensor"), id="sd15_latents", marks=needs_cuda),
    pytest.param(((256, 3, 32, 32), 1, True, True, 1.0, "tensor"), id="cifar_b256", marks=needs_cuda),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_sampler_step_matches_ref(case: tuple, dtype: torch.dtype) -> None:
    shape, step, with_x0_prev, with_noise, clip_range, index_kind = case
    x, model_output, x0_prev, noise, coefs = make_inputs(shape, dtype, zlib.crc32(repr((case, str(dtype))).encode()))
    x0_prev = x0_prev if with_x0_prev else None
    noise = noise if with_noise else None
    i = torch.tensor(step, device=DEVICE) if index_kind == "tensor" else step
    out = (torch.full_like(x, float("nan")), torch.full_like(x, float("nan")))
    x_next, x0 = sampler_step(x, model_output, x0_prev, noise, coefs, i, clip_range, out=out)
    assert x_next.data_ptr() == out[0].data_ptr() and x0.data_ptr() == out[1].data_ptr()
    ref_next, ref_x0 = reference(x, model_output, x0_prev, noise, coefs, step, clip_range)
    assert rel_err(x_next, ref_next) < TOLERANCE[dtype]
    assert rel_err(x0, ref_x0) < TOLERANCE[dtype]
    if clip_range is not None:
        assert x0.abs().max().item() <= clip_range


def test_mixed_layouts_and_int32_step() -> None:
    """Channels-last x with contiguous model_output / noise; the step index as a one-element int32 tensor."""
    x, model_output, x0_prev, noise, coefs = make_inputs((2, 5, 6, 7), torch.float32, seed=11)
    i = torch.tensor([4], device=DEVICE, dtype=torch.int32)
    x_next, x0 = sampler_step(x, model_output.contiguous(), x0_prev, noise.contiguous(), coefs, i, 2.0)
    assert x_next.is_contiguous(memory_format=torch.channels_last)
    ref_next, ref_x0 = reference(x, model_output, x0_prev, noise, coefs, 4, 2.0)
    assert rel_err(x_next, ref_next) < 1e-6 and rel_err(x0, ref_x0) < 1e-6


def test_in_place_into_x_and_x0_prev() -> None:
    x, model_output, x0_prev, noise, coefs = make_inputs((3, 4, 5, 6), torch.float32, seed=12, channels_last=False)
    ref_next, ref_x0 = reference(x, model_output, x0_prev, noise, coefs, 2, None)
    x_next, x0 = sampler_step(x, model_output, x0_prev, noise, coefs, 2, None, out=(x, x0_prev))
    assert x_next.data_ptr() == x.data_ptr() and x0.data_ptr() == x0_prev.data_ptr()
    assert rel_err(x_next, ref_next) < 1e-6 and rel_err(x0, ref_x0) < 1e-6


@needs_cuda
def test_cuda_graph_replays_with_a_new_step_index() -> None:
    x, model_output, x0_prev, noise, coefs = make_inputs((2, 4, 16, 16), torch.float16, seed=13)
    i = torch.tensor(0, device=DEVICE)
    out = (torch.empty_like(x), torch.empty_like(x))
    sampler_step(x, model_output, x0_prev, noise, coefs, i, 1.0, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sampler_step(x, model_output, x0_prev, noise, coefs, i, 1.0, out=out)
    for step in (3, 6):
        out[0].fill_(float("nan"))
        i.fill_(step)
        graph.replay()
        torch.cuda.synchronize()
        ref_next, _ = reference(x, model_output, x0_prev, noise, coefs, step, 1.0)
        assert rel_err(out[0], ref_next) < TOLERANCE[torch.float16]


def test_example_inputs_and_cost() -> None:
    args, kwargs = OP.example_inputs("small", torch.float32, DEVICE, 0)
    flops, moved = OP.cost(args, kwargs)
    assert flops == 10.0 * args[0].numel() and moved == 6 * args[0].numel() * 4 + 24


def test_bad_arguments_raise() -> None:
    x, model_output, x0_prev, noise, coefs = make_inputs((1, 3, 4, 4), torch.float32, seed=0)
    with pytest.raises(FastdiffError):
        sampler_step(x, model_output, x0_prev, noise, coefs, 7, None)  # table has 7 rows: 0..6
    with pytest.raises(FastdiffError):
        sampler_step(x, model_output, x0_prev, noise, coefs[:, :5], 0, None)
    with pytest.raises(FastdiffError):
        sampler_step(x, model_output[:, :2], x0_prev, noise, coefs, 0, None)
