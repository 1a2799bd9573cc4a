"""Helpers every kernel module shares: the fused activations (codes, Triton and torch forms), the SM count that
sizes launch grids, programmatic dependent launch, the scratch of reductions split over programs, the GroupNorm
partials a conv's epilogue writes for the norm of its output, and channels-last example tensors."""

from __future__ import annotations

import functools
import os
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

from fastdiff.errors import FastdiffError

ACTIVATIONS: dict[str | None, int] = {None: 0, "silu": 1, "gelu": 2, "relu": 3}
"""Activation name -> the constexpr code the kernels branch on (:func:`apply_activation`)."""


def check_activation(activation: str | None) -> int:
    """The kernel code of ``activation``; a FastdiffError for a name not in ``ACTIVATIONS``."""
    if activation not in ACTIVATIONS:
        raise FastdiffError(f"unknown activation {activation!r}; expected one of {list(ACTIVATIONS)}")
    return ACTIVATIONS[activation]


@triton.jit
def apply_activation(y, ACT: tl.constexpr):
    """``y`` (fp32) through the activation of code ``ACT``: 0 none, 1 SiLU, 2 GELU (exact, erf), 3 ReLU."""
    if ACT == 1:
        y = y / (1.0 + tl.exp(-y))
    elif ACT == 2:
        y = 0.5 * y * (1.0 + tl.math.erf(y * 0.7071067811865476))
    elif ACT == 3:
        y = tl.maximum(y, 0.0)
    return y


def activation_ref(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The fused activations in plain torch (gelu is the exact erf form)."""
    check_activation(activation)
    if activation == "silu":
        return F.silu(y)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "relu":
        return F.relu(y)
    return y


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere.

    The interpreter runs programs one by one, so the fewest, largest programs are fastest there.
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


PDL_ENV = "FASTDIFF_PDL"
"""Set to ``0`` to launch every kernel without programmatic dependent launch (the A/B switch of the benches)."""


@functools.cache
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with programmatic dependent launch (PDL; Hopper and newer, unless
    ``FASTDIFF_PDL=0``): the GPU may launch a kernel as the programs of the one before it in the stream exit,
    without the full drain and launch gap in between; the kernel runs :func:`grid_dependency_sync` before
    touching memory. It counts where a step is ~120 small kernels in one CUDA graph (batch 1; docs/engine/pdl.md)."""
    if device.type != "cuda" or os.environ.get(PDL_ENV, "1") == "0":
        return False
    return _supports_pdl(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """The launch arguments of a kernel that takes ``PDL`` (see :func:`programmatic_launch`)."""
    pdl = programmatic_launch(device)
    return {"PDL": pdl, "launch_pdl": pdl}


@triton.jit
def grid_dependency_sync(PDL: tl.constexpr):
    """The first statement of every kernel the package launches (``PDL``: launched with ``launch_pdl=True``):
    waits until the kernel before it in the stream has finished and its writes are visible. Each kernel waiting
    for its predecessor makes the order transitive: nothing is read or written before every earlier kernel is
    done. A no-op without PDL (and in the interpreter).

    The kernels do not signal their dependents early (``gdc_launch_dependents`` at their start): that lets the
    waiting programs of the next kernels fill the GPU ahead of time, and in a development A/B on the H100 (batch-1
    step, not a committed result) it was slower than no PDL at all: 0.854 ms per step against 0.726-0.745."""
    if PDL:
        tl_cuda.gdc_wait()


@dataclass(eq=False)
class SplitWorkspace:
    """Scratch of a kernel that splits a reduction over several programs and finishes it in the same launch (the
    split-K conv): ``partials`` (fp32, each program's part) and ``counters`` (int32, one
    per finished unit, zero between calls: the last program to arrive resets its own). Allocated by the first call
    that needs more than it holds and reused while the sizes stay (CUDA-graph safe: let the first call run before
    capture). One workspace serves one kernel at a time: give kernels that may run concurrently (on other streams)
    their own."""

    partials: torch.Tensor | None = field(default=None, repr=False)
    counters: torch.Tensor | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def reserve(self, partial_elems: int, counters: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(partials, counters) holding at least ``partial_elems`` fp32 partials and ``counters`` counters on
        ``device``: the buffers only grow, and check and growth are one step, so a launch from another host thread
        (the engine's concurrent first launches) never gets a buffer that a smaller request replaced."""
        with self._lock:
            if self.partials is None or self.partials.numel() < partial_elems or self.partials.device != device:
                self.partials = torch.empty(partial_elems, device=device, dtype=torch.float32)
            if self.counters is None or self.counters.numel() < counters or self.counters.device != device:
                self.counters = torch.zeros(counters, device=device, dtype=torch.int32)
            return self.partials, self.counters


@dataclass(eq=False)
class GroupNormPartials:
    """Partial GroupNorm statistics of a conv's output, written by the conv's epilogue for the norm that reads that
    output: ``conv2d(..., stats=p)`` fills ``partials`` (fp32 [N, G, row-tile slots, channel-tile parts, (count,
    mean, M2)], laid out by that call's tiles, kept in ``tiles``: (BLOCK_M, BLOCK_N, Ho*Wo, Cout)), and
    ``group_norm_act(y, ..., stats=p)`` merges them per program while it normalises: one pass over ``y`` instead
    of a statistics pass and an output pass (the engine's ``-st`` convs and ``apply`` norms,
    ``fastdiff.engine.epilogue_norm``). ``groups`` is the norm's. The buffer is allocated by the first conv call
    and reused while the shapes stay the same (CUDA-graph safe)."""

    groups: int
    partials: torch.Tensor | None = field(default=None, init=False, repr=False)
    tiles: tuple[int, int, int, int] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise FastdiffError(f"GroupNorm groups must be a positive int, got {self.groups!r}")

    def check_channels(self, channels: int) -> None:
        """FastdiffError unless the norm's groups divide ``channels``."""
        if channels % self.groups:
            raise FastdiffError(f"stats: {self.groups} GroupNorm groups do not divide {channels} channels")


@triton.jit
def finish_arrival(count_ptr, unit, SPLIT: tl.constexpr):
    """Counts a program in at ``count_ptr[unit]`` after all of its threads stored their partials (release); True
    in the last of the unit's SPLIT programs, which may then read every partial (acquire). That program must
    reset the counter with :func:`reset_arrivals` once it has read them."""
    tl.debug_barrier()  # every thread's partial is stored before the counter moves
    arrived = tl.atomic_add(count_ptr + unit, 1, sem="acq_rel", scope="gpu")
    return arrived == SPLIT - 1


@triton.jit
def reset_arrivals(count_ptr, unit):
    """The last program of a unit sets its counter back to 0 for the next launch."""
    tl.atomic_xchg(count_ptr + unit, 0, sem="relaxed", scope="gpu")


def channels_last_randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: str | torch.device, gen: torch.Generator
) -> torch.Tensor:
    """Standard-normal [N, C, H, W] tensor (drawn on the CPU for reproducibility) in channels-last memory."""
    t = torch.randn(shape, generator=gen, dtype=torch.float32)
    return t.to(device=device, dtype=dtype).contiguous(memory_format=torch.channels_last)
