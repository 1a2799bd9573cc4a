"""sampler_step (the fused generic sampler update) against its plain-torch ref in float64."""

from __future__ import annotations

import importlib
import zlib

import pytest
import torch

from fastdiff.errors import FastdiffError
from fastdiff.kernels.philox_noise import gaussian_noise_ref
from fastdiff.kernels.sampler_step import COL, COLUMNS, OP, block_size, sampler_step, sampler_step_ref

from .conftest import DEVICE, DTYPES, float64, needs_cuda, rel_err

sampler_step_module = importlib.import_module("fastdiff.kernels.sampler_step")

UNGUIDED_STEPS = (2, 5)
"""Table rows whose guidance switch W is 0: the conditional output alone (cases cfg_sde_b3, sd15_latents)."""
TOLERANCE = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_inputs(shape, dtype, seed, channels_last, guided):
    gen = torch.Generator().manual_seed(seed)

    def draw(scale: float, rows: int = 1) -> torch.Tensor:
        t = (scale * torch.randn((rows * shape[0], *shape[1:]), generator=gen)).to(device=DEVICE, dtype=dtype)
        return t.contiguous(memory_format=torch.channels_last) if channels_last else t

    tensors = {"x": draw(1.5), "model_output": draw(1.0, 2 if guided else 1), "h1": draw(0.8), "h2": draw(0.7),
               "aux": draw(1.2), "noise": draw(1.0)}  # fmt: skip
    coefs = torch.rand((7, len(COLUMNS)), generator=gen) * 2 - 1
    coefs[list(UNGUIDED_STEPS), COL["W"]] = 0.0  # steps outside a guidance interval
    coefs = coefs.to(DEVICE)
    guidance = (torch.rand(shape[0], generator=gen) * 8).to(DEVICE) if guided else None
    return tensors, coefs, guidance


