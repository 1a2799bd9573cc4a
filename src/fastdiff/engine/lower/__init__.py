"""Model-family lowerings: each module writes one family's forward with the op vocabulary of
:mod:`fastdiff.engine.ir`. A lowering module defines ``MODEL_CLASS``, ``default_size(model) -> (h, w)`` and
``lower(model, graph)``; adding a family to the engine is one new module here and one line in ``FAMILIES``.
"""

from __future__ import annotations

from types import ModuleType

from torch import nn

from fastdiff.engine.lower import autoencoder_kl, convnext_unet, ddpm_unet, unet_2d_condition
from fastdiff.errors import FastdiffError

FAMILIES: tuple[ModuleType, ...] = (ddpm_unet, convnext_unet, unet_2d_condition, autoencoder_kl)


def lowering_for(model: nn.Module) -> ModuleType:
    """The lowering module of ``model``'s family (a one-line error for a model the engine cannot run)."""
    for family in FAMILIES:
        if isinstance(model, family.MODEL_CLASS):
            return family
    names = ", ".join(f.MODEL_CLASS.__name__ for f in FAMILIES)
    raise FastdiffError(f"the fused engine supports {names}; got {type(model).__name__}")


def supports(model: nn.Module) -> bool:
    """Whether the fused engine can run ``model``."""
    return any(isinstance(model, family.MODEL_CLASS) for family in FAMILIES)
