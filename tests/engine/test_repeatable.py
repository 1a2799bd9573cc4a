"""Every op of the engine's chosen step gives the same bytes when called again on the same inputs (GPU only): a
kernel that does not (a race) changes images between processes even with one kernel plan, and leaves the
candidates (``fastdiff.engine.candidates.NOT_REPEATABLE``)."""

from __future__ import annotations

import pytest
import torch

from fastdiff.engine import Engine
from fastdiff.engine.graph import channels_last_empty
from fastdiff.models import load_unet

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.slow,
]


@pytest.mark.parametrize("batch", [1, 256])
def test_every_chosen_op_repeats_bit_for_bit(batch):
    torch.manual_seed(0)
    unet = load_unet("ddpm-cifar10", device="cuda", dtype=torch.float16)
    fused = Engine("cuda").step_model(unet, batch, torch.float16)
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = channels_last_empty((batch, 3, 32, 32), torch.float16, torch.device("cuda"))
    x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
    fused.forward(x, torch.tensor([500], device="cuda"))
    moving = {}
    for op, call in zip(fused.step_ops, fused._calls, strict=True):
        call()
        first = fused.tensor(op.output).clone()
        for _ in range(3):
            call()
            if not torch.equal(first, fused.tensor(op.output)):
                moving[op.name] = fused.impls[op.name].name
                break
    assert not moving, f"ops whose output changes between identical calls: {moving}"
