"""The engine's weights: uploaded once from the lowering's source tensors (:class:`WeightStreamer`), packed on the
device into each kernel's layout (:func:`packed_weights`), and the layouts each implementation reads
(:func:`weight_roles`).

Streamed weight upload: pinned host copies, one copy stream, one event per module, per-module waits.

``submit(module, sources, pack)`` allocates the device tensors of ``sources`` (from the copy stream's memory pool:
``CudaBackend.allocate``), queues their host->device copies on the copy stream (from pinned memory, so they run
asynchronously: a few pinned chunks reused as the copies drain them, :class:`StagingRing`), queues ``pack`` (the
layouts the kernels read, made from the uploaded sources: transposes, casts, fp8 scales) on the copy stream behind
them, and records that module's event. Packing on the device costs the host nothing: on the host it took 0.6 s of a
warm SD 1.5 start on the H100 (``contiguous`` of 760 layouts, git cf9cc86, ``benchmarks/ready.py --profile``), and
each source crosses PCIe once however many layouts are made of it. The first forward calls ``wait(module)`` right
before each module's compute: the compute stream then waits only for that module's own weights, so the first layers
run while later layers' weights are still in flight (early start). On the CPU, copies and packing are synchronous
and waits are no-ops.

The stream and event calls go through a small backend object so the ordering is testable without a GPU
(:class:`RecordingBackend`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fastdiff.devices import normalize_device
from fastdiff.engine.impl import Impl
from fastdiff.engine.ir import Op
from fastdiff.kernels.conv2d import pack_conv_weight
from fastdiff.kernels.conv2d_tma import pack_conv_weight_fp8, pack_upsample2_weight
from fastdiff.kernels.depthwise_conv2d import pack_depthwise_weight
from fastdiff.kernels.linear import pack_linear_weight, pack_linear_weight_fp8
from fastdiff.kernels.tap_sum_conv2d import pack_tap_weight

log = logging.getLogger(__name__)

Pack = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
"""Makes the layouts the kernels read from a module's uploaded source tensors (role -> tensor both ways)."""


