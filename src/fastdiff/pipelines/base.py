"""What both pipelines share: backend and fp8 checks, seed lists, the lazily created engine, output conversion, the
check for non-finite images."""

from __future__ import annotations

import logging
import numbers
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fastdiff.devices import DTYPES
from fastdiff.engine.kernel_plan import KernelPlan
from fastdiff.errors import FastdiffError

if TYPE_CHECKING:
    from fastdiff.engine import Engine

log = logging.getLogger(__name__)

BACKENDS = ("engine", "eager")
FP8 = "fp8"
"""The ``from_pretrained`` dtype name of the engine's fp8 mode: fp16 activations with e4m3 convs after each
GroupNorm (``fastdiff.engine.Engine(fp8=True)``; Hopper GPUs, or Triton's CPU interpreter for tests)."""
DTYPE_NAMES = (*DTYPES, FP8)
"""The dtype names ``Pipeline.from_pretrained`` takes."""


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """``backend`` checked ("engine" or "eager"); None means the engine on CUDA and eager elsewhere. The engine
    off CUDA needs Triton's interpreter (``TRITON_INTERPRET=1``): said here, before any loading."""
    backend = backend or ("engine" if device.type == "cuda" else "eager")
    if backend not in BACKENDS:
        raise FastdiffError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    if backend == "engine" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise FastdiffError("the engine backend needs a CUDA GPU (or TRITON_INTERPRET=1 for its CPU test mode)")
    return backend


def check_fp8(device: torch.device, dtype: torch.dtype, backend: str | None) -> str:
    """The backend for an fp8 pipeline (None means "engine": fp8 exists only there), after checking, in this
    order, that ``device`` can run fp8 convs and that ``dtype`` is fp16 or bf16
    (``fastdiff.engine.fp8.fp8_unsupported``) and that the backend is the engine; each failure is a one-line
    FastdiffError."""
    from fastdiff.engine.fp8 import fp8_unsupported

    reason = fp8_unsupported(device, dtype, role="pipeline")
    if reason is not None:
        raise FastdiffError(reason)
    backend = resolve_backend("engine" if backend is None else backend, device)
    if backend != "engine":
        raise FastdiffError(f"fp8 runs only in the engine backend (e4m3 convs on Hopper): not with backend={backend!r}")
    return backend


def expand_seeds(seeds: int | Sequence[int] | None, count: int, what: str = "") -> list[int]:
    """One seed per image: None means ``0..count-1``, an int ``s`` means ``s, s+1, ...``, a sequence must hold
    ``count`` seeds (``what`` says what the count is made of, for the error)."""
    if seeds is None:
        return list(range(count))
    if isinstance(seeds, numbers.Integral) and not isinstance(seeds, bool):
        return list(range(int(seeds), int(seeds) + count))
    seed_list = [int(s) for s in seeds]
    if len(seed_list) != count:
        raise FastdiffError(f"got {len(seed_list)} seeds for {count} images{what}")
    return seed_list


def check_output_type(output_type: str, allowed: Sequence[str]) -> None:
    if output_type not in allowed:
        raise FastdiffError(f"unknown output_type {output_type!r}: use one of {', '.join(allowed)}")


class EnginePipeline:
    """The part of a pipeline that owns its device, its backend and (for backend "engine") its
    ``fastdiff.engine.Engine``, created on first use."""

    def __init__(
        self,
        device: torch.device | str,
        backend: str | None,
        fp8: bool = False,
        plan: KernelPlan | str | os.PathLike[str] | None = None,
        tune: str = "auto",
    ) -> None:
        self.device = torch.device(device)
        self.backend = resolve_backend(backend, self.device)
        self.fp8 = fp8
        from fastdiff.engine import TUNE_MODES

        if tune not in TUNE_MODES:
            raise FastdiffError(f"tune must be one of {', '.join(TUNE_MODES)}, got {tune!r}")
        self.plan = load_plan(plan)
        self.tune = tune
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        """The pipeline's ``fastdiff.engine.Engine`` (created on first use; backend "engine" only; its fp8 mode
        with ``fp8``, its kernel plan ``plan`` and ``tune`` mode: ``fastdiff.engine.kernel_plan``)."""
        if self._engine is None:
            from fastdiff.engine import Engine

            self._engine = Engine(self.device, fp8=self.fp8, plan=self.plan, tune=self.tune)
        return self._engine

    @property
    def plan_digest(self) -> str | None:
        """The digest of the kernels the last call ran (``Engine.plan_digest``); None on the eager backend."""
        return self._engine.plan_digest if self._engine is not None else None


def load_plan(plan: KernelPlan | str | os.PathLike[str] | None) -> KernelPlan | None:
    """A kernel plan argument read now (a file path, a ``KernelPlan`` or None), so a bad file fails before any
    model loads (one line)."""
    if plan is None or isinstance(plan, KernelPlan):
        return plan
    return KernelPlan.load(plan)


def nonfinite_message(images: torch.Tensor) -> str | None:
    """One line saying how many values of ``images`` are NaN or inf, or None when all are finite (one host sync:
    call it where the images are read on the host anyway)."""
    bad = int((~torch.isfinite(images)).sum())
    return None if bad == 0 else f"non-finite output: {bad} of {images.numel()} values are NaN or inf"


def warn_if_nonfinite(images: torch.Tensor, backend: str, dtype: torch.dtype) -> None:
    """Log a warning when a call's images hold NaN or inf: they would be written as black or broken images with no
    other sign (the pipelines check the images they convert for the host, PIL or NumPy; device tensors they return
    unchecked and unsynchronised). fp16 overflows in some models' layers; the other dtypes or ``backend="eager"``
    tell whether the engine is the cause."""
    message = nonfinite_message(images)
    if message is not None:
        log.warning("%s (backend %s, %s): the images are broken; try another dtype, or backend='eager' to see whether "
                    "the engine is the cause", message, backend, str(dtype).removeprefix("torch."))  # fmt: skip
