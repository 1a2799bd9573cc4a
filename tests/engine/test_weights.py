"""Streamed weights: one event per module recorded after its copies; the first forward waits on each module's
own event right before that module's compute (early start), later forwards wait on nothing."""

from __future__ import annotations

import pytest
import torch

from fastdiff.engine.executor import FusedModel
from fastdiff.engine.graph import channels_last_empty
from fastdiff.engine.weights import RecordingBackend, StagingRing, WeightStreamer


def test_streamer_copies_and_keeps_layout():
    streamer = WeightStreamer("cpu", RecordingBackend())
    w = torch.randn(5, 3, 3, 3).contiguous(memory_format=torch.channels_last)
    out = streamer.submit("conv", {"weight": w, "bias": torch.randn(5)})
    assert torch.equal(out["weight"], w) and out["weight"].stride() == w.stride()
    assert [kind for kind, _ in streamer.backend.log] == ["copy", "copy", "pack", "record"]
    streamer.wait("conv")
    streamer.wait("conv")  # second wait is free
    assert streamer.backend.log[-1] == ("wait", 1) and len(streamer.backend.log) == 5


def test_streamer_packs_the_uploaded_sources_after_their_copies():
    """Each source crosses once; the layouts are made from the uploaded copies, behind the copies, before the
    module's event."""
    from fastdiff.kernels.conv2d import pack_conv_weight

    streamer = WeightStreamer("cpu", RecordingBackend())
    w, b = torch.randn(5, 3, 3, 3), torch.randn(5)
    seen = {}

    def pack(uploaded):
        seen.update(uploaded)
        return {"packed": pack_conv_weight(uploaded["weight"]).half(), "weight": uploaded["weight"].half(),
                "bias": uploaded["bias"]}  # fmt: skip

    out = streamer.submit("conv", {"weight": w, "bias": b}, pack)
    assert [kind for kind, _ in streamer.backend.log] == ["copy", "copy", "pack", "record"]
    assert seen["weight"] is not w and torch.equal(seen["weight"], w)  # the upload, not the host tensor
    assert torch.equal(out["packed"], pack_conv_weight(w).half()) and torch.equal(out["bias"], b)
    assert streamer.bytes == (w.numel() + b.numel()) * 4  # the sources once, not the three layouts


def test_first_forward_waits_per_module(tiny_model):
    """Module k: its copies, its event, a wait on that event only, its compute; then module k + 1."""
    backend = RecordingBackend()
    fused = FusedModel(tiny_model("attn_pad0", 3), 1, torch.float32, "cpu", "triton", "triton",
                      WeightStreamer("cpu", backend))  # fmt: skip
    assert backend.log == []  # nothing is uploaded before the first forward
    fused.call = lambda op, impl: lambda: backend.log.append(("compute", op.name))
    sources = {op.name: sum(t is not None for t in op.weights.values()) for op in fused.ops}
    x_in = channels_last_empty(fused.x_in_value.shape, torch.float32, torch.device("cpu")).normal_()
    fused.forward_from_row(x_in)
    position = 0
    for op in fused.ops:
        copies = 0
        while backend.log[position][0] == "copy":
            copies += 1
            position += 1
        assert copies == sources[op.name]  # one copy per source tensor of the module, however many layouts
        pack, record, wait, compute = backend.log[position : position + 4]
        assert pack[0] == "pack" and record[0] == "record" and wait == ("wait", record[1])
        assert compute == ("compute", op.name)
        position += 4
    assert position == len(backend.log)
    start = len(backend.log)
    fused.forward_from_row(x_in)  # later forwards: no uploads, no waits
    assert backend.log[start:] == [("compute", op.name) for op in fused.ops]


class LateCopyEngine:
    """A copy engine that runs the copies queued from staged memory only when the host waits for their event: any
    write into a staging chunk before that would reach the device."""

    def __init__(self) -> None:
        self.queued: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device tensor, staged source)
        self.done = 0
        self.waits = 0

    def record(self) -> int:
        return len(self.queued)

    def wait_host(self, event: int) -> None:
        self.waits += 1
        for dst, src in self.queued[self.done : event]:
            dst.copy_(src)
        self.done = max(self.done, event)


