"""What ``fastdiff profile`` measures (``ProfileConfig``), which kind of model it names, the defaults of each kind and
the checks of a configuration, all before any model loads."""

from __future__ import annotations

import dataclasses
import gc
import math
import numbers
from dataclasses import dataclass

import torch

from fastdiff.cli_args import DEFAULT_GUIDANCE
from fastdiff.devices import DTYPES
from fastdiff.errors import FastdiffError
from fastdiff.pipelines.text_to_image import check_size, is_text_to_image_dir

BACKENDS = ("engine", "eager", "compile")
TEXT_FLAGS = ("guidance", "height", "width", "prompt")
"""``ProfileConfig`` fields (CLI flags) that only text-to-image models take."""
DEFAULT_PROMPT = "a photo of a t-shirt"
"""The prompt of a text-to-image profile when none is given: in the bundled fashion-mnist-t2i's vocabulary, and
like any prompt padded to the text encoder's 77 tokens, so its words do not change the time of SD's steps."""
UNCONDITIONAL_DEFAULTS = {"sampler": "ddpm", "steps": 1000, "timed_steps": 20, "loads": 20}
TEXT_DEFAULTS = {"sampler": "ddim", "steps": 50, "loads": 2}
"""Defaults of the fields left None, per kind of model: a text-to-image load to first image takes seconds (weights,
the engine's build), an unconditional one milliseconds."""


@dataclass
class ProfileConfig:
    model: str = "ddpm-cifar10"
    """An unconditional preset or U-Net directory, or a text-to-image model: ``sd15``/``sd21`` (random weights),
    ``fashion-mnist-t2i`` or a Stable Diffusion pipeline directory (``is_text_model``)."""
    batch: int = 1
    sampler: str | None = None
    """None: ddpm (unconditional), ddim (text-to-image)."""
    steps: int | None = None
    """Steps of one sample; None: 1000 (unconditional), 50 (text-to-image)."""
    dtype: str = "fp16"
    device: str = "cuda"
    backends: tuple[str, ...] = BACKENDS
    loads: int | None = None
    """Fresh loads for load-to-first-step (unconditional, per mode; default 20) or load-to-first-image (text-to-image,
    per backend; default 2)."""
    timed_steps: int | None = None
    """Unconditional models: steps per timed run (default 20; every step of a loop costs the same), per-sample numbers
    scale it to ``steps``. Text-to-image models time whole images: not taken."""
    repeats: int = 3
    energy_seconds: float = 5.0
    seed: int = 0
    top: int = 10
    guidance: float | None = None
    """Text-to-image only: classifier-free guidance scale (default 7.5; > 1: the U-Net runs on 2x the batch)."""
    height: int | None = None
    """Text-to-image only: image height in pixels (default: the model's, 512 for sd15, 768 for sd21)."""
    width: int | None = None
    prompt: str | None = None
    """Text-to-image only: the prompt of every image (default ``DEFAULT_PROMPT``)."""


def is_text_model(model: str) -> bool:
    """Whether ``model`` names a text-to-image model: a Stable Diffusion preset (``SD_PRESETS``), the bundled
    text-to-image preset or a pipeline directory with model_index.json. Reads no weights."""
    return is_text_to_image_dir(model)


def _check_text_flags(cfg: ProfileConfig) -> None:
    if cfg.timed_steps is not None:
        raise FastdiffError(
            f"--timed-steps applies to unconditional models only: {cfg.model} is text-to-image, whose timed runs are "
            "whole images of --steps steps"
        )
    check_size(cfg.height, cfg.width)
    g = cfg.guidance
    if g is not None and (isinstance(g, bool) or not isinstance(g, numbers.Real) or not math.isfinite(g) or g < 0):
        raise FastdiffError(f"guidance must be a finite number >= 0 (<= 1: no guidance), got {g!r}")
    if cfg.prompt is not None and not isinstance(cfg.prompt, str):
        raise FastdiffError(f"prompt must be a string, got {cfg.prompt!r}")


def resolve_config(cfg: ProfileConfig) -> ProfileConfig:
    """``cfg`` with the defaults of its kind of model filled in (``UNCONDITIONAL_DEFAULTS``, ``TEXT_DEFAULTS``),
    after refusing, in one line, the fields that do not apply to it: guidance, height, width and prompt for an
    unconditional model, timed_steps for a text-to-image one. Reads no weights."""
    if is_text_model(cfg.model):
        _check_text_flags(cfg)
        filled = {k: v for k, v in TEXT_DEFAULTS.items() if getattr(cfg, k) is None}
        if cfg.guidance is None:
            filled["guidance"] = DEFAULT_GUIDANCE
        if cfg.prompt is None:
            filled["prompt"] = DEFAULT_PROMPT
        return dataclasses.replace(cfg, **filled)
    given = [f"--{name}" for name in TEXT_FLAGS if getattr(cfg, name) is not None]
    if given:
        raise FastdiffError(
            f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to text-to-image models only (sd15, sd21, "
            f"fashion-mnist-t2i or a pipeline directory with model_index.json); {cfg.model} is unconditional"
        )
    filled = {k: v for k, v in UNCONDITIONAL_DEFAULTS.items() if getattr(cfg, k) is None}
    return dataclasses.replace(cfg, **filled)


def validate(cfg: ProfileConfig) -> torch.device:
    """The device to profile on, after checking ``cfg`` (one-line :class:`FastdiffError` for bad input); ``cfg``
    is resolved (``resolve_config``)."""
    counts = (cfg.batch, cfg.steps, cfg.repeats, cfg.loads) + (
        (cfg.timed_steps,) if cfg.timed_steps is not None else ()
    )
    if any(n is None or n <= 0 for n in counts):
        raise FastdiffError("batch, steps, timed steps, repeats and loads must be positive")
    if cfg.dtype not in DTYPES:
        raise FastdiffError(f"unknown dtype {cfg.dtype!r}: choose from {', '.join(DTYPES)}")
    unknown = [b for b in cfg.backends if b not in BACKENDS]
    if unknown or not cfg.backends:
        raise FastdiffError(f"unknown backend {unknown[0] if unknown else ''!r}: choose from {', '.join(BACKENDS)}")
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise FastdiffError("profile on cuda asked for but no CUDA GPU is available (use --device cpu)")
    if device.type == "cpu":
        if cfg.dtype != "fp32":
            raise FastdiffError(f"the CPU profile runs fp32 (got --dtype {cfg.dtype})")
        if any(b != "eager" for b in cfg.backends):
            raise FastdiffError("on the CPU only the eager backend is profiled (engine and compile need CUDA)")
    elif device.type != "cuda":
        raise FastdiffError(f"unsupported device {cfg.device!r}: use cpu or cuda")
    return device


def free(device: torch.device) -> None:
    """Collect garbage and, on CUDA, return cached blocks (between backends, so peaks do not carry over)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
