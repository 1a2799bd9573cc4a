"""U-Net models and ``load_unet``: a preset name or a local diffusers-format / fastdiff-format directory."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from fastdiff.errors import FastdiffError
from fastdiff.models.autoencoder_kl import AutoencoderKL, AutoencoderKLConfig
from fastdiff.models.convnext_unet import (
    CONVNEXT_PRESETS,
    ConvNeXtUNet,
    ConvNeXtUNetConfig,
    convnext_unet_from_dir,
)
from fastdiff.models.ddpm_unet import DDPM_PRESETS, DDPMUNet, DDPMUNetConfig, ddpm_unet_from_dir
from fastdiff.models.unet_2d_condition import UNet2DConditionConfig, UNet2DConditionModel, unet_2d_condition_from_dir

log = logging.getLogger(__name__)

PRESETS: dict[str, object] = {**DDPM_PRESETS, **CONVNEXT_PRESETS}
"""Preset name -> config dataclass instance (architecture only; random weights). Unconditional U-Nets only: the
Stable Diffusion architectures are ``fastdiff.models.stable_diffusion.SD_PRESETS``."""

BUNDLED_DIR = Path(__file__).resolve().parent.parent / "weights"
"""Weights shipped inside the package: BUNDLED_DIR/<preset>/ holds config.json + safetensors."""

__all__ = [
    "PRESETS",
    "AutoencoderKL",
    "AutoencoderKLConfig",
    "ConvNeXtUNet",
    "ConvNeXtUNetConfig",
    "DDPMUNet",
    "DDPMUNetConfig",
    "UNet2DConditionConfig",
    "UNet2DConditionModel",
    "load_unet",
    "model_from_config",
    "resolve_model_dir",
]


def model_from_config(config: object) -> nn.Module:
    """A randomly initialised model for a config dataclass."""
    if isinstance(config, DDPMUNetConfig):
        return DDPMUNet(config)
    if isinstance(config, ConvNeXtUNetConfig):
        return ConvNeXtUNet(config)
    if isinstance(config, UNet2DConditionConfig):
        return UNet2DConditionModel(config)
    if isinstance(config, AutoencoderKLConfig):
        return AutoencoderKL(config)
    raise FastdiffError(f"unknown model config type {type(config).__name__}")


def resolve_model_dir(path: Path) -> Path:
    """The folder holding the U-Net's config.json: ``path`` itself or its ``unet/`` subfolder."""
    if not path.exists():
        raise FastdiffError(f"model path not found: {path}")
    if not path.is_dir():
        raise FastdiffError(f"model path is not a directory: {path}")
    for candidate in (path / "unet", path):
        if (candidate / "config.json").is_file():
            return candidate
    raise FastdiffError(f"no config.json in {path} or {path / 'unet'}")


def read_scheduler_config(path: Path) -> dict | None:
    """diffusers' scheduler_config.json next to the model (root or scheduler/ subfolder), if present."""
    for candidate in (path / "scheduler", path, path.parent / "scheduler", path.parent):
        file = candidate / "scheduler_config.json"
        if file.is_file():
            try:
                return json.loads(file.read_text())
            except json.JSONDecodeError as exc:
                raise FastdiffError(f"{file} is not valid JSON: {exc}") from exc
    return None


def load_unet(
    path_or_preset: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Load a U-Net from a preset name (bundled weights if shipped, else random) or a local directory.

    The returned module has ``forward(x, t) -> model output`` and attributes ``config`` and
    ``scheduler_config`` (a diffusers-style dict or None). A directory whose U-Net is a ``UNet2DConditionModel``
    (e.g. a Stable Diffusion pipeline) gives the text-conditioned ``forward(x, t, encoder_hidden_states)``.
    """
    name = str(path_or_preset)
    if name in PRESETS and not Path(name).exists():
        bundled = BUNDLED_DIR / name
        if (bundled / "config.json").is_file():
            return load_unet(bundled, device, dtype)
        model = model_from_config(PRESETS[name])
        model.scheduler_config = None
        log.warning("preset %s has no bundled weights: using RANDOM weights (images will be noise)", name)
        return model.to(device=device, dtype=dtype).eval()
    path = Path(name).expanduser()
    if not path.exists() and not any(sep in name for sep in "/\\") and not name.startswith("."):
        raise FastdiffError(f"unknown model {name!r}: not a preset ({', '.join(sorted(PRESETS))}) nor a path")
    root = resolve_model_dir(path)
    try:
        config = json.loads((root / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise FastdiffError(f"{root / 'config.json'} is not valid JSON: {exc}") from exc
    class_name = config.get("_class_name", "UNet2DModel")
    if class_name == "UNet2DModel":
        model = ddpm_unet_from_dir(root, config)
    elif class_name == "ConvNeXtUNet":
        model = convnext_unet_from_dir(root, config)
    elif class_name == "UNet2DConditionModel":
        model = unet_2d_condition_from_dir(root, config)
    else:
        raise FastdiffError(f"{root / 'config.json'}: model class {class_name!r} is not supported")
    model.scheduler_config = read_scheduler_config(root)
    log.info("loaded %s from %s", class_name, root)
    return model.to(device=device, dtype=dtype).eval()