class StagingRing:
    """Pinned host memory for uploads, reused: ``chunks`` buffers of ``chunk_bytes``, filled one after another; a
    chunk's copies are marked by one event (``record``) when the ring moves past it, and the host waits for that event
    (``wait_host``) before it writes the chunk again. A tensor larger than a chunk gets pinned memory of its own.

    Pinning is what costs: page-locking each weight's own buffer took 0.9 s of a warm SD 1.5 start on the H100
    (1.55 GiB in 569 buffers, git 2d664ef), and freeing them again 0.3 s; here ``chunks x chunk_bytes`` are pinned
    once per streamer. ``pinned(nbytes)`` gives a uint8 buffer (``torch.empty(..., pin_memory=True)`` on CUDA)."""

    ALIGN = 512

    def __init__(
        self,
        pinned: Callable[[int], torch.Tensor],
        record: Callable[[], Any],
        wait_host: Callable[[Any], None],
        chunk_bytes: int = 64 << 20,
        chunks: int = 3,
    ) -> None:
        self._pinned, self._record, self._wait_host = pinned, record, wait_host
        self.chunk_bytes, self.chunks = chunk_bytes, chunks
        self._buffers: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._current = self._offset = 0

    def stage(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned copy of the host tensor ``t`` (same shape and strides) that stays valid until the copy queued
        from it right after this call has run (the next ``stage`` calls may record and wait in between)."""
        if not (t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))):
            t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        if nbytes > self.chunk_bytes:
            own = self._pinned(nbytes)
            return self._view(own, t).copy_(t)
        if not self._buffers or self._offset + nbytes > self.chunk_bytes:
            self._next_chunk()
        buffer = self._buffers[self._current][self._offset : self._offset + nbytes]
        self._offset += -(-nbytes // self.ALIGN) * self.ALIGN
        return self._view(buffer, t).copy_(t)

    def _next_chunk(self) -> None:
        if self._buffers:  # the copies queued from the chunk being left: one event after them
            self._events[self._current] = self._record()
            self._current = (self._current + 1) % self.chunks
        if self._current == len(self._buffers):
            self._buffers.append(self._pinned(self.chunk_bytes))
            self._events.append(None)
        elif self._events[self._current] is not None:  # its earlier copies must have run before it is written
            self._wait_host(self._events[self._current])
            self._events[self._current] = None
        self._offset = 0

    @staticmethod
    def _view(buffer: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return buffer[: t.numel() * t.element_size()].view(t.dtype).as_strided(t.shape, t.stride())

    def release(self) -> None:
        """Drop the chunks (call once every copy from them has run)."""
        self._buffers.clear()
        self._events.clear()
        self._current = self._offset = 0


class CudaBackend:
    """Copies on a dedicated CUDA stream from a :class:`StagingRing`; events recorded there; waits on the current
    stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.ring = StagingRing(
            lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
            self.record,
            torch.cuda.Event.synchronize,
        )

    def allocate(self, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A tensor on ``device`` (this backend's) for ``like``'s upload, from the copy stream's pool. A block the
        compute stream freed may still be read or written by its queued kernels, which the copy stream does not
        wait for; the caching allocator hands such a block back at once to the stream that freed it. (Only the copy
        stream uses the upload, unless ``pack`` hands it over as it is: see :meth:`pack`.)"""
        with torch.cuda.stream(self.stream):
            return torch.empty_like(like, device=device)  # same strides (channels-last stays)

    def pack(self, pack: Pack, sources: dict[str, torch.Tensor], resident: bool) -> dict[str, torch.Tensor]:
        """``pack(sources)`` queued on the copy stream, behind the copies. ``resident``: some sources were on the
        device before (made by the compute stream): the copy stream waits for the compute stream's work first, and
        marks them as read on the copy stream. The packed tensors are marked as used by the compute stream, so that
        once freed, their blocks wait for its work before the copy stream's pool gives them out again."""
        compute = torch.cuda.current_stream(self.device)
        if resident:
            self.stream.wait_stream(compute)
            for t in sources.values():
                t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            out = pack(sources)
        for t in out.values():
            t.record_stream(compute)
        return out

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def record(self) -> Any:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        """Wait for every copy; the staging chunks are then free to go."""
        self.stream.synchronize()
        self.ring.release()

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return self.ring.stage(t)  # same strides: a channels-last weight stays channels-last


class SyncBackend:
    """CPU (or no streams): plain copies, packing at once; nothing to wait for."""

    def allocate(self, like: torch.Tensor, device: torch.device) -> torch.Tensor:
        return torch.empty_like(like, device=device)  # same strides (channels-last stays)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def pack(self, pack: Pack, sources: dict[str, torch.Tensor], resident: bool) -> dict[str, torch.Tensor]:
        return pack(sources)

    def record(self) -> Any:
        return None

    def wait(self, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t


class RecordingBackend(SyncBackend):
    """Logs ("copy", tag) / ("pack", roles) / ("record", n) / ("wait", n) in call order: for ordering tests."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []
        self._events = 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        super().copy(dst, src)
        self.log.append(("copy", src.data_ptr()))

    def pack(self, pack: Pack, sources: dict[str, torch.Tensor], resident: bool) -> dict[str, torch.Tensor]:
        self.log.append(("pack", tuple(sources)))
        return super().pack(pack, sources, resident)

    def record(self) -> Any:
        self._events += 1
        self.log.append(("record", self._events))
        return self._events

    def wait(self, event: Any) -> None:
        self.log.append(("wait", event))


class WeightStreamer:
    """Per-module host->device weight upload with one event per module (see the module docstring)."""

    def __init__(self, device: torch.device | str, backend: Any | None = None) -> None:
        self.device = normalize_device(device)
        if backend is None:
            backend = CudaBackend(self.device) if self.device.type == "cuda" else SyncBackend()
        self.backend = backend
        self.events: dict[str, Any] = {}
        self._staging: list[torch.Tensor] = []  # pinned sources of copies in flight (freed by wait_all)
        self.order: list[str] = []
        self.bytes = 0
        self.started = time.perf_counter()

    def submit(
        self, module: str, sources: dict[str, torch.Tensor],
        pack: Pack | None = None,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """``pack`` (default: none) of ``sources`` uploaded to the device: device tensors for ``module``, filled
        asynchronously, and the module's event recorded after them. Sources already on the device (a Pipeline's
        model on the GPU) are not streamed, and what ``pack`` would hand over of them as they are is copied, so
        that the engine never shares memory with the model."""
        uploaded, resident = {}, []
        for role, host in sources.items():
            if host.device.type == "cuda":  # already on the GPU: nothing to stream
                uploaded[role] = host
                resident.append(host.untyped_storage().data_ptr())
                continue
            pinned = self.backend.pin(host)
            dev = self.backend.allocate(pinned, self.device)
            self.backend.copy(dev, pinned)
            self._staging.append(pinned)
            self.bytes += pinned.numel() * pinned.element_size()
            uploaded[role] = dev

        def packed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            out = pack(tensors) if pack is not None else dict(tensors)
            return {k: v.clone() if v.untyped_storage().data_ptr() in resident else v for k, v in out.items()}

        out = self.backend.pack(packed, uploaded, bool(resident))
        self.events[module] = self.backend.record()
        self.order.append(module)
        return out

    def wait(self, module: str) -> None:
        """Make the current stream wait for ``module``'s weights (once; later calls are free)."""
        event = self.events.pop(module, None)
        if event is not None:
            self.backend.wait(event)

    def wait_all(self) -> None:
        """Make the current stream wait for every module still pending; then release the pinned staging copies
        (the host waits for the copy stream first)."""
        for module in list(self.events):
            self.wait(module)
        self.backend.synchronize()
        self._staging.clear()


def packed_weights(
    op: Op,
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    conv_impl: str,
    taps: bool,
    roles: set[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The layouts the kernels read of ``op``'s ``weights`` (the lowering's sources, ``op.weights``, or their
    uploaded copies: conv and GEMM weights in the model's dtype, the rest fp32), packed where they are, in the
    engine ``dtype`` (sums and scales in fp32): those of every implementation ``conv_impl`` allows ("auto": ours and
    the library's; ``taps``: the op may run the tap-sum conv), or only ``roles`` (:data:`WEIGHT_ROLES`' names) where
    the implementations are known (a kernel plan's). ``device``: the engine's (the phase form is CUDA's only)."""

    def want(role: str) -> bool:
        return roles is None or role in roles

    out: dict[str, torch.Tensor] = {}
    triton_too, library_too = conv_impl in ("auto", "triton"), conv_impl in ("auto", "cudnn")
    if op.kind == "conv" and "fp8_scale" in op.params:  # e4m3 [Cout, K] and (input scale x channel scales)
        out["packed_fp8"], scale = pack_conv_weight_fp8(weights["weight"])
        out["weight_scale"] = scale * op.params["fp8_scale"]
        if "bias" in weights:
            out["bias"] = weights["bias"].to(dtype)
    elif op.kind == "conv":
        weight = weights["weight"]
        if triton_too:
            if want("packed"):
                out["packed"] = pack_conv_weight(weight).to(dtype)
            if op.params["upsample"] == 2 and weight.shape[-1] == 3 and device.type == "cuda" and want("packed_up2"):
                out["packed_up2"] = pack_upsample2_weight(weight.float()).to(dtype)  # conv2d_tma's phase form
            if taps and want("packed_taps"):  # tap_sum_conv2d's [Cin, K*K*Cout] (and the raw weight for its shape)
                out["packed_taps"] = pack_tap_weight(weight).to(dtype)
                library_too = True
        if library_too and want("weight"):
            if "pad_end" in op.params:  # padding (p, p + 1) == a zero first tap row and column, padding p + 1
                weight = F.pad(weight, (1, 0, 1, 0))
            out["weight"] = weight.to(dtype).contiguous(memory_format=torch.channels_last)
        if "bias" in weights:
            out["bias"] = weights["bias"].to(dtype)
    elif op.kind == "linear" and "fp8_scale" in op.params:  # e4m3 [N_w, K] and (input scale x row scales)
        out["packed_fp8"], scale = pack_linear_weight_fp8(weights["weight"])
        out["weight_scale"] = scale * op.params["fp8_scale"]
        if "bias" in weights:
            out["bias"] = weights["bias"].to(dtype)
    elif op.kind == "linear":  # one layout, W^T [K, N], read by both kernels.linear and cuBLAS
        out["packed"] = pack_linear_weight(weights["weight"], op.params["geglu"]).to(dtype)
        if "bias" in weights:
            out["bias"] = weights["bias"].to(dtype)
    elif op.kind == "depthwise":
        weight = weights["weight"]
        if triton_too and want("packed"):
            out["packed"] = pack_depthwise_weight(weight).to(dtype)
        if library_too and want("weight"):
            out["weight"] = weight.to(dtype).contiguous(memory_format=torch.channels_last)
    elif op.kind in ("group_norm", "layer_norm", "gate"):
        out = {k: v.to(dtype) for k, v in weights.items() if v is not None}
    return out


WEIGHT_ROLES: dict[tuple[str, str, bool], set[str]] = {
    ("conv", "triton", False): {"packed", "bias"},
    ("conv", "triton-tma", False): {"packed", "packed_up2", "bias"},
    ("conv", "triton-tma", True): {"packed_fp8", "weight_scale", "bias"},
    ("conv", "triton-taps", False): {"weight", "packed_taps", "bias"},
    ("conv", "gluon", False): {"packed", "bias"},
    ("conv", "cudnn", False): {"weight", "bias"},
    ("conv", "fused", False): {"packed", "bias"},  # a shortcut summed in its conv2, which reads them
    ("depthwise", "triton", False): {"packed"},
    ("depthwise", "cudnn", False): {"weight"},
    ("linear", "triton", False): {"packed", "bias"},
    ("linear", "triton-tma", False): {"packed", "bias"},
    ("linear", "triton-tma", True): {"packed_fp8", "weight_scale", "bias"},
    ("linear", "cublas", False): {"packed", "bias"},
}
"""(op kind, kernel, fp8) -> the device weight layouts an implementation reads (the others are dropped after the
autotune); any split or fusion form reads its kernel's."""


def weight_roles(kind: str, impl: Impl) -> set[str] | None:
    """The weight layouts an op of ``kind`` reads on ``impl``; None: all it has."""
    return WEIGHT_ROLES.get((kind, impl.kernel, impl.fp8))


def roles_of(kind: str, impls: list[Impl]) -> set[str] | None:
    """The weight layouts an op of ``kind`` needs to run each of ``impls``; None: all it has."""
    roles: set[str] = set()
    for impl in impls:
        reads = weight_roles(kind, impl)
        if reads is None:
            return None
        roles |= reads
    return roles
