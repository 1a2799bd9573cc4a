"""fastdiff: diffusion U-Net sampling as fast as the GPU allows, measured against diffusers and torch.compile.

``import fastdiff`` imports no torch: ``Pipeline``, ``TextToImagePipeline`` and ``load_unet`` load on first use
(so ``fastdiff --version`` and ``--help`` answer at once)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fastdiff.errors import FastdiffError
from fastdiff.version import __version__

if TYPE_CHECKING:
    from fastdiff.models import load_unet
    from fastdiff.pipelines import Pipeline, TextToImagePipeline

__all__ = ["FastdiffError", "Pipeline", "TextToImagePipeline", "__version__", "load_unet"]

_LAZY = {"Pipeline": "fastdiff.pipelines", "TextToImagePipeline": "fastdiff.pipelines", "load_unet": "fastdiff.models"}
"""Public names imported from their module on first access (the modules import torch)."""


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later accesses skip this hook
        return value
    raise AttributeError(f"module 'fastdiff' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
