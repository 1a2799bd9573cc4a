"""Devices, dtypes and timing: the names users pass ("auto", "cuda:1", "fp16") and the one timer every
measurement uses."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from fastdiff.errors import FastdiffError

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""The model dtypes fastdiff runs, by their command-line names."""


def resolve_device(device: str | torch.device) -> torch.device:
    """ "auto" -> cuda if available else cpu; a CUDA device this machine does not have is an error."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise FastdiffError(f"unknown device {device!r}: use auto, cpu, cuda or cuda:N") from exc
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (dev.index or 0) >= count:
            found = "no CUDA GPU is available" if count == 0 else f"this machine has {count} CUDA GPU(s)"
            raise FastdiffError(f"device {device} was asked for but {found} (use --device cpu or auto)")
    if dev.type not in ("cpu", "cuda"):
        raise FastdiffError(f"unsupported device {device!r}: use auto, cpu, cuda or cuda:N")
    return dev


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """ "fp32"/"fp16"/"bf16" (or a torch dtype among those) -> torch dtype."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype in DTYPES:
        return DTYPES[dtype]
    raise FastdiffError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")


def warn_slow_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """Log one warning when a model is to run in fp16 or bf16 on the CPU: PyTorch's CPU convolutions and matmuls
    in those dtypes are many times slower than in fp32, which is the CPU's fast path (the run goes on as asked)."""
    names = {torch.float16: "fp16", torch.bfloat16: "bf16"}
    if device.type == "cpu" and dtype in names:
        log.warning(
            "%s on the CPU is slow (many times slower than fp32, the CPU's fast path): use dtype fp32 there",
            names[dtype],
        )


def rank_device(device: str, flag: str) -> str:
    """The device of a torchrun process: ``device`` "auto" (a GPU if present, else the CPU) or "cuda" means
    ``cuda:LOCAL_RANK`` (made the current device), "cpu" stays; anything else is a one-line error naming ``flag``
    (the option that launched the processes)."""
    import os

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if local_rank >= torch.cuda.device_count():
            raise FastdiffError(f"LOCAL_RANK {local_rank} but {torch.cuda.device_count()} CUDA GPUs are visible")
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    if device != "cpu":
        raise FastdiffError(f"{flag} takes --device auto, cuda or cpu (rank r takes GPU r), got {device}")
    return device


def normalize_device(device: torch.device | str) -> torch.device:
    """``device`` with an explicit index for CUDA ("cuda" -> "cuda:<current>"), so it compares equal to
    tensors' devices."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def host_to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small CPU tensor (seeds, guidance scales) on ``device`` without waiting for the GPU: ``.to("cuda")`` of
    pageable memory synchronizes the stream, i.e. waits for every kernel queued before it, so the host could not
    prepare the next batch while the GPU runs this one. Here it goes through pinned memory, copied asynchronously
    (the caching host allocator keeps the pinned block until the copy is done)."""
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall time of ``fn()`` in ms: CUDA events on the GPU (warm up before calling), perf_counter on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3
