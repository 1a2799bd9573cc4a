"""Memory plan: every activation buffer of one forward gets an offset in a single arena, computed once.

Input: buffers with a byte size and an inclusive lifetime ``[first, last]`` in op indices (a buffer is live
from the op that first writes it to the op that last reads it). Two buffers may share bytes only if their
lifetimes are disjoint. Placement is greedy by size (largest first, each at the lowest aligned offset that
overlaps no already placed buffer with an intersecting lifetime; Pisarchyk & Lee 2020, "greedy by size"), so
the arena is at least the largest live set and at most the sum of all sizes.

Zero-copy concat lives one level up (``fastdiff.engine.executor``): a concat input is a channel slice of the
concat's buffer, so only the concat buffer is planned, with a lifetime covering all its parts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fastdiff.errors import FastdiffError

log = logging.getLogger(__name__)

ALIGNMENT = 256
"""Byte alignment of every buffer (covers 16-byte vector loads and the allocator's own 256-byte granule)."""


@dataclass(frozen=True)
class BufferSpec:
    """One buffer to place: ``nbytes`` live over ops ``first..last`` (inclusive)."""

    name: str
    nbytes: int
    first: int
    last: int


@dataclass(frozen=True)
class MemoryPlan:
    """Offsets of every buffer in one arena of ``peak_bytes`` bytes."""

    offsets: dict[str, int]
    specs: dict[str, BufferSpec]
    peak_bytes: int
    alignment: int

    @property
    def total_bytes(self) -> int:
        """Bytes if every buffer had its own allocation (the no-reuse baseline)."""
        return sum(_aligned(s.nbytes, self.alignment) for s in self.specs.values())

    def tensor(
        self, arena: torch.Tensor, name: str, shape: tuple[int, int, int, int], dtype: torch.dtype
    ) -> torch.Tensor:
        """Buffer ``name`` as a logical ``[N, C, H, W]`` channels-last tensor viewing ``arena`` (uint8)."""
        n, c, h, w = shape
        nbytes = n * c * h * w * dtype.itemsize
        if nbytes > self.specs[name].nbytes:
            raise FastdiffError(f"buffer {name}: shape {shape} needs {nbytes} bytes, planned {self.specs[name].nbytes}")
        start = self.offsets[name]
        flat = arena[start : start + nbytes].view(dtype)
        return flat.view(n, h, w, c).permute(0, 3, 1, 2)


def _aligned(nbytes: int, alignment: int) -> int:
    return (nbytes + alignment - 1) // alignment * alignment


def plan_memory(specs: list[BufferSpec], alignment: int = ALIGNMENT) -> MemoryPlan:
    """Greedy-by-size placement of ``specs`` (see the module docstring)."""
    by_name: dict[str, BufferSpec] = {}
    for spec in specs:
        if spec.name in by_name:
            raise FastdiffError(f"buffer {spec.name!r} planned twice")
        if spec.nbytes < 0 or spec.first > spec.last:
            raise FastdiffError(f"buffer {spec.name!r}: bad size {spec.nbytes} or lifetime {spec.first}..{spec.last}")
        by_name[spec.name] = spec
    placed: list[tuple[int, int, BufferSpec]] = []  # (offset, aligned size, spec)
    offsets: dict[str, int] = {}
    peak = 0
    for spec in sorted(specs, key=lambda s: (-s.nbytes, s.first, s.name)):
        size = _aligned(spec.nbytes, alignment)
        conflicts = sorted(
            (off, off + sz) for off, sz, other in placed if other.first <= spec.last and spec.first <= other.last
        )
        offset = 0
        for start, end in conflicts:  # first gap (in address order) wide enough
            if start - offset >= size:
                break
            offset = max(offset, end)
        offsets[spec.name] = offset
        placed.append((offset, size, spec))
        peak = max(peak, offset + size)
    plan = MemoryPlan(offsets, by_name, peak, alignment)
    log.debug("memory plan: %d buffers, peak %d bytes (no reuse: %d)", len(specs), peak, plan.total_bytes)
    return plan


def max_live_bytes(specs: list[BufferSpec], alignment: int = ALIGNMENT) -> int:
    """The largest total (aligned) size of buffers live at one op: a lower bound for any plan's peak."""
    if not specs:
        return 0
    events = sorted({s.first for s in specs})
    return max(sum(_aligned(s.nbytes, alignment) for s in specs if s.first <= t <= s.last) for t in events)
