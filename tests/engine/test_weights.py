"""Streamed weights: one event per module recorded after its copies; the first forward waits on each module's
own event right before that module's compute (early start), later forwards wait on nothing."""

from __future__ import annotations

import pytest
import torch

from fastdiff.engine.executor import FusedModel
from fastdiff.engine.graph import channels_last_empty
from fastdiff.engine.weights import RecordingBackend, WeightStreamer


def test_streamer_copies_and_keeps_layout():
    streamer = WeightStreamer("cpu", RecordingBackend())
    w = torch.randn(5, 3, 3, 3).contiguous(memory_format=torch.channels_last)
    out = streamer.submit("conv", {"weight": w, "bias": torch.randn(5)})
    assert torch.equal(out["weight"], w) and out["weight"].stride() == w.stride()
    assert [kind for kind, _ in streamer.backend.log] == ["copy", "copy", "record"]
    streamer.wait("conv")
    streamer.wait("conv")  # second wait is free
    assert streamer.backend.log[-1] == ("wait", 1) and len(streamer.backend.log) == 4


def test_first_forward_waits_per_module(tiny_model):
    """Module k: its copies, its event, a wait on that event only, its compute; then module k + 1."""
    backend = RecordingBackend()
    fused = FusedModel(tiny_model("attn_pad0", 3), 1, torch.float32, "cpu", "triton", "triton",
                      WeightStreamer("cpu", backend))  # fmt: skip
    assert backend.log == []  # nothing is uploaded before the first forward
    fused.call = lambda op, impl: lambda: backend.log.append(("compute", op.name))
    x_in = channels_last_empty(fused.x_in_value.shape, torch.float32, torch.device("cpu")).normal_()
    fused.forward_from_row(x_in)
    position = 0
    for op in fused.ops:
        copies = 0
        while backend.log[position][0] == "copy":
            copies += 1
            position += 1
        assert copies == len(fused.device_weights[op.name])  # one copy per weight tensor of the module
        record, wait, compute = backend.log[position : position + 3]
        assert record[0] == "record" and wait == ("wait", record[1]) and compute == ("compute", op.name)
        position += 3
    assert position == len(backend.log)
    start = len(backend.log)
    fused.forward_from_row(x_in)  # later forwards: no uploads, no waits
    assert backend.log[start:] == [("compute", op.name) for op in fused.ops]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_streamed_weights_arrive(tiny_model):
    model = tiny_model("attn_pad0", 4).cuda()
    fused = FusedModel(model, 2, torch.float16, "cuda", "triton", "triton")
    x = torch.randn(2, 3, 6, 10, device="cuda")
    x_in = channels_last_empty((2, 3, 6, 10), torch.float16, torch.device("cuda")).copy_(x)
    out = fused.forward(x_in, torch.tensor([10], device="cuda")).float()
    with torch.no_grad():
        ref = model(x, torch.tensor([10], device="cuda"))
    assert float((out - ref).norm() / ref.norm()) < 1e-2