CASES = [
    # shape, step, history (h1, h2, aux), noise ("tensor", "seeds", None), clip, index kind, channels-last, guided
    pytest.param(((2, 3, 7, 9), 0, (True, True, True), "seeds", 1.0, "int", True, False), id="c3_7x9_unipc_seeds"),
    pytest.param(((1, 3, 7, 9), 6, (False, False, False), "tensor", None, "tensor", True, False), id="ddpm_b1"),
    pytest.param(((5, 33, 7, 9), 3, (True, False, False), None, 0.5, "tensor", False, False), id="c33_nchw_dpm"),
    pytest.param(((3, 4, 6, 10), 2, (True, False, False), "seeds", None, "int", True, True), id="cfg_sde_b3"),
    pytest.param(((1, 1, 5, 13), 4, (True, True, True), "tensor", None, "tensor", False, True), id="c1_cfg_unipc"),
    pytest.param(
        ((2, 4, 64, 64), 5, (True, True, True), "seeds", None, "tensor", True, True),
        id="sd15_latents",
        marks=needs_cuda,
    ),  # fmt: skip
    pytest.param(
        ((256, 3, 32, 32), 1, (True, False, False), "seeds", 1.0, "tensor", True, False),
        id="cifar_b256",
        marks=needs_cuda,
    ),  # fmt: skip
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_sampler_step_matches_ref(case: tuple, dtype: torch.dtype) -> None:
    shape, step, (with_h1, with_h2, with_aux), noise_kind, clip_range, index_kind, channels_last, guided = case
    seed = zlib.crc32(repr((case, str(dtype))).encode())
    t, coefs, guidance = make_inputs(shape, dtype, seed, channels_last, guided)
    history = [t["h1"] if with_h1 else None, t["h2"] if with_h2 else None, t["aux"] if with_aux else None]
    seeds = torch.arange(shape[0], dtype=torch.int64, device=DEVICE) * 131 + seed if noise_kind == "seeds" else None
    kwargs = {"noise": t["noise"] if noise_kind == "tensor" else None, "seeds": seeds, "guidance": guidance,
              "clip_range": clip_range}  # fmt: skip
    i = step if index_kind == "int" else torch.tensor(step, device=DEVICE)
    n_out = 2 + with_h2 + with_aux
    out = tuple(torch.full_like(t["x"], float("nan")) for _ in range(n_out))
    input_dtype = torch.float16 if dtype == torch.float32 else dtype  # the engine: fp32 state, fp16 model input
    model_input = torch.full_like(t["model_output"], float("nan"), dtype=input_dtype)
    got = sampler_step(t["x"], t["model_output"], coefs, i, *history, **kwargs, out=out, model_input=model_input)
    ref = sampler_step_ref(*[float64(a) for a in (t["x"], t["model_output"], coefs)], step,
                           *[float64(h) for h in history], **{k: float64(v) for k, v in kwargs.items()})  # fmt: skip
    assert len(got) == len(ref) == n_out and all(g is o for g, o in zip(got, out, strict=True))
    for name, g, r in zip(("x_next", "x0", "h1 -> h2", "xc -> aux"), got, ref, strict=False):
        assert g.dtype == dtype and g.stride() == t["x"].stride()
        err = rel_err(g, r)
        assert err < TOLERANCE[dtype], f"{name}: {err:.2e}"
    if clip_range is not None:
        assert got[1].abs().max().item() <= clip_range
    expected_input = torch.cat([got[0]] * (2 if guided else 1)).to(input_dtype)
    assert torch.equal(model_input, expected_input)  # the next model input: x_next cast, both CFG halves


def test_in_place_state_update_equals_functional() -> None:
    """out=(x, h1, h2, aux) aliasing the inputs updates the whole state as the functional call would."""
    t, coefs, _ = make_inputs((2, 3, 5, 6), torch.float32, 7, True, False)
    state = [t["x"].clone(), t["h1"].clone(), t["h2"].clone(), t["aux"].clone()]
    expected = sampler_step(*state[:1], t["model_output"], coefs, 2, *state[1:], noise=t["noise"])
    sampler_step(state[0], t["model_output"], coefs, 2, *state[1:], noise=t["noise"], out=tuple(state))
    for got, exp in zip(state, expected, strict=True):
        torch.testing.assert_close(got, exp, rtol=0, atol=0)


def test_seeded_noise_is_the_counter_draw_of_step_plus_one() -> None:
    """With only the noise term (F = 1), x_next is draw i + 1 of each image's seed: image b depends on seed b only."""
    shape = (3, 2, 5, 7)
    coefs = torch.zeros((9, len(COLUMNS)), device=DEVICE)
    coefs[:, COLUMNS.index("F")] = 1.0
    x = torch.randn(shape, device=DEVICE).contiguous(memory_format=torch.channels_last)
    seeds = torch.tensor([5, 2**40 + 3, 77], device=DEVICE)
    got = sampler_step(x, x, coefs, torch.tensor(4, device=DEVICE), seeds=seeds)[0]
    torch.testing.assert_close(got, gaussian_noise_ref(seeds, 5, shape[1:]), rtol=1e-5, atol=1e-5)
    alone = sampler_step(x[1:2], x[1:2], coefs, 4, seeds=seeds[1:2])[0]
    torch.testing.assert_close(alone, got[1:2], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("numel", "expected"),
    [
        pytest.param(3 * 32 * 32, 128, id="cifar_b1_24_programs"),
        pytest.param(4 * 64 * 64, 128, id="sd_latent_b1_128_programs"),
        pytest.param(100, 128, id="tiny_one_program"),
        pytest.param(256 * 3 * 32 * 32, 1024, id="cifar_b256_largest_block"),
        pytest.param(132 * 2 * 300, 512, id="between"),
    ],
)
def test_block_size(monkeypatch: pytest.MonkeyPatch, numel: int, expected: int) -> None:
    """Two programs per SM (132 SMs), each of 128..1024 elements."""
    monkeypatch.setattr(sampler_step_module, "num_sms", lambda device: 132)
    assert block_size(numel, torch.device("cpu")) == expected


def test_block_size_does_not_change_the_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every element is its own thread's work: the step with seeded noise gives the same bits at any block size
    (here 128 against 1024, with a ragged last program)."""
    t, coefs, _ = make_inputs((2, 3, 7, 9), torch.float32, 11, True, False)
    seeds = torch.tensor([4, 9], device=DEVICE)
    results = []
    for block in (128, 1024):
        monkeypatch.setattr(sampler_step_module, "block_size", lambda numel, device, block=block: block)
        results.append(sampler_step(t["x"], t["model_output"], coefs, 3, t["h1"], seeds=seeds, clip_range=1.0))
    for small, large in zip(*results, strict=True):
        torch.testing.assert_close(small, large, rtol=0, atol=0)


def test_registry_example_runs() -> None:
    args, kwargs = OP.example_inputs("small", torch.float32, DEVICE, 0)
    got = sampler_step(*args, **kwargs)
    ref = sampler_step_ref(*[float64(a) for a in args], **{k: float64(v) for k, v in kwargs.items()})
    for g, r in zip(got, ref, strict=True):
        assert rel_err(g, r) < 1e-6
    flops, moved = OP.cost(args, kwargs)
    assert flops >= 14 * args[0].numel() and moved >= 8 * args[0].numel() * 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"coefs": torch.zeros(3, 6)}, "coefs"),
        ({"i": 9}, "outside"),
        ({"clip_range": 0.0}, "clip_range"),
        ({"model_output": torch.zeros(2, 3, 4, 4)}, "model_output"),
        ({"h2": torch.zeros(1, 3, 4, 4)}, "h2"),
        ({"noise": torch.zeros(1, 3, 4, 4), "seeds": torch.zeros(1, dtype=torch.int64)}, "either noise or seeds"),
        ({"seeds": torch.zeros(2, dtype=torch.int64)}, "seeds"),
        ({"guidance": torch.ones(1)}, "model_output"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, message: str) -> None:
    args = {"x": torch.zeros(1, 3, 4, 4), "model_output": torch.zeros(1, 3, 4, 4),
            "coefs": torch.zeros(9, len(COLUMNS)), "i": 0} | kwargs  # fmt: skip
    args = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(FastdiffError, match=message):
        sampler_step(**args)


def test_model_input_must_be_dense_like_x_and_x_nonempty() -> None:
    t, coefs, _ = make_inputs((2, 3, 4, 5), torch.float32, 3, False, False)
    strided = torch.full((4, 3, 4, 5), float("nan"), device=DEVICE)[::2]  # right shape, every other row
    with pytest.raises(FastdiffError, match="model_input"):
        sampler_step(t["x"], t["model_output"], coefs, 0, model_input=strided)
    with pytest.raises(FastdiffError, match="empty"):
        sampler_step(t["x"][:0], t["model_output"][:0], coefs, 0)


def test_guidance_switch_off_takes_the_conditional_output() -> None:
    """A step whose W is 0 combines nothing: the step equals an unguided step on the conditional half."""
    t, coefs, _ = make_inputs((2, 3, 5, 6), torch.float32, 11, True, True)
    guidance = torch.tensor([3.0, 7.5], device=DEVICE)
    cond = t["model_output"][2:]
    for step in UNGUIDED_STEPS:
        got = sampler_step(t["x"], t["model_output"], coefs, step, t["h1"], guidance=guidance)
        alone = sampler_step(t["x"], cond, coefs, step, t["h1"])
        for g, a in zip(got, alone, strict=True):
            torch.testing.assert_close(g, a, rtol=1e-6, atol=1e-6)
    guided = sampler_step(t["x"], t["model_output"], coefs, 3, t["h1"], guidance=guidance)
    alone = sampler_step(t["x"], cond, coefs, 3, t["h1"])
    assert (guided[0] - alone[0]).abs().max() > 1e-2  # W = 1: the scales apply