@pytest.mark.parametrize(
    "tensor",
    [
        pytest.param(lambda g: torch.randn(7, 5, 3, 3, generator=g).half(), id="fp16_odd_bytes"),
        pytest.param(
            lambda g: torch.randn(6, 4, 3, 3, generator=g).contiguous(memory_format=torch.channels_last),
            id="fp32_channels_last",
        ),
        pytest.param(lambda g: torch.randn(9, 13, generator=g).t(), id="transposed_view"),
        pytest.param(lambda g: torch.randn(33, generator=g).to(torch.float8_e4m3fn), id="fp8"),
        pytest.param(lambda g: torch.randn(700, generator=g), id="larger_than_a_chunk"),
    ],
)
def test_staging_ring_never_overwrites_a_chunk_before_its_copies_ran(tensor):
    """Many uploads through a ring of 2 chunks of 1 KiB: each staged copy keeps its shape and strides (contiguous or
    channels-last ones) and every upload lands with its own bytes although the copies run late (only when the host
    waits for them)."""
    g = torch.Generator().manual_seed(0)
    engine = LateCopyEngine()
    ring = StagingRing(lambda n: torch.full((n,), 0xFF, dtype=torch.uint8), engine.record, engine.wait_host, 1024, 2)
    sources = [tensor(g) for _ in range(12)]
    uploads = []
    for src in sources:
        staged = ring.stage(src)
        assert staged.shape == src.shape and torch.equal(staged.float(), src.float())
        if src.is_contiguous() or src.is_contiguous(memory_format=torch.channels_last):
            assert staged.stride() == src.stride()
        dst = torch.empty_like(staged)
        engine.queued.append((dst, staged))
        uploads.append(dst)
    engine.wait_host(len(engine.queued))  # the streamer's synchronize
    ring.release()
    assert all(torch.equal(dst.float(), src.float()) for dst, src in zip(uploads, sources, strict=True))
    big = sources[0].numel() * sources[0].element_size() > 1024
    assert engine.waits > 1 or big  # the ring did wrap and wait (a tensor over a chunk gets its own memory)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_cuda_streamed_weights_arrive(tiny_model, dtype):
    """A model already on the GPU: packed from its own tensors there, and no layout shares their memory (in fp32 the
    norms' and biases' packing is the identity, which must be a copy)."""
    model = tiny_model("attn_pad0", 4).cuda()
    fused = FusedModel(model, 2, dtype, "cuda", "triton", "triton")
    x = torch.randn(2, 3, 6, 10, device="cuda")
    x_in = channels_last_empty((2, 3, 6, 10), dtype, torch.device("cuda")).copy_(x)
    out = fused.forward(x_in, torch.tensor([10], device="cuda")).float()
    with torch.no_grad():
        ref = model(x, torch.tensor([10], device="cuda"))
    assert float((out - ref).norm() / ref.norm()) < 1e-2  # fp16, or fp32 with tf32 dots
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert not any(t.untyped_storage().data_ptr() in params for w in fused.device_weights.values() for t in w.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_uploads_never_get_a_block_the_compute_stream_just_freed():
    """The caching allocator gives a block that the compute stream freed straight back to the next allocation on that
    stream, whose queued kernels may still use it. The copy stream does not wait for them, so an upload there could
    land under a pending kernel. The streamer's device tensors come from the copy stream's pool instead."""
    from fastdiff.engine.weights import CudaBackend

    device = torch.device("cuda")
    n = 3 << 20
    freed = torch.empty(n, device=device)
    address = freed.data_ptr()
    del freed  # on the compute stream, as a temporary of a queued kernel would be
    upload = CudaBackend(device).allocate(torch.empty(n, pin_memory=True), device)
    assert upload.data_ptr() != address
    assert torch.empty(n, device=device).data_ptr() == address  # (the control: the compute stream reuses it)


@pytest.mark.parametrize("source", [torch.float16, torch.bfloat16, torch.float32])
def test_packing_from_the_model_dtype_gives_the_fp32_copys_bytes(source):
    """The lowering keeps conv and GEMM weights in the model's dtype: every layout (our conv's, the Upsample2D phase
    form, cuDNN's, the tap-sum form, Downsample2D's padded one, a GEMM's) packed from them has the bytes the
    packing of an fp32 copy of them gives, in the engine's fp16 and fp32."""
    import dataclasses

    from fastdiff.engine.ir import GraphBuilder
    from fastdiff.engine.weights import packed_weights

    torch.manual_seed(0)
    graph = GraphBuilder(2, 8, 8)
    x = graph.value("x", 6, 8, 8)
    convs = {"up": dict(upsample=2), "down": dict(downsample_pad0=True), "plain": {}}
    for name, kw in convs.items():
        conv = torch.nn.Conv2d(6, 5, 3, stride=2 if name == "down" else 1, padding=0 if name == "down" else 1)
        graph.conv(name, conv.to(source), x, **kw)
    linear = torch.nn.Linear(6, 8).to(source)
    graph.linear("ff", linear.weight, linear.bias, x, geglu=True)
    cuda = torch.device("cuda")  # the phase form is packed for CUDA engines only
    for op in graph.ops:
        fp32 = dataclasses.replace(op, weights={k: v.float() for k, v in op.weights.items()})
        for dtype in (torch.float16, torch.float32):
            got = packed_weights(op, op.weights, dtype, cuda, "auto", taps=op.kind == "conv")
            want = packed_weights(fp32, fp32.weights, dtype, cuda, "auto", taps=op.kind == "conv")
            assert set(got) == set(want) and len(got) >= 2, op.name
            for role in got:
                assert got[role].dtype == want[role].dtype and torch.equal(got[role], want[role]), (op.name, role)
