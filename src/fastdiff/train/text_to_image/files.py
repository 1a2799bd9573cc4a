"""What the stages write: diffusers model folders (``config.json`` + fp16 safetensors), the whole
``StableDiffusionPipeline`` directory (``model_index.json`` and its components), and the weights rounded to the
saved precision.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastdiff.models.autoencoder_kl import AutoencoderKL
from fastdiff.models.clip_text import CLIPTextModel, save_clip_text
from fastdiff.models.unet_2d_condition import UNet2DConditionModel
from fastdiff.train.text_to_image.config import SCHEDULER_CONFIG
from fastdiff.train.text_to_image.prompts import write_tokenizer

SAVE_DTYPE = torch.float16
"""Every written weight file is fp16."""
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
SUMMARY_NAME = "summary.json"
LOSS_LOG_NAME = "loss.jsonl"
LOSS_CURVE_NAME = "loss.png"

DIFFUSERS_VERSION = SCHEDULER_CONFIG["_diffusers_version"]
"""The diffusers release whose directory format the written configs follow."""

MODEL_INDEX: dict[str, Any] = {
    "_class_name": "StableDiffusionPipeline",
    "_diffusers_version": DIFFUSERS_VERSION,
    "feature_extractor": [None, None],
    "image_encoder": [None, None],
    "requires_safety_checker": False,
    "safety_checker": [None, None],
    "scheduler": ["diffusers", SCHEDULER_CONFIG["_class_name"]],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "unet": ["diffusers", "UNet2DConditionModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def diffusers_config(config: Any, class_name: str) -> dict[str, Any]:
    """A config dataclass as a diffusers ``config.json`` dict (tuples as lists)."""
    data = json.loads(json.dumps(dataclasses.asdict(config)))
    return {"_class_name": class_name, "_diffusers_version": DIFFUSERS_VERSION, **data}


def safetensors_bytes(module: nn.Module, dtype: torch.dtype) -> bytes:
    """The module's state dict (floating tensors cast to ``dtype``) serialised as safetensors, in memory (a plain
    file write then gives it the umask's mode; safetensors' save_file makes owner-only files)."""
    from safetensors.torch import save

    state = {
        k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
        for k, v in module.state_dict().items()
    }
    return save(state, metadata={"format": "pt"})


def write_diffusers_model(folder: Path, module: nn.Module, class_name: str, dtype: torch.dtype) -> None:
    """config.json + diffusion_pytorch_model.safetensors of fastdiff's diffusers-compatible ``module``."""
    folder.mkdir(parents=True, exist_ok=True)
    config = diffusers_config(module.config, class_name)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / DIFFUSERS_WEIGHTS).write_bytes(safetensors_bytes(module, dtype))


def round_to(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module`` with every floating parameter and buffer rounded to ``dtype`` and back (in place): the
    weights the saved files hold, in the module's own precision."""
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(dtype).to(tensor.dtype))
    return module


def copy_files(src: Path, dst: Path) -> None:
    """Copy the files of ``src`` into ``dst`` by plain writes (so they get the umask's mode)."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.iterdir()):
        if path.is_file():
            (dst / path.name).write_bytes(path.read_bytes())


def write_pipeline(
    folder: Path, unet: UNet2DConditionModel, vae: AutoencoderKL, text_encoder: CLIPTextModel, dtype: torch.dtype
) -> dict[str, int]:
    """A diffusers ``StableDiffusionPipeline`` directory in ``folder``: model_index.json, scheduler/, tokenizer/,
    text_encoder/ (in transformers' layout), unet/ and vae/ (diffusers configs), weights in ``dtype``; returns the
    bytes of each component."""
    (folder / "model_index.json").write_text(json.dumps(MODEL_INDEX, indent=2) + "\n")
    (folder / "scheduler").mkdir()
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(SCHEDULER_CONFIG, indent=2) + "\n")
    write_tokenizer(folder / "tokenizer")
    save_clip_text(text_encoder, folder / "text_encoder", dtype)
    write_diffusers_model(folder / "unet", unet, "UNet2DConditionModel", dtype)
    write_diffusers_model(folder / "vae", vae, "AutoencoderKL", dtype)
    return {part: folder_bytes(folder / part) for part in ("unet", "vae", "text_encoder", "tokenizer", "scheduler")}
