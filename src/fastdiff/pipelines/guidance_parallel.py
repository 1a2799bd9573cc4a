"""Classifier-free guidance split over two processes (xDiT's "CFG parallel"): one image's two U-Net halves at once.

With guidance, every step runs the U-Net on [x; x] against [uncond; cond] text states (2B rows) and the sampler step
combines the halves. ``GuidanceSplit`` runs rows 0..B-1 (unconditional) on rank 0 and B..2B-1 (conditional) on rank 1
of a two-process ``torch.distributed`` group, and gathers the two outputs on both ranks (``all_gather``), so both
hold the whole model output and take the same sampler step: their states, and so their images, are the same bytes.
Against one process the difference is only what the U-Net's kernels give at batch B instead of 2B (on the CPU, GEMMs
may round differently by batch size; ``tests/test_guidance_parallel.py`` bounds it).

On the eager backend this module's ``GuidanceSplit.wrap`` gathers the halves; on the engine
(``TextToImagePipeline.split_guidance`` with backend "engine") ``fastdiff.engine.GuidanceHalf`` runs the U-Net at B
rows and gathers inside the sampling loop, before the fused sampler step, so the collective is captured in the
loop's CUDA graph (checked on the CPU with gloo; not yet run on GPUs, so ``fastdiff sample --guidance-parallel``
still runs eagerly).

    torchrun --nproc-per-node 2 -m fastdiff.cli sample --model DIR --prompt "a cat" --guidance-parallel --out cat.png
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from fastdiff.errors import FastdiffError

HalfModel = Callable[[torch.Tensor, torch.Tensor, slice], torch.Tensor]
"""``model(x_rows, t_rows, rows)``: the U-Net output for ``rows`` of the guided batch (the text states' rows too)."""

GROUP_SIZE = 2


def check_launch() -> None:
    """A one-line error unless this process runs under ``torchrun`` with exactly two processes (checked before any
    loading: ``WORLD_SIZE`` and ``RANK`` in the environment)."""
    world = os.environ.get("WORLD_SIZE")
    if world is None or "RANK" not in os.environ:
        raise FastdiffError("guidance-parallel runs two processes: launch it with torchrun --nproc-per-node 2")
    if world != str(GROUP_SIZE):
        raise FastdiffError(f"guidance-parallel splits the two guidance halves over 2 processes, got {world}")


class GuidanceSplit:
    """Rank r of a two-process group computes half r of each guided U-Net call; ``wrap`` gathers the halves."""

    def __init__(self, group: torch.distributed.ProcessGroup | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise FastdiffError(
                "guidance-parallel needs torch.distributed initialised (torchrun --nproc-per-node 2, then "
                "torch.distributed.init_process_group)"
            )
        size = dist.get_world_size(group)
        if size != GROUP_SIZE:
            raise FastdiffError(f"guidance-parallel splits the two guidance halves over 2 processes, got {size}")
        self.group = group
        self.rank = dist.get_rank(group)

    def wrap(self, half_model: HalfModel) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """``model(inp, t)`` on the guided batch ``inp`` [2B, ...]: this rank's half through ``half_model``, the
        other half from the other rank; returns [2B, ...] on both."""
        import torch.distributed as dist

        def model(inp: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            half = inp.shape[0] // 2
            rows = slice(self.rank * half, (self.rank + 1) * half)
            mine = half_model(inp[rows], t[rows], rows).contiguous()
            out = mine.new_empty((GROUP_SIZE * half, *mine.shape[1:]))
            dist.all_gather_into_tensor(out, mine, group=self.group)  # rank 0's rows, then rank 1's
            return out

        return model
